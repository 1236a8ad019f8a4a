"""Writing drafter directories: ``config.json`` plus safetensors shards, all or nothing.

Everything is written into a temporary sibling directory first and renamed into place at the
end, so an interrupted save never leaves a half-written drafter where a loader would find it.
Shards are at most ``max_shard_bytes`` (the device machine returns files of at most 16 MiB);
more than one shard comes with an HF ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch


def save_drafter_dir(path: str, config: dict, tensors: dict[str, torch.Tensor], *,
                     max_shard_bytes: int = 15 * 2**20, dtype: torch.dtype | None = torch.bfloat16,
                     extra_files: dict[str, str] | None = None) -> None:
    """Write ``config`` and ``tensors`` (converted to ``dtype`` unless None) to directory ``path``.

    ``extra_files`` maps file names to text written beside them (a provenance note)."""
    from safetensors.torch import save_file

    path = os.path.abspath(os.path.expanduser(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name in sorted(tensors):
            t = tensors[name].detach()
            t = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous().cpu()
            n = t.numel() * t.element_size()
            if shards[-1] and size + n > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += n
        if len(shards) == 1:
            save_file(shards[0], os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map, total = {}, 0
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
                for name, t in shard.items():
                    weight_map[name] = fname
                    total += t.numel() * t.element_size()
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        for fname, text in (extra_files or {}).items():
            with open(os.path.join(tmp, fname), "w") as f:
                f.write(text)
        os.chmod(tmp, 0o755)
        old = None
        if os.path.exists(path):
            old = path + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
