"""Helpers for the dense-model tests: tiny random HF Llama / Qwen3 checkpoints, GGUF files written
from them with llama.cpp's names and conventions, and GGML block encoders/decoders written from
ggml's block layouts (independent of specdec and of the ``gguf`` package's kernels).
"""

from __future__ import annotations

import copy
import os

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as QT

# ---------------------------------------------------------------------------------------------
# tiny HF models

VOCAB = 320  # 256 byte tokens + <|endoftext|> + padding tokens (see gguf_vocab)
EOS = 256

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def tiny_config(kind: str, hidden: int = 64, inter: int = 128, heads: int = 4, kv: int = 2, layers: int = 2):
    """An HF config for ``kind`` in llama | llama_tied | llama3 | qwen3 (qwen3: head_dim != hidden/heads)."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, rms_norm_eps=1e-5,
                  bos_token_id=None, eos_token_id=EOS, initializer_range=0.1)
    if kind == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           max_position_embeddings=512)
    if kind == "llama_tied":  # SmolLM2-like
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                           max_position_embeddings=512, tie_word_embeddings=True)
    if kind == "llama3":
        return LlamaConfig(**common, rope_parameters=dict(LLAMA3_ROPE), max_position_embeddings=131072)
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=2 * hidden // heads, max_position_embeddings=1024,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    raise ValueError(kind)


def tiny_model(kind: str, seed: int = 0, **sizes):
    """A random fp32 HF model; norm weights are randomised too so a mis-mapped norm shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **sizes), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model.eval()


def with_weights(model, replace: dict[str, torch.Tensor]):
    """A copy of ``model`` whose HF-named weights in ``replace`` are swapped (e.g. dequantized)."""
    m = copy.deepcopy(model)
    state = m.state_dict()
    for k, v in replace.items():
        assert state[k].shape == v.shape, k
        state[k] = v.to(state[k].dtype)
    m.load_state_dict(state)
    if m.config.tie_word_embeddings:
        m.tie_weights()
    return m.eval()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain greedy continuation with transformers' generate (no EOS stop)."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (b is the reference)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def prompt_ids(n: int = 40, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


# ---------------------------------------------------------------------------------------------
# GGUF writing (llama.cpp conventions)

_BLOCK = {  # HF decoder-layer suffix -> llama.cpp block suffix
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.{i}.<suffix>
    return f"blk.{parts[2]}.{_BLOCK['.'.join(parts[3:])]}"


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute``: per head, rotate-half -> interleaved rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (token i of the tiny vocab is byte i)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def gguf_vocab(w: "gguf.GGUFWriter", pre: str = "gpt-2") -> None:
    """A byte-level BPE vocabulary of VOCAB tokens (no merges): bytes, <|endoftext|>, padding."""
    tokens = _bytes_to_unicode() + ["<|endoftext|>"] + [f"<|pad{i}|>" for i in range(VOCAB - 257)]
    types = [1] * 256 + [3] + [5] * (VOCAB - 257)  # normal, control, unused
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([])
    w.add_eos_token_id(EOS)
    w.add_add_bos_token(False)


def encode_tensor(arr: np.ndarray, qtype: QT) -> tuple[np.ndarray, QT]:
    """``arr`` (fp32, [rows, cols]) in ``qtype`` storage: the array GGUFWriter.add_tensor takes."""
    if qtype == QT.F32:
        return arr.astype(np.float32), qtype
    if qtype == QT.F16:
        return arr.astype(np.float16), qtype
    if qtype == QT.Q4_K:
        return q4_k_encode(arr), qtype
    if qtype == QT.Q6_K:
        return q6_k_encode(arr), qtype
    return gguf.quants.quantize(arr, qtype), qtype


def decode_tensor(stored: np.ndarray, qtype: QT, shape) -> np.ndarray:
    """What a correct reader must produce from ``stored`` (gguf's kernels; own ones for K-quants)."""
    if qtype == QT.Q4_K:
        return q4_k_decode(stored).reshape(shape)
    if qtype == QT.Q6_K:
        return q6_k_decode(stored).reshape(shape)
    if qtype == QT.F16:
        return stored.astype(np.float32).reshape(shape)
    return gguf.quants.dequantize(stored, qtype).astype(np.float32).reshape(shape)


def write_gguf(model, path: str, qtype: QT = QT.F32, pre: str = "gpt-2", skip: tuple[str, ...] = (),
               extra: dict[str, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """Write ``model`` as llama.cpp would (arch ``llama`` or ``qwen3``); 2-D weights in ``qtype``.

    Returns the HF-named weights a correct reader recovers (dequantized, un-permuted), so the
    test can run transformers on exactly those values. ``skip`` (GGUF names) leaves tensors
    out and ``extra`` adds tensors, for the bad-input tests.
    """
    cfg = model.config
    arch = cfg.model_type
    assert arch in ("llama", "qwen3"), arch
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(int(qtype) if qtype != QT.F32 else 0)
    gguf_vocab(w, pre)
    recovered: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        a = t.detach().float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = llama_permute(a, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = llama_permute(a, kv)
        if gguf_name(name) in skip:
            continue
        q = qtype if a.ndim == 2 else QT.F32  # llama.cpp keeps 1-D tensors (norms) in F32
        stored, q = encode_tensor(a, q)
        w.add_tensor(gguf_name(name), stored, raw_dtype=q if q not in (QT.F32, QT.F16) else None)
        back = decode_tensor(stored, q, a.shape)
        if arch == "llama" and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            n = heads if "q_proj" in name else kv
            back = back.reshape(n, back.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(a.shape)
        recovered[name] = torch.from_numpy(np.ascontiguousarray(back))
    if arch == "llama" and rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    for k, v in (extra or {}).items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return recovered


def llama3_rope_factors(rope: dict, dim: int) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for llama3 RoPE (frequency divisors)."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# GGML K-quant blocks (QK_K = 256), from ggml's block layouts

def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def q6_k_encode(x: np.ndarray) -> np.ndarray:
    """[rows, cols] fp32 -> Q6_K bytes [rows, cols/256*210]: ql[128] qh[64] scales[16] (int8) d (fp16)."""
    rows = x.shape[0]
    b = x.reshape(-1, 16, 16).astype(np.float32)  # blocks x sub-blocks x values
    s = np.abs(b).max(-1) / 31.0  # per sub-block scale so q stays in -31..31
    d = _f16(s.max(-1) / 127.0)
    df = d.astype(np.float32)
    sc = np.clip(np.round(s / np.where(df > 0, df, 1)[:, None]), 0, 127).astype(np.int8)
    step = df[:, None, None] * sc[..., None].astype(np.float32)
    q = np.where(step > 0, np.round(b / np.where(step > 0, step, 1)), 0)
    L = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # half, quarter, l
    ql = np.concatenate([L[:, :, 0] & 0xF | (L[:, :, 2] & 0xF) << 4,
                         L[:, :, 1] & 0xF | (L[:, :, 3] & 0xF) << 4], axis=2)  # [nb, 2, 64]
    qh = (L[:, :, 0] >> 4) | (L[:, :, 1] >> 4) << 2 | (L[:, :, 2] >> 4) << 4 | (L[:, :, 3] >> 4) << 6  # [nb, 2, 32]
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)], axis=1)
    return out.reshape(rows, -1)


def q6_k_decode(raw: np.ndarray) -> np.ndarray:
    blk = raw.reshape(-1, 210)
    ql, qh = blk[:, :128].reshape(-1, 2, 64), blk[:, 128:192].reshape(-1, 2, 32)
    sc = blk[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blk[:, 208:210].copy().view(np.float16).astype(np.float32).reshape(-1)
    q = np.stack([ql[:, :, :32] & 0xF | ((qh >> 0) & 3) << 4,
                  ql[:, :, 32:] & 0xF | ((qh >> 2) & 3) << 4,
                  ql[:, :, :32] >> 4 | ((qh >> 4) & 3) << 4,
                  ql[:, :, 32:] >> 4 | ((qh >> 6) & 3) << 4], axis=2).astype(np.float32) - 32  # [nb, 2, 4, 32]
    y = q.reshape(-1, 16, 16) * sc[:, :, None] * d[:, None, None]
    return y.reshape(raw.shape[0], -1)


def _pack_scale_min_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> ggml's 12-byte layout (inverse of get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | (sc[:, 4:8] >> 4) << 6
    out[:, 4:8] = m[:, 0:4] | (m[:, 4:8] >> 4) << 6
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | (m[:, 4:8] & 0xF) << 4
    return out


def _unpack_scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc = np.empty((s.shape[0], 8), dtype=np.uint8)
    m = np.empty_like(sc)
    sc[:, :4], m[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0xF) | (s[:, 0:4] >> 6) << 4
    m[:, 4:] = (s[:, 8:12] >> 4) | (s[:, 4:8] >> 6) << 4
    return sc.astype(np.float32), m.astype(np.float32)


def q4_k_encode(x: np.ndarray) -> np.ndarray:
    """[rows, cols] fp32 -> Q4_K bytes [rows, cols/256*144]: d dmin (fp16) scales[12] qs[128]."""
    rows = x.shape[0]
    b = x.reshape(-1, 8, 32).astype(np.float32)
    mn = np.minimum(b.min(-1), 0)
    scale = (b.max(-1) - mn) / 15.0
    d, dmin = _f16(scale.max(-1) / 63.0), _f16((-mn).max(-1) / 63.0)
    df, dmf = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.round(scale / np.where(df > 0, df, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-mn / np.where(dmf > 0, dmf, 1)[:, None]), 0, 63).astype(np.uint8)
    step = df[:, None] * sc
    q = np.where(step[..., None] > 0, np.round((b + (dmf[:, None] * m)[..., None]) / np.where(step > 0, step, 1)[..., None]), 0)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, 128)
    out = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8),
                          _pack_scale_min_k4(sc, m), qs], axis=1)
    return out.reshape(rows, -1)


def q4_k_decode(raw: np.ndarray) -> np.ndarray:
    blk = raw.reshape(-1, 144)
    d = blk[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(-1)
    dmin = blk[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(-1)
    sc, m = _unpack_scale_min_k4(blk[:, 4:16])
    qs = blk[:, 16:].reshape(-1, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
    y = d[:, None, None] * sc[..., None] * q - (dmin[:, None] * m)[..., None]
    return y.reshape(raw.shape[0], -1)


def q5_k_decode(raw: np.ndarray) -> np.ndarray:
    """Q5_K: d dmin (fp16) scales[12] qh[32] qs[128]; bit 2c / 2c+1 of qh[l] is the 5th bit."""
    blk = raw.reshape(-1, 176)
    d = blk[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(-1)
    dmin = blk[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(-1)
    sc, m = _unpack_scale_min_k4(blk[:, 4:16])
    qh, qs = blk[:, 16:48], blk[:, 48:].reshape(-1, 4, 32)
    hi = np.stack([(qh >> (2 * c + j)) & 1 for c in range(4) for j in range(2)], axis=1)  # [nb, 8, 32]
    lo = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 8, 32)
    q = (lo + 16 * hi).astype(np.float32)
    y = d[:, None, None] * sc[..., None] * q - (dmin[:, None] * m)[..., None]
    return y.reshape(raw.shape[0], -1)


def q4_0_decode(raw: np.ndarray) -> np.ndarray:
    blk = raw.reshape(-1, 18)
    d = blk[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(-1, 1)
    qs = blk[:, 2:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32) - 8
    return (q * d).reshape(raw.shape[0], -1)


def q4_1_decode(raw: np.ndarray) -> np.ndarray:
    blk = raw.reshape(-1, 20)
    d = blk[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(-1, 1)
    m = blk[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(-1, 1)
    qs = blk[:, 4:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
    return (q * d + m).reshape(raw.shape[0], -1)


def random_k_blocks(rows: int, cols: int, block_bytes: int, seed: int) -> np.ndarray:
    """Random K-quant bytes with sane fp16 super-block scales d, dmin in the first 4 bytes."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    raw[:, 0:2] = _f16(rng.uniform(0.001, 0.01, size=(raw.shape[0], 1))).view(np.uint8)
    raw[:, 2:4] = _f16(rng.uniform(0.001, 0.01, size=(raw.shape[0], 1))).view(np.uint8)
    return raw.reshape(rows, -1)


def write_single_tensor_gguf(path: str, name: str, stored: np.ndarray, qtype: QT | None) -> None:
    """A GGUF with one tensor and just enough metadata for GGUFSource."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor(name, stored, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def save_hf(model, path: str, max_shard_size: str | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    return path
