"""Draft vocabularies (``--draft-vocab``, :mod:`specdec.drafters.draft_vocab`): the subset's logits,
the file formats and their errors, and MTP and DFlash drafting only the subset's tokens with the
output of plain decoding (greedy; the sampled checks are in test_mtp.py and test_dflash.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from _dflash_util import write_drafter  # noqa: E402
from _engine_util import build_llama, plain_generate  # noqa: E402
from _mtp_util import build_qwen35  # noqa: E402

from specdec import LLM  # noqa: E402
from specdec.cli import main  # noqa: E402
from specdec.drafters import draft_vocab  # noqa: E402
from specdec.drafters.draft_vocab import DraftVocab, PromptPart, load_token_ids, token_counts_vocab  # noqa: E402
from specdec.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


def test_subset_logits_and_the_rest_minus_infinity():
    g = torch.Generator().manual_seed(0)
    w, h = torch.randn(20, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    ids = [11, 3, 7]
    v = DraftVocab(ids, w, 20)
    full = F.linear(h, w)
    got = v.logits(h)
    assert got.shape == (2, 3, 20) and got.dtype == torch.float32
    assert torch.allclose(got[..., ids], full[..., ids])
    off = [t for t in range(20) if t not in ids]
    assert torch.isinf(got[..., off]).all() and (got[..., off] < 0).all()
    capped = v.logits(h, lambda x: torch.tanh(x / 2) * 2)  # a soft cap on the subset only: the rest stays -inf
    assert torch.allclose(capped[..., ids], torch.tanh(full[..., ids] / 2) * 2)
    assert torch.isinf(capped[..., off]).all()
    with pytest.raises(ConfigError, match="rows"):  # a rank's shard of the head
        DraftVocab(ids, w[:10], 20)


def test_prompt_part():
    """A request's prompt tokens off the subset: the last distinct ones, at most PROMPT_TOKENS, in fixed
    buffers refilled in place; their logits as the head's, the other tokens' -inf."""
    g = torch.Generator().manual_seed(1)
    w, h = torch.randn(30, 8, generator=g), torch.randn(4, 8, generator=g)
    v = DraftVocab([0, 1, 2], w, 30, prompt_tokens=3)
    part = v.prompt_part(torch.tensor([5, 1, 9, 5, 7, 2, 8, 7]))
    assert part.ids.tolist() == [7, 8, 5] and torch.equal(part.rows, w[[7, 8, 5]])  # 9 is the 4th: dropped
    got, full = v.logits(h, part=part), F.linear(h, w)
    on = [0, 1, 2, 5, 7, 8]
    assert torch.allclose(got[:, on], full[:, on]) and got.shape == (4, 30)
    assert torch.isinf(got[:, [t for t in range(30) if t not in on]]).all()
    same = v.prompt_part(torch.tensor([3, 0]), part)
    assert same is part and part.ids.tolist() == [3, 30, 30] and not part.rows[1:].any()  # unused: id V, zero rows
    assert torch.isinf(v.logits(h, part=part)[:, [5, 7, 8]]).all()
    assert DraftVocab([0], w, 30, prompt_tokens=0).prompt_part(torch.tensor([4])) is None
    # one part per slot (DFlashSlots): row s of h [S, R, H] takes slot s's tokens, as a part of its own would
    slots = PromptPart.empty(v, 3, slots=2)
    v.prompt_part(torch.tensor([9, 4]), slots.slot(0))
    v.prompt_part(torch.tensor([6]), slots.slot(1))
    hs = torch.randn(2, 5, 8, generator=g)
    both = v.logits(hs, part=slots.first(2))
    for s_, toks in enumerate(([9, 4], [6])):
        alone = v.logits(hs[s_], part=v.prompt_part(torch.tensor(toks)))
        assert torch.equal(torch.isinf(both[s_]), torch.isinf(alone)) and torch.allclose(both[s_], alone)
    with pytest.raises(ConfigError, match="distinct"):
        DraftVocab([1, 1], w, 30)


def test_files_and_their_errors(tmp_path):
    def put(name, data):
        p = tmp_path / name
        if name.endswith(".pt"):
            torch.save(data, p)
        else:
            p.write_text(data if isinstance(data, str) else json.dumps(data))
        return str(p)

    assert load_token_ids(put("a.json", [5, 1, 3]), 10) == [5, 1, 3]
    assert load_token_ids(put("b.json", {"token_ids": [2, 4]}), 10) == [2, 4]
    assert load_token_ids(put("c.pt", torch.tensor([7, 0])), 10) == [7, 0]
    assert load_token_ids(put("d.pt", [1, 9]), 10) == [1, 9]
    bad = {"missing.json": None, "e.json": "[1, 2", "f.json": [], "g.json": [1, 10], "h.json": [1, 1],
           "i.json": [1.5], "j.pt": torch.tensor([1.0]), "k.json": {"ids": [1]}, "l.json": [True]}
    for name, data in bad.items():
        path = str(tmp_path / name) if data is None else put(name, data)
        with pytest.raises(ConfigError, match=name.replace(".", r"\.")) as e:
            load_token_ids(path, 10)
        assert "\n" not in str(e.value)


def test_most_counted_tokens():
    counts = torch.tensor([5, 0, 9, 9, 1, 0])
    assert token_counts_vocab(counts, 3) == [0, 2, 3]  # 9, 9, 5 (ties by id), returned sorted
    assert token_counts_vocab(counts, 3, always=[5]) == [2, 3, 5]
    assert token_counts_vocab(counts, 1, always=[1, 5]) == [1, 5]


def _drafted(res) -> set[int]:
    return {t for s in res.stats.trace for t in s["draft"]}


@pytest.mark.parametrize("static", [False, True])
def test_mtp_drafts_only_the_subset_and_output_is_plain(tmp_path, static, monkeypatch):
    path = build_qwen35(tmp_path / "q35", moe=False, seed=2)
    lm = LLM(path, draft="mtp", num_draft_tokens=3, device="cpu")
    vocab = lm.model.config.vocab_size
    prompt = torch.randint(vocab, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    want = plain_generate(lm.model, prompt, 40).token_ids
    full = lm.generate(prompt, max_new_tokens=40, trace=True)
    keep = sorted(set(range(0, vocab, 3)) | set(want[:20]))  # a third of the tokens, and some the target emits
    lm.drafter.static_steps = static
    for prompt_tokens in (0, 1024):  # the subset alone; the subset and the prompt's tokens
        monkeypatch.setattr(draft_vocab, "PROMPT_TOKENS", prompt_tokens)
        lm.drafter.use_draft_vocab(keep)
        res = lm.generate(prompt, max_new_tokens=40, trace=True)
        assert res.token_ids == want == full.token_ids
        allowed = set(keep) | (set(prompt) if prompt_tokens else set())
        assert _drafted(res) <= allowed and not _drafted(full) <= allowed  # the full head drafts off the subset
        assert sum(res.stats.accepted) > 0
    assert not _drafted(res) <= set(keep)  # prompt tokens drafted


def test_dflash_and_ngram_first_draft_only_the_subset(tmp_path):
    target = build_llama(tmp_path / "llama", vocab=64, hidden=32, layers=4)
    dpath, _ = write_drafter(tmp_path / "dflash", hidden=32, num_target_layers=4, target_layer_ids=(1, 2), block_size=4)
    keep = list(range(0, 64, 2))
    vfile = tmp_path / "vocab.json"
    vfile.write_text(json.dumps(keep))
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    plain = LLM(target, device="cpu").generate(prompt, max_new_tokens=32)
    for draft in (f"dflash:{dpath}", f"dflash:{dpath}+ngram"):
        full = LLM(target, draft=draft, device="cpu").generate(prompt, max_new_tokens=32, trace=True)
        lm = LLM(target, draft=draft, device="cpu", draft_vocab=str(vfile))
        res = lm.generate(prompt, max_new_tokens=32, trace=True)
        assert res.token_ids == plain.token_ids == full.token_ids, draft
        model_drafter = getattr(lm.drafter, "base", lm.drafter)
        assert len(model_drafter.vocab) == len(keep)
        if "+ngram" not in draft:  # the history lookup proposes what it finds, in the subset or not
            allowed = set(keep) | set(prompt)
            assert _drafted(res) <= allowed and not _drafted(full) <= allowed, draft


def test_cli_refuses_a_draft_vocab_without_a_model_drafter(tmp_path, capsys):
    target = build_llama(tmp_path / "llama", vocab=64, hidden=32, layers=4)
    vfile = tmp_path / "vocab.json"
    vfile.write_text("[1, 2, 3]")
    for draft, vocab, msg in (("ngram", str(vfile), "applies to MTP and DFlash drafters"),
                              ("none", str(vfile), "not to 'none'"),
                              ("dflash:/nowhere", str(tmp_path / "nope.json"), "nope.json: no such file")):
        rc = main(["generate", "-m", target, "--device", "cpu", "--draft", draft, "--draft-vocab", vocab, "-p", "hi"])
        err = capsys.readouterr().err
        assert rc == 2 and msg in err and "Traceback" not in err, (draft, err)


def test_info_names_a_drafter_directorys_vocabulary(tmp_path, capsys):
    target = build_llama(tmp_path / "llama", vocab=64, hidden=32, layers=4)
    dpath, _ = write_drafter(tmp_path / "dflash", hidden=32, num_target_layers=4, target_layer_ids=(1, 2), block_size=4)
    assert main(["info", str(dpath), "--json"]) == 0 and "draft_vocab" not in json.loads(capsys.readouterr().out)
    (tmp_path / "dflash" / "draft_vocab.json").write_text(json.dumps({"token_ids": [1, 5, 9]}))
    assert main(["info", str(dpath), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["draft_vocab"].startswith("3 tokens and the prompt's")
    lm = LLM(target, draft=f"dflash:{dpath}", device="cpu")  # and the drafter takes it by default
    assert lm.drafter.vocab.ids.tolist() == [1, 5, 9]


def test_a_tensor_parallel_rank_drafts_over_the_whole_head(tmp_path, monkeypatch):
    """A rank's LM head is its shard: a directory's list is not used there (an explicit one is refused)."""
    from specdec.drafters.factory import make_drafter
    from specdec.loading import load_model

    target = build_llama(tmp_path / "llama", vocab=64, hidden=32, layers=4)
    dpath, _ = write_drafter(tmp_path / "dflash", hidden=32, num_target_layers=4, target_layer_ids=(1, 2), block_size=4)
    (tmp_path / "dflash" / "draft_vocab.json").write_text("[1, 5, 9]")
    loaded = load_model(target, "cpu", tokenizer=False)
    assert make_drafter(f"dflash:{dpath}", loaded).vocab is not None
    monkeypatch.setattr(loaded.model, "shard", object())  # as on a rank
    assert make_drafter(f"dflash:{dpath}", loaded).vocab is None


def test_a_directory_list_is_used_where_it_pays():
    """A drafter directory's list by default: always on the CPU; on CUDA only where the head rows it skips reach
    CUDA_LIST_MIN_SKIPPED_BYTES (SmolLM2's 57 MB head reads faster whole on the H200; a Qwen3.5 head's 2 GB not)."""
    import types

    from specdec.drafters.factory import CUDA_LIST_MIN_SKIPPED_BYTES, _list_pays

    def target(dev, v, h):
        w = torch.empty(v, h, dtype=torch.bfloat16, device="meta")
        return types.SimpleNamespace(device=torch.device(dev), head_weight=lambda: w)
    assert _list_pays(target("cpu", 49152, 576), 16384)
    assert not _list_pays(target("cuda", 49152, 576), 16384)  # skips 38 MB
    assert _list_pays(target("cuda", 248320, 4096), 32768)  # skips 1.8 GB
    rows = CUDA_LIST_MIN_SKIPPED_BYTES // (2 * 1024)
    assert _list_pays(target("cuda", rows + 10, 1024), 10) and not _list_pays(target("cuda", rows + 10, 1024), 11)
