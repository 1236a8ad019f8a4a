"""Training a DFlash drafter: a new config and model for a target, the batched block forward,
the loss, anchor sampling and saving a directory that :func:`load_dflash_drafter` reads.

The inference math lives in :mod:`specdec.drafters.dflash_model`; this module runs the same
modules on many blocks at once. One training sequence of ``L`` tokens (prompt + response)
has its target features ``feats [L, n*H]`` computed once; each *anchor* ``a`` (a position whose
next token is a supervised response token) stands for one inference step with ``a`` committed
positions before it: the block ``[tokens[a], mask x (bs-1)]`` at positions ``a..a+bs-1`` sees
the context keys of positions ``0..a-1`` and its own ``bs`` keys, nothing else. All blocks of a
sequence share one set of context keys/values per layer; a boolean mask keeps them apart:

    queries  [B, heads, A*bs, d]            (A anchors per sequence, bs rows per block)
    keys     [B, heads, L + A*bs, d]        (the context, then every block's own rows)
    mask     [B, 1, A*bs, L + A*bs]         ctx key j: j < a;  block key: same block only

Sliding-window and causal layers (loaded z-lab checkpoints) add their rules by position, as
``block_mask`` does; :func:`new_dflash_config` makes full-attention layers only.

Memory: the mask is ``B * A*bs * (L + A*bs)`` bytes (16 x 1024 x 2048 = 32 MiB) and one
layer's attention scores, where SDPA falls back to the math kernel, ``heads`` times that in
the compute dtype; ``anchor_chunk`` bounds both by running the anchors in groups (the context
keys are computed once either way). The loss applies the LM head in row chunks under
activation checkpointing, so at most one chunk of fp32 logits exists at a time, in the backward too.
Measured on an H200 (``scripts/dflash_train_memory.py``, ``benchmarks/dflash_train_memory.json``):
a 5-layer drafter of SmolLM2-135M shape, fp32 weights under bf16 autocast, 16 x 1024 tokens
with 64 anchors of 16 rows (16,384 query rows): forward + loss + backward in 60 ms, 6.4 GiB
above the weights; 32,768 rows 10.4 GiB. Chunking the anchors only made it slower there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..drafters.dflash import check_fit
from ..drafters.dflash_model import DFlashConfig, DFlashDraftModel, default_target_layer_ids
from ..errors import ConfigError
from ..models.base import CausalLM
from ..models.layers import Attention, SwiGLU, apply_rope
from ..weights.save import save_drafter_dir


def new_dflash_config(target, num_layers: int = 5, block_size: int = 16, *, mask_token_id: int) -> dict:
    """A z-lab style ``config.json`` dict for a new drafter of ``target`` (a :class:`CausalLM` or a
    ``LoadedModel``): the target's width, heads, head_dim, norm eps and RoPE, ``num_layers``
    full-attention (bidirectional) layers reading ``default_target_layer_ids`` of the target.

    Validated with :meth:`DFlashConfig.from_dict` and ``check_fit``, so
    :func:`load_dflash_drafter` accepts a directory written with it for this target.
    """
    target: CausalLM = getattr(target, "model", target)
    tc = target.config
    n_target = len(target.layers)
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": tc.hidden_size, "intermediate_size": tc.intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": tc.num_attention_heads,
        "num_key_value_heads": tc.num_key_value_heads, "head_dim": tc.head_dim,
        "rms_norm_eps": tc.rms_norm_eps, "rope_theta": tc.rope_theta,
        "rope_scaling": dict(tc.rope_scaling) if tc.rope_scaling else None,
        "max_position_embeddings": tc.max_position_embeddings,
        "vocab_size": int(target.embed_tokens.weight.shape[0]), "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "use_sliding_window": False,
        "layer_types": ["full_attention"] * num_layers,
        "block_size": block_size, "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": mask_token_id,
                          "target_layer_ids": default_target_layer_ids(n_target, num_layers)},
    }
    if tc.partial_rotary_factor != 1.0:
        cfg["partial_rotary_factor"] = tc.partial_rotary_factor
    c = DFlashConfig.from_dict(cfg, source="new_dflash_config")
    check_fit(c, target, "new_dflash_config")
    return cfg


def new_dflash_model(target, cfg_dict: dict, init: str = "target") -> DFlashDraftModel:
    """A trainable fp32 :class:`DFlashDraftModel` on the target's device.

    ``init="target"``: drafter layer ``i`` is a copy of an evenly spaced target decoder layer
    (layers ``round(i * (n - 1) / (m - 1))`` among the target's plain-attention SwiGLU layers:
    the first and the last included): q/k/v/o, MLP, and its input/post-attention norms, so each
    copy starts as the function it was trained as; q_norm/k_norm are ones where the target has
    none (Llama), zero-centred norms are converted (``1 + w``); target biases are dropped (DFlash
    has none). ``fc`` starts as the average of the captured layers (``[I/n, ..., I/n]``): the
    context stream is then the normalised mean of the target's hidden states, which the copied
    k/v projections can already read. ``hidden_norm`` is ones; ``norm`` is the target's final norm
    (the target's LM head reads it). ``init="random"``: small normal weights (std 0.02), norms ones.
    """
    if init not in ("target", "random"):
        raise ConfigError(f"init must be 'target' or 'random', got {init!r}")
    target: CausalLM = getattr(target, "model", target)
    c = DFlashConfig.from_dict(cfg_dict, source="new_dflash_model")
    check_fit(c, target, "new_dflash_model")
    model = DFlashDraftModel(c).to(device=target.device, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        if init == "target":
            _copy_from_target(model, target)
    return model


def _norm_weight(norm) -> torch.Tensor:
    w = norm.weight.detach().float()
    return 1.0 + w if norm.zero_centered else w


def _copy_from_target(model: DFlashDraftModel, target: CausalLM) -> None:
    plain = [i for i, layer in enumerate(target.layers)
             if isinstance(getattr(layer, "self_attn", None), Attention) and not layer.self_attn.gated
             and isinstance(getattr(layer, "mlp", None), SwiGLU)]
    m = len(model.layers)
    if not plain:
        raise ConfigError("init='target' needs target layers with plain attention and a SwiGLU MLP; "
                          "this target has none: use init='random'")
    picks = [plain[round(i * (len(plain) - 1) / max(m - 1, 1))] for i in range(m)]
    for layer, j in zip(model.layers, picks):
        src = target.layers[j]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
        for name in ("q_norm", "k_norm"):
            norm, w = getattr(src.self_attn, name), getattr(layer.self_attn, name).weight
            w.fill_(1.0) if norm is None else w.copy_(_norm_weight(norm))
        layer.input_layernorm.weight.copy_(_norm_weight(src.input_layernorm))
        layer.post_attention_layernorm.weight.copy_(_norm_weight(src.post_attention_layernorm))
    n, h = len(model.config.target_layer_ids), model.config.hidden_size
    eye = torch.eye(h, device=model.fc.weight.device) / n
    model.fc.weight.copy_(eye.repeat(1, n))
    model.norm.weight.copy_(_norm_weight(target.norm))


# --- the batched block forward -----------------------------------------------------------------

def dflash_block_hidden(model: DFlashDraftModel, embed: torch.Tensor, feats: torch.Tensor, tokens: torch.Tensor,
                        anchors: torch.Tensor, anchor_valid: torch.Tensor, *,
                        anchor_chunk: int | None = None) -> torch.Tensor:
    """Final-normed hidden rows of every anchor's block, ``[B, A, bs, H]`` (differentiable).

    ``embed [V, H]``: the target's embedding table (``target.embed_tokens.weight``, frozen: no
    gradient reaches it; the block is embedded with the raw table times the drafter's
    ``input_embedding_scale``, as at inference).
    ``feats [B, L, n*H]``: the target's captured features of whole sequences (no grad needed;
    inference-mode tensors, as ``CausalLM.forward`` returns them, are cloned).
    ``tokens [B, L]``; ``anchors [B, A]`` long positions in ``0..L-1``; ``anchor_valid [B, A]``
    bool (invalid anchors are computed at position 0 and are the loss's to ignore).
    Row ``k`` of anchor ``a``'s block equals what :meth:`DFlashDrafter.block_logits` computes
    after committing ``tokens[:a]`` with last token ``tokens[a]``. ``anchor_chunk``: run at most
    that many anchors per call (bounds one call's mask and scores; autograd still keeps every
    chunk's activations, and at 16k rows on an H200 it was slower and no smaller: leave it None
    unless the scores themselves do not fit).
    """
    b, l = tokens.shape
    if feats.shape[:2] != (b, l) or anchors.shape != anchor_valid.shape or anchors.shape[0] != b:
        raise ValueError(f"shapes disagree: feats {tuple(feats.shape)}, tokens {tuple(tokens.shape)}, "
                         f"anchors {tuple(anchors.shape)}, anchor_valid {tuple(anchor_valid.shape)}")
    dt = model.fc.weight.dtype
    if feats.is_inference():  # the target forwards in inference mode; autograd cannot save such tensors
        feats = feats.clone()
    anchors = torch.where(anchor_valid, anchors, torch.zeros_like(anchors))
    ctx = model.hidden_norm(model.fc(feats.to(dt)))  # [B, L, H], the context stream
    cos, sin = model.rotary.cos_sin(torch.arange(l, device=tokens.device), dt)
    ctx_kv = [layer.self_attn.kv(ctx, cos, sin) for layer in model.layers]  # each [B, n_kv, L, d]
    step = anchors.shape[1] if not anchor_chunk else anchor_chunk
    out = [_blocks(model, embed, ctx_kv, tokens, anchors[:, s: s + step])
           for s in range(0, anchors.shape[1], max(step, 1))]
    return torch.cat(out, dim=1)


def _blocks(model: DFlashDraftModel, embed: torch.Tensor, ctx_kv, tokens: torch.Tensor,
            anchors: torch.Tensor) -> torch.Tensor:
    """The blocks of ``anchors [B, A]`` through every layer -> ``[B, A, bs, H]``."""
    c, dt = model.config, model.fc.weight.dtype
    b, l = tokens.shape
    n_a, bs = anchors.shape[1], c.block_size
    t = n_a * bs
    dev = tokens.device
    ids = torch.full((b, n_a, bs), c.mask_token_id, dtype=torch.int64, device=dev)
    ids[:, :, 0] = tokens.gather(1, anchors)
    x = F.embedding(ids.view(b, t), embed.detach()).to(dt)  # the target's table stays frozen
    if c.input_embedding_scale != 1.0:
        x = x * c.input_embedding_scale
    pos = (anchors[:, :, None] + torch.arange(bs, device=dev)).view(b, t)  # [B, T]
    cos, sin = model.rotary.cos_sin(pos.reshape(-1), dt)
    cos, sin = cos.view(b, 1, t, -1), sin.view(b, 1, t, -1)

    # which keys each row sees: context keys before its anchor, and its own block
    block_of = torch.arange(n_a, device=dev).repeat_interleave(bs)  # [T]
    ctx_ok = torch.arange(l, device=dev)[None, None, :] < anchors.repeat_interleave(bs, dim=1)[:, :, None]
    own_ok = (block_of[:, None] == block_of[None, :]).expand(b, t, t)
    base = torch.cat([ctx_ok, own_ok], dim=-1)  # [B, T, L + T]
    kpos = torch.cat([torch.arange(l, device=dev).expand(b, l), pos], dim=1)  # [B, L + T]
    rel = pos[:, :, None] - kpos[:, None, :]  # query position - key position
    masks: dict = {}
    for i, layer in enumerate(model.layers):
        window, causal = c.windows[i], c.causal[i]
        if (window, causal) not in masks:
            ok = base
            if causal:
                ok = ok & (rel >= 0)
            if window is not None:
                ok = ok & (rel < window) if causal else ok & (rel.abs() < window)
            masks[(window, causal)] = ok[:, None]  # [B, 1, T, L + T]
        x = _layer(layer, x, cos, sin, *ctx_kv[i], masks[(window, causal)])
    return model.norm(x).view(b, n_a, bs, -1)


def _layer(layer, x, cos, sin, k_ctx, v_ctx, mask):
    """``DFlashLayer.forward`` with a batch dimension: ``x [B, T, H]``, ``k_ctx, v_ctx [B, n_kv, L, d]``."""
    att = layer.self_attn
    b, t, _ = x.shape
    h = layer.input_layernorm(x)
    q = att.q_norm(att.q_proj(h).view(b, t, att.n_heads, att.head_dim)).transpose(1, 2)
    q = apply_rope(q, cos, sin)
    k, v = att.kv(h, cos, sin)
    k, v = torch.cat([k_ctx, k], dim=2), torch.cat([v_ctx, v], dim=2)
    groups = att.n_heads // att.n_kv
    if groups > 1:  # expanded (small next to the scores) rather than enable_gqa, which not every masked kernel takes
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=att.scale)
    x = x + att.o_proj(o.transpose(1, 2).reshape(b, t, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


# --- the loss -----------------------------------------------------------------------------------

def dflash_loss(model: DFlashDraftModel, hidden: torch.Tensor, head_weight: torch.Tensor, tokens: torch.Tensor,
                anchors: torch.Tensor, anchor_valid: torch.Tensor, label_valid: torch.Tensor,
                gamma: float = 7.0, chunk_rows: int = 4096) -> tuple[torch.Tensor, dict]:
    """Weighted cross-entropy of the block rows, and accuracy statistics.

    Row ``k = 1..bs-1`` of anchor ``a``'s block (``hidden [B, A, bs, H]`` from
    :func:`dflash_block_hidden`) predicts ``tokens[a + k]``; it is supervised where the anchor is
    valid, ``a + k < L`` and ``label_valid[a + k]`` (response tokens). Each supervised row weighs
    ``exp(-(k - 1) / gamma)`` (early rows matter most: a draft is accepted only after every row
    before it), and the loss is ``sum(w * ce) / sum(w)``. The logits are ``model.logits(h,
    head_weight)`` in fp32, ``chunk_rows`` rows at a time and recomputed in the backward, so at
    most one chunk of ``[chunk_rows, V]`` logits is alive.

    ``stats`` (detached tensors, no host sync): ``acc [bs-1]`` top-1 accuracy per row k (NaN
    where no row k is supervised), ``rows [bs-1]`` supervised rows per k, ``accept_len``: mean,
    over blocks whose row 1 is supervised, of the longest prefix of rows whose argmax is right
    and supervised (a proxy of tau - 1 for greedy decoding), ``blocks`` the number of such blocks.
    """
    b, n_a, bs, _ = hidden.shape
    l = tokens.shape[1]
    dev = hidden.device
    idx = anchors[:, :, None] + torch.arange(1, bs, device=dev)  # [B, A, bs-1] label positions
    inside = idx < l
    idx = torch.where(inside, idx, torch.zeros_like(idx)).view(b, -1)
    labels = tokens.gather(1, idx).view(b, n_a, bs - 1)
    sup = anchor_valid[:, :, None] & inside & label_valid.gather(1, idx).view(b, n_a, bs - 1)
    k_weight = torch.exp(-torch.arange(bs - 1, device=dev, dtype=torch.float32) / gamma)  # row k: exp(-(k-1)/g)

    h = hidden[:, :, 1:][sup]  # [N, H], supervised rows only
    y, w = labels[sup], k_weight.expand(b, n_a, -1)[sup]
    head = head_weight.detach().to(h.dtype)
    total = hidden.new_zeros((), dtype=torch.float32) + 0.0 * hidden.sum()  # keeps a graph when N = 0
    right = []
    for s in range(0, h.shape[0], chunk_rows):
        args = (h[s: s + chunk_rows], y[s: s + chunk_rows], w[s: s + chunk_rows])
        if torch.is_grad_enabled() and h.requires_grad:
            part, ok = checkpoint(_head_chunk, model, head, *args, use_reentrant=False)
        else:
            part, ok = _head_chunk(model, head, *args)
        total = total + part
        right.append(ok)
    loss = total / w.sum().clamp_min(1e-12)

    correct = torch.zeros_like(sup)
    if right:
        correct[sup] = torch.cat(right)
    rows = sup.sum((0, 1))
    prefix = torch.cumprod((correct & sup).to(torch.int32), dim=-1).sum(-1)  # [B, A]
    counted = sup[:, :, 0]
    blocks = counted.sum()
    stats = {
        "loss": loss.detach(),
        "acc": correct.sum((0, 1)) / rows.float(),  # 0 / 0 = NaN where nothing is supervised
        "rows": rows,
        "accept_len": (prefix * counted).sum() / blocks.clamp_min(1).float(),
        "blocks": blocks,
    }
    return loss, stats


def _head_chunk(model: DFlashDraftModel, head: torch.Tensor, h: torch.Tensor, y: torch.Tensor,
                w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted CE sum of one chunk of rows and which argmax drafts are right."""
    logits = model.logits(h, head)  # [n, V] fp32
    ce = F.cross_entropy(logits, y, reduction="none")
    return (ce * w).sum(), logits.argmax(-1) == y


# --- anchors -----------------------------------------------------------------------------------

def sample_anchors(label_valid: torch.Tensor, num_anchors: int, bs: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors ``[B, num_anchors]`` (long, sorted per row) and ``anchor_valid`` (bool).

    Position ``p`` may anchor a block when ``label_valid[p + 1]``: the token after it (the
    block's first draft) is supervised. Up to ``num_anchors`` per sequence, without replacement,
    uniformly among those; a sequence with fewer gets them all, padded at the end with position
    0 and ``anchor_valid`` False. ``bs`` (the block size, at least 2) is checked only: a block may
    run past the end of the sequence, its rows there are unsupervised and the loss skips them.
    ``generator`` must live on ``label_valid``'s device.
    """
    if bs < 2 or num_anchors < 1:
        raise ValueError(f"need bs >= 2 and num_anchors >= 1, got bs={bs}, num_anchors={num_anchors}")
    b, l = label_valid.shape
    dev = label_valid.device
    eligible = label_valid[:, 1:].bool()  # [B, L-1]: position p anchors if label p+1 is supervised
    keys = torch.rand(eligible.shape, generator=generator, device=dev).masked_fill(~eligible, -1.0)
    top, pos = keys.topk(min(num_anchors, l - 1), dim=1)
    valid = top >= 0
    # sort the chosen positions, invalid ones last (as l), then give them position 0
    order = torch.where(valid, pos, torch.full_like(pos, l)).sort(dim=1).values
    valid = order < l
    anchors = torch.where(valid, order, torch.zeros_like(order))
    if anchors.shape[1] < num_anchors:
        pad = num_anchors - anchors.shape[1]
        anchors = F.pad(anchors, (0, pad))
        valid = F.pad(valid, (0, pad))
    return anchors, valid


def trim_anchors(anchors: torch.Tensor, valid: torch.Tensor, multiple: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the anchor columns no sequence of the batch uses: :func:`sample_anchors` puts each row's
    invalid anchors last, so only the first ``max valid count`` columns hold valid ones (that count
    rounded up to ``multiple``, for few distinct shapes). Blocks never see each other, so the loss
    and its gradients are those of the untrimmed batch. With the recipe's 512 anchors and replies
    of at most 256 tokens, ~60 % of the blocks computed were invalid anchors (SmolLM2's data)."""
    n = int(valid.sum(1).max()) if valid.numel() else 0
    keep = min(anchors.shape[1], max(multiple, -(-n // multiple) * multiple))
    return anchors[:, :keep], valid[:, :keep]


# --- saving ------------------------------------------------------------------------------------

def save_dflash_dir(model: DFlashDraftModel, cfg_dict: dict, path: str, extra_files: dict[str, str] | None = None,
                    dtype: torch.dtype | None = torch.bfloat16, max_shard_bytes: int = 15 * 2**20) -> None:
    """Write ``cfg_dict`` and the drafter's weights (``DFlashDraftModel.state_dict()`` names,
    converted to ``dtype``; None keeps fp32 for resuming) to directory ``path`` atomically, in
    shards of at most ``max_shard_bytes`` with an index when there are several;
    :func:`load_dflash_drafter` loads it strictly. ``extra_files``: name -> text written beside."""
    c = DFlashConfig.from_dict(cfg_dict, source="save_dflash_dir")
    mc = model.config
    if (c.hidden_size, c.num_hidden_layers, c.target_layer_ids, c.block_size) != (
            mc.hidden_size, mc.num_hidden_layers, mc.target_layer_ids, mc.block_size):
        raise ConfigError("save_dflash_dir: cfg_dict describes another drafter than the model's config "
                          "(hidden_size, num_hidden_layers, target_layer_ids, block_size)")
    tensors = {n: t for n, t in model.state_dict().items()}
    save_drafter_dir(path, cfg_dict, tensors, dtype=dtype, extra_files=extra_files, max_shard_bytes=max_shard_bytes)
