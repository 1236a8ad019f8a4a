"""specdec's environment variables, in one table, read strictly.

Each switch is read once, where its module is imported. A value that is not one of the spellings
accepted is a one-line :class:`ConfigError` naming the variable: ``SPECDEC_FUSED_LAYER=off`` turns
the fused GEMMs off, and ``SPECDEC_FUSED_LAYER=of`` is an error rather than silently "on".
:func:`check` (the CLI calls it first) reads every variable in the table and warns about a
``SPECDEC_*`` name that is not in it (a typo would otherwise change nothing, silently).

The switches are for measuring and debugging: the defaults are what the benchmarks measured best.
The comment beside each switch's use in its module says what it changes and what it measured.
"""

from __future__ import annotations

import os
import warnings

from .errors import ConfigError

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")

# name -> (default, what it does); the on/off switches
SWITCHES: dict[str, tuple[bool, str]] = {
    "SPECDEC_BLOCKED_SCAN": (True, "sampling's cumulative sums in blocks, not CUDA's serial row scan"),
    "SPECDEC_CPU_EXACT": (True, "--batch-invariant on the CPU as unpadded row-exact eager steps (cpu_exact.py)"),
    "SPECDEC_CPU_ONEDNN": (True, "fp32 CPU linears on oneDNN (cpu_linear.py)"),
    "SPECDEC_CPU_PACK": (True, "oneDNN linears' weights kept packed too (a second copy in memory)"),
    "SPECDEC_DELTA_FUSED": (True, "the Gated DeltaNet's decode and verify steps on Triton kernels (off: torch ops)"),
    "SPECDEC_DELTA_ONE_KERNEL": (True, "a Gated DeltaNet step's conv, gates and recurrence as one kernel (else two)"),
    "SPECDEC_DELTA_PROJ": (True, "the Gated DeltaNet's in-projections as one GEMM"),
    "SPECDEC_DFLASH_FAST": (True, "DFlash's propose as captured static steps"),
    "SPECDEC_DFLASH_STATIC_FLUSH": (True, "DFlash's context write as one static step"),
    "SPECDEC_DFLASH_STATIC_SAMPLING": (True, "DFlash's sampled drafts drawn inside its static block"),
    "SPECDEC_DRAFTER_SPLIT": (True, "drafters' static steps on the split attention kernel"),
    "SPECDEC_EXPERT_KERNEL": (True, "MoE experts on the Triton expert kernel"),
    "SPECDEC_FOLD_RESIDUAL": (True, "a layer's last residual add folded into the next layer's norm"),
    "SPECDEC_FUSED_HYBRID": (True, "Qwen3.5 layers' GEMMs on the fused Triton GEMM"),
    "SPECDEC_FUSED_LAYER": (True, "the fused Triton GEMMs of a layer (fused_layer.py)"),
    "SPECDEC_FUSED_LAYER_WIDE": (True, "the fused GEMM for weights wider than its tile table"),
    "SPECDEC_FUSED_MOE": (True, "a MoE block's step in three kernels"),
    "SPECDEC_FUSED_NORM": (True, "RMSNorm (with its residual add) as one Triton kernel"),
    "SPECDEC_PRENORM_ADD": (True, "a sandwich-normed layer's post-norm, residual add and next norm as one kernel (Gemma 3 and 4)"),
    "SPECDEC_GEMMA4_SMALL_FUSED": (True, "Gemma 4's small models (KV sharing, per-layer inputs) on the fused layers, row-exact (off: cuBLAS and padded steps)"),
    "SPECDEC_SANDWICH_TAIL": (True, "Gemma 4's MoE layer tail (its post-feed-forward norms, the residual add, the layer scalar) as one kernel"),
    "SPECDEC_DENSE_TAIL": (True, "Gemma 4's dense layer tail (the post-feed-forward norm, the residual add, the layer scalar) as one kernel; with a per-layer input (E2B, E4B) three for seven"),
    "SPECDEC_FUSED_ROPE": (True, "RoPE and the KV-cache write of static steps in one kernel"),
    "SPECDEC_FUSED_SPLIT_K": (True, "split K in the fused GEMM"),
    "SPECDEC_GREEDY_CHAIN": (True, "greedy plain decoding on the greedy-chain steps"),
    "SPECDEC_MOE_GROUPED_BMM": (True, "a MoE prefill's experts as two batched GEMMs (off: a loop over the experts)"),
    "SPECDEC_MTP_FAST": (True, "MTP's propose as captured static steps"),
    "SPECDEC_MTP_SPLIT_CATCHUP": (True, "MTP's committed rows past its static step's run eagerly, then the static step (CUDA)"),
    "SPECDEC_MTP_STATIC_SAMPLING": (True, "MTP's sampled drafts inside its static steps"),
    "SPECDEC_NORM_ROUTER": (True, "a MoE layer's post-mixer add and norm with the router's GEMM as one kernel"),
    "SPECDEC_GATE_IN_SPLIT": (True, "gated attention's sigmoid gate in the split attention kernel (CUDA static steps)"),
    "SPECDEC_NORM_ROPE": (True, "the q/k norms in the RoPE + cache-write kernel (one sequence's CUDA steps)"),
    "SPECDEC_PDL": (True, "programmatic dependent launch between Triton kernels"),
    "SPECDEC_PLAIN_LOOKAHEAD": (True, "plain decoding queues step i+1 before reading step i's token"),
    "SPECDEC_ROPE_TABLE": (True, "a static step's RoPE cos/sin looked up in a table kept per device (CUDA)"),
    "SPECDEC_ROW_EXACT": (True, "row-exact targets run unpadded steps"),
    "SPECDEC_SHORT_SPAN": (True, "static steps over the live part of the cache only"),
    "SPECDEC_SPAN_BUCKETS": (True, "one-sequence steps over power-of-two spans of the first split, not the whole cache"),
    "SPECDEC_SPLIT_DIRECT": (True, "a one-split span written by the split kernel itself"),
    "SPECDEC_SPLIT_PIPELINE": (True, "the split attention kernel's pipelined walk"),
    "SPECDEC_SPLIT_SMALL_TILES": (True, "small tiles in the split attention kernel"),
    "SPECDEC_STATIC_ACCEPT": (True, "sampled acceptance as one captured step (CUDA graphs)"),
    "SPECDEC_SYMM_ALLREDUCE": (True, "tensor parallelism's all-reduce on symmetric memory"),
    "SPECDEC_SYNC_COPIES": (False, "device-to-host copies synchronous (debugging)"),
}

# name -> (default, lowest, highest, what it sets)
INTEGERS: dict[str, tuple[int, int, int, str]] = {
    "SPECDEC_PREFILL_ROWS": (128, 1, 512, "rows of a static prefill chunk (engine/generate.py)"),
}

# name -> (default, the options, what it chooses)
CHOICES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "SPECDEC_SPAN_ATTENTION": ("split", ("split", "sdpa"), "the span-invariant attention's kernel (CUDA)"),
}

# name -> (default, what it sets); probabilities in 0..1
PROBABILITIES: dict[str, tuple[float, str]] = {
    "SPECDEC_DFLASH_CPU_CONFIDENCE": (0.3, "DFlash's CPU block cut for greedy blocks (drafters/dflash.py)"),
    "SPECDEC_DFLASH_CPU_SAMPLED_CONFIDENCE": (0.2, "DFlash's CPU block cut for sampled blocks (drafters/dflash.py)"),
}

# variables read elsewhere, with their own checks (name -> what)
OTHERS: dict[str, str] = {
    "SPECDEC_API_KEY": "the key `specdec serve` requires (--api-key)",
    "SPECDEC_BENCH_DATA": "the folder of bench prompt sets (--data-dir)",
    "SPECDEC_COMBINE_CUT": "rows,features of the split attention's combine program",
    "SPECDEC_COMMIT": "the commit the bench records where the tree has no .git",
    "SPECDEC_FUSED_LAYER_TILES": "forced tilings of the fused GEMM (JSON)",
    "SPECDEC_SPLIT_KEYS": "keys per split of the split attention's first tier (every head size)",
    "SPECDEC_SPLIT_FAR": "NEAR,FAR: the split attention's FAR-key splits past the first NEAR positions (0: one size)",
    "SPECDEC_LLAMA_VOCAB_DIR": "tests: the llama.cpp reference vocabularies",
    "SPECDEC_TRITON_DIR": "tests: the Triton package for the interpreter tests",
}


def switch(name: str) -> bool:
    """The on/off switch ``name`` (a key of :data:`SWITCHES`): its default when unset or empty,
    else 1/true/yes/on or 0/false/no/off (any case); a one-line ConfigError otherwise."""
    default = SWITCHES[name][0]
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    v = raw.strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise ConfigError(f"{name}={raw!r}: want 1 or 0 (or true/false, yes/no, on/off); unset, it is "
                      f"{'on' if default else 'off'}")


def integer(name: str) -> int:
    """The whole number in ``name`` (a key of :data:`INTEGERS`) within its range, its default when
    unset or empty; a one-line ConfigError otherwise."""
    default, lo, hi, _ = INTEGERS[name]
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        v = int(raw.strip())
    except ValueError:
        v = None
    if v is None or not lo <= v <= hi:
        raise ConfigError(f"{name}={raw!r}: want a whole number in {lo}..{hi} (unset: {default})")
    return v


def choice(name: str) -> str:
    """One of the options of ``name`` (a key of :data:`CHOICES`), its default when unset or empty;
    a one-line ConfigError otherwise."""
    default, options, _ = CHOICES[name]
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    if raw.strip().lower() not in options:
        raise ConfigError(f"{name}={raw!r}: want one of {', '.join(options)} (unset: {default})")
    return raw.strip().lower()


def probability(name: str) -> float:
    """The probability in ``name`` (a key of :data:`PROBABILITIES`), its default when unset or empty; a
    one-line ConfigError unless it is a number in 0..1."""
    default = PROBABILITIES[name][0]
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not 0.0 <= v <= 1.0:
        raise ConfigError(f"{name}={raw!r}: want a probability in 0..1 (unset: {default})")
    return v


def check() -> None:
    """Read every switch (a bad value raises here, before any work) and warn, one line each, about
    ``SPECDEC_*`` variables that specdec does not read."""
    for name in SWITCHES:
        switch(name)
    for name in INTEGERS:
        integer(name)
    for name in CHOICES:
        choice(name)
    for name in PROBABILITIES:
        probability(name)
    known = {**SWITCHES, **INTEGERS, **CHOICES, **PROBABILITIES, **OTHERS}
    unknown = sorted(n for n in os.environ if n.startswith("SPECDEC_") and n not in known)
    for n in unknown:
        warnings.warn(f"{n} is set but specdec reads no such variable (a typo?); `specdec info --env` lists "
                      "those it reads", stacklevel=2)


def describe() -> list[tuple[str, str, str]]:
    """``(name, value, what)`` for every variable in the tables: the value set, else its default
    (``unset`` for the variables read elsewhere)."""
    rows = []
    for name, (default, what) in sorted(SWITCHES.items()):
        raw = os.environ.get(name)
        rows.append((name, raw if raw is not None else f"default: {'on' if default else 'off'}", what))
    for name, (default, lo, hi, what) in sorted(INTEGERS.items()):
        raw = os.environ.get(name)
        rows.append((name, raw if raw is not None else f"default: {default}", f"{what}, {lo}..{hi}"))
    for name, (default, options, what) in sorted(CHOICES.items()):
        raw = os.environ.get(name)
        rows.append((name, raw if raw is not None else f"default: {default}", f"{what}: {' | '.join(options)}"))
    for name, (default, what) in sorted(PROBABILITIES.items()):
        raw = os.environ.get(name)
        rows.append((name, raw if raw is not None else f"default: {default}", f"{what}, 0..1"))
    for name, what in sorted(OTHERS.items()):
        raw = os.environ.get(name)
        shown = "(set)" if name == "SPECDEC_API_KEY" and raw else raw
        rows.append((name, shown if raw is not None else "unset", what))
    return rows
