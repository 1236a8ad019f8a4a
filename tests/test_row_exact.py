"""SPECDEC_ROW_EXACT (models/base.py): a target whose every step kernel gives a row the same bits at any row
count runs unpadded static steps in ``generate`` (a 1-row plain step, k+1 rows a verify) and keeps 16-row
prefill chunks. The kernels' row invariance is checked in Triton's interpreter (tests/_interpret_kernels.py
fused-layer) and on the GPU; here the wiring, on the CPU."""

import torch
from _engine_util import tiny_llama

from specdec.drafters.ngram import NgramDrafter
from specdec.engine import SpeculativeGenerator
from specdec.engine.generate import STEP_ROWS
from specdec.models import base, graphs
from specdec.shapes import build_shape


def test_row_exact_needs_the_flag_and_the_fused_kernels(monkeypatch):
    m = tiny_llama()
    monkeypatch.setattr(base, "ROW_EXACT", False)
    assert not m.row_exact()
    monkeypatch.setattr(base, "ROW_EXACT", True)
    assert not m.row_exact()  # CPU weights: no fused kernels
    assert not build_shape("tiny", torch.device("cpu"), torch.float32).row_exact()  # a base CausalLM family too


def test_row_exact_target_runs_unpadded_steps(monkeypatch):
    m = tiny_llama(max_pos=256)
    rows = []
    call = graphs.GraphedTarget.__call__

    def record(self, ids, rows_=None):
        out = call(self, ids, rows_)
        rows.append(rows_ if rows_ is not None else (self.pad_to if self.pad_to and ids.shape[0] <= self.pad_to
                                                     else ids.shape[0]))
        return out
    monkeypatch.setattr(graphs.GraphedTarget, "__call__", record)
    prompt = torch.randint(0, 90, (21,), generator=torch.Generator().manual_seed(0)).tolist() * 2
    want = SpeculativeGenerator(m, None, 0, batch_invariant=True).generate(prompt, 30).token_ids
    assert set(rows) == {STEP_ROWS}  # padded: every step 16 rows
    monkeypatch.setattr(m, "row_exact", lambda rows=1: True, raising=False)
    for drafter, k in ((None, 0), (NgramDrafter(), 3)):
        g = SpeculativeGenerator(m, drafter, k, batch_invariant=True)
        assert g.row_exact and g.pad_to == (k + 1 if k else None) and g.chunk_rows == STEP_ROWS and g.static
        rows.clear()
        got = g.generate(prompt, 30)
        assert got.token_ids == want
        # plain steps of 1 row, verify steps of k+1 (a shorter last one padded: one captured step); on the CPU
        # the prompt is one eager forward (static prefill chunks are CUDA's)
        assert len(rows) == got.stats.steps and set(rows) == {k + 1}, rows


def test_only_the_targets_own_steps_ask_for_the_exact_head(monkeypatch):
    """The row-exact head (the fused GEMM) is for one sequence's target rows; batched steps (serving,
    distillation) and drafters ask for cuBLAS's (``exact=False``), whose speed there is what was measured."""
    m = tiny_llama(max_pos=256)
    asked = []
    real = m.raw_logits
    monkeypatch.setattr(m, "raw_logits", lambda h, exact=True: asked.append(exact) or real(h, exact), raising=False)
    ids = torch.randint(0, 90, (2, 5), generator=torch.Generator().manual_seed(1))
    starts = torch.zeros(2, dtype=torch.long)
    m.forward_batch(ids, None, starts, logits="all")
    m.forward_batch(ids, None, starts, last=torch.tensor([4, 2]))
    assert asked == [False, False]
    asked.clear()
    SpeculativeGenerator(m, None, 0, batch_invariant=True).generate(list(range(1, 9)), 4)
    assert asked and all(asked)
    # a drafter's logits are drafts: DFlash asks for cuBLAS's head, the target's verify steps for the exact one
    from specdec.drafters.dflash import DFlashDrafter
    from specdec.train.dflash_batch import new_dflash_config, new_dflash_model
    cfg = new_dflash_config(m, 1, 4, mask_token_id=m.config.vocab_size - 1)
    drafter = DFlashDrafter(new_dflash_model(m, cfg, init="random").eval(), m)
    asked.clear()
    SpeculativeGenerator(m, drafter, 3, batch_invariant=True).generate(list(range(1, 9)), 8)
    assert True in asked and False in asked


def test_verify_steps_past_the_wide_layers_rows_are_not_row_exact(monkeypatch):
    """A layer past fused_layer.MAX_HIDDEN takes the kernels in forwards of up to WIDE_ROWS rows a sequence only: a
    verify step of more rows would run it on cuBLAS, so such a generator is not row-exact (it pads, or warns)."""
    from specdec.models import fused_layer
    m = tiny_llama(max_pos=256)
    monkeypatch.setattr(fused_layer, "MAX_HIDDEN", 8)  # the tiny model is wider: its layers are "wide"
    monkeypatch.setattr(base, "ROW_EXACT", True)
    monkeypatch.setattr(fused_layer, "on_device", lambda w: True)  # CUDA weights and Triton, as far as the question goes
    monkeypatch.setattr(fused_layer, "triton", fused_layer.triton or object())
    for layer in m.layers:
        layer.fused_path = True
    wr = fused_layer.WIDE_ROWS
    assert m.row_exact() and m.row_exact(wr) and not m.row_exact(wr + 1)
    assert SpeculativeGenerator(m, NgramDrafter(), wr - 1, batch_invariant=True).row_exact
    assert not SpeculativeGenerator(m, NgramDrafter(), wr, batch_invariant=True).row_exact
