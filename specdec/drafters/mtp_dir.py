"""MTP drafter directories: a trained MTP head for a target (``--draft mtp:PATH``).

The head is the NextN block of :mod:`.mtp` with one decoder layer of the target's own kind:

    x = fc([norm_e(embed(t_{i+1})), norm_h(h_i)])   # embedding first, h_i after the target's final norm
    x = layer(x)       # llama / qwen3: DenseDecoderLayer (q/k norms for qwen3); qwen3_5(_moe): gated attention
    g = norm(x)        # also the input of the next chained step
    logits = head(g)   # the target's embedding and LM head are shared: the directory holds neither

Llama-family heads use plain RMSNorms (``x̂ · w``) as their targets do; Qwen3.5 heads use the
zero-centred ones (``x̂ · (1 + w)``), like the block Qwen3.5 checkpoints carry. The layer runs
with the target's config (RoPE, eps, bias flags, its own KV cache), so ``config.json`` only
records the fields that decide whether the head fits the target:

    {"architectures": ["SpecdecMTPDrafter"], "model_type": "specdec_mtp", "target_model_type": "llama",
     "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
     "head_dim": 64, "rms_norm_eps": 1e-05, "vocab_size": 49152, "num_target_layers": 30,
     "num_draft_steps_trained": 4}

(MoE targets record ``moe_intermediate_size``, ``shared_expert_intermediate_size``,
``num_experts`` and ``num_experts_per_tok`` instead of ``intermediate_size``.) The weights are
``model.safetensors`` or shards with ``model.safetensors.index.json``, under the block's
parameter names: ``fc.weight``, ``pre_fc_norm_embedding.weight``, ``pre_fc_norm_hidden.weight``,
``layers.0.*``, ``norm.weight``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..config import read_json
from ..errors import CheckpointError, ConfigError
from ..models.base import CausalLM
from ..models.layers import RMSNorm
from ..weights import load_into
from ..weights.safetensors_io import SafetensorsSource
from .mtp import MTPBlock, MTPDrafter

MODEL_TYPE = "specdec_mtp"
ARCHITECTURE = "SpecdecMTPDrafter"
FAMILIES = ("llama", "qwen3", "qwen3_5", "qwen3_5_moe")
# every field any family checks against its target (a family checks those its target has)
FIT_FIELDS = ("target_model_type", "hidden_size", "intermediate_size", "moe_intermediate_size",
              "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers")


def _family(target: CausalLM) -> str:
    """The kind of decoder layer the head needs, named like the target's architecture."""
    from ..models.llama import LlamaForCausalLM, Qwen3ForCausalLM
    from ..models.qwen35 import Qwen35ForCausalLM, Qwen35MoeForCausalLM

    for cls, name in ((Qwen35MoeForCausalLM, "qwen3_5_moe"), (Qwen35ForCausalLM, "qwen3_5"),
                      (Qwen3ForCausalLM, "qwen3"), (LlamaForCausalLM, "llama")):
        if isinstance(target, cls):
            return name
    raise ConfigError(f"MTP drafter directories fit {', '.join(FAMILIES)} targets, not "
                      f"{target.config.model_type} ({type(target).__name__})")


def fits(target: CausalLM) -> bool:
    """Whether an MTP block can be built for ``target`` (its family one of FAMILIES)."""
    try:
        _family(target)
    except ConfigError:
        return False
    return True


def _build(target: CausalLM) -> MTPBlock:
    """An uninitialised block for ``target`` (on the current default device)."""
    c, family = target.config, _family(target)
    if family in ("llama", "qwen3"):
        from ..models.llama import DenseDecoderLayer
        return MTPBlock(c, DenseDecoderLayer(c, qk_norm=family == "qwen3"), zero_centered=False)
    from ..models.qwen35 import FullAttentionDecoderLayer
    return MTPBlock(c, FullAttentionDecoderLayer(c, moe=family == "qwen3_5_moe"), zero_centered=True)


def _fit_fields(target: CausalLM) -> dict:
    """The config fields a head must share with ``target`` (shapes and the kind of layer)."""
    c, family = target.config, _family(target)
    out = {"target_model_type": family, "hidden_size": c.hidden_size}
    if family == "qwen3_5_moe":
        out.update(moe_intermediate_size=c.moe_intermediate_size,
                   shared_expert_intermediate_size=c.shared_expert_intermediate_size,
                   num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok)
    else:
        out["intermediate_size"] = c.intermediate_size
    out.update(num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
               head_dim=c.head_dim, vocab_size=c.vocab_size, num_target_layers=len(target.layers))
    return out


def mtp_config(target: CausalLM, steps: int | None) -> dict:
    """The ``config.json`` of a head for ``target`` trained to chain ``steps`` drafts (None: unknown)."""
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **_fit_fields(target),
            "rms_norm_eps": target.config.rms_norm_eps, "num_draft_steps_trained": steps}


def new_mtp_block(target: CausalLM, init_from_layer: int | None = None,
                  generator: torch.Generator | None = None) -> MTPBlock:
    """A fresh head for ``target``, in its dtype and on its device.

    Linear weights are drawn from N(0, ``initializer_range``) (the target config's, default
    0.02), biases are zero and every norm starts as the identity. ``init_from_layer``: start the
    decoder layer as a copy of the target's layer of that index instead (negative: from the end;
    the last layer, -1, is a good start: it already reads the target's final-layer features; a
    Qwen3.5 target needs a full-attention layer). ``generator`` (a CPU
    generator) makes the draw reproducible on any device.
    """
    std = float(target.config.raw.get("initializer_range", 0.02))
    with torch.device("cpu"):
        block = _build(target).float()
    with torch.no_grad():
        for m in block.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std, generator=generator)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, RMSNorm):
                m.weight.fill_(0.0 if m.zero_centered else 1.0)  # the identity, in either convention
            else:
                for p in m.parameters(recurse=False):  # stacked MoE experts
                    nn.init.normal_(p, 0.0, std, generator=generator)
    block = block.to(device=target.device, dtype=target.dtype)
    if init_from_layer is not None:
        n = len(target.layers)
        if type(init_from_layer) is not int or not -n <= init_from_layer < n:
            raise ConfigError(f"init_from_layer={init_from_layer!r} is not a layer of the target (-{n}..{n - 1})")
        src = target.layers[init_from_layer]
        if type(src) is not type(block.layers[0]):
            raise ConfigError(f"init_from_layer={init_from_layer}: the target's layer is a {type(src).__name__}, "
                              f"the head's a {type(block.layers[0]).__name__} (pick a full-attention layer)")
        with torch.no_grad():
            block.layers[0].load_state_dict(src.state_dict())
    return block


def save_mtp_dir(block: MTPBlock, target: CausalLM, path: str, *, steps: int | None = None,
                 extra_files: dict[str, str] | None = None, dtype: torch.dtype | None = torch.bfloat16,
                 max_shard_bytes: int = 15 * 2**20) -> None:
    """Write ``block`` (a head for ``target``) as a drafter directory at ``path``, atomically.

    ``steps``: the chain length it was trained for (``num_draft_steps_trained``); ``extra_files``:
    text files written beside (a provenance note); ``dtype``: the stored dtype (None: as is);
    shards of at most ``max_shard_bytes`` (see :func:`specdec.weights.save.save_drafter_dir`).
    """
    from ..weights.save import save_drafter_dir

    if block.embed_tokens is not None or block.shared_head is not None:
        raise ConfigError("save_mtp_dir: a head with dedicated embeddings or LM head cannot be saved as an MTP "
                          "drafter directory (the directory format shares the target's)")
    tensors = dict(block.state_dict())
    with torch.device("meta"):
        want = _build(target).state_dict()
    for name, t in want.items():  # refuse a head for another target before writing anything
        if name not in tensors or tuple(tensors[name].shape) != tuple(t.shape):
            got = list(tensors[name].shape) if name in tensors else "missing"
            raise ConfigError(f"save_mtp_dir: tensor '{name}' is {got}, the target needs {list(t.shape)}")
    save_drafter_dir(path, mtp_config(target, steps), tensors, dtype=dtype, extra_files=extra_files,
                     max_shard_bytes=max_shard_bytes)


def is_mtp_config(d: dict) -> bool:
    return d.get("model_type") == MODEL_TYPE


def check_fit(d: dict, target: CausalLM, source: str) -> None:
    """Refuse a head config that was not made for ``target`` (one line naming the field)."""
    if not is_mtp_config(d):
        raise ConfigError(f"{source}: field 'model_type' is {d.get('model_type')!r}, expected '{MODEL_TYPE}' "
                          f"(an MTP drafter directory written by save_mtp_dir)")
    for field, want in _fit_fields(target).items():
        if field not in d:
            raise ConfigError(f"{source}: required field '{field}' is missing")
        if d[field] != want or type(d[field]) is not type(want):
            raise ConfigError(f"{source}: field '{field}'={str(repr(d[field]))[:80]} but the target has {want!r}; "
                              f"this MTP drafter was made for another model")
    steps = d.get("num_draft_steps_trained")
    if steps is not None and (type(steps) is not int or steps < 1):
        raise ConfigError(f"{source}: field 'num_draft_steps_trained' must be a positive integer or null, "
                          f"got {str(repr(steps))[:80]}")


def load_mtp_dir(path: str, loaded, sample_drafts: bool = True) -> MTPDrafter:
    """Load the MTP head in directory ``path`` for the target in ``loaded`` (a
    :class:`~specdec.loading.LoadedModel` or a bare :class:`CausalLM`).

    Strict: a missing, unexpected, mis-shaped or non-float tensor, or a head made for another
    target, is an error naming the tensor or field and the file.
    """
    target: CausalLM = getattr(loaded, "model", loaded)
    path = os.path.expanduser(str(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: an MTP drafter is a directory with config.json and model.safetensors")
    cfg_path = os.path.join(path, "config.json")
    d = read_json(cfg_path)
    try:
        _family(target)
    except ConfigError as e:
        raise ConfigError(f"{getattr(loaded, 'path', cfg_path)}: {e}") from e
    check_fit(d, target, cfg_path)
    src = SafetensorsSource(path)
    with torch.device("meta"):
        block = _build(target)
    names = {n: n for n in block.state_dict()}
    load_into(block, src, names, dtype=target.dtype, device=target.device, desc="loading MTP head")
    block.eval()
    d = MTPDrafter(block, target, sample_drafts=sample_drafts)
    d.path = path  # its draft_vocab.json, if any, is found here (drafters.factory)
    return d
