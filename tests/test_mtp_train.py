"""The chained MTP training forward (``specdec.train.mtp_batch``) computes what the drafter
computes at inference: for anchors whose continuation is the head's own greedy chain (so the
chain is alive and teacher forcing feeds the drafts), the head's logits at every step equal
``MTPDrafter.last_logits`` after ``propose``. Plus labels, the chunked loss and a few AdamW
steps that lower it."""

from __future__ import annotations

import pytest
import torch

from _engine_util import build_llama
from specdec.drafters.mtp import MTPDrafter, load_mtp_drafter
from specdec.drafters.mtp_dir import new_mtp_block
from specdec.loading import load_model
from specdec.sampling import SamplingParams
from specdec.train.mtp_batch import chain_labels, chunked_cross_entropy, mtp_chain_hidden, mtp_chain_loss

K = 4
VOCAB = 40

pytestmark = pytest.mark.usefixtures("single_thread")


def _target(kind: str, root) -> object:
    if kind == "llama":
        return load_model(build_llama(root / "t", vocab=VOCAB, hidden=32, layers=2, seed=1), "cpu", tokenizer=False)
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM
        torch.manual_seed(2)
        Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=512)).save_pretrained(str(root / "t"))
        return load_model(str(root / "t"), "cpu", tokenizer=False)
    from _mtp_util import build_qwen35  # the checkpoint's own block: gated attention, zero-centred norms
    return load_model(build_qwen35(root / "t", moe=False, seed=2), "cpu", tokenizer=False)


def _randomise_norms(block, seed: int) -> None:
    """Norm weights away from their identity start, so a swapped or skipped norm shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("norm.weight") or "norm_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_5"])
def setup(request, tmp_path_factory):
    loaded = _target(request.param, tmp_path_factory.mktemp(f"train_{request.param}"))
    if request.param == "qwen3_5":
        block = load_mtp_drafter(loaded).block
    else:
        block = new_mtp_block(loaded.model, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():  # a larger spread than the init's: the chain then depends on every weight
            for p in block.parameters():
                p.mul_(8.0) if p.dim() == 2 else None
        _randomise_norms(block, 4)
    return loaded.model, block


def _inference_chain(target, block, prefix: list[int], last: int, cuts: tuple[int, ...] = ()):
    """Greedy ``propose(last, K)`` after the target committed ``prefix``: (drafts, logits [K, V]).

    ``cuts``: the prompt is ``prefix[:cuts[0]]`` and the rest is committed in steps as the engine
    does (propose, then observe the committed tokens), so the drafter's cache holds committed
    rows computed in several forwards and overwritten chained rows."""
    drafter = MTPDrafter(block, target)
    cache = target.new_cache(64)
    a = cuts[0] if cuts else len(prefix)
    drafter.begin(torch.tensor(prefix[:a]), target(torch.tensor(prefix[:a]), cache, logits="last"))
    for a, b in zip(cuts, cuts[1:] + (len(prefix),)):
        drafter.propose(prefix[a], 3, SamplingParams(), None)
        ids = torch.tensor(prefix[a:b])
        drafter.observe(ids, target(ids, cache))
    prop = drafter.propose(last, K, SamplingParams(), None)
    return prop.tokens.tolist(), drafter.last_logits


def test_training_forward_matches_inference(setup):
    """Three sequences, each ``prefix + [last] + greedy drafts + filler``, batched and padded to one
    length: at anchor ``len(prefix) - 1`` the K training logits equal the propose's logits (one
    drafter reached that point through earlier proposes and commits)."""
    target, block = setup
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(7)
    length = 24
    seqs, anchors, want = [], [], []
    for n, cuts in ((3, ()), (9, ()), (14, (5, 8, 9))):
        prefix = torch.randint(vocab, (n + 1,), generator=g).tolist()
        drafts, logits = _inference_chain(target, block, prefix[:-1], prefix[-1], cuts)
        filler = torch.randint(vocab, (length - n - 1 - K,), generator=g).tolist()  # must not leak back
        seqs.append(prefix + drafts + filler)
        anchors.append(n - 1)
        want.append(logits)
    tokens = torch.tensor(seqs)
    hidden = torch.stack([target(tokens[b], target.new_cache(length), logits="none").hidden for b in range(3)])
    with torch.no_grad():
        gs = mtp_chain_hidden(block, target.embed, hidden, tokens, K, target.rotary)
    for b, i in enumerate(anchors):
        got = torch.stack([target.head(gs[s][b, i:i + 1])[0] for s in range(K)])
        torch.testing.assert_close(got, want[b], atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"sequence {b}, anchor {i}: {m}")


def test_labels():
    tokens = torch.arange(10).reshape(2, 5) + 100
    supervise = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)
    labels, valid = chain_labels(tokens, supervise, 2)
    # step 1, anchor i predicts index i + 2; step 2 index i + 3
    assert valid[0].tolist() == [[True, True, True, False, False], [True, True, False, False, False]]
    assert valid[1].tolist() == [[True, True, False, False, False], [True, False, False, False, False]]
    assert labels[0][0, :3].tolist() == [102, 103, 104] and labels[1][1, :2].tolist() == [108, 109]


def test_chunked_cross_entropy_matches_full():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 8, generator=g, requires_grad=True)
    w = torch.randn(50, 8, generator=g)
    y = torch.randint(50, (37,), generator=g)
    ce, hits = chunked_cross_entropy(x, w, y, chunk_rows=10)
    ce.backward()
    x2 = x.detach().clone().requires_grad_(True)
    logits = x2 @ w.T
    ref = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
    ref.backward()
    torch.testing.assert_close(ce, ref)
    torch.testing.assert_close(x.grad, x2.grad)
    assert int(hits) == int((logits.argmax(-1) == y).sum())


def test_adamw_lowers_the_loss(tmp_path):
    """The head learns the target's own greedy continuations: a few AdamW steps lower the loss."""
    loaded = _target("llama", tmp_path)
    target = loaded.model
    target.requires_grad_(False)
    block = new_mtp_block(target, init_from_layer=-1, generator=torch.Generator().manual_seed(0)).float()
    g = torch.Generator().manual_seed(1)
    seqs = []
    for _ in range(4):
        prompt = torch.randint(VOCAB, (4,), generator=g).tolist()
        cache = target.new_cache(64)
        out = target(torch.tensor(prompt), cache, logits="last")
        seq = list(prompt)
        for _ in range(28):
            seq.append(int(out.logits[-1].argmax()))
            out = target(torch.tensor(seq[-1:]), cache, logits="last")
        seqs.append(seq)
    tokens = torch.tensor(seqs)
    hidden = torch.stack([target(t, target.new_cache(64), logits="none").hidden for t in tokens])
    supervise = torch.zeros_like(tokens, dtype=torch.bool)
    supervise[:, 4:] = True
    opt = torch.optim.AdamW(block.parameters(), lr=1e-2)
    losses, first = [], None
    for _ in range(25):
        res = mtp_chain_loss(block, target.embed, target.head_weight(), hidden, tokens, supervise, 3, target.rotary,
                             chunk_rows=16)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        losses.append(float(res.loss.detach()))
        first = res.step_loss if first is None else first
    # every supervised index 4..31 is predicted once per step (by anchors i = index - s - 1 >= 0)
    assert res.step_count.tolist() == [4 * 28] * 3
    assert losses[-1] < 0.8 * losses[0], losses
    assert (res.step_loss < first - 0.3).all(), (first, res.step_loss)
