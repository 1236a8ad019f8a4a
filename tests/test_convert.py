"""``specdec convert``: tiny random HF checkpoints of every family, converted to every type, read
back by specdec and by the ``gguf`` package.

Bounds (relative max error of the logits, max|a-b| / max|b|, 24-token prompt):
- F32 vs transformers on the original weights: 1e-5 (measured <= 4e-7). The F32 tensors are
  also compared bit for bit with the test-only writers of ``_dense_util`` / ``_qwen35_util``,
  which follow llama.cpp's ``convert_hf_to_gguf.py`` independently of ``specdec.convert``.
- F16 / BF16 vs the original weights: 1e-2 / 5e-2 (measured below 2e-3 / 1.6e-2).
- Quantized types vs transformers run on the weights specdec dequantized from the file: 1e-4
  (the reader and the conversion conventions must agree exactly), and vs the original weights
  a loose sanity bound per type: random weights with random norm gains amplify weight error,
  so these are wide (measured maxima in ``LOOSE``'s comment), yet a wrong block layout or a
  lost convention lands far outside them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

import _dense_util as U
import specdec
from _mtp_util import build_qwen35
from _qwen35_util import fuse_experts, hf_vl_model
from _qwen35_util import hf_model as qwen35_hf
from _qwen35_util import write_gguf as qwen35_reference_gguf
from specdec.cli import CONVERT_TYPES, main
from specdec.convert import TYPES, convert
from specdec.convert.vocab import pre_tokenizer_name
from specdec.drafters.mtp import load_mtp_drafter
from specdec.engine import SpeculativeGenerator
from specdec.errors import CheckpointError, ConfigError
from specdec.loading import load_model
from specdec.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

FAMILIES = ("llama3", "llama_tied", "qwen3", "qwen35", "qwen35moe")
TIGHT = {QT.F32: 1e-5, QT.F16: 1e-2, QT.BF16: 5e-2}
DEQUANT = 1e-4
# vs the original weights (max rel error, min cosine of the logit rows); measured max/min
# over the five families (llama3 is the worst): Q8_0 0.055/0.998, Q6_K 0.18/0.98,
# Q4_0 0.75/0.68, Q4_K 0.66/0.73
LOOSE = {QT.Q8_0: (0.1, 0.99), QT.Q6_K: (0.4, 0.9), QT.Q4_0: (1.0, 0.5), QT.Q4_K: (1.0, 0.5)}
# every weight read back vs the original, max|a-b| / max|b| per tensor (a requested type's
# fallbacks are finer than it): F16 and BF16 round to 11 and 8 significant bits; Q8_0 half a
# step of amax/127; Q4_0 a whole step of amax/8 (the side opposite the max clips); the
# K-quants' 6-bit sub-block scales add a little to half a step (measured: Q6_K 0.022, Q4_K 0.057)
WEIGHT = {QT.F16: 2 ** -11, QT.BF16: 2 ** -8, QT.Q8_0: 0.55 / 127, QT.Q4_0: 1.01 / 8, QT.Q6_K: 0.03, QT.Q4_K: 0.08}
# requested type -> what a tensor may fall back to, in order, when its rows are not whole blocks
CHAIN = {QT.Q4_K: (QT.Q4_K, QT.Q5_0, QT.F16), QT.Q6_K: (QT.Q6_K, QT.Q8_0, QT.F16),
         QT.Q8_0: (QT.Q8_0, QT.F16), QT.Q4_0: (QT.Q4_0, QT.F16)}
F32_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def write_tokenizer(path: str, vocab: int, bos_post_processor: bool = False) -> None:
    """A small byte-level BPE tokenizer of at most ``vocab`` tokens with BOS/EOS and a chat
    template, trained on the spot; with room for them (``vocab`` >= 300), all 256 byte tokens."""
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, processors, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if vocab >= 300 else []
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 300), special_tokens=["<|begin|>", "<|end|>"],
                                  initial_alphabet=alphabet)
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. " * 20, "def f(x): return x * 2\n" * 10], trainer)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<|begin|> $A", special_tokens=[("<|begin|>", 0)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"bos_token": "<|begin|>", "eos_token": "<|end|>", "tokenizer_class": "PreTrainedTokenizerFast",
                   "chat_template": "{% for m in messages %}<|begin|>{{ m['content'] }}<|end|>{% endfor %}"}, fh)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (HF directory, transformers model with the same weights)."""
    out = {}
    for fam in FAMILIES:
        path = str(tmp_path_factory.mktemp(fam))
        if fam.startswith("qwen35"):
            build_qwen35(path, moe=fam == "qwen35moe", seed=2)  # hidden 64: K-quant rows fall back
            hf = qwen35_hf("moe" if fam == "qwen35moe" else "dense", 2)
        else:
            sizes = {} if fam == "llama_tied" else dict(hidden=256, inter=512)  # K-quant rows of 256
            hf = U.tiny_model(fam, seed=5, **sizes)
            U.save_hf(hf, path)
        write_tokenizer(path, hf.config.vocab_size, bos_post_processor=fam == "llama3")
        out[fam] = (path, hf)
    return out


def _prompt(vocab: int, n: int = 24) -> list[int]:
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(3)).tolist()


@torch.no_grad()
def _logits(model, ids):
    return model(torch.tensor(ids), model.new_cache(len(ids))).logits


@torch.no_grad()
def _hf_logits(hf, ids):
    return hf(torch.tensor([ids])).logits[0].float()


def _expected_type(name: str, shape: tuple[int, ...], qt: QT) -> QT:
    if len(shape) < 2 or not name.endswith(".weight") or name.endswith(F32_ALWAYS) or qt == QT.F32:
        return QT.F32
    for t in CHAIN.get(qt, (qt,)):
        if shape[-1] % gguf.GGML_QUANT_SIZES[t][0] == 0:
            return t
    raise AssertionError(name)


def _reference_file(fam: str, path: str, hf, tmp_path) -> str:
    """The same checkpoint written by the test-only llama.cpp-style writers (F32)."""
    ref = str(tmp_path / "reference.gguf")
    if fam.startswith("qwen35"):
        qwen35_reference_gguf(path, ref, shexp_gate_1d=True)
    else:
        U.write_gguf(hf, ref, QT.F32)
    return ref


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("fam", FAMILIES)
def test_round_trip(models, fam, name, tmp_path):
    path, hf = models[fam]
    qt = TYPES[name]
    out = str(tmp_path / f"{fam}.{name}.gguf")
    res = convert(path, out, name)
    assert res.path == out and os.path.isfile(out)
    assert os.listdir(tmp_path) == [os.path.basename(out)], "a temporary file was left behind"

    # the gguf package's reader: names and shapes as llama.cpp's converter writes them, types as planned
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    ref = {t.name: t for t in gguf.GGUFReader(_reference_file(fam, path, hf, tmp_path)).tensors}
    assert set(tensors) == set(ref), f"names differ: {sorted(set(tensors) ^ set(ref))}"
    used = set()
    for tname, t in tensors.items():
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        assert shape == tuple(int(x) for x in reversed(ref[tname].shape.tolist())), tname
        assert t.tensor_type == _expected_type(tname, shape, qt), f"{tname} {shape}: {t.tensor_type.name}"
        used.add(t.tensor_type)
        if qt == QT.F32:  # bit for bit what the independent llama.cpp-style writer wrote
            a, b = np.asarray(t.data), np.asarray(ref[tname].data)
            if tname == "rope_freqs.weight":  # computed from the config, float rounding may differ
                assert np.allclose(a, b, rtol=1e-6, atol=0), tname
            else:
                assert np.array_equal(a, b), tname
    assert qt in used or qt in (QT.Q4_K, QT.Q6_K) and fam in ("llama_tied", "qwen35", "qwen35moe")
    arch = reader.fields["general.architecture"].contents()
    assert arch == {"llama3": "llama", "llama_tied": "llama", "qwen3": "qwen3", "qwen35": "qwen35",
                    "qwen35moe": "qwen35moe"}[fam]
    if fam.startswith("qwen35"):
        assert reader.fields[f"{arch}.nextn_predict_layers"].contents() == 1
        assert "blk.4.nextn.eh_proj.weight" in tensors and "blk.4.attn_q.weight" in tensors

    # specdec reads it back: logits against transformers
    loaded = load_model(out, "cpu", "float32")
    ids = _prompt(hf.config.vocab_size)
    ours = _logits(loaded.model, ids)
    orig = _hf_logits(hf, ids)
    err = U.rel_err(ours, orig)
    if qt != QT.F32:  # every weight specdec reads back is within its type's rounding of the original
        hf_state = hf.state_dict()
        worst = max(U.rel_err(v, hf_state[k if k == "lm_head.weight" else "model." + k])
                    for k, v in loaded.model.state_dict().items())
        print(f"{fam} {name}: weights {worst:.3g}")
        assert worst <= WEIGHT[qt], f"{fam} {name}: a weight is off by {worst:.3g} of its max (> {WEIGHT[qt]})"
    if qt in TIGHT:
        assert err <= TIGHT[qt], f"{fam} {name}: relative max error {err:.3g} > {TIGHT[qt]}"
        return
    # quantized: transformers on the weights specdec dequantized must agree tightly
    state = {(k if k == "lm_head.weight" else "model." + k): v for k, v in loaded.model.state_dict().items()}
    deq = _hf_logits(U.with_weights(hf, state), ids)
    tight = U.rel_err(ours, deq)
    cos = float(torch.nn.functional.cosine_similarity(ours, orig, dim=-1).min())
    print(f"{fam} {name}: vs dequantized {tight:.3g}, vs original {err:.3g} (cosine {cos:.4f})")
    assert tight <= DEQUANT, f"{fam} {name}: {tight:.3g} vs transformers on the dequantized weights"
    max_rel, min_cos = LOOSE[qt]
    assert err <= max_rel and cos >= min_cos, f"{fam} {name}: vs the original weights {err:.3g}, cosine {cos:.3g}"


@pytest.mark.parametrize("fam", ["qwen35", "qwen35moe"])
def test_mtp_drafter_from_gguf_drafts_like_hf(models, fam, tmp_path):
    path, _ = models[fam]
    out = str(tmp_path / "m.gguf")
    convert(path, out, "f32")
    g, h = load_model(out, "cpu", tokenizer=False), load_model(path, "cpu", tokenizer=False)
    gd, hd = load_mtp_drafter(g), load_mtp_drafter(h)
    for name, p in gd.block.state_dict().items():  # norms went through 1 + w - 1: not bit for bit
        torch.testing.assert_close(p, hd.block.state_dict()[name], atol=1e-6, rtol=0, msg=name)
    prompt = _prompt(g.model.config.vocab_size, 13)
    a = SpeculativeGenerator(g.model, gd, 3).generate(prompt, 30, trace=True)
    b = SpeculativeGenerator(h.model, hd, 3).generate(prompt, 30, trace=True)
    assert a.token_ids == b.token_ids
    assert [s["draft"] for s in a.stats.trace] == [s["draft"] for s in b.stats.trace]
    assert a.stats.drafted > 0


def test_fused_experts_and_vl_wrapper(models, tmp_path):
    """A checkpoint with experts in transformers' fused layout converts to the same file; a
    vision-language wrapper converts its language model only (vision tensors left out)."""
    import shutil

    path, _ = models["qwen35moe"]
    fused = str(tmp_path / "fused")
    shutil.copytree(path, fused)
    fuse_experts(fused)
    a, b = str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")
    convert(path, a, "f32")
    convert(fused, b, "f32")
    ta, tb = ({t.name: np.asarray(t.data) for t in gguf.GGUFReader(p).tensors} for p in (a, b))
    assert ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)

    vl = hf_vl_model()
    vl_dir = str(tmp_path / "vl")
    vl.save_pretrained(vl_dir)
    write_tokenizer(vl_dir, 256)
    out = str(tmp_path / "vl.gguf")
    convert(vl_dir, out, "f32")
    assert not any("visual" in t.name or t.name.startswith("v.") for t in gguf.GGUFReader(out).tensors)
    ids = _prompt(256)
    with torch.no_grad():
        want = vl(input_ids=torch.tensor([ids])).logits[0]
    err = U.rel_err(_logits(load_model(out, "cpu", tokenizer=False).model, ids), want)
    assert err <= TIGHT[QT.F32], f"VL wrapper: relative max error {err:.3g}"


def test_llama_attention_bias(tmp_path):
    """q/k biases are permuted with their rows, as llama.cpp's converter does, and specdec's loader
    reads such a file (attention and MLP biases, known by their tensors) into transformers' logits."""
    from transformers import LlamaForCausalLM

    from specdec.loading import load_model

    cfg = U.tiny_config("llama")
    cfg.attention_bias = True
    cfg.mlp_bias = True
    torch.manual_seed(4)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    path = U.save_hf(hf, str(tmp_path / "hf"))
    out = str(tmp_path / "m.gguf")
    convert(path, out, "f32", vocab=False)
    got = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(out).tensors}
    attn = hf.model.layers[1].self_attn
    for proj, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads)):
        for kind in ("weight", "bias"):
            want = getattr(getattr(attn, f"{proj}_proj"), kind).detach().numpy()
            assert np.array_equal(got[f"blk.1.attn_{proj}.{kind}"].reshape(want.shape), U.llama_permute(want, heads))
    assert np.array_equal(got["blk.1.attn_v.bias"], attn.v_proj.bias.detach().numpy())
    assert "blk.1.attn_output.bias" in got and "blk.1.ffn_down.bias" in got
    m = load_model(out, "cpu", "float32", tokenizer=False).model
    assert m.config.attention_bias and m.config.mlp_bias
    ids = torch.randint(1, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    have = m(ids, m.new_cache(16)).logits
    assert float((have - want).abs().max() / want.abs().max()) < 1e-4


def test_tokenizer_metadata(models, tmp_path):
    path, _ = models["llama3"]
    out = str(tmp_path / "m.gguf")
    convert(path, out, "q8_0")
    src, hf_tok = load_model(out, "cpu").tokenizer, Tokenizer.from_hf_dir(path)
    for text in ["The quick fox", "  def f(x):\n\treturn x * 2  ", "lazy <|end|> dog", ""]:
        assert src.encode(text) == hf_tok.encode(text), text
        assert src.decode(src.encode(text, add_special=False)) == text  # every byte is a token
    assert src.encode("The")[0] == 0, "BOS from the post-processor"
    assert src.eos_ids == [1] and src.bos_id == 0
    msgs = [{"role": "user", "content": "hi"}]
    assert src.apply_chat_template(msgs) == hf_tok.apply_chat_template(msgs)
    fields = gguf.GGUFReader(out).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == U.VOCAB and tokens[-1] == f"[PAD{U.VOCAB - 1}]"
    types = fields["tokenizer.ggml.token_type"].contents()
    assert types[0] == types[1] == gguf.TokenType.CONTROL and types[-1] == gguf.TokenType.UNUSED


@pytest.mark.parametrize("regex,name", [
    (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
     "llama-bpe"),
    (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
     "qwen2"),
    (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
     "qwen35"),
])
def test_pre_tokenizer_names(regex, name):
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated"}
    tj = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, {"type": "ByteLevel", "use_regex": False}]}}
    assert pre_tokenizer_name(tj, "t.json") == name
    smollm = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, {"type": "ByteLevel", "use_regex": True}]}}
    assert pre_tokenizer_name(smollm, "t.json") == "smollm"
    with pytest.raises(CheckpointError, match="t.json"):
        pre_tokenizer_name({"pre_tokenizer": {"type": "Metaspace"}}, "t.json")


# --- safe writes ----------------------------------------------------------------------------------

_SLOW = """
import sys, time
import specdec.convert.writer as W
real = W.encode
def slow(arr, qt):
    print("writing", flush=True)
    time.sleep(0.3)
    return real(arr, qt)
W.encode = slow
from specdec.convert import convert
convert(sys.argv[1], sys.argv[2], "q8_0")
"""


def test_killed_conversion_leaves_no_output(models, tmp_path):
    path, _ = models["qwen35"]
    out = tmp_path / "killed.gguf"
    root = os.path.dirname(os.path.dirname(os.path.abspath(specdec.__file__)))  # this specdec, not another install
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p))
    proc = subprocess.Popen([sys.executable, "-c", _SLOW, path, str(out)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing", "the conversion never started writing"
        assert proc.stdout.readline().strip() == "writing"  # the first tensor is in the file
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    left = os.listdir(tmp_path)
    assert left and all(n.startswith(".killed.gguf.") and n.endswith(".tmp") for n in left), left


def test_failed_conversion_cleans_up(models, tmp_path, monkeypatch):
    import specdec.convert.writer as W

    calls, real = [], W.encode

    def failing(arr, qt):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        return real(arr, qt)

    monkeypatch.setattr(W, "encode", failing)
    with pytest.raises(OSError, match="disk full"):
        convert(models["llama_tied"][0], str(tmp_path / "x.gguf"), "f16")
    assert os.listdir(tmp_path) == []


def test_refuses_to_overwrite(models, tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(CheckpointError, match=r"m\.gguf.*--force"):
        convert(models["llama_tied"][0], str(out), "q8_0")
    assert out.read_bytes() == b"keep me"
    convert(models["llama_tied"][0], str(out), "q8_0", force=True)
    assert out.read_bytes()[:4] == b"GGUF"


# --- command line and bad input ----------------------------------------------------------------

def test_cli_convert_then_info(models, tmp_path, capsys):
    path, _ = models["qwen35moe"]
    out = str(tmp_path / "moe.gguf")
    assert main(["convert", path, out, "--type", "q8_0"]) == 0
    said = capsys.readouterr().out
    assert out in said and "qwen35moe" in said and "Q8_0" in said
    assert main(["info", out]) == 0
    info = capsys.readouterr().out
    assert "qwen3_5_moe" in info and "mtp" in info
    assert main(["convert", path, out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and out in err and "--force" in err
    assert main(["convert", path, out, "--force", "--type", "Q4_K"]) == 0


def test_cli_types_match_the_converter():
    assert CONVERT_TYPES == tuple(TYPES)


@pytest.mark.parametrize("case", ["no_config", "model_type", "type", "no_dir", "no_tokenizer"])
def test_bad_input_is_named(models, tmp_path, capsys, case):
    src = tmp_path / "hf"
    src.mkdir()
    args = [str(src), str(tmp_path / "o.gguf")]
    if case == "no_config":
        culprit = "config.json"
    elif case == "model_type":
        (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
        culprit = "gpt2"
    elif case == "type":
        args = [models["llama_tied"][0], args[1], "--type", "q3_k"]
        culprit = "q3_k"
    elif case == "no_dir":
        args = [str(tmp_path / "missing"), args[1]]
        culprit = "missing"
    else:
        path = tmp_path / "hf2"
        U.save_hf(U.tiny_model("llama_tied"), str(path))
        args = [str(path), args[1]]
        culprit = "tokenizer.json"
    capsys.readouterr()
    assert main(["convert", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and culprit in err, err
    assert not (tmp_path / "o.gguf").exists()
    if case == "no_tokenizer":
        assert main(["convert", *args, "--no-vocab"]) == 0
        loaded = load_model(args[1], "cpu")  # no vocabulary in the file: no tokenizer, ids still work
        assert loaded.format == "gguf" and loaded.tokenizer is None


def test_python_errors_are_specdec_errors(tmp_path):
    with pytest.raises(ConfigError, match="--type 'q2'"):
        convert(str(tmp_path), str(tmp_path / "o.gguf"), "q2")
