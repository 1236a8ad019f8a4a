"""Build a drafter from a user-facing spec: ``none``, ``ngram``, ``mtp`` (the target's own MTP
block, or else the MTP head shipped for it), ``mtp:PATH`` (a trained MTP head directory),
``dflash`` (the DFlash drafter shipped for the target), ``dflash:PATH``, ``auto`` (the shipped
DFlash drafter with history lookup first on CUDA, the shipped MTP head so on the CPU, else none:
:mod:`.shipped`), and any model drafter spec followed by
``+ngram`` (``dflash+ngram``, ``mtp:PATH+ngram``, ...): history lookup first, the model drafter
where the history has no match (:mod:`.combined`).

Importing this module is cheap (no torch): the CLI reads :data:`SPECS` and checks specs with
:func:`check_spec` before any model is loaded.
"""

from __future__ import annotations

import os

from ..errors import ConfigError

VOCAB_FILE = "draft_vocab.json"  # a drafter directory's draft vocabulary, used unless --draft-vocab says otherwise

SPECS = "auto | none | ngram | mtp | mtp:PATH | dflash | dflash:PATH | any of the last four +ngram"
SUFFIX = "+ngram"


def check_spec(spec, block_size: int | None = None) -> None:
    """Refuse a malformed drafter spec, or a ``block_size`` for a drafter that has none, without
    loading anything. Drafter objects (not strings) are accepted as they are."""
    if spec is None or spec == "none":
        if block_size is not None:
            raise ConfigError("block_size was given but no DFlash drafter is used")
        return
    if isinstance(spec, str) and spec.endswith(SUFFIX):
        base = spec[: -len(SUFFIX)]
        if base in ("", "none", "auto", "ngram") or base.endswith(SUFFIX):
            raise ConfigError(f"draft '{spec}': +ngram follows a model drafter (mtp, mtp:PATH, dflash, dflash:PATH)")
        try:
            return check_spec(base, block_size)
        except ConfigError as e:
            raise ConfigError(f"draft '{spec}': {e}") from None
    if not isinstance(spec, str) or spec in ("auto", "dflash"):  # auto: block_size applies if it picks DFlash
        return
    if spec.startswith("dflash:"):
        if not spec[len("dflash:"):].strip():
            raise ConfigError(f"draft '{spec}' needs a path: dflash:PATH (a DFlash drafter directory)")
        return
    if spec.startswith("mtp:") and not spec[len("mtp:"):].strip():
        raise ConfigError(f"draft '{spec}' needs a path: mtp:PATH (an MTP drafter directory)")
    if spec not in ("ngram", "mtp") and not spec.startswith("mtp:"):
        raise ConfigError(f"unknown drafter '{spec}'; expected {SPECS}")
    if block_size is not None:
        raise ConfigError(f"block_size applies to DFlash drafters only, not '{spec}' (use num_draft_tokens)")


def resolve_spec(spec, loaded, serving: bool = False):
    """``auto`` made concrete for this target and device (``dflash+ngram``, for the serving loop
    ``dflash``; ``mtp+ngram`` on the CPU; or ``none``: :func:`~.shipped.auto_spec`); other specs as given."""
    if spec == "auto":
        from .shipped import auto_spec
        return auto_spec(getattr(loaded, "path", None), getattr(loaded, "model", loaded).device.type, serving)
    return spec


def make_drafter(spec, loaded, *, block_size: int | None = None, draft_vocab: str | None = None,
                 draft_int8: bool = False):
    """``loaded`` is the target's :class:`~specdec.loading.LoadedModel`. Returns a drafter or None.
    ``draft_vocab``: a draft-vocabulary file (:mod:`.draft_vocab`) for an MTP or DFlash drafter;
    None: the drafter directory's ``draft_vocab.json`` where it has one (``specdec train`` writes it), the
    target is not a tensor-parallel rank and the list pays (:func:`_list_pays`), else the whole vocabulary;
    ``"none"``: the whole vocabulary. ``draft_int8``: a DFlash drafter's fast steps on int8 weights
    (``DFlashDrafter.use_int8_weights``; CUDA)."""
    check_spec(spec, block_size)
    spec = resolve_spec(spec, loaded)  # auto may pick none: block_size is then moot
    from .draft_vocab import load_token_ids

    target = getattr(loaded, "model", loaded)  # a LoadedModel, or (the serving loop's callers) the model itself
    vocab_size = target.config.vocab_size
    explicit = draft_vocab not in (None, "none")
    ids = load_token_ids(draft_vocab, vocab_size) if explicit else None  # a bad file fails before the drafter loads
    d = _make(spec, loaded, block_size)
    model_drafter = getattr(d, "base", d)  # NgramFirst drafts with its model drafter
    if explicit and not hasattr(model_drafter, "use_draft_vocab"):
        name = spec if isinstance(spec, str) else "none" if spec is None else type(d).__name__
        raise ConfigError(f"--draft-vocab applies to MTP and DFlash drafters (mtp, dflash, ... +ngram), not to '{name}'")
    folder = getattr(model_drafter, "path", "") if isinstance(spec, str) else ""  # a drafter directory's own list
    sharded = getattr(target, "shard", None) is not None  # a rank's head is its shard: no subset of it
    if draft_vocab is None and folder and not sharded and os.path.isfile(os.path.join(folder, VOCAB_FILE)):
        ids = load_token_ids(os.path.join(folder, VOCAB_FILE), vocab_size)
        if _list_pays(target, len(ids)):
            draft_vocab = os.path.join(folder, VOCAB_FILE)
        else:
            ids = None
    if ids is not None:
        model_drafter.use_draft_vocab(ids, f"draft vocabulary {draft_vocab}")
    if draft_int8:
        if not hasattr(model_drafter, "use_int8_weights"):
            name = spec if isinstance(spec, str) else "none" if spec is None else type(d).__name__
            raise ConfigError(f"--draft-int8 applies to DFlash drafters (dflash, dflash:PATH, dflash+ngram), not to '{name}'")
        model_drafter.use_int8_weights()
    return d


# On CUDA a draft vocabulary's logits cost a few small kernels more than the whole head's (a -inf row of the
# vocabulary, the list's and the prompt's logits written into it): the list pays only where the head rows it
# skips take longer to read than those. On the H200 (session of 2026-12-05 (second), `specdec bench`, 100
# GSM8K prompts, one process) SmolLM2-135M's shipped drafters, whose 16,384-token lists skip 38 MB of its
# 57 MB head, ran faster with the whole head (DFlash 2,689 -> 2,850 tok/s, MTP 1,743 -> 1,805); on the
# qwen3.5-9b shape a 32,768-token list skips 1.8 GB a draft (MTP K=3 step 1.56x -> 1.34x a decode step).
# On the CPU the list always pays (SmolLM2 MTP 1.45x plain with it on 2 cores).
CUDA_LIST_MIN_SKIPPED_BYTES = 64 << 20


def _list_pays(target, n: int) -> bool:
    """Whether a drafter directory's list of ``n`` tokens is used by default: on the CPU, or when the head rows
    it skips are at least CUDA_LIST_MIN_SKIPPED_BYTES."""
    if target.device.type != "cuda":
        return True
    w = target.head_weight()
    return (w.shape[0] - n) * w.shape[1] * w.element_size() >= CUDA_LIST_MIN_SKIPPED_BYTES


def _make(spec, loaded, block_size):
    """:func:`make_drafter` without draft vocabularies."""
    if spec is None or spec == "none":
        return None
    if not isinstance(spec, str):
        return spec  # already a drafter object
    if spec.endswith(SUFFIX):
        from .combined import NgramFirst
        return NgramFirst(_make(spec[: -len(SUFFIX)], loaded, block_size))
    if spec == "dflash":
        from .shipped import shipped_dir
        spec = "dflash:" + shipped_dir("dflash", loaded.path)
    if spec == "ngram":
        from .ngram import NgramDrafter
        return NgramDrafter()
    if spec == "mtp":
        from .mtp import load_mtp_drafter
        from .shipped import shipped_for
        own = "mtp" in getattr(loaded.arch, "drafters", ())
        head = shipped_for(loaded.path).get("mtp")
        if not own and head is not None:
            from .mtp_dir import load_mtp_dir
            return load_mtp_dir(head, loaded)
        return load_mtp_drafter(loaded)
    if spec.startswith("mtp:"):
        from .mtp_dir import load_mtp_dir
        return load_mtp_dir(spec[len("mtp:"):], loaded)
    from .dflash import load_dflash_drafter
    return load_dflash_drafter(spec[len("dflash:"):], loaded, block_size=block_size)
