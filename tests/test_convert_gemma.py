"""``specdec convert`` for Gemma 3: a tiny random ``gemma3_text`` checkpoint with a Gemma-style
tokenizer (SentencePiece BPE with byte fallback, as transformers' ``GemmaTokenizer`` writes it)
converted to F32 and Q8_0, read back by specdec and by the ``gguf`` package.

Bounds (relative max error of the logits, max|a-b| / max|b|, 40-token prompt): F32 vs
transformers 1e-5; Q8_0 vs transformers run on the weights specdec dequantized 1e-4. The F32
file's tensors equal bit for bit those of ``_gemma_util.write_gguf`` (llama.cpp's layout, written
independently), and its model metadata equals that file's. Also: configs llama.cpp's gemma3
cannot express by default (layer pattern, attention scale, local RoPE base, soft-capping), a
vision-language wrapper, and tokenizers that no SentencePiece vocabulary reproduces (refused).
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from _dense_util import hf_logits, prompt_ids, rel_err, save_hf, with_weights
from _gemma_util import tiny_model, write_gguf
from specdec.convert import convert
from specdec.errors import CheckpointError, ConfigError
from specdec.loading import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

SPACE = "\u2581"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "\n\n"]
CHARS = [SPACE] + list("thearnisodlwpg")
PIECES = [SPACE + "t", "he", "in", "er", "an", SPACE + "a", "th", SPACE + "the", "on", "re", SPACE + "s", "at",
          "en", "ain", SPACE + "r", "ra", SPACE + "rain", SPACE + "in", "sp", SPACE + "sp", SPACE + "spain", "ed",
          "nd", "is", SPACE + "i"]
TEXTS = ["the rain in spain", " leading  spaces ", "hello\n\nworld\n\n\n", "héllo ☃ spainthe",
         "<start_of_turn>user\nthe end<end_of_turn>\n", "<bos>is it?"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
            "<end_of_turn>\n{% endfor %}")


def spm_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece BPE as transformers converts it: every split of a piece into two pieces is a
    merge, ranked by the piece's score (here: its id), then by the ids of the parts."""
    keyed = sorted(((vocab[p], vocab[p[:k]], vocab[p[k:]]), (p[:k], p[k:]))
                   for p in vocab for k in range(1, len(p)) if p[:k] in vocab and p[k:] in vocab
                   and p not in SPECIALS and not p.startswith("<0x"))
    return [m for _, m in keyed]


def gemma_tokenizer(path: str, merges=None):
    """A Gemma-style HF tokenizer saved to ``path`` (305 tokens: specials, bytes, pieces, "▁▁")."""
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    vocab = {t: i for i, t in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + CHARS + PIECES)}
    tok = GemmaTokenizer(vocab=vocab, merges=spm_merges(vocab) if merges is None else merges, add_bos_token=True)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.add_tokens(["\n\n", SPACE * 2])  # user-defined: always one token, as in Gemma
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(HF directory, transformers model, HF tokenizer): the GGUF-expressible tiny Gemma 3."""
    path = str(tmp_path_factory.mktemp("gemma3"))
    hf = tiny_model("llama_cpp", seed=3)
    save_hf(hf, path)
    return path, hf, gemma_tokenizer(path)


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids), model.new_cache(len(ids))).logits


def _fields(path: str) -> dict:
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}


@pytest.mark.parametrize("name", ["f32", "q8_0"])
def test_round_trip(checkpoint, name, tmp_path):
    path, hf, _ = checkpoint
    out = str(tmp_path / f"gemma3.{name}.gguf")
    res = convert(path, out, name)
    assert res.arch == "gemma3"
    ref_path = str(tmp_path / "reference.gguf")
    write_gguf(hf, ref_path)
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    ref = {t.name: t for t in gguf.GGUFReader(ref_path).tensors}
    assert set(tensors) == set(ref), f"names differ: {sorted(set(tensors) ^ set(ref))}"
    assert "output.weight" not in tensors  # tied
    for tname, t in tensors.items():
        assert t.shape.tolist() == ref[tname].shape.tolist(), tname
        want = QT.Q8_0 if name == "q8_0" and len(t.shape) == 2 else QT.F32
        assert t.tensor_type == want, f"{tname}: {t.tensor_type.name}"
        if name == "f32":  # the +1 of every norm included
            assert np.array_equal(np.asarray(t.data), np.asarray(ref[tname].data)), tname
    got, want = _fields(out), _fields(ref_path)
    model_keys = {k for k in want if k.startswith("gemma3.")}
    assert {k for k in got if k.startswith("gemma3.")} == model_keys | {"gemma3.vocab_size"}
    assert all(got[k] == pytest.approx(want[k]) for k in model_keys), {k: (got[k], want[k]) for k in model_keys}

    loaded = load_model(out, "cpu", "float32", tokenizer=False)
    ids = prompt_ids(40, 2)
    ours, orig = _logits(loaded.model, ids), hf_logits(hf, ids)
    if name == "f32":
        err = rel_err(ours, orig)
        assert err <= 1e-5, f"F32: relative max error {err:.3g}"
        return
    state = {(k if k == "lm_head.weight" else "model." + k): v for k, v in loaded.model.state_dict().items()}
    err = rel_err(ours, hf_logits(with_weights(hf, state), ids))
    assert err <= 1e-4, f"Q8_0 vs transformers on the dequantized weights: {err:.3g}"


def test_vocabulary(checkpoint, tmp_path):
    """The SentencePiece vocabulary encodes as the HF tokenizer does (specials, user-defined
    "\\n\\n", byte fallback, runs of spaces), with llama.cpp's SPM metadata."""
    path, _, tok = checkpoint
    out = str(tmp_path / "v.gguf")
    convert(path, out, "f32")
    f = _fields(out)
    assert f["tokenizer.ggml.model"] == "llama" and f["tokenizer.ggml.pre"] == "default"
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"], f["tokenizer.ggml.unknown_token_id"],
            f["tokenizer.ggml.padding_token_id"]) == (2, 1, 3, 0)
    assert f["tokenizer.ggml.add_bos_token"] is True and f["tokenizer.ggml.add_eos_token"] is False
    assert f["tokenizer.ggml.add_space_prefix"] is False and f["tokenizer.chat_template"] == TEMPLATE
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == len(f["tokenizer.ggml.scores"]) == 320
    assert [types[i] for i in (0, 3, 5, 7, 8, 264, 300, 304, 319)] == [3, 2, 3, 4, 6, 1, 1, 4, 5]
    assert tokens[304] == "  "  # matched in the normalized text by HF, in the raw text by llama.cpp

    ours = load_model(out, "cpu", "float32").tokenizer
    for text in TEXTS:  # (specdec adds no second BOS before a "<bos>" text; transformers does)
        assert ours.encode(text, add_special=False) == tok(text, add_special_tokens=False).input_ids, repr(text)
    assert ours.encode(TEXTS[0]) == tok(TEXTS[0]).input_ids and ours.encode(TEXTS[0])[0] == 2
    assert ours.decode(tok("héllo ☃ the rain").input_ids, skip_special=True) == "héllo ☃ the rain"


def test_unsupported_tokenizers(tmp_path):
    """A tokenizer that an SPM vocabulary cannot reproduce is refused in one line, naming why;
    ``vocab=False`` still converts the weights."""
    import shutil

    hf = tiny_model("llama_cpp", seed=3)
    path = save_hf(hf, str(tmp_path / "hf"))
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + CHARS + PIECES)}
    merges = spm_merges(vocab)
    gemma_tokenizer(path, merges=[m for m in merges if m != ("▁t", "he")])  # ▁t + he is no merge
    with pytest.raises(CheckpointError, match=r"splits into '▁t' \+ 'he' but that is no merge") as e:
        convert(path, str(tmp_path / "a.gguf"), "f32")
    assert "\n" not in str(e.value)
    convert(path, str(tmp_path / "a.gguf"), "f32", vocab=False)
    assert not any(k.startswith("tokenizer.") for k in _fields(str(tmp_path / "a.gguf")))

    tj_path = os.path.join(path, "tokenizer.json")
    with open(tj_path) as fh:
        tj = json.load(fh)
    tj["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    with open(tj_path, "w") as fh:
        json.dump(tj, fh)
    with pytest.raises(CheckpointError, match="pre-tokenizer .'ByteLevel'. is not supported"):
        convert(path, str(tmp_path / "b.gguf"), "f32")
    tj["model"] = {"type": "Unigram", "vocab": [["<pad>", 0.0]], "unk_id": 0}
    with open(tj_path, "w") as fh:
        json.dump(tj, fh)
    with pytest.raises(CheckpointError, match="tokenizer model 'Unigram' is not supported"):
        convert(path, str(tmp_path / "b.gguf"), "f32")
    assert not os.path.exists(tmp_path / "b.gguf")
    shutil.rmtree(path)


@pytest.mark.filterwarnings("ignore:gemma3_text config. attn_logit_softcapping")
@pytest.mark.parametrize("kind", ["base", "capped"])
def test_layouts_llama_cpp_assumes_otherwise(kind, tmp_path):
    """Layer pattern, attention scale, local RoPE base and final soft-capping that differ from
    what llama.cpp assumes for gemma3 are written in the keys specdec reads: logits still match."""
    hf = tiny_model(kind, seed=4)
    path = save_hf(hf, str(tmp_path / kind))
    out = str(tmp_path / f"{kind}.gguf")
    convert(path, out, "f32", vocab=False)
    f = _fields(out)
    c = hf.config
    assert f["gemma3.attention.sliding_window_pattern"] == [t == "sliding_attention" for t in c.layer_types]
    if kind == "base":
        assert f["gemma3.attention.scale"] == pytest.approx(24 ** -0.5)
        assert "gemma3.rope.freq_base_swa" not in f and "gemma3.final_logit_softcapping" not in f
    else:
        assert f["gemma3.rope.freq_base_swa"] == 5000.0 and f["gemma3.final_logit_softcapping"] == 3.0
        assert f["gemma3.rope.scaling.type"] == "linear" and f["gemma3.rope.scaling.factor"] == 4.0
        assert "gemma3.attention.scale" not in f
    loaded = load_model(out, "cpu", "float32", tokenizer=False)
    ids = prompt_ids(40, 1)
    err = rel_err(_logits(loaded.model, ids), hf_logits(hf, ids))
    assert err <= 1e-5, f"{kind}: relative max error {err:.3g}"


def test_scaled_local_rope_is_refused(tmp_path):
    hf = tiny_model("base", seed=4)
    hf.config.rope_parameters["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    path = save_hf(hf, str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="sliding_attention rope_type 'linear' cannot be converted"):
        convert(path, str(tmp_path / "m.gguf"), "f32", vocab=False)


def test_vision_language_checkpoint_converts_its_language_model(tmp_path):
    """A ``gemma3`` (vision-language) checkpoint: only the language model is written (no vision
    tower or projector tensors), and text-only logits equal transformers' on the whole model."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from _gemma_util import tiny_config

    torch.manual_seed(6)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=tiny_config("llama_cpp").to_dict(), vision_config=vision.to_dict(),
                       mm_tokens_per_image=4, image_token_index=300, boi_token_index=301, eoi_token_index=302)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                p.copy_(0.3 * torch.randn_like(p))
    path = save_hf(hf, str(tmp_path / "mm"))
    out = str(tmp_path / "mm.gguf")
    convert(path, out, "f32", vocab=False)
    names = {t.name for t in gguf.GGUFReader(out).tensors}
    assert len(names) == 2 + 13 * 6 and all(n.startswith(("blk.", "token_embd", "output_norm")) for n in names)
    ids = [i % 300 for i in prompt_ids(40, 7)]  # no image tokens
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    err = rel_err(_logits(load_model(out, "cpu", "float32", tokenizer=False).model, ids), want)
    assert err <= 1e-5, f"relative max error {err:.3g}"
