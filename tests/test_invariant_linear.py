"""Row-count-invariant linear layers (models/invariant_linear.py): which weights get swapped, and
that a swapped layer computes what ``nn.Linear`` computes. The Triton kernel itself runs on CUDA
only (CPU-only installs have no Triton): its bits over 1..512 rows are checked on the H200 by
``scripts/invariant_gemm.py``, and in the serving loop by the shape checks (BENCHMARKS.md)."""

from __future__ import annotations

import pytest
import torch

from _engine_util import build_llama
from specdec.cpu_linear import plain
from specdec.engine.serve_loop import EngineLoop
from specdec.errors import ConfigError
from specdec.loading import load_model
from specdec.models import invariant_linear as il
from specdec.models.invariant_linear import InvariantLinear, cublas_varies, make_rows_invariant, row_counts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_llama(tmp_path_factory.mktemp("inv") / "t", vocab=64, hidden=32, layers=2, seed=3)
    return path


def test_config_by_row_count():
    assert il.config_for(1) == il.config_for(128) == (64, 32, 128, 4, 4)
    assert il.config_for(129) == il.config_for(256) == (64, 64, 128, 4, 3) and il.config_for(512)[:2] == (128, 128)


def test_row_counts():
    assert row_counts(1) == [1] and row_counts(48) == [1, 2, 4, 8, 16, 32, 48] and row_counts(64)[-2:] == [32, 64]


def test_swaps_the_weights_whose_results_vary(tiny):
    loaded = load_model(tiny, "cpu", "float32", tokenizer=False)
    model = loaded.model
    ids = torch.randint(64, (7,), generator=torch.Generator().manual_seed(1))
    before = model.forward(ids, model.new_cache(16)).logits
    probed = []

    def varies(w, rows):  # the down projections' shape "varies", nothing else
        probed.append((tuple(w.shape), tuple(rows)))
        return w.shape[1] == model.config.intermediate_size

    assert make_rows_invariant(model, 48) == []  # no CUDA here: nothing probed, nothing swapped
    names = make_rows_invariant(model, 48, varies=varies, force=True)
    assert names == [f"layers.{i}.mlp.down_proj" for i in range(2)], names
    assert all(isinstance(model.layers[i].mlp.down_proj, InvariantLinear) for i in range(2))
    assert plain(model.layers[0].self_attn.o_proj)
    assert len(probed) == len(set(probed)) and all(r == (1, 2, 4, 8, 16, 32, 48) for _, r in probed)  # once a shape
    after = model.forward(ids, model.new_cache(16)).logits
    assert torch.equal(before, after)  # the same tensors; on the CPU the same cpu_linear.linear
    assert make_rows_invariant(model, 48, varies=varies, force=True) == []  # swapped layers are not swapped again


def test_cublas_varies_compares_row_zero(monkeypatch):
    """A GEMM whose row 0 changes with the row count is found; one computed row by row is not."""
    from specdec.models import invariant_linear as il

    w = torch.randn(8, 16)
    seen = []

    def row_by_row(x, weight, bias=None):
        seen.append(x.shape[0])
        return torch.stack([(weight * r).sum(-1) for r in x])

    monkeypatch.setattr(il.F, "linear", row_by_row)
    assert not il.cublas_varies(w, [1, 2, 8]) and sorted(seen) == [1, 1, 2, 8]
    monkeypatch.setattr(il.F, "linear", lambda x, weight, bias=None: row_by_row(x, weight) + (x.shape[0] > 4) * 1e-3)
    assert il.cublas_varies(w, [1, 2, 8])
    assert not il.cublas_varies(w, [1, 2, 4])


def test_loop_option(tiny):
    loaded = load_model(tiny, "cpu", "float32", tokenizer=False)
    assert EngineLoop(loaded, "ngram", max_slots=2, static_steps=True, invariant_gemm=True).invariant_linears == []
    with pytest.raises(ConfigError, match="invariant_gemm"):
        EngineLoop(loaded, "ngram", max_slots=2, invariant_gemm="yes")
