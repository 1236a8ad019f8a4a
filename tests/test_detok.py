"""The server's incremental detokeniser (a window per push) gives exactly the text of decoding the
whole reply, on real vocabularies: SmolLM2's (always installed) and llama.cpp's reference ones
(``$SPECDEC_LLAMA_VOCAB_DIR``, as tests/test_tokenizer.py), for real texts and random ids."""

import os
import random

import pytest

from specdec.api import default_model_path
from specdec.detok import TextStream
from specdec.tokenizer import Tokenizer
from specdec.weights.gguf_io import GGUFSource

from test_tokenizer import VOCAB_DIR, VOCABS, read_cases


def _tok(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFSource(path).metadata, path)


def _streamed(tok, ids, rng) -> str:
    ts, out, i = TextStream(tok), [], 0
    while i < len(ids):
        n = rng.randint(1, 3)  # a step commits 1..3 tokens
        out.append(ts.push(ids[i:i + n]))
        i += n
    return "".join(out) + ts.flush()


def _check(tok, texts: list[str], seed: int) -> list[str]:
    rng, bad = random.Random(seed), []
    seqs = [tok.encode(t, add_special=False) for t in texts]
    seqs.append([i for s in seqs for i in s])  # one long reply
    seqs += [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 200))] for _ in range(30)]  # any ids at all
    for ids in seqs:
        want, got = tok.decode(ids), _streamed(tok, ids, rng)
        if got != want:
            bad.append(f"{ids[:40]}...: streamed {got[:80]!r} != decoded {want[:80]!r}")
    return bad


def test_streamed_text_equals_decoded_smollm2():
    tok = _tok(default_model_path())
    texts = ["Hello, world! Ünïcödé ✓ 🙂 and 中文 text.", "def f(x):\n    return x  # tabs\tand  spaces",
             open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()[:4000]]
    assert not _check(tok, texts, 0)


@pytest.mark.parametrize("name", VOCABS)
def test_streamed_text_equals_decoded_reference_vocabs(name):
    path = os.path.join(VOCAB_DIR, f"ggml-vocab-{name}.gguf")
    if not os.path.exists(path + ".inp"):
        pytest.skip(f"{path}(.inp) not found (set SPECDEC_LLAMA_VOCAB_DIR, as for tests/test_tokenizer.py)")
    tok = _tok(path)
    bad = _check(tok, [t for t, _ in read_cases(path)], 1)
    assert not bad, f"{name}: {len(bad)} differ:\n" + "\n".join(bad[:5])


def test_ids_that_change_earlier_text_redecode_the_whole_reply():
    """A tokenizer whose decode of an id changes the text of the one before it (here "a" then "b"
    read as "X"): the window's text no longer starts with what it was, and the whole reply is
    decoded again, so the final text still equals the decoded reply."""

    class Merging:
        def decode(self, ids):
            return "".join("ab"[i] for i in ids).replace("ab", "X")

    ts = TextStream(Merging())
    pieces = [ts.push([0]), ts.push([0]), ts.push([1])]  # "a", "a", then "b" turns the last "a" into "X"
    assert pieces[:2] == ["a", "a"] and ts.text == "aX"
    assert ts.flush() == "" and ts.text == Merging().decode([0, 0, 1])
