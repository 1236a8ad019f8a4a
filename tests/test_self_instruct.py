"""scripts/make_self_instruct.py: the cleaning and filtering of the target's requests (units), and a
short run with the embedded SmolLM2 on the CPU that writes a prompt file `specdec train` reads."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import make_self_instruct as si  # noqa: E402


@pytest.mark.parametrize("reply, want", [
    ("Question: How do volcanoes form?", "How do volcanoes form?"),
    ('"Can you write a haiku about autumn rain?"', "Can you write a haiku about autumn rain?"),
    ("Sure, here is one: Explain   recursion to a beginner.\n\nThis request asks...", "Explain recursion to a beginner."),
    ("Write a Python function that reverses a list.\nIt should not use reversed().",
     "Write a Python function that reverses a list. It should not use reversed()."),
    ("Hi!", None),  # too short
    ("Tell me about the history of paper money and", None),  # not a sentence's end
    ("Why?  Why not?", None),  # fewer than 4 words
])
def test_clean(reply, want):
    assert si.clean(reply) == want


def test_select_dedupes_and_keeps_test_texts_out():
    tests = ["what is the capital of france?", "write a function add(a, b) that returns the sum."]
    replies = ["What is the capital of France?",  # a test text
               "Please write a function add(a, b) that returns the sum. Use type hints.",  # contains one
               "How do bees make honey?", "how do  bees make honey?",  # a duplicate up to case and spacing
               "ok", "Give three tips for learning to juggle.", "Name two rivers in Africa and their lengths."]
    kept, counts = si.select(replies, tests, limit=2)
    assert kept == ["How do bees make honey?", "Give three tips for learning to juggle."]
    assert counts == {"replies": 7, "unusable": 1, "duplicates": 1, "test_overlap": 2, "kept": 2}


def test_meta_prompts_are_seeded_and_mixed():
    import random
    a, b = si.meta_prompts(200, random.Random(1)), si.meta_prompts(200, random.Random(1))
    assert a == b and len(set(a)) > 150
    assert any(" in Python " in m or " for Python " in m for m in a) and any("AI assistant" in m for m in a)


def test_run_with_the_embedded_target_writes_a_prompt_file(tmp_path):
    out, prov = str(tmp_path / "si.jsonl"), str(tmp_path / "si.json")
    rc = si.main(["--num", "6", "--oversample", "2", "--max-new-tokens", "40", "--slots", "12", "--device", "cpu",
                  "--out", out, "--provenance", prov])
    assert rc == 0 and not os.path.exists(out + ".tmp")
    rows = [json.loads(line) for line in open(out, encoding="utf-8")]
    info = json.load(open(prov))
    assert info["generated"] == 12 and info["kept"] == len(rows) <= 6
    assert len(rows) >= 1, info  # the instruct model writes usable requests (about 4 in 10 replies)
    texts = [r["prompt"] for r in rows]
    assert all(list(r) == ["prompt"] and si.clean(p) == p for r, p in zip(rows, texts))
    assert len({p.lower() for p in texts}) == len(texts)
    from specdec.train.data import read_prompts
    assert read_prompts(out) == texts  # what `specdec train --prompts` reads


def test_bad_target_and_out_are_one_line_errors(tmp_path, capsys):
    out = str(tmp_path / "si.jsonl")
    assert si.main(["--num", "3", "--target", str(tmp_path / "missing.gguf"), "--out", out]) == 2
    assert "missing.gguf: no such file" in capsys.readouterr().err and not os.path.exists(out)
    with pytest.raises(SystemExit):
        si.main(["--num", "3", "--out", str(tmp_path / "no" / "si.jsonl")])
    assert "its folder does not exist" in capsys.readouterr().err
