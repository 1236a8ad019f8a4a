"""The chained MTP training forward: what :class:`~specdec.drafters.mtp.MTPDrafter` computes at
inference, for every anchor of a batch at once, differentiably.

At inference, once the target has committed ``t_0 .. t_i`` (hidden states ``h_0 .. h_i`` after
its final norm) and the next token ``t_{i+1}`` is known, ``propose`` runs (see :mod:`.mtp`):

- step 1: the row ``(h_i, t_{i+1})`` at position ``i``; the block's KV cache holds the committed
  rows ``(h_j, t_{j+1})`` at positions ``j <= i``. Its output ``g_{1,i}`` predicts ``t_{i+2}``;
- step ``s >= 2``: the chained row ``(g_{s-1,i}, d_{s-1})`` at position ``i + s - 1``, attending to
  the committed rows ``0 .. i`` and the chained rows of this propose (positions ``i+1 .. i+s-1``).
  ``g_{s,i}`` predicts ``t_{i+s+1}``.

Training does the same for every anchor ``i`` with teacher forcing: the chained rows take the
true tokens ``t_{i+s}`` where inference takes the drafts (equal to the truth while the chain is
alive, which is the only case whose drafts can be accepted). Per step ``s`` the block runs once
over all ``L`` anchors; its keys and values are kept, and the attention of step ``s`` reads

    keys [K_1 | K_2 | .. | K_s]  (each [B, heads, L, d]; K_j[:, :, i] is anchor i's row of step j)
    mask [L, s*L]: query i sees K_1[0..i] (causal: the committed rows) and K_j[i] for j = 2..s

so every query attends to exactly what its inference twin does, at the same positions. The
attention costs ``s`` times step 1's and runs through SDPA with that boolean mask (the
memory-efficient kernel on CUDA never materialises the scores).

Rows past the end: step ``s`` at anchor ``i`` needs ``t_{i+s}``, so only anchors
``i <= L - 1 - s`` are real; the others are computed from a clamped token and must not be
supervised (:func:`chain_labels` marks them invalid). Sequences are right-padded: positions
start at 0 in every row of the batch, and padding after a sequence never reaches its rows.

The target stays frozen: pass its ``embed`` and ``rotary`` (and to the loss its LM head weight)
with ``requires_grad`` off. Hidden states from the target's ``forward`` are inference tensors;
they are copied here so autograd may save them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..drafters.mtp import MTPBlock


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied out of inference mode when it was made there (autograd cannot save those)."""
    return t.clone() if t.is_inference() else t


def chain_mask(length: int, step: int, device) -> torch.Tensor:
    """Boolean ``[L, step*L]``: query ``i`` of step ``step`` sees step-1 keys ``0..i`` and its own
    keys of steps ``2..step``."""
    i = torch.arange(length, device=device)
    causal = i[None, :] <= i[:, None]
    own = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [own] * (step - 1), dim=1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q ``[B, H, L, d]``, k/v ``[B, Hkv, S, d]`` (GQA), mask ``[L, S]`` -> ``[B, H, L, dv]``."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # expanded keys are small; a GQA flag would send a masked SDPA to the math kernel
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def mtp_chain_hidden(block: MTPBlock, embed: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                     tokens: torch.Tensor, steps: int, rotary) -> list[torch.Tensor]:
    """The block's final-normed outputs ``g_s`` ``[B, L, H]`` for chain steps ``s = 1 .. steps``.

    ``embed``: the target's ``embed`` (ids -> ``[.., H]``); ``hidden [B, L, H]``: the target's
    hidden states after its final norm (``ForwardOut.hidden``) of ``tokens [B, L]``; ``rotary``:
    the target's :class:`~specdec.models.layers.RotaryEmbedding`. Element ``s - 1`` of the result,
    at anchor ``i``, is ``g_{s,i}``: it predicts ``tokens[:, i + s + 1]`` and is real for
    ``i <= L - 1 - s`` (see the module docstring and :func:`chain_labels`).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    b, length, h = hidden.shape
    if tokens.shape != (b, length):
        raise ValueError(f"tokens {list(tokens.shape)} do not match hidden {list(hidden.shape)}")
    layer = block.layers[0]
    attn = layer.self_attn
    dev, dtype = hidden.device, block.fc.weight.dtype
    idx = torch.arange(length, device=dev)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    prev = _plain(hidden).to(dtype)
    outs = []
    for s in range(1, steps + 1):
        tok = tokens[:, (idx + s).clamp(max=length - 1)]  # t_{i+s}; clamped rows are never supervised
        emb = _plain(embed(tok)).to(dtype)
        x = block.fc(torch.cat([block.pre_fc_norm_embedding(emb), block.pre_fc_norm_hidden(prev)], dim=-1))
        cos, sin = rotary.cos_sin(idx + (s - 1), dtype)  # anchor i's row of step s sits at i + s - 1
        flat = layer.input_layernorm(x).reshape(b * length, h)
        q, k, v, gate = attn.project(flat, cos.repeat(b, 1), sin.repeat(b, 1))  # [heads, B*L, d]

        def batched(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(t.shape[0], b, length, t.shape[-1]).transpose(0, 1)  # [B, heads, L, d]

        keys.append(batched(k))
        values.append(batched(v))
        o = _attend(batched(q), torch.cat(keys, dim=2), torch.cat(values, dim=2), chain_mask(length, s, dev),
                    attn.scale)
        o = o.transpose(0, 1).reshape(o.shape[1], b * length, o.shape[-1])  # back to [heads, B*L, d]
        x = x + attn.output(o, gate).reshape(b, length, h)
        x = x + layer.mlp(layer.post_attention_layernorm(x).reshape(b * length, h)).reshape(b, length, h)
        prev = block.norm(x)
        outs.append(prev)
    return outs


def chain_labels(tokens: torch.Tensor, supervise: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and their mask for :func:`mtp_chain_hidden`'s outputs, each ``[steps, B, L]``.

    Step ``s`` at anchor ``i`` predicts ``tokens[:, i + s + 1]``; it is supervised when that index
    lies inside the sequence and ``supervise`` (``[B, L]`` bool: "the token at this index is
    one to predict", e.g. a response token) is set there.
    """
    b, length = tokens.shape
    idx = torch.arange(length, device=tokens.device)
    labels, valid = [], []
    for s in range(1, steps + 1):
        j = idx + s + 1
        inside = j < length
        jc = j.clamp(max=length - 1)
        labels.append(tokens[:, jc])
        valid.append(supervise[:, jc].bool() & inside[None, :])
    return torch.stack(labels), torch.stack(valid)


@dataclass
class ChainLoss:
    loss: torch.Tensor  # scalar: the weighted mean over steps of each step's mean cross-entropy
    step_loss: torch.Tensor  # [steps] mean cross-entropy per step (detached)
    step_acc: torch.Tensor  # [steps] top-1 accuracy per step
    step_count: torch.Tensor  # [steps] supervised rows per step


def _ce_sum(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, softcap: float | None):
    logits = F.linear(x, weight).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, reduction="sum"), (logits.argmax(-1) == labels).sum()


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 2048,
                          softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and top-1 hits of ``head(x [N, H])`` against ``labels [N]``, the LM
    head ``weight [V, H]`` applied ``chunk_rows`` rows at a time. Each chunk is checkpointed, so
    the backward pass recomputes its logits: at most one chunk of ``[chunk_rows, V]`` fp32 logits
    is alive at any time, forward or backward."""
    total = x.new_zeros((), dtype=torch.float32)
    hits = torch.zeros((), dtype=torch.int64, device=x.device)
    for c in range(0, x.shape[0], chunk_rows):
        ce, hit = checkpoint(_ce_sum, x[c:c + chunk_rows], weight, labels[c:c + chunk_rows], softcap,
                             use_reentrant=False)
        total = total + ce
        hits = hits + hit
    return total, hits


def mtp_chain_loss(block: MTPBlock, embed: Callable[[torch.Tensor], torch.Tensor], head_weight: torch.Tensor,
                   hidden: torch.Tensor, tokens: torch.Tensor, supervise: torch.Tensor, steps: int, rotary, *,
                   step_weights: Sequence[float] | None = None, chunk_rows: int = 2048,
                   softcap: float | None = None) -> ChainLoss:
    """Cross-entropy of the chained head: step ``s`` at anchor ``i`` against ``tokens[:, i+s+1]``
    where :func:`chain_labels` marks it supervised.

    ``head_weight [V, H]``: the target's LM head (``target.head_weight()``), applied in chunks of
    ``chunk_rows`` rows; ``softcap``: the target's final logit soft-cap, if any. The loss is the
    mean over steps (weighted by ``step_weights``) of each step's mean over its supervised rows;
    a step without any counts zero. The statistics are device tensors (no host sync here).
    """
    gs = mtp_chain_hidden(block, embed, hidden, tokens, steps, rotary)
    labels, valid = chain_labels(tokens, supervise, steps)
    weight = _plain(head_weight)
    w = torch.ones(steps) if step_weights is None else torch.tensor([float(x) for x in step_weights])
    if w.shape != (steps,):
        raise ValueError(f"step_weights has {w.numel()} entries for {steps} steps")
    losses, accs, counts = [], [], []
    for s, g in enumerate(gs):
        ok = valid[s]
        n = ok.sum()
        ce, hits = chunked_cross_entropy(g[ok], weight.to(g.dtype), labels[s][ok], chunk_rows, softcap)
        losses.append(ce / n.clamp(min=1))
        accs.append(hits.float() / n.clamp(min=1))
        counts.append(n)
    step_loss = torch.stack(losses)
    w = w.to(step_loss.device)
    return ChainLoss((step_loss * w).sum() / w.sum(), step_loss.detach(), torch.stack(accs), torch.stack(counts))
