"""``--batch-invariant`` on the CPU for the Llama family: unpadded eager steps in cpu_exact's row-invariant forms
(oneDNN linears with 1-row calls padded to 2 rows, attention on oneDNN matmuls). Checked bit for bit: every
committed position's logits are the same in plain and speculative decoding, with a drafter that is actually
accepted (the target's own continuation, partly spoiled), so that rows 0..k of verify steps and rollback are
exercised. Mutation checks show that the test sees each of the two forms missing."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from _engine_util import SpoiledOracle  # noqa: E402
from specdec import cpu_exact, cpu_linear  # noqa: E402
from specdec.engine import SpeculativeGenerator  # noqa: E402
from specdec.engine import generate as engine_mod  # noqa: E402

NEW_TOKENS = 40

pytestmark = pytest.mark.cpu_exact  # the product's CPU path (tests/conftest.py turns it off elsewhere)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, single_thread):
    """A Llama whose down_proj has K = 1,536 (a 1-row oneDNN call rounds otherwise there) and 3 query heads a KV head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.loading import load_model

    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("cpu_exact") / "llama"
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return load_model(str(path), "cpu", "float32").model


def record(model, drafter, k, prompt, monkeypatch, **kw):
    """Greedy generation; (tokens, the committed positions' logits [N, V] in order, stats, the generator)."""
    rows = []
    accept = engine_mod.accept_greedy

    def recording(drafts, logits):
        packed = accept(drafts, logits)
        rows.append(logits[: int(packed[0]) + 1].clone())
        return packed

    monkeypatch.setattr(engine_mod, "accept_greedy", recording)
    gen = SpeculativeGenerator(model, drafter, k, batch_invariant=True, **kw)
    res = gen.generate(prompt, NEW_TOKENS)
    monkeypatch.setattr(engine_mod, "accept_greedy", accept)
    return res.token_ids, torch.cat(rows), res.stats, gen


def differing(model, prompt, monkeypatch, k=4):
    """(positions whose logits differ between plain and speculative decoding, positions compared, stats, tokens equal)."""
    plain, plain_rows, _, gen = record(model, None, 0, prompt, monkeypatch)
    assert gen.cpu_exact and gen.pad_to is None and not gen.static  # the unpadded eager path
    spec, spec_rows, stats, _ = record(model, SpoiledOracle(prompt + plain, model.config.vocab_size, spoil=0.3), k,
                                       prompt, monkeypatch)
    acc = stats.accepted
    assert sum(acc) >= 10 and any(a < k for a in acc) and any(a >= 2 for a in acc), acc  # rows > 0 and rollback ran
    n = min(len(plain_rows), len(spec_rows))
    assert n >= NEW_TOKENS - 1
    return int((plain_rows[:n] != spec_rows[:n]).any(-1).sum()), n, stats, plain == spec


@pytest.mark.parametrize("k", [4, 20])
def test_llama_is_bitwise_invariant_unpadded(llama, monkeypatch, k):
    # k = 20: more drafts than the padded static step's 16 rows hold; the unpadded path has no such limit
    for seed in (0, 1):
        prompt = torch.randint(0, 97, (7 + 9 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        differ, n, _, same = differing(llama, prompt, monkeypatch, k)
        assert differ == 0, f"{differ} of {n} positions' logits differ between plain and speculative decoding"
        assert same


def test_sdpa_instead_breaks_it(llama, monkeypatch):
    """Mutation check: the CPU's SDPA in place of cpu_exact.attention changes a row's bits with the row count."""
    def sdpa(q, k, v, mask, scale):
        rep = q.shape[0] // k.shape[0]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0),
                                              attn_mask=mask, scale=scale)
    monkeypatch.setattr(cpu_exact, "attention", sdpa)
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    assert differing(llama, prompt, monkeypatch)[0] > 0


def test_unpadded_one_row_linears_break_it(llama, monkeypatch):
    """Mutation check: a 1-row linear left unpadded (a GEMV) rounds otherwise than the same row in a verify step.
    Where this CPU's oneDNN gives a 1-row call the padded call's bits (on an AVX2-only AMD EPYC it did, on the CI's
    machines it did not), the GEMV sums in another order instead (a broadcast product's sum), so that the check sees
    a 1-row form of its own on any machine."""
    real = cpu_linear.row_invariant_linear
    forms = []  # per 1-row call: whether oneDNN's unpadded GEMV differed from the padded call

    def unpadded(x, w, b=None, pack=True):
        if x.numel() == x.shape[-1]:
            y = torch.ops.mkldnn._linear_pointwise(x, cpu_linear.packed(w) if pack else w, b, "none", [], "")
            forms.append(not torch.equal(y, real(x, w, b, pack)))
            if forms[-1]:
                return y
            y = (x[..., None, :] * w).sum(-1)
            return y if b is None else y + b
        return real(x, w, b, pack)
    monkeypatch.setattr(cpu_linear, "row_invariant_linear", unpadded)
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    assert differing(llama, prompt, monkeypatch)[0] > 0, f"oneDNN's GEMV differed in {sum(forms)} of {len(forms)} calls"


def test_off_switch_and_other_families_pad(llama, monkeypatch, tmp_path):
    from _qwen35_util import hf_model

    from specdec.loading import load_model

    monkeypatch.setattr(engine_mod, "CPU_EXACT", False)
    gen = SpeculativeGenerator(llama, None, 0, batch_invariant=True)
    assert not gen.cpu_exact and gen.pad_to == engine_mod.STEP_ROWS
    monkeypatch.setattr(engine_mod, "CPU_EXACT", True)
    assert not SpeculativeGenerator(llama, None, 0).cpu_exact  # the CPU default: fast steps, tokens tested equal
    hf_model("dense", seed=2).save_pretrained(tmp_path)
    hybrid = load_model(str(tmp_path), "cpu", "float32").model  # Gated DeltaNet layers: not covered, padded
    gen = SpeculativeGenerator(hybrid, None, 0, batch_invariant=True)
    assert not gen.cpu_exact and gen.pad_to == engine_mod.STEP_ROWS


def test_attention_matches_sdpa_values():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(6, 5, 16, generator=g), torch.randn(2, 12, 16, generator=g), torch.randn(2, 12, 16, generator=g)
    mask = torch.arange(12)[None, :] <= (7 + torch.arange(5))[:, None]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 0), v.repeat_interleave(3, 0), attn_mask=mask, scale=0.25)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_exact.attention(q, k, v, mask, 0.25), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cpu_exact.attention(q[:, :1], k, v, None, 0.25),
                                   F.scaled_dot_product_attention(q[:, :1], k.repeat_interleave(3, 0),
                                                                  v.repeat_interleave(3, 0), scale=0.25),
                                   rtol=1e-5, atol=1e-5)
