"""GGUF BPE and SentencePiece tokenizers against llama.cpp's reference token ids.

llama.cpp ships vocab-only GGUF files with ``.inp`` (test strings separated by a
``\\n__ggml_vocab_test__\\n`` line) and ``.out`` (one line of space-separated ids per string,
tokenized without BOS and without parsing special tokens) that its ``test-tokenizer-0`` checks.
They are read from ``$SPECDEC_LLAMA_VOCAB_DIR`` (CI extracts them from the llama-cpp-python
sdist: ``pip download --no-deps --no-binary :all: llama-cpp-python``).
"""

from __future__ import annotations

import json
import os

import pytest

from specdec.errors import CheckpointError, RequestError
from specdec.tokenizer import PRE_REGEXES, Tokenizer
from specdec.weights.gguf_io import GGUFSource

VOCAB_DIR = os.environ.get("SPECDEC_LLAMA_VOCAB_DIR", "/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp/models")
SEP = "\n__ggml_vocab_test__\n"
# The four the project targets, plus other BPE pre-tokenizers specdec maps (cheap to check),
# plus the SentencePiece (``llama`` model) vocabularies: Llama 2 (space prefix) and Phi-3, plus
# Gemma 4's SentencePiece-style BPE (``gemma4`` model).
VOCABS = ["qwen2", "qwen35", "llama-bpe", "gpt-2", "starcoder", "refact", "mpt", "command-r", "llama-spm", "phi-3",
          "gemma-4"]


def read_cases(path: str) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs the way test-tokenizer-0.cpp reads them."""
    with open(path + ".inp", encoding="utf-8", newline="") as fh:
        raw = fh.read()
    with open(path + ".out", encoding="utf-8", newline="") as fh:
        lines = fh.read().split("\n")
    texts, pos = [], 0
    while pos < len(raw):  # split on the separator; a trailing one leaves no empty case
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    if lines and lines[-1] == "":  # getline semantics: a final newline ends the last line
        lines = lines[:-1]
    assert len(texts) == len(lines), f"{path}: {len(texts)} inputs but {len(lines)} outputs"
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, lines)]


@pytest.mark.parametrize("name", VOCABS)
def test_matches_llama_cpp_reference(name):
    if not os.path.isdir(VOCAB_DIR):
        pytest.skip(f"llama.cpp vocab directory {VOCAB_DIR} not found (set SPECDEC_LLAMA_VOCAB_DIR; "
                    "CI extracts it from the llama-cpp-python sdist)")
    path = os.path.join(VOCAB_DIR, f"ggml-vocab-{name}.gguf")
    if not os.path.exists(path + ".out"):
        pytest.skip(f"{path}(.inp/.out) not found in {VOCAB_DIR}")
    src = GGUFSource(path)
    tok = Tokenizer.from_gguf(src.metadata, path)
    cases = read_cases(path)
    assert len(cases) > 30
    bad = []
    for text, want in cases:
        got = tok.encode(text, add_special=False)
        if got != want:
            bad.append(f"{text!r}: llama.cpp {want} specdec {got}")
        elif tok.decode(got) != text:
            bad.append(f"{text!r}: decodes to {tok.decode(got)!r}")
    assert not bad, f"{name}: {len(bad)} of {len(cases)} differ:\n" + "\n".join(bad)


def test_unknown_pre_tokenizer_is_named():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre",
            "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": []}
    with pytest.raises(CheckpointError, match="no-such-pre") as e:
        Tokenizer.from_gguf(meta, "x.gguf")
    assert "qwen2" in str(e.value) and "x.gguf" in str(e.value)


def test_unknown_tokenizer_model_is_named():
    with pytest.raises(CheckpointError, match="'t5'.*not supported") as e:
        Tokenizer.from_gguf({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]}, "x.gguf")
    assert "x.gguf" in str(e.value) and "llama" in str(e.value)


def test_spm_vocabulary_without_scores_is_named():
    with pytest.raises(CheckpointError, match="tokenizer.ggml.scores") as e:
        Tokenizer.from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]}, "x.gguf")
    assert "x.gguf" in str(e.value)


@pytest.mark.parametrize("field,value,match", [
    ("tokenizer.ggml.scores", [0.0], "tokenizer.ggml.scores"),  # one score for two tokens
    ("tokenizer.ggml.token_type", [1, "x"], "tokenizer.ggml.token_type"),
    ("tokenizer.ggml.tokens", ["a", 7], "tokenizer.ggml.tokens"),
    ("tokenizer.ggml.bos_token_id", 9, "bos_token_id"),  # outside the vocabulary
    ("tokenizer.ggml.add_bos_token", "yes", "add_bos_token"),
])
def test_corrupt_spm_vocabulary_is_named(field, value, match):
    """Corrupt SentencePiece metadata ends in a CheckpointError naming the file and the field."""
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.scores": [0.0, -1.0],
            "tokenizer.ggml.token_type": [1, 1], "tokenizer.ggml.unknown_token_id": -1, field: value}
    with pytest.raises(CheckpointError, match=match) as e:
        Tokenizer.from_gguf(meta, "x.gguf")
    assert "x.gguf" in str(e.value)


def _spm(tokens: list[tuple[str, float, int]], **meta):
    m = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [t for t, _, _ in tokens],
         "tokenizer.ggml.scores": [s for _, s, _ in tokens], "tokenizer.ggml.token_type": [k for _, _, k in tokens]}
    m.update(meta)
    return Tokenizer.from_gguf(m, "tiny.gguf")


# a tiny SentencePiece vocabulary: specials, byte tokens, and pieces with scores
_TINY = ([("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3), ("<turn>", 0.0, 4)]
         + [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
         + [("▁", -1.0, 1), ("a", -2.0, 1), ("b", -3.0, 1), ("ab", -4.0, 1), ("▁a", -5.0, 1), ("ba", -0.5, 1),
            ("aba", -6.0, 1), ("é", -7.0, 1)])


def test_spm_merges_by_score_and_falls_back_to_bytes():
    tok = _spm(_TINY, **{"tokenizer.ggml.add_space_prefix": False, "tokenizer.chat_template": "{{ bos_token }}x"})
    ids = {t: i for i, (t, _, _) in enumerate(_TINY)}
    # a b a b: "ba" (score -0.5) merges before either "ab" (-4.0); then a + ba = "aba" is a token
    # and merges; "abab" is not, so "aba" "b" (plain left-to-right BPE by length would give ab ab)
    assert tok.encode("abab", add_special=False) == [ids["aba"], ids["b"]]
    # characters outside the vocabulary: UTF-8 bytes; "é" is a piece
    assert tok.encode("zé", add_special=False) == [ids["<0x7A>"], ids["é"]]
    assert tok.encode("€", add_special=False) == [ids["<0xE2>"], ids["<0x82>"], ids["<0xAC>"]]
    # user-defined and control text is split out; BOS added (add_bos defaults to true)
    assert tok.encode("a<turn>b</s>") == [ids["<s>"], ids["a"], ids["<turn>"], ids["b"], ids["</s>"]]
    assert tok.decode(tok.encode("zé € a<turn>b", add_special=False)) == "zé € a<turn>b"
    assert tok.decode([ids["<s>"], ids["a"], ids["</s>"]], skip_special=True) == "a"
    with pytest.raises(RequestError, match="token id 999 is outside the vocabulary"):
        tok.decode([999])
    assert tok.bos_id == 1 and tok.eos_ids == [2]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>x"


def test_spm_space_prefix():
    tok = _spm(_TINY)  # add_space_prefix defaults to true (llama.cpp)
    ids = {t: i for i, (t, _, _) in enumerate(_TINY)}
    assert tok.encode("a a", add_special=False) == [ids["▁a"], ids["▁a"]]
    # a fragment after a special token gets the prefix too
    assert tok.encode("a<turn>a", add_special=False) == [ids["▁a"], ids["<turn>"], ids["▁a"]]
    assert tok.decode(tok.encode("a a", add_special=False)) == "a a"


# --- gemma4: SentencePiece-style BPE ---------------------------------------------------------------

def gemma4_meta(n_tokens: int = 0, **meta) -> dict:
    """A tiny ``gemma4`` vocabulary as GGUF metadata: Gemma 4's special tokens, byte tokens, and
    pieces whose merge ranks disagree with their scores (scoring them as SentencePiece would gives
    other ids), padded with unused ``[PADi]`` tokens to ``n_tokens``."""
    tokens = ([("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 3), ("<mask>", 3), ("<|turn>", 3), ("<turn|>", 3),
               ("<|tool_response>", 4)] + [(f"<0x{b:02X}>", 6) for b in range(256)]
              + [(t, 1) for t in ("▁", "a", "b", "\n", "ab", "ba", "aba", "▁a", "\n\n", "\n\n\n", "a\n")])
    tokens += [(f"[PAD{i}]", 5) for i in range(len(tokens), n_tokens)]
    # by score "ba" would merge first and "aba" next; by rank "a b" does
    score = {"ba": -0.5, "aba": -1.0}
    m = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": [t for t, _ in tokens],
         "tokenizer.ggml.scores": [score.get(t, -5.0) for t, _ in tokens],
         "tokenizer.ggml.token_type": [k for _, k in tokens],
         "tokenizer.ggml.merges": ["a b", "b a", "ab a", "▁ a", "\n \n", "a \n"],
         "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
         "tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": True,
         "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n"
                                    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"}
    m.update(meta)
    return m


def test_gemma4_merges_by_rank_and_keeps_newline_runs():
    meta = gemma4_meta()
    tok = Tokenizer.from_gguf(meta, "tiny.gguf")
    ids = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}

    def enc(text: str) -> list[str]:
        return [meta["tokenizer.ggml.tokens"][i] for i in tok.encode(text, add_special=False)]

    assert enc("abab") == ["ab", "ab"]  # rank 0 "a b" twice; scores would give "aba" "b"
    assert enc("aba") == ["aba"]  # "a b", then "ab a"
    assert enc("a a") == ["a", "▁a"]  # spaces are "▁", and no space prefix
    assert enc("\n\n\n") == ["\n\n\n"]  # a newline run that is a token comes out whole ...
    assert enc("\n\n\n\n") == ["\n\n", "\n\n"]  # ... else it merges like any text
    assert enc("a\nb") == ["a", "\n", "b"]  # newline runs merge apart: no "a \n" across them
    assert enc("é") == ["<0xC3>", "<0xA9>"]  # byte fallback
    assert enc("a<|turn>b<|tool_response>") == ["a", "<|turn>", "b", "<|tool_response>"]
    assert tok.encode("ab") == [ids["<bos>"], ids["ab"]]
    for text in ("abab \n\n\n é a<|turn>b", "  a\n\n\n\nb "):
        assert tok.decode(tok.encode(text, add_special=False)) == text
    assert tok.decode(tok.encode("a<|turn>b"), skip_special=True) == "ab"
    assert tok.bos_id == 2 and tok.eos_ids == [1, ids["<turn|>"], ids["<|tool_response>"]]
    chat = tok.apply_chat_template([{"role": "user", "content": "ab"}])
    assert chat == "<bos><|turn>user\nab<turn|>\n<|turn>model\n"
    got = tok.encode(chat)  # the template's own <bos> is not doubled
    assert got[:2] == [ids["<bos>"], ids["<|turn>"]] and got.count(ids["<bos>"]) == 1 and tok.decode(got) == chat
    # llama.cpp adds BOS to a gemma4 vocabulary even when the file says not to
    assert Tokenizer.from_gguf(gemma4_meta(**{"tokenizer.ggml.add_bos_token": False}), "x").encode("a")[0] == 2


@pytest.mark.parametrize("field,value,match", [
    ("tokenizer.ggml.merges", None, "'tokenizer.ggml.merges' is missing"),
    ("tokenizer.ggml.merges", ["a b", "ab"], "'tokenizer.ggml.merges' has an entry without a space: 'ab'"),
    ("tokenizer.ggml.merges", ["a b", 3], "'tokenizer.ggml.merges' entry #1"),
    ("tokenizer.ggml.bos_token_id", None, "'tokenizer.ggml.bos_token_id' is missing"),
    ("tokenizer.ggml.bos_token_id", 999, "'tokenizer.ggml.bos_token_id' = 999 is outside"),
    ("tokenizer.ggml.token_type", [1], "'tokenizer.ggml.token_type' has 1 entries"),
])
def test_corrupt_gemma4_vocabulary_is_named(field, value, match):
    meta = gemma4_meta()
    if value is None:
        del meta[field]
    else:
        meta[field] = value
    with pytest.raises(CheckpointError, match=match) as e:
        Tokenizer.from_gguf(meta, "x.gguf")
    assert str(e.value).startswith("x.gguf: ") and "\n" not in str(e.value)


def test_gemma4_reference_vocabulary_matches_transformers():
    """The Gemma 4 vocabulary of llama.cpp's tests: special ids, a chat template from the file, and
    the same ids as transformers' ``GemmaTokenizer`` (BPE with byte fallback, ``"▁"`` for spaces)
    built from the file's tokens and merges, on llama.cpp's test strings and on random ones."""
    import random

    from tokenizers import AddedToken
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    path = os.path.join(VOCAB_DIR, "ggml-vocab-gemma-4.gguf")
    if not os.path.exists(path + ".inp"):
        pytest.skip(f"{path}(.inp/.out) not found (set SPECDEC_LLAMA_VOCAB_DIR)")
    meta = GGUFSource(path).metadata
    tok = Tokenizer.from_gguf(meta, path)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert tok.bos_id == 2 and tok.add_bos and tok.eos_ids == [1, tokens.index("<turn|>"), tokens.index("<|tool_response>")]
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert chat.startswith("<bos><|turn>user\nHi there<turn|>\n<|turn>model\n"), chat
    ids = tok.encode(chat)
    assert ids[:3] == [2, tokens.index("<|turn>"), tokens.index("user")] and ids.count(2) == 1

    hf = GemmaTokenizer(vocab={t: i for i, t in enumerate(tokens)},
                        merges=[tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]])
    hf.add_tokens([AddedToken(t, special=k == 3, normalized=False) for t, k in zip(tokens, types) if k in (3, 4)])
    rng = random.Random(0)
    alphabet = list("ab \n\t.,é🦙{}()=\r") + ["the", "  ", "\n\n", "<|turn>"]
    texts = [t for t, _ in read_cases(path)] + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
                                                for _ in range(500)]
    bad = [t for t in texts if tok.encode(t, add_special=False) != hf(t, add_special_tokens=False)["input_ids"]]
    assert not bad, f"{len(bad)} of {len(texts)} differ from transformers, e.g. {bad[:3]}"


def test_llama_cpp_pre_names_are_mapped():
    # names llama.cpp writes for the families specdec targets
    for pre in ("gpt-2", "llama-bpe", "qwen2", "qwen35", "smollm", "default"):
        assert pre in PRE_REGEXES


# --- HF tokenizer.json directories -----------------------------------------------------------------

def _hf_tokenizer_dir(path, bos_post_processor: bool) -> str:
    """A small byte-level BPE tokenizer.json (+ tokenizer_config.json) trained on the spot.

    With ``bos_post_processor`` its post-processor prepends BOS, as Llama 3's does.
    """
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, processors, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. " * 20, "def f(x): return x * 2\n" * 10], trainer)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", 0)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                   "tokenizer_class": "PreTrainedTokenizerFast"}, fh)
    return str(path)


@pytest.mark.parametrize("bos", [True, False], ids=["bos-post-processor", "no-bos"])
def test_hf_dir_tokenizer_matches_transformers(tmp_path, bos):
    from transformers import AutoTokenizer

    path = _hf_tokenizer_dir(tmp_path / "tok", bos)
    ours, theirs = Tokenizer.from_hf_dir(path), AutoTokenizer.from_pretrained(path)
    assert ours.eos_ids == [1]
    for text in ["The quick fox", "  def f(x):\n\treturn x ** 2  ", "ünï 🦙 <|end_of_text|>", ""]:
        for special in (True, False):
            want = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special=special) == want, (text, special)
        assert ours.decode(ours.encode(text, add_special=False)) == text
    assert (ours.encode("The")[0] == 0) == bos


def test_chat_template_is_compiled_once_and_again_when_replaced(monkeypatch):
    """Compiling the Jinja template was ~95 % of a render (~6 ms a prompt: ~48 s of a training
    run's start on 14k prompts): it is compiled once per template text."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tok = _spm(_TINY, **{"tokenizer.chat_template": "{{ bos_token }}{{ messages[0]['content'] }}"})
    compiled = []
    real = ImmutableSandboxedEnvironment.from_string
    monkeypatch.setattr(ImmutableSandboxedEnvironment, "from_string",
                        lambda self, src, *a, **k: compiled.append(src) or real(self, src, *a, **k))
    assert [tok.apply_chat_template([{"role": "user", "content": c}]) for c in "ab"] == ["<s>a", "<s>b"]
    assert len(compiled) == 1
    tok.chat_template = "{{ messages[0]['content'] }}!"
    assert tok.apply_chat_template([{"role": "user", "content": "c"}]) == "c!"
    assert len(compiled) == 2
    tok.chat_template = "{% if %}"
    with pytest.raises(CheckpointError, match="the chat template does not parse"):
        tok.apply_chat_template([{"role": "user", "content": "c"}])
