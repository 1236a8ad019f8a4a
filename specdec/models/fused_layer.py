"""A Llama-family layer's GEMMs in Triton, SwiGLU's activation in the gate/up GEMM (issue 10: fewer,
faster kernels for small models).

A 16-row SmolLM2 step on the H200 ran ~11 kernels a layer (1.35 ms a step for weights that take
0.07 ms to read): the step is its launches and their latencies. cuBLAS took 3.1 us for the 576 x 576
o_proj at 16 rows and 4.4 us for the 1536 -> 576 down_proj, where a Triton GEMM with 16-row tiles and
a tiling picked per weight took 2.6 and 3.7 (scripts/check_fused_layer.py --sweep); the whole step went
1.33 -> 1.16 ms (scripts/ab_flags.py, one process). Here a layer runs:

- RMSNorm (after the residual add, from the second layer on): ``fused_ops``' kernel, as before;
- the q/k/v GEMM: :func:`linear`;
- RoPE + the cache write, the split attention: their own kernels, as before;
- o_proj: :func:`linear`; then the residual add and RMSNorm: ``fused_ops``' kernel;
- gate/up and ``silu(gate) * up``: :func:`linear` with ``silu`` (one kernel instead of two);
- down_proj: :func:`linear`, whose output the next layer's add-and-norm kernel adds (the residual add
  folded as ``SPECDEC_FOLD_RESIDUAL`` folds it: one kernel less).

From ~11 kernels a layer to 8. (A version with RoPE and the cache write in the q/k/v GEMM's epilogue, one
kernel a layer fewer, was no faster on the H200: ``SPECDEC_QKV_ROPE``, code at ae48a51. A version with the
norm and the residual add inside the q/k/v and gate/up GEMMs, 6.5 kernels a layer, was slower: on the H200
the prologue cost 2.5-4 us a GEMM, more than the norm kernel it replaced; BENCHMARKS.md.) Each program computes ``BM = 16`` rows by ``BN`` outputs,
walking K in ``BK`` blocks in order and accumulating in fp32: a row's bits depend on its own inputs
and the weight's tiling only (never on the row count, the other rows or the step; a weight's tiling is
fixed by its shape), so one kernel serves prefill chunks, decode and verify steps and batched steps
alike. A model takes these kernels for every CUDA forward without gradients (:func:`usable`) or for
none (layers wider than MAX_HIDDEN: every such forward of at most WIDE_ROWS rows a sequence, :func:`runs`), so
plain and speculative decoding compute the same rows. They need not be cuBLAS's bits (on
the H200 a random SmolLM2-shape model's logits came out identical: both sum K in k16 steps, in order,
with no split). Which models take it: :func:`eligible`;
``SPECDEC_FUSED_LAYER=0`` turns it off. ``scripts/check_fused_layer.py`` compares the kernel with its
torch reference (:func:`reference`) and times it on the GPU; tests/_interpret_kernels.py runs it on
the CPU.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import torch

from .. import env
from ..cpu_linear import plain
from ..errors import ConfigError
from . import pdl

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ENABLED = env.switch("SPECDEC_FUSED_LAYER")
# Layers wider than this (the qwen3-8b shape's 4096) take the kernels in forwards of at most WIDE_ROWS rows a sequence
# only (decode and verify steps, a prefill's last chunk); a longer prefill runs them on cuBLAS: there the 16-row tiles
# (mma.sync, no wgmma) took 2-3x cuBLAS's time on the H200 (qwen3-8b shape, 512 / 4,096 tokens: 62 / 541 against
# 30 / 182 ms, scripts/ab_flags.py). Plain and speculative decoding prefill alike, so their outputs stay equal; a row's
# bits in a step still depend on its inputs alone.
MAX_HIDDEN = 1024
WIDE_ROWS = 32
# SPECDEC_FUSED_LAYER_WIDE=0: layers wider than MAX_HIDDEN and Qwen3's q/k-normed layers stay on cuBLAS (and their
# steps padded: such a model is not row_exact). On the H200 (qwen3-8b shape, context 512, scripts/ab_flags.py) the
# kernels took plain decoding's step 5.79 ms (16 rows padded, cuBLAS) -> 5.52 (1 row), 4.90 with 128-key splits
WIDE = env.switch("SPECDEC_FUSED_LAYER_WIDE")
# split K (a tiling's fifth field): a weight of few output tiles (the qwen3-8b shape's 4096 x 4096 o_proj at 64 outputs
# a program: 64 programs for 132 SMs) runs each tile as SPLIT programs over K; each writes its fp32 partial sums and the
# tile's last to finish adds them in split order (the same order whichever finishes last) and writes the output, so a
# row's bits still depend on its inputs and the weight's tiling alone. SPECDEC_FUSED_SPLIT_K=0: every tiling unsplit
SPLIT_K = env.switch("SPECDEC_FUSED_SPLIT_K")
# a weight of at most this many bytes is pulled into L2 whole before a PDL wait, a larger one not at all: on the H200
# (scripts/ab_flags.py, qwen3-8b shape, 1-row step) prefetching the 4096-wide weights whole (33-201 MB, past the
# 50 MB L2) cost 5.50 -> 7.15 ms, their rows' first 16 MB of lines 5.50 -> 5.70; SmolLM2's weights (1-2 MB) go whole
PREFETCH_BYTES = 16 << 20
# split K's tile counters a device (see linear: a larger step runs as several kernels over its rows)
COUNTERS = 1 << 16
BM = 16  # rows a program: fixed (a row's bits must not depend on the tile it shares)
# (BN, BK, warps, stages): the tiling of the outputs and of K, fixed per weight shape (never by the rows)
TILE = (16, 128, 2, 4)
# (N, K, silu) -> tiling: the fastest of scripts/check_fused_layer.py --sweep at 16 rows on the H200
# (SmolLM2's four weights, 54 tilings; times against cuBLAS in the same run, BENCHMARKS.md)
TILES: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {
    (960, 576, False): (16, 128, 2, 4),  # q/k/v: 2.44 us (cuBLAS 3.00)
    (576, 576, False): (16, 128, 2, 4),  # o_proj: 2.59 us (cuBLAS 3.16)
    (1536, 576, True): (32, 128, 4, 4),  # gate/up + silu * up: 3.61 us (cuBLAS + silu_mul 4.88)
    (576, 1536, False): (16, 256, 4, 4),  # down_proj: 3.75 us (cuBLAS 4.43)
    # the LM head of a row-exact target (SPECDEC_ROW_EXACT; --head --only head --sweep, 66 tilings): 17.13 us at
    # 16 rows, 16.39 at 1 (the default tiling 19.75 / 18.72; cuBLAS 16.91 / 15.94)
    (49152, 576, False): (32, 64, 2, 4),
    # the qwen3-8b shape (WIDE; --shape qwen3-8b --sweep --head, 24 tilings a weight, each timed call on another
    # copy of its weight so that none is read from L2): us at 16 rows, cuBLAS in brackets
    # with K split (SPLIT_K; 2026-12-04 (fourth)) where the step measured faster (scripts/ab_flags.py, 1-row step at
    # context 512, ms: defaults 4.97, o_proj split 2 4.79, q/k/v split 4 4.85, down_proj split 4 on 3 stages 5.03); alone
    # (16 rows, us) they time as the unsplit tiles: q/k/v 16.78 against 16.30-16.54, o_proj 11.26 both
    (6144, 4096, False): (64, 128, 4, 4, 4),  # q/k/v: 17.00 (15.62) unsplit on (64, 256, 8, 4)
    (4096, 4096, False): (64, 256, 4, 4, 2),  # o_proj: 13.73 (13.75) unsplit
    (12288, 4096, True): (32, 128, 4, 4),  # gate/up + silu * up: 48.87 (52.84 with silu_mul)
    # down_proj: 30.12 (29.14); K split 2 ways (SPLIT_K, 2026-12-04 (fourth)): 26.98 against 28.12 unsplit (28.60), and
    # the 1-row step (scripts/ab_flags.py, defaults-split-k) 5.21 -> 4.97 ms
    (4096, 12288, False): (64, 256, 4, 4, 2),
    (151936, 4096, False): (128, 128, 4, 3),  # LM head: 282.55 (303.86)
    (4096, 20480, False): (64, 256, 4, 4, 2),  # a DFlash drafter's fc (5 target layers): 42.16, unsplit 44.89 (43.45)
    # the qwen3.5-35b-a3b shape (--shape qwen3.5-35b-a3b --sweep --head --rows 1, the 1-row step plain decoding runs; us
    # at 1 row, _wide_tile's default and cuBLAS in brackets; session of 2026-12-05 (second)); the 1-row step with these
    # four (scripts/ab_flags.py, defaults+tiles, context 512) 3.317 -> 3.143 ms
    (12352, 2048, False): (64, 128, 4, 4),  # a Gated DeltaNet's in-projections: 14.63 (16.00; 15.53)
    (9216, 2048, False): (32, 256, 4, 4),  # the gated attention's q/k/v + gate: 13.55 (14.70; 11.86)
    (2048, 4096, False): (64, 256, 4, 4, 2),  # o_proj / the DeltaNet's out_proj: 8.76 (10.15 split 4; 9.30)
    (248320, 2048, False): (128, 128, 4, 4),  # LM head: 226.93 (228.77; 245.52)
    # the gemma3-270m shape (2026-12-06 (tenth), H100, --shape gemma3-270m --sweep --head --rows 1; us at 1 row, the
    # default TILE and cuBLAS in brackets; its q/k/v (1536 x 640) keeps TILE, the best there, 2.61 us); the 1-row step
    # with these (scripts/ab_flags.py, defaults+tiles, context 512, 6 rounds) 0.804 -> 0.762 ms
    (640, 1024, False): (16, 256, 4, 4),  # o_proj: 2.73 (3.11; 4.52)
    (2048, 640, True): (32, 256, 4, 4),  # gate/up + gelu_tanh * up: 4.21 (6.12; cuBLAS + silu_mul 6.87)
    (640, 2048, False): (64, 256, 4, 4, 4),  # down_proj: 4.52 (5.39; 6.38)
    (262144, 640, False): (32, 128, 2, 4),  # LM head (tied): 108.06 (108.20; 113.27)
    # its MoE router + the shared expert's gate (2026-12-06 (third), H100, --only router --sweep --rows 1, 64 tilings
    # with K split 1-8 ways): 4.58 us (the default TILE 5.41; cuBLAS 3.09); the 1-row step (ab_flags defaults+tiles)
    # 3.691 / 3.709 -> 3.660 / 3.621 ms in two rounds
    (257, 2048, False): (16, 128, 2, 3, 8),
    # the gemma4-26b-a4b shape (2026-12-07 (twelfth), H100, --shape gemma4-26b-a4b --sweep --rows 1 --only ..., us at 1
    # row, the default tiling and cuBLAS in brackets; each keeps a row's bits at 1..512 rows); all seven in the 1-row step
    # (scripts/ab_flags.py defaults+tiles, context 512, one process) 4.560 -> 4.382 ms
    (8192, 2816, False): (64, 256, 4, 4, 1),  # a sliding layer's q/k/v: 17.45 (17.38; 17.82)
    (9216, 2816, False): (32, 256, 4, 4, 1),  # a full layer's q/k (keys as values): 21.90 (23.37; 20.22)
    (2816, 4096, False): (64, 256, 4, 3, 3),  # a sliding layer's o_proj: 11.03 (11.97; 12.81)
    (2816, 8192, False): (64, 256, 4, 3, 3),  # a full layer's o_proj: 18.70 (20.33; 20.63)
    (2112, 2816, True): (32, 256, 4, 4, 1),  # gate/up + gelu_tanh * up: 10.63 (11.62; cuBLAS + the product 13.53)
    (2816, 2112, False): (64, 256, 4, 3, 3),  # down_proj: 8.43 (8.76; 7.34)
    (128, 2816, False): (16, 256, 4, 3, 8),  # the MoE router: 4.16 (6.02; 6.36)
    # the gemma4-e2b shape (2026-12-07 (fourteenth), H100, scripts/device_e2b.sh tiles: --shape gemma4-e2b --sweep --rows
    # 1; us at 1 row, the default TILE and cuBLAS in brackets; each keeps a row's bits at 1..200 rows): the 1,536-output
    # projections with K split, the others on wider tiles; its per-layer projection (1536 x 256) keeps TILE, the best
    # (1.82 us). The 1-row step (scripts/ab_flags.py, context 512, one process) 4.533 -> 3.025 ms with the first five
    (1536, 12288, False): (64, 256, 4, 4, 4),  # a KV-shared layer's (double-wide) down_proj: 16.57 (28.07; 17.80)
    (1536, 6144, False): (64, 256, 4, 4, 4),  # down_proj: 10.13 (14.69; 11.50)
    (1536, 4096, False): (32, 256, 4, 4, 4),  # a full layer's o_proj: 10.34 (12.29; 9.48)
    (1536, 2048, False): (64, 256, 4, 4, 2),  # a sliding layer's o_proj: 6.53 (6.66; 5.70)
    (2560, 1536, False): (64, 256, 4, 4, 1),  # a sliding layer's q/k/v: 6.08 (7.67; 5.71)
    (5120, 1536, False): (64, 256, 4, 4, 1),  # a full layer's q/k/v: 9.18 (13.44; 8.20)
    (2048, 1536, False): (64, 256, 4, 4, 2),  # a KV-shared sliding layer's q: 5.59 (6.35; 5.68)
    (4096, 1536, False): (64, 256, 4, 4, 1),  # a KV-shared full layer's q: 6.97 (11.30; 7.05)
    (6144, 1536, True): (32, 128, 4, 4, 1),  # gate/up + gelu_tanh * up: 15.30 (16.96; cuBLAS + the product 17.38)
    (12288, 1536, True): (32, 128, 4, 4, 1),  # a KV-shared layer's gate/up: 26.63 (27.37; 29.54)
    (256, 1536, False): (16, 256, 2, 4, 1),  # the per-layer input's gate: 3.40 (3.92; 4.88)
    (8960, 1536, False): (32, 256, 4, 4, 1),  # the embeddings' projection to the per-layer inputs: 12.80 (13.10; 12.42)
}
# weights of 2,048 or more outputs and inputs that the table does not name (a Qwen3.5 MTP block's fc, other 4096-wide
# layers): the qwen3-8b shape's tilings by kind (its default TILE took 24.8 against 17.0 us on its q/k/v, 60.8 against
# 30.1 on its down_proj)
TILE_WIDE = {False: (64, 256, 4, 4), True: (32, 128, 4, 4)}
WIDE_PROGRAMS = 128  # (the H100's and H200's 132 SMs)
# (Measured and removed, session of 2026-12-07 (fifteenth), H100: narrow weights over a long K that the table does not
# name (fewer than 2,048 outputs, K at least twice that) on TILE_WIDE with K split, the sweeps' best on the three such
# weights swept. In the steps and drafter proposes that would take it (SmolLM2's and Gemma 3's drafter fc, E4B's
# per-layer gate; scripts/ab_flags.py, two calls) it moved them -5 % to +2 %, within the calls' noise.)
# (Measured and removed, session of 2026-12-07 (fifteenth), H100: a resident form for chosen weights, each program's 16
# weight rows loaded into registers before its PDL wait, then x's rows in turn, fp32 products summed in one reduction
# (a row's bits its own at any row count). A probe (scripts/probe_persistent.py) had put it at 2.3 us after its input
# against 9.0 loading after. On the qwen3.5-35b-a3b shape's 2048 x 4096 out/o_proj (scripts/ab_flags.py, 3 rounds) the
# 1-row step went 3.720 -> 3.808 ms and the padded 16-row step 3.860 -> 5.064: its programs, a whole SM's registers
# each, started only as the chain's programs left the SMs (8 us added a projection, the timeline's), and each row's
# reduction cost ~2 us. The idea needs the weights in shared memory or the chain and the projection in one kernel.)
# int8 rows (Int8Rows: a DFlash drafter's --draft-int8) by (N, K, silu): half the bytes a K block, so wider K blocks
# than the bf16 tilings (which took these weights at 0.79-1.18x their bf16 time). The qwen3-8b shape's drafter weights
# (scripts/check_fused_layer.py --shape qwen3-8b --int8 --sweep, 16 rows, INT8_SWEEP's 24 tilings, H100, session of
# 2026-12-06 (ninth)); us int8 against bf16 on its own tiling in brackets
TILES_INT8: dict[tuple[int, int, bool], tuple[int, int, int, int, int]] = {
    (6144, 4096, False): (64, 512, 4, 4, 1),  # q/k/v: 12.65 (22.11)
    (4096, 4096, False): (32, 512, 4, 4, 2),  # o_proj: 12.55 (15.09)
    (12288, 4096, True): (32, 256, 4, 4, 1),  # gate/up + silu * up: 39.82 (69.02)
    (4096, 12288, False): (32, 256, 4, 4, 4),  # down_proj: 23.36 (38.52)
    (4096, 20480, False): (32, 512, 4, 4, 2),  # the drafter's fc (5 target layers): 35.43 (59.91)
    (10240, 4096, False): (32, 256, 4, 4, 1),  # every layer's context keys and values: 20.15 (33.32)
}
# other int8 weights: 32 outputs by 256 of K a program, K split to fill about two waves of programs (the rule the table's
# best splits follow: 128 output tiles 2 ways (4 for down_proj, 2 within 1 %), 192 or more unsplit)
TILE_INT8 = (32, 256, 4, 4)
_FORCED: dict | None = None


def forced_tiles() -> dict:
    """``SPECDEC_FUSED_LAYER_TILES`` (for sweeps and checks): '{"N,K,silu": [BN, BK, warps, stages(, split)], ...}'
    (silu 0 or 1) over the table above; the key "*" stands for every weight the table does not name (device_check's
    random models on split K)."""
    global _FORCED
    if _FORCED is None:
        raw = os.environ.get("SPECDEC_FUSED_LAYER_TILES", "{}")
        try:
            _FORCED = {key if key == "*" else tuple(int(v) for v in key.split(",")): tuple(int(v) for v in t)
                       for key, t in json.loads(raw).items()}
            if any((key != "*" and len(key) != 3) or len(t) not in (4, 5) for key, t in _FORCED.items()):
                raise ValueError
        except (ValueError, TypeError, AttributeError):
            raise ConfigError(f"SPECDEC_FUSED_LAYER_TILES={raw!r}: want '{{\"N,K,silu\": [BN, BK, warps, stages(, split)], "
                              f"...}}' (or the key \"*\")") from None
    return _FORCED


def tile_for(n: int, k: int, silu: bool, int8: bool = False) -> tuple[int, ...]:
    """The tiling of a weight of ``n`` outputs (gate outputs with ``silu``) and ``k`` inputs: (BN, BK, warps,
    stages[, split]); ``int8``: of its :class:`Int8Rows` (TILES_INT8, else TILE_INT8 split to fill two waves;
    ``SPECDEC_FUSED_LAYER_TILES`` does not name them)."""
    if int8:
        return TILES_INT8.get((n, k, silu)) or TILE_INT8 + (max(1, min(4, 2 * WIDE_PROGRAMS // -(-n // TILE_INT8[0]))),)
    forced = forced_tiles()
    return (forced.get((n, k, int(silu))) or TILES.get((n, k, silu)) or forced.get("*")
            or (_wide_tile(n, silu) if min(n, k) >= 2048 else TILE))


def _wide_tile(n: int, silu: bool) -> tuple[int, ...]:
    """TILE_WIDE, K split so that the tiles' programs fill about WIDE_PROGRAMS SMs once (at most 4 ways): the qwen3-8b
    shape's measured best splits (o_proj's 64 tiles 2 ways, down_proj's 64 tiles 2 ways) follow this rule; a 2048-wide
    layer's 32 tiles (qwen3.5-35b-a3b's o_proj and out_proj) take 4."""
    bn = TILE_WIDE[silu][0]
    return TILE_WIDE[silu] + (max(1, min(4, WIDE_PROGRAMS // -(-n // bn))),)


def usable(x: torch.Tensor) -> bool:
    """Whether a forward with input ``x`` takes the kernels: CUDA, bf16/fp16, no gradient wanted,
    not inside torch.compile (inductor fuses the torch ops itself), the kernels on."""
    return (ENABLED and triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling())


def eligible(layer) -> bool:
    """Whether a ``llama.DenseDecoderLayer`` has what these kernels compute: no biases, no output gate, one
    process (no shard), fused projections, contiguous weights; a q/k norm (Qwen3) or a hidden size past
    MAX_HIDDEN only with WIDE.
    The config's question only: whether a forward runs the kernels is :func:`usable`'s. A layer of another kind
    answers itself (``fused_eligible``: Qwen3.5's hybrid layers)."""
    if hasattr(layer, "fused_eligible"):
        return layer.fused_eligible()
    a, mlp = layer.self_attn, layer.mlp
    return ((a.q_norm is None or WIDE) and not a.gated and attention_fusable(a) and mlp_fusable(mlp)
            and type(mlp).act is _silu_act() and (layer.config.hidden_size <= MAX_HIDDEN or WIDE))


def linear_ready(lin) -> bool:
    """A projection as :func:`linear` takes it: a plain linear without a bias, its weight contiguous."""
    return plain(lin) and lin.bias is None and lin.weight.is_contiguous()


def attention_fusable(a) -> bool:
    """An attention module's projections as the kernels take them: q/k/v fused into one contiguous weight without a
    bias (``Attention.fuse``), o_proj a plain linear without a bias, its weight contiguous."""
    return a._fused is not None and a._fused[1] is None and a._fused[0].is_contiguous() and linear_ready(a.o_proj)


def mlp_fusable(mlp) -> bool:
    """A gated MLP's projections as the kernels take them: gate/up fused without a bias (``SwiGLU.fuse``), down_proj a
    plain linear without a bias, its weight contiguous (the activation is the caller's question)."""
    return mlp._fused is not None and mlp._fused[1] is None and linear_ready(mlp.down_proj)


def runs(layer, rows: int) -> bool:
    """Whether a forward of ``rows`` rows a sequence (where :func:`usable`) runs ``layer`` on the kernels: an
    :func:`eligible` layer (``fused_path``) in every such forward up to MAX_HIDDEN wide, past it in forwards of at
    most WIDE_ROWS rows (see there). The same answer in plain and speculative decoding's forwards."""
    return getattr(layer, "fused_path", False) and (rows <= WIDE_ROWS or layer.config.hidden_size <= MAX_HIDDEN)


def model_runs(model, rows: int = 1) -> bool:
    """Whether ``model``'s every layer runs the kernels in forwards of up to ``rows`` rows a sequence (:func:`runs`),
    one process, its weights on CUDA in bf16/fp16 (:func:`on_device`): the kernels' part of ``row_exact``."""
    return (ENABLED and triton is not None and model.shard is None and on_device(model.embed_tokens.weight)
            and bool(model.layers) and all(runs(layer, rows) for layer in model.layers))


def on_device(w: torch.Tensor) -> bool:
    """A weight the kernels take: on CUDA, in bf16 or fp16."""
    return w.is_cuda and w.dtype in (torch.bfloat16, torch.float16)


def _silu_act():
    from .layers import SwiGLU
    return SwiGLU.act


if triton is not None:
    @triton.jit
    def glu_act(g, GELU: tl.constexpr):
        """A gated MLP's activation of the fp32 gate ``g``, fp32 (the caller rounds): SiLU, or with GELU the tanh form
        (Gemma's gelu_pytorch_tanh), tanh(u) as 1 - 2 / (exp(2u) + 1) with u capped at 20 (where tanh is 1 in fp32) so
        that exp never overflows. Shared by this GEMM's epilogue and the expert kernels."""
        if GELU:
            u = tl.minimum(0.7978845608028654 * (g + 0.044715 * g * g * g), 20.0)
            return 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
        else:
            return g / (1.0 + tl.exp(-g))

    @triton.jit
    def _fence():
        """``fence.acq_rel.gpu`` (the split-K hand-over: a program's partial sums reach L2 before it counts in)."""
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit(do_not_specialize=["M"])
    def _kernel(x, w, y, ws, cnt, sc, M, N, K, sx, sy, KS, SILU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, SPLIT: tl.constexpr, FENCE: tl.constexpr, USE_GDC: tl.constexpr,
                PER_LINE: tl.constexpr, LINES: tl.constexpr, SCALED: tl.constexpr = False, GELU: tl.constexpr = False):
        # programs run M-tile fastest, then the K split: the row tiles of one weight block run side by side (L2)
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        pid_m, rest = pid % num_m, pid // num_m
        pid_s, pid_n = rest % SPLIT, rest // SPLIT
        rm = pid_m * BM + tl.arange(0, BM)
        mm = rm < M
        rn = pid_n * BN + tl.arange(0, BN)
        mn = rn < N
        if USE_GDC:  # models/pdl.py: let the next kernel launch; wait for the one before
            tl.extra.cuda.gdc_launch_dependents()
            if LINES > 0:  # meanwhile pull this program's weight rows into L2: they never depend on the kernel before
                rows = tl.minimum(rn, N - 1)
                pdl.rows_to_l2(w, rows, K, PER_LINE, LINES)
                if SILU:
                    pdl.rows_to_l2(w, rows + N, K, PER_LINE, LINES)
            tl.extra.cuda.gdc_wait()
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        if SILU:
            acc_up = tl.zeros([BM, BN], dtype=tl.float32)
        rk = tl.arange(0, BK)
        k_end = tl.minimum(K, (pid_s + 1) * KS)
        for k0 in range(pid_s * KS, k_end, BK):
            kk = k0 + rk
            a = tl.load(x + rm[:, None] * sx + kk[None, :], mask=mm[:, None] & (kk[None, :] < k_end), other=0.0)
            wm = mn[None, :] & (kk[:, None] < k_end)
            b = tl.load(w + rn[None, :] * K + kk[:, None], mask=wm, other=0.0)
            if SCALED:  # int8 weights (Int8Rows): exact in bf16 / fp16, their row scales applied at the end
                b = b.to(a.dtype)
            acc = tl.dot(a, b, acc)
            if SILU:  # the up rows follow the N gate rows
                bu = tl.load(w + (N + rn)[None, :] * K + kk[:, None], mask=wm, other=0.0)
                if SCALED:
                    bu = bu.to(a.dtype)
                acc_up = tl.dot(a, bu, acc_up)
        last = True
        if SPLIT > 1:  # split K: each program's fp32 partial to the workspace; the tile's last program to count in
            # sums the partials in split order (the same order whichever program is last) and writes the output
            cols = 2 * N if SILU else N
            part = ws + (pid_s * M + rm[:, None]) * cols + rn[None, :]
            mo = mm[:, None] & mn[None, :]
            tl.store(part, acc, mask=mo)
            if SILU:
                tl.store(part + N, acc_up, mask=mo)
            if FENCE:
                _fence()
            tl.debug_barrier()
            tile = pid_n * num_m + pid_m
            last = tl.atomic_add(cnt + tile, 1) == SPLIT - 1
            if last:
                tl.store(cnt + tile, 0)  # the counters stay zero between kernels
                if FENCE:
                    _fence()
                base = ws + rm[:, None] * cols + rn[None, :]
                acc = tl.load(base, mask=mo, other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT):
                    acc += tl.load(base + s * M * cols, mask=mo, other=0.0, cache_modifier=".cg")
                if SILU:
                    acc_up = tl.load(base + N, mask=mo, other=0.0, cache_modifier=".cg")
                    for s in tl.static_range(1, SPLIT):
                        acc_up += tl.load(base + N + s * M * cols, mask=mo, other=0.0, cache_modifier=".cg")
        if last:
            if SCALED:  # a weight row's scale times its sums (the same for every split's partial)
                acc = acc * tl.load(sc + rn, mask=mn, other=0.0)[None, :]
                if SILU:
                    acc_up = acc_up * tl.load(sc + N + rn, mask=mn, other=0.0)[None, :]
            if SILU:  # act(gate) * up, each rounded where the torch ops round
                gf = acc.to(y.dtype.element_ty).to(tl.float32)
                act = glu_act(gf, GELU).to(y.dtype.element_ty)
                out = (act.to(tl.float32) * acc_up.to(y.dtype.element_ty).to(tl.float32)).to(y.dtype.element_ty)
            else:
                out = acc.to(y.dtype.element_ty)
            tl.store(y + rm[:, None] * sy + rn[None, :], out, mask=mm[:, None] & mn[None, :])


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


class Int8Rows(NamedTuple):
    """A weight ``[N, K]`` as int8 rows and an fp32 scale a row (``w ~ q * scale[:, None]``, symmetric, the
    largest magnitude of a row at 127): half the bytes a GEMM at one to 16 rows reads, which is its time. For
    drafters only (a drafter's weights change its drafts, never the output: the target verifies them);
    :func:`linear` takes it where it takes a weight."""
    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def of(cls, w: torch.Tensor) -> "Int8Rows":
        """``w`` (any float dtype) quantized a row at a time."""
        wf = w.detach().float()
        scale = (wf.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scale.contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)


@torch.no_grad()
def int8_values_(module: torch.nn.Module) -> torch.nn.Module:
    """Every ``nn.Linear`` weight of ``module`` replaced, in place, by its :class:`Int8Rows`' values in its own dtype:
    what the int8 kernels multiply (up to their fp32 sums), for eager references and CPU acceptance checks of
    ``--draft-int8``. Returns ``module``."""
    for mod in module.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.weight.data = Int8Rows.of(mod.weight).dequantized(mod.weight.dtype)
    return module


def linear(x: torch.Tensor, w: "torch.Tensor | Int8Rows", silu: bool = False, tile: tuple | None = None,
           gelu: bool = False) -> torch.Tensor:
    """``x [..., K] @ w.T`` -> ``[..., N]`` in ``x``'s dtype (contiguous); with ``silu`` (``w``: N gate
    rows, then N up rows) ``silu(gate) * up``; with ``gelu`` (the same layout) ``gelu_tanh(gate) * up`` (Gemma's
    MLP; it takes the gated tilings). ``w`` contiguous, or :class:`Int8Rows` (a row's sums times its
    scale, in fp32, before the epilogue); ``tile``: (BN, BK, warps, stages[, split])."""
    w, sc = (w.q, w.scale) if isinstance(w, Int8Rows) else (w, None)
    silu = silu or gelu
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = _rows(x)
    m = x2.shape[0]
    n = w.shape[0] // 2 if silu else w.shape[0]
    if w.dim() != 2 or w.shape[1] != k or not w.is_contiguous() or (silu and w.shape[0] % 2):
        raise ValueError(f"fused_layer.linear: weight {tuple(w.shape)} for input features {k}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages, split = (tuple(tile or tile_for(n, k, silu, sc is not None)) + (1,))[:5]
    split = split if SPLIT_K else 1
    ks = triton.cdiv(triton.cdiv(k, max(split, 1)), bk) * bk  # K a split: whole BK blocks
    split = triton.cdiv(k, ks)  # (none empty)
    per_line, lines = prefetch_lines(w)
    n_tiles = triton.cdiv(n, bn)
    # split K: one kernel per chunk of rows whose tiles the counters cover (rows never share a tile's bits)
    chunk = max(m, 1) if split == 1 else max(COUNTERS // n_tiles, 1) * BM
    for r0 in range(0, m, chunk):
        xr, yr = x2[r0:r0 + chunk], y[r0:r0 + chunk]
        mr = xr.shape[0]
        ws, cnt = (y, y) if split == 1 else (torch.empty(split, mr, 2 * n if silu else n, dtype=torch.float32,
                                                         device=x.device), _counters(x.device))
        _kernel[(triton.cdiv(mr, BM) * n_tiles * split,)](
            xr, w, yr, ws, cnt, y if sc is None else sc, mr, n, k, xr.stride(0), yr.stride(0), ks, SILU=silu, BM=BM,
            BN=bn, BK=bk, SPLIT=split, FENCE=not pdl.INTERPRETED, num_warps=warps, num_stages=stages,
            PER_LINE=per_line, LINES=lines, SCALED=sc is not None, GELU=gelu, **pdl.options(xr))
    return y.view(*lead, n)


_COUNTER_BUFS: dict = {}


def _counters(device: torch.device) -> torch.Tensor:
    """The split-K kernels' tile counters on ``device``: zero between kernels (each tile's last program resets
    its own). One buffer a device: the engine runs its kernels on one stream, one kernel after the other (under
    PDL a kernel touches them after its wait only)."""
    buf = _COUNTER_BUFS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # zeros made under a capture would hold nothing until the graph first replays (a capture runs no kernel)
            raise RuntimeError("fused_layer: split K's counters are made by an eager call; run the step once "
                               "before capturing it (graphs.capture's warm-up does)")
        buf = _COUNTER_BUFS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf


def prefetch_lines(w: torch.Tensor) -> tuple[int, int]:
    """``(PER_LINE, LINES)`` of the kernel's L2 prefetch of ``w``'s rows: every line of every row where the
    weight has at most PREFETCH_BYTES, else none (``LINES`` 0)."""
    per_line, lines = pdl.l2_lines(w.shape[1], w.element_size())
    return per_line, lines if w.numel() * w.element_size() <= PREFETCH_BYTES else 0


def reference(x: torch.Tensor, w: "torch.Tensor | Int8Rows", silu: bool = False, gelu: bool = False) -> torch.Tensor:
    """:func:`linear` in torch ops (an fp32 GEMM; :class:`Int8Rows`: the int8 rows' sums times their
    scales), the CPU equivalent the checks compare it with."""
    q, sc = (w.q, w.scale) if isinstance(w, Int8Rows) else (w, None)
    silu = silu or gelu

    def mm(rows):
        out = x.float() @ q[rows].float().T
        return (out if sc is None else out * sc[rows]).to(x.dtype)
    n = q.shape[0] // 2 if silu else q.shape[0]
    if not silu:
        return mm(slice(0, n))
    g, u = mm(slice(0, n)).float(), mm(slice(n, 2 * n)).float()
    act = torch.nn.functional.gelu(g, approximate="tanh") if gelu else torch.nn.functional.silu(g)
    return (act.to(x.dtype).float() * u).to(x.dtype)
