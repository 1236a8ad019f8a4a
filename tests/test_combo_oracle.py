"""scripts/combo_oracle.py's walk rules (offline tau of the DFlash / history-lookup choices and of DFlash
trees), on token lists made up here: what each rule accepts at one anchor."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import combo_oracle as co  # noqa: E402

# the reply: the anchor at position 2 (token 12), then 13, 14, ...
SEQ = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


def test_accepted_counts_the_matching_prefix_within_the_reply():
    assert co.accepted([13, 14, 99, 16], SEQ, 2) == 2
    assert co.accepted([], SEQ, 2) == 0
    assert co.accepted([18, 19, 20], SEQ, 7) == 2  # the reply ends: nothing past it counts


def test_tree_takes_the_second_choice_then_the_block_tail():
    block = [13, 99, 15, 16, 98]  # wrong at the block's second position
    top2 = [0, 14, 0, 0, 0]  # whose second choice is right
    assert co.tree(block, top2, SEQ, 2, jmax=14, tail=14) == 4  # 13, then 14 (second choice), 15, 16
    assert co.tree(block, top2, SEQ, 2, jmax=14, tail=1) == 3  # a tail of one: 15 only
    assert co.tree(block, top2, SEQ, 2, jmax=0, tail=14) == 1  # no branch at the second position
    assert co.tree(block, [0] * 5, SEQ, 2, jmax=14, tail=14) == 1  # a wrong second choice: the block's own


def test_rules_choose_as_named():
    block, lookup = [13, 14, 99], [13, 14, 15, 16]
    r = co.rules(block, lookup, SEQ, 2, top2=[0, 0, 15])
    assert r["dflash"] == (2, True) and r["ngram_only"] == (4, False)
    assert r["best_of_both (oracle)"] == (4, True)
    assert r["lookup_first_min3"] == (4, False) and r["lookup_first_min6"] == (2, True)
    assert r["tree_top2_all_positions (135 rows)"] == (3, True)  # 13, 14, then 15 as the third's second choice
