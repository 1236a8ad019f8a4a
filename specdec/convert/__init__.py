"""``specdec convert``: an HF checkpoint directory to one llama.cpp-compatible GGUF file.

One module per concern: :mod:`.dense`, :mod:`.qwen35`, :mod:`.gemma3` and :mod:`.gemma4` turn a
checkpoint into a :class:`~.plan.Plan` (llama.cpp names, metadata and conventions, tensors read lazily),
:mod:`.vocab` adds the tokenizer, :mod:`.quantize` / :mod:`.kquants` pick and encode each
tensor's type, and :mod:`.writer` writes the file under a temporary name, renamed when done.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import gguf

from ..errors import CheckpointError, ConfigError
from .plan import Plan
from .quantize import TYPES, parse_type
from .writer import write_plan

__all__ = ["TYPES", "ConvertResult", "convert", "build_plan", "parse_type"]


@dataclass
class ConvertResult:
    path: str
    arch: str
    tensors: int
    types: dict[str, int]  # GGML type name -> how many tensors were written in it
    nbytes: int


def build_plan(hf_dir: str, vocab: bool = True) -> Plan:
    """The GGUF plan of the HF checkpoint in ``hf_dir`` (config checked, no tensor read yet)."""
    from ..loading import read_model_config
    from ..weights.safetensors_io import SafetensorsSource

    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"{hf_dir}: not an HF checkpoint directory")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise CheckpointError(f"{hf_dir}: no config.json (not an HF checkpoint directory)")
    arch, cfg, _ = read_model_config(hf_dir)
    source = SafetensorsSource(hf_dir)
    if arch.name in ("llama", "qwen3"):
        from .dense import plan_dense
        plan = plan_dense(cfg, source)
    elif arch.name in ("qwen3_5", "qwen3_5_moe"):
        from .qwen35 import plan_qwen35
        plan = plan_qwen35(cfg, source)
    elif arch.name == "gemma3":
        from .gemma3 import plan_gemma3
        plan = plan_gemma3(cfg, source)
    elif arch.name == "gemma4":
        from .gemma4 import plan_gemma4
        plan = plan_gemma4(cfg, source)
    else:  # registered for loading but not (yet) for conversion
        raise ConfigError(f"{hf_dir}: model_type '{cfg.model_type}' cannot be converted yet")
    plan.string(gguf.Keys.General.NAME, os.path.basename(os.path.normpath(hf_dir)))
    if vocab:
        from .vocab import add_vocab
        add_vocab(plan, hf_dir, cfg.vocab_size, cfg.eos_token_id)
    return plan


def convert(hf_dir: str, out: str, out_type: str = "f16", *, force: bool = False, vocab: bool = True,
            progress=None) -> ConvertResult:
    """Convert the HF checkpoint ``hf_dir`` to the GGUF file ``out``, weights in ``out_type``
    (one of :data:`TYPES`; norms and other small tensors stay F32, rows that do not fit a block
    type fall back to a wider type). Refuses to overwrite ``out`` unless ``force``; the file
    appears only when complete. ``progress(total_bytes, desc)``: a bar factory (default: tqdm
    on a terminal)."""
    qt = parse_type(out_type)
    hf_dir = os.path.expanduser(str(hf_dir))
    out = os.path.expanduser(str(out))
    if os.path.exists(out) and not force:  # before any work
        raise CheckpointError(f"{out}: already exists; pass --force to overwrite it")
    plan = build_plan(hf_dir, vocab=vocab)
    kw = {} if progress is None else {"progress": progress}
    types = write_plan(plan, out, qt, force=force, **kw)
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t.name] = counts.get(t.name, 0) + 1
    return ConvertResult(out, plan.arch, len(types), counts, os.path.getsize(out))
