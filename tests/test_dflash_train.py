"""DFlash training pieces: the batched block forward equals the inference drafter's, a saved
drafter loads strictly and decodes losslessly, a few AdamW steps lower the loss, and anchors
respect the supervision mask. Tiny random Llama target, fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from _dflash_util import write_drafter
from _engine_util import build_llama, plain_generate
from specdec.drafters.dflash import DFlashDrafter, load_dflash_drafter
from specdec.errors import ConfigError
from specdec.loading import load_model
from specdec.train.dflash_batch import (dflash_block_hidden, dflash_loss, new_dflash_config, new_dflash_model,
                                        sample_anchors, save_dflash_dir, trim_anchors)
from specdec.train.trainer import collate, make_batches

VOCAB, HIDDEN, LAYERS, BS = 64, 32, 6, 4

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = build_llama(tmp_path_factory.mktemp("target"), vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, seed=3)
    return path, load_model(path, "cpu", tokenizer=False)


def _drafter(loaded, seed: int = 0, layers: int = 2):
    """A new drafter with every weight perturbed (norms too), so a mis-wired tensor shows."""
    cfg = new_dflash_config(loaded, num_layers=layers, block_size=BS, mask_token_id=VOCAB - 1)
    model = new_dflash_model(loaded, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return cfg, model


def _features(target, tokens: torch.Tensor, layers) -> torch.Tensor:
    """Captured target features ``[B, L, n*H]`` of whole sequences (one prefill each)."""
    out = []
    for row in tokens:
        cache = target.new_cache(row.numel())
        out.append(target.forward(row, cache, capture=layers, logits="none").captured)
    return torch.stack(out)


def test_config_fits_the_target(target):
    cfg = new_dflash_config(target[1], num_layers=5, block_size=16, mask_token_id=7)
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2, 2, 2, 3]  # z-lab's formula for 6 layers
    assert cfg["num_target_layers"] == LAYERS and cfg["layer_types"] == ["full_attention"] * 5
    model = new_dflash_model(target[1], cfg)
    t = target[1].model
    assert torch.equal(model.layers[0].self_attn.q_proj.weight, t.layers[0].self_attn.q_proj.weight)
    assert torch.equal(model.layers[-1].mlp.down_proj.weight, t.layers[-1].mlp.down_proj.weight)
    assert model.fc.weight.dtype == torch.float32


def _check_parity(model, t):
    """Every anchor's block rows equal the real drafter's block logits after committing
    ``tokens[:a]`` with last token ``tokens[a]`` (blocks near the end run past L)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(VOCAB, (2, 20), generator=g)
    anchors = torch.tensor([[1, 5, 6, 12, 18, 0], [3, 4, 9, 17, 19, 2]])
    valid = torch.tensor([[True] * 5 + [False], [True] * 6])
    ids = model.config.target_layer_ids
    with torch.no_grad():
        feats = _features(t, tokens, ids)
        hid = dflash_block_hidden(model, t.embed_tokens.weight, feats, tokens, anchors, valid)
        chunked = dflash_block_hidden(model, t.embed_tokens.weight, feats, tokens, anchors, valid, anchor_chunk=4)
    assert hid.shape == (2, 6, BS, model.config.hidden_size)
    torch.testing.assert_close(chunked, hid, rtol=1e-5, atol=1e-5)
    drafter = DFlashDrafter(model, t)
    for b in range(2):
        for j in range(6):
            a = int(anchors[b, j])
            if not valid[b, j]:
                continue
            drafter.begin(tokens[b, :a], t.forward(tokens[b, :a], t.new_cache(a + 1), capture=ids))
            want = drafter.block_logits(int(tokens[b, a]))
            got = model.logits(hid[b, j, 1:], t.head_weight())
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            if a + 1 < 20:  # the block one position later is a different computation
                drafter.begin(tokens[b, :a + 1], t.forward(tokens[b, :a + 1], t.new_cache(a + 2), capture=ids))
                assert not torch.allclose(got, drafter.block_logits(int(tokens[b, a + 1])), atol=1e-3)


def test_block_hidden_matches_inference(target):
    _, model = _drafter(target[1])
    _check_parity(model.eval(), target[1].model)


@pytest.mark.parametrize("kind", ["qwen3", "llama3"])
def test_other_targets_init_and_parity(tmp_path, kind):
    """Qwen3 (q/k norms, head_dim != hidden / heads): the copied layers keep its norms; Llama 3
    (llama3 RoPE scaling): the drafter's config carries the scaling."""
    from _dense_util import tiny_model
    path = str(tmp_path / kind)
    tiny_model(kind, seed=2, layers=4).save_pretrained(path)
    loaded = load_model(path, "cpu", tokenizer=False)
    cfg = new_dflash_config(loaded, num_layers=2, block_size=BS, mask_token_id=3)
    model = new_dflash_model(loaded, cfg)
    assert torch.equal(model.norm.weight, loaded.model.norm.weight)
    if kind == "qwen3":
        assert cfg["head_dim"] == loaded.model.config.head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]
        assert torch.equal(model.layers[-1].self_attn.k_norm.weight, loaded.model.layers[-1].self_attn.k_norm.weight)
    else:
        assert cfg["rope_scaling"]["rope_type"] == "llama3" and model.rotary.scaling["factor"] == 8.0
    _check_parity(model.eval(), loaded.model)


@pytest.mark.parametrize("kind", ["sliding", "causal"])
def test_block_hidden_matches_inference_zlab_layer_kinds(tmp_path, target, kind):
    """Loaded z-lab checkpoints may have sliding-window (causal by default) or causal layers."""
    kw = (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3) if kind == "sliding"
          else dict(config={"is_causal": True}))
    path, _ = write_drafter(tmp_path / kind, hidden=HIDDEN, num_target_layers=LAYERS, target_layer_ids=(1, 4),
                            block_size=BS, mask_token_id=VOCAB - 1, seed=5, **kw)
    model = load_dflash_drafter(path, target[1]).model
    assert any(model.config.causal) and (kind == "causal" or model.config.windows[0] == 3)
    _check_parity(model, target[1].model)


def test_saved_drafter_loads_strictly_and_is_lossless(tmp_path, target):
    path, loaded = target
    cfg, model = _drafter(loaded, seed=2)
    out = str(tmp_path / "drafter")
    save_dflash_dir(model, cfg, out, extra_files={"README.md": "test\n"}, dtype=torch.float32)
    back = load_dflash_drafter(out, loaded)
    for name, p in model.state_dict().items():
        assert torch.equal(back.model.state_dict()[name], p), name

    from specdec.api import LLM
    llm = LLM(path, draft=f"dflash:{out}", device="cpu")
    prompt = torch.randint(VOCAB, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    res = llm.generate(prompt, 40)
    assert res.token_ids == plain_generate(llm.model, prompt, 40).token_ids


def test_sharded_save_loads_back(tmp_path, target):
    """Several shards and an index (SmolLM2's 5-layer drafter is ~39 MB in bf16: 3 shards)."""
    import os
    cfg, model = _drafter(target[1], seed=4)
    out = str(tmp_path / "sharded")
    save_dflash_dir(model, cfg, out, max_shard_bytes=20_000)
    files = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    back = load_dflash_drafter(out, target[1]).model.state_dict()
    for name, p in model.state_dict().items():
        assert torch.equal(back[name], p.to(torch.bfloat16).float()), name
    save_dflash_dir(model, cfg, out, dtype=None)  # overwrites in place, fp32 kept
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with pytest.raises(ConfigError, match="another drafter"):
        save_dflash_dir(model, dict(cfg, block_size=BS + 1), str(tmp_path / "bad"))


def test_adamw_lowers_the_loss(target):
    t = target[1].model
    cfg, model = _drafter(target[1], seed=3)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(VOCAB, (2, 24), generator=g)
    label_valid = torch.ones_like(tokens, dtype=torch.bool)
    label_valid[:, :6] = False  # the prompt
    with torch.inference_mode():  # as a trainer would get them from CausalLM.forward
        feats = _features(t, tokens, model.config.target_layer_ids)
    assert feats.is_inference()
    anchors, valid = sample_anchors(label_valid, 8, BS, g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        hid = dflash_block_hidden(model, t.embed_tokens.weight, feats, tokens, anchors, valid)
        loss, stats = dflash_loss(model, hid, t.head_weight(), tokens, anchors, valid, label_valid, chunk_rows=10)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.5 and losses[-1] == min(losses), losses
    assert t.embed_tokens.weight.grad is None and t.head_weight().grad is None  # the target stays frozen
    assert stats["acc"].shape == (BS - 1,) and 0 <= float(stats["accept_len"]) <= BS - 1
    assert int(stats["blocks"]) == int(valid.sum())


def test_loss_weights_and_stats():
    """Hand-made hidden rows whose logits are one-hot: known CE per row, known prefixes."""
    from specdec.drafters.dflash_model import DFlashConfig, DFlashDraftModel
    cfg = {"architectures": ["DFlashDraftModel"], "hidden_size": 8, "intermediate_size": 8,
                     "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
                     "rope_theta": 1e4, "block_size": 4, "num_target_layers": 2,
                     "dflash_config": {"mask_token_id": 0, "target_layer_ids": [0]}}
    model = DFlashDraftModel(DFlashConfig.from_dict(cfg))
    head = torch.eye(8) * 50.0  # vocab 8: logits = 50 * h, so h = e_t drafts t with CE ~ 0
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])
    anchors, valid = torch.tensor([[0, 3]]), torch.tensor([[True, True]])
    label_valid = torch.tensor([[False, True, True, True, True, False]])  # label 6 unsupervised
    hid = torch.zeros(1, 2, 4, 8)
    for j, a in enumerate([0, 3]):
        for k in range(1, 4):
            if a + k < 6:
                hid[0, j, k, tokens[0, a + k]] = 1.0
    hid[0, 0, 2] = 0.0
    hid[0, 0, 2, 7] = 1.0  # anchor 0, row 2 wrong
    loss, stats = dflash_loss(model, hid, head, tokens, anchors, valid, label_valid, gamma=2.0, chunk_rows=2)
    w = torch.exp(-torch.arange(3) / 2.0)
    # supervised: anchor 0 rows 1,2,3 (labels 2,3,4); anchor 3 row 1 (label 5); row 2 -> label 6 is not
    assert torch.allclose(loss, 50.0 * w[1] / (w.sum() + w[0]), rtol=1e-4)
    assert stats["rows"].tolist() == [2, 1, 1]
    assert stats["acc"].tolist() == [1.0, 0.0, 1.0]
    assert float(stats["accept_len"]) == 1.0 and int(stats["blocks"]) == 2  # prefixes 1 and 1


def test_sample_anchors_respect_labels_and_count():
    g = torch.Generator().manual_seed(0)
    label_valid = torch.zeros(3, 30, dtype=torch.bool)
    label_valid[0, 10:25] = True  # 15 eligible anchors: 9..23
    label_valid[1, 28:] = True  # 2 eligible: 27, 28
    for _ in range(20):
        anchors, valid = sample_anchors(label_valid, 6, 4, g)
        assert anchors.shape == valid.shape == (3, 6)
        assert valid.sum(1).tolist() == [6, 2, 0]
        for b in range(3):
            chosen = anchors[b][valid[b]]
            assert torch.all(label_valid[b, chosen + 1])
            assert chosen.unique().numel() == chosen.numel() and torch.equal(chosen, chosen.sort().values)
        assert anchors[1, :2].tolist() == [27, 28]
    wide, wide_valid = sample_anchors(label_valid[:, :5], 8, 4, g)
    assert wide.shape == (3, 8) and not wide_valid.any()


def test_chunked_loss_gradient_equals_direct(target):
    """The chunked, checkpointed head gives the loss and gradient of the plain formula."""
    t = target[1].model
    _, model = _drafter(target[1], seed=6)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(VOCAB, (2, 12), generator=g)
    label_valid = torch.rand(2, 12, generator=g) < 0.7
    anchors, valid = sample_anchors(label_valid, 4, BS, g)
    hid = torch.randn(2, 4, BS, HIDDEN, generator=g, requires_grad=True)
    loss, _ = dflash_loss(model, hid, t.head_weight(), tokens, anchors, valid, label_valid, gamma=3.0, chunk_rows=3)
    (grad,) = torch.autograd.grad(loss, hid)

    ref = hid.new_zeros(()).double()
    wsum = 0.0
    for b in range(2):
        for j in range(4):
            for k in range(1, BS):
                p = int(anchors[b, j]) + k
                if valid[b, j] and p < 12 and label_valid[b, p]:
                    w = torch.exp(torch.tensor(-(k - 1) / 3.0))
                    logits = model.logits(hid[b, j, k], t.head_weight())
                    ref = ref + w * torch.nn.functional.cross_entropy(logits[None], tokens[b, p][None])
                    wsum += float(w)
    ref = ref / wsum
    (ref_grad,) = torch.autograd.grad(ref, hid)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad.float(), rtol=1e-4, atol=1e-6)


def test_trimmed_anchors_give_the_same_loss_and_gradients(target):
    """Dropping the anchor columns that hold only invalid anchors changes neither the loss nor a
    gradient: blocks never see each other, and every valid anchor is kept."""
    t = target[1].model
    _, model = _drafter(target[1], seed=8)
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(VOCAB, (3, 20), generator=g)
    label_valid = torch.zeros(3, 20, dtype=torch.bool)
    label_valid[0, 8:14] = True  # 6 eligible anchors
    label_valid[1, 15:] = True  # 5
    label_valid[2, 18:] = True  # 2
    with torch.inference_mode():
        feats = _features(t, tokens, model.config.target_layer_ids)
    anchors, valid = sample_anchors(label_valid, 12, BS, g)
    short, short_valid = trim_anchors(anchors, valid, multiple=4)
    assert short.shape == (3, 8) and torch.equal(short_valid.sum(1), valid.sum(1))  # 6 valid at most -> 8 columns
    assert torch.equal(short[short_valid], anchors[valid])
    results = []
    for a, ok in ((anchors, valid), (short, short_valid)):
        model.zero_grad()
        hid = dflash_block_hidden(model, t.embed_tokens.weight, feats, tokens, a, ok)
        loss, stats = dflash_loss(model, hid, t.head_weight(), tokens, a, ok, label_valid)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, stats))
    (l0, g0, s0), (l1, g1, s1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-7)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=n)
    assert int(s0["blocks"]) == int(s1["blocks"]) and float(s0["accept_len"]) == float(s1["accept_len"])
    none, none_valid = trim_anchors(anchors, torch.zeros_like(valid), multiple=4)
    assert none.shape == (3, 4) and not none_valid.any()  # a batch with no valid anchor keeps one column group


def test_batches_pad_to_a_multiple_and_keep_the_budget():
    g = torch.Generator().manual_seed(1)
    seqs = [(list(range(int(n))), int(n) // 3) for n in torch.randint(5, 150, (200,), generator=g)]
    batches = make_batches(seqs, 1024, 128, multiple=32)
    assert sorted(i for b in batches for i in b) == list(range(200))
    widths = set()
    for b in batches:
        ids, valid = collate(seqs, b, 128, "cpu", multiple=32)
        longest = max(len(seqs[i][0]) for i in b)
        assert ids.shape == (len(b), min(-(-longest // 32) * 32, 128)) and ids.numel() <= 1024
        for r, i in enumerate(b):  # the reply tokens of each row, nothing in its padding
            toks, first = seqs[i]
            n = min(len(toks), 128)
            assert ids[r, :n].tolist() == toks[:n] and valid[r].nonzero().flatten().tolist() == list(range(first, n))
        widths.add(ids.shape[1])
    assert widths <= {32, 64, 96, 128} and len(widths) == 4
