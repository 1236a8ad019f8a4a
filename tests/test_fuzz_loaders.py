"""Corrupted checkpoints end in one clear error (issue 15).

A fixed-seed fuzz over five small checkpoints (a Llama GGUF with a slice of the real SmolLM2
vocabulary, the same as a sharded HF directory, a DFlash drafter, a Qwen3.5 with ``mtp.*`` as HF
and as GGUF; see ``_fuzz_util``): every outcome of ``specdec info`` and of the load must be a
clean result or a :class:`SpecdecError`, each within a time bound (SIGALRM, so a hang fails the
test) and without raising the process's peak RSS by more than a bound (a runaway allocation of
gigabytes cannot hide under an earlier peak). ``scripts/fuzz_loaders.py --cases N`` runs the same for thousands
of cases. Plus regression tests for the two raw exceptions the issue quotes.
"""

import os

import pytest

from _dense_util import tiny_model, write_gguf
from _fuzz_util import build_seeds, fuzz, smollm2_vocab, write_gguf_seed
from specdec.errors import CheckpointError, SpecdecError
from specdec.loading import load_model
from specdec.tokenizer import Tokenizer

CASES = 8000  # ~20 s on two idle cores, ~40 s on busy ones
TIME_LIMIT_S = 5.0  # per case; the slowest real case takes well under a second
RSS_LIMIT_MB = 200  # peak-RSS growth of one case; every seed is a few hundred KiB


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    return str(root), build_seeds(str(root))


def test_fuzzed_checkpoints_load_or_raise_specdec_error(seeds, single_thread):
    root, s = seeds
    counts: dict[str, int] = {}
    bad = []
    for i, (kind, what, out) in enumerate(fuzz(s, root, CASES, seed=15, time_limit=TIME_LIMIT_S)):
        counts[out.kind] = counts.get(out.kind, 0) + 1
        if out.kind not in ("loaded", "error") or out.rss_growth_mb > RSS_LIMIT_MB:
            bad.append(f"#{i} {kind} {what}: {out.kind} after {out.seconds:.1f} s, "
                       f"+{out.rss_growth_mb:.0f} MiB peak RSS: {out.detail[:300]}")
    assert not bad, f"{len(bad)} of {CASES} cases ({counts}):\n" + "\n".join(bad[:20])
    # the corruptions reach past the first checks: some copies still load, most fail
    assert counts.get("loaded", 0) > CASES // 50 and counts["error"] > CASES // 2, counts


def test_fuzz_errors_name_the_file(seeds, single_thread):
    root, s = seeds
    for kind, what, out in fuzz(s, root, 400, seed=16):
        if out.kind == "error":
            assert os.path.join(root, "case") in out.detail, (kind, what, out.detail)


# --- the two raw exceptions quoted in issue 15 ---------------------------------------------------

def _smollm2_meta(**replace) -> dict:
    tokens, types, merges = smollm2_vocab()
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    meta.update(replace)
    return meta


def test_merge_naming_unknown_token_is_checkpoint_error():
    """``Exception: Error while initializing BPE: Token 'Ġholy' out of vocabulary``."""
    meta = _smollm2_meta()
    meta["tokenizer.ggml.merges"] = meta["tokenizer.ggml.merges"] + ["Ġho ly"]
    with pytest.raises(CheckpointError, match=r"model\.gguf: GGUF field 'tokenizer\.ggml\.merges'.*Ġho"):
        Tokenizer.from_gguf(meta, "model.gguf")


def test_merges_with_non_string_entry_is_checkpoint_error():
    """``TypeError: failed to extract enum PyMerges ('Merges | Filename')``: a flipped type byte
    turns a merges entry into a number."""
    meta = _smollm2_meta()
    meta["tokenizer.ggml.merges"] = meta["tokenizer.ggml.merges"][:5] + [7] + meta["tokenizer.ggml.merges"][5:]
    with pytest.raises(CheckpointError, match=r"model\.gguf: GGUF field 'tokenizer\.ggml\.merges' entry #5"):
        Tokenizer.from_gguf(meta, "model.gguf")


def test_merge_without_space_is_checkpoint_error():
    """The same ``PyMerges`` TypeError from a merge whose separating space was flipped."""
    meta = _smollm2_meta()
    meta["tokenizer.ggml.merges"] = ["Ġt"] + meta["tokenizer.ggml.merges"]
    with pytest.raises(CheckpointError, match=r"'tokenizer\.ggml\.merges' has an entry without a space"):
        Tokenizer.from_gguf(meta, "model.gguf")


def test_token_type_length_mismatch_is_checkpoint_error():
    meta = _smollm2_meta(**{"tokenizer.ggml.token_type": [1, 1, 3]})
    with pytest.raises(CheckpointError, match=r"'tokenizer\.ggml\.token_type' has 3 entries for 320 tokens"):
        Tokenizer.from_gguf(meta, "model.gguf")


@pytest.mark.parametrize("merge", ["Ġho ly", "Ġhol"])
def test_gguf_with_corrupt_merge_fails_load_naming_the_file(tmp_path, merge):
    """End to end through ``load_model``: a GGUF whose merges name a token not in its vocabulary."""
    tokens, types, merges = smollm2_vocab()
    path = str(tmp_path / "bad.gguf")
    write_gguf_seed(path, (tokens, types, merges + [merge]))
    with pytest.raises(SpecdecError, match=r"bad\.gguf: GGUF field 'tokenizer\.ggml\.merges'"):
        load_model(path, device="cpu")


def test_declared_huge_array_fails_at_once(tmp_path):
    """A string array whose declared length is 2^63 fails on the size check, before allocating."""
    path = str(tmp_path / "m.gguf")
    write_gguf(tiny_model("llama_tied"), path)
    data = bytearray(open(path, "rb").read())
    key = b"tokenizer.ggml.tokens"
    at = data.index(key) + len(key) + 4 + 4  # key, value type (array), element type (string)
    data[at:at + 8] = (2**63).to_bytes(8, "little")
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"m\.gguf: truncated or corrupt GGUF.*'tokenizer\.ggml\.tokens'"):
        load_model(path, device="cpu")


def test_cli_prints_a_corrupt_checkpoint_error_as_one_line(tmp_path, capsys):
    """``specdec generate`` on a GGUF whose merges name an unknown token (with a newline in it):
    exit status 2 and one line on stderr naming the file and the field."""
    from specdec.cli import main

    tokens, types, merges = smollm2_vocab()
    path = str(tmp_path / "bad.gguf")
    write_gguf_seed(path, (tokens, types, merges + ["Ġho\nly x"]))
    assert main(["generate", "--model", path, "--device", "cpu", "-p", "hi", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.gguf" in err and "tokenizer.ggml.merges" in err, err


def test_corrupt_chat_template_is_checkpoint_error():
    meta = _smollm2_meta(**{"tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }{% endfor %}"})
    tok = Tokenizer.from_gguf(meta, "model.gguf")
    with pytest.raises(CheckpointError, match=r"model\.gguf: the chat template does not parse \(line 1"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
