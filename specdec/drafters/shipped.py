"""Drafters shipped inside specdec, for the targets they were trained for.

Each folder of ``specdec/data/drafters/`` holds a ``shipped.json`` that names its target by content
(:func:`~specdec.train.data.target_fingerprint`: the file's size and its first and last MiB, not its
name or path), and one drafter directory per kind (``dflash``, ``mtp``) with its provenance
(``TRAINING.md``, ``training.json``). A target whose fingerprint matches gets them by bare name:
``--draft dflash``, ``--draft mtp``, and ``--draft auto`` (the CLI's default).
"""

from __future__ import annotations

import functools
import os

from ..config import read_json
from ..errors import ConfigError

ROOT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "drafters")

# Where ``auto`` picks the shipped DFlash drafter. On the CPU (fp32, 2 cores) ``auto`` is the shipped MTP
# head behind the history lookup instead (one sequence): with their draft vocabularies (session of
# 2026-12-03 (eighth), BENCHMARKS.md) ``mtp+ngram`` ran 1.56x / 1.35x / 1.06x plain on GSM8K / HumanEval /
# MT-Bench, ``dflash+ngram`` 1.47x / 1.25x / 1.04x; without them neither paid there. With packed oneDNN weights
# (2026-12-05, 10 prompts each): ``mtp+ngram`` 2.28x / 2.05x / 1.37x, ``dflash+ngram`` 2.14x / 1.97x / 1.12x.
AUTO_DEVICES = ("cuda",)
CPU_AUTO = "mtp+ngram"


@functools.lru_cache(maxsize=None)
def _manifests() -> tuple[dict, ...]:
    out = []
    if os.path.isdir(ROOT):
        for name in sorted(os.listdir(ROOT)):
            f = os.path.join(ROOT, name, "shipped.json")
            if os.path.isfile(f):
                m = read_json(f)
                m["folder"] = os.path.join(ROOT, name)
                out.append(m)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _fingerprint(path: str, size: int, mtime: float) -> str:
    from ..train.data import target_fingerprint
    return target_fingerprint(path)


def shipped_for(target_path: str | None) -> dict[str, str]:
    """``{kind: drafter directory}`` shipped for the target at ``target_path`` (empty if none)."""
    if not target_path or not os.path.exists(target_path) or not _manifests():
        return {}
    st = os.stat(target_path)
    fp = _fingerprint(os.path.realpath(target_path), st.st_size, st.st_mtime)
    for m in _manifests():
        if m.get("target_fingerprint") == fp:
            return {kind: os.path.join(m["folder"], sub) for kind, sub in m.get("drafters", {}).items()}
    return {}


def shipped_dir(kind: str, target_path: str | None) -> str:
    """The shipped ``kind`` drafter for this target, or a one-line error saying what to do instead."""
    d = shipped_for(target_path).get(kind)
    if d is None:
        raise ConfigError(f"no {kind} drafter is shipped for {target_path} (specdec ships them for the embedded "
                          f"SmolLM2-135M-Instruct only); give --draft {kind}:PATH, or train one with "
                          f"`specdec train {kind} --target {target_path} --out DIR`")
    return d


def auto_spec(target_path: str | None, device_type: str, serving: bool = False) -> str:
    """What ``--draft auto`` means for this target on this device: where the shipped DFlash drafter
    pays (:data:`AUTO_DEVICES`), ``dflash+ngram`` for one sequence (history lookup first: on the H200,
    cf0fdd2 with the stage-6 drafter, 2.14x / 1.96x / 1.26x plain on GSM8K / HumanEval / MT-Bench against
    1.98x / 1.38x / 1.08x for ``dflash`` alone, BENCHMARKS.md) and ``dflash`` for the serving loop (``serving``: there
    the combination drafts slot by slot, not in one all-slots step, and is not measured); on the CPU
    :data:`CPU_AUTO` for one sequence where an MTP head is shipped (the serving loop: not measured, none);
    else ``none``."""
    shipped = shipped_for(target_path)
    if device_type in AUTO_DEVICES and "dflash" in shipped:
        return "dflash" if serving else "dflash+ngram"
    if device_type == "cpu" and not serving and "mtp" in shipped:
        return CPU_AUTO
    return "none"
