"""scripts/ab_flags.py: each variant's flags are set while its steps are built and the defaults come
back after (also when the timing fails); bad input fails in one line."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import ab_flags  # noqa: E402
from specdec.models import base, fused_layer, layers, pdl, split_attention  # noqa: E402


def _state():
    return (base.FOLD_RESIDUAL, split_attention.DIRECT, layers.DRAFTER_SPLIT, fused_layer.ENABLED, pdl.ENABLED,
            split_attention.SMALL_TILES)


F, T = False, True


@pytest.mark.parametrize("variant, want", [("base", (F, F, F, F, F, F)), ("fold", (T, F, F, F, F, F)),
                                           ("direct", (F, T, F, F, F, F)), ("drafter-split", (F, F, T, F, F, F)),
                                           ("fused-layer", (F, F, F, T, F, F)), ("fused+direct", (F, T, F, T, F, F)),
                                           ("fused+direct+pdl", (F, T, F, T, T, F)),
                                           ("fused+direct+pdl+small-tiles", (F, T, F, T, T, T)),
                                           ("all", (T, T, T, T, T, T)), ("defaults", (T, T, T, T, T, T)),
                                           ("defaults-fold", (F, T, T, T, T, T))])
def test_flags_set_and_restored(variant, want):
    before = _state()
    with ab_flags.flags(ab_flags.VARIANTS[variant]):
        assert _state() == want
    assert _state() == before
    with pytest.raises(RuntimeError), ab_flags.flags(ab_flags.VARIANTS[variant]):
        raise RuntimeError("a failed timing")
    assert _state() == before


def test_defaults_variant_is_what_ships():
    """``defaults`` must be the package's own defaults (read from the modules' environment switches), so
    ``defaults-fold`` asks the fold's question against what users run."""
    switches = ("SPECDEC_FOLD_RESIDUAL", "SPECDEC_SPLIT_DIRECT", "SPECDEC_DRAFTER_SPLIT", "SPECDEC_FUSED_LAYER",
                "SPECDEC_PDL", "SPECDEC_SPLIT_SMALL_TILES")
    if any(s in os.environ for s in switches):
        pytest.fail("run without SPECDEC_* flag overrides in the environment")
    shipped = _state()  # the modules' values at import, no switch set: the package's defaults
    with ab_flags.flags(ab_flags.VARIANTS["defaults"]):
        assert _state() == shipped


@pytest.mark.parametrize("argv, msg", [(["--shape", "smollm2-135m", "--rounds", "0"], "must be >= 1"),
                                       (["--shape", "no-such-shape"], "no-such-shape"),
                                       (["--shape", "smollm2-135m", "--context", "9000"], "exceeds shape")])
def test_bad_input_is_one_line(argv, msg, capsys):
    try:
        rc = ab_flags.main(argv)
    except SystemExit as e:  # argparse's error
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and msg in err[-1] and "Traceback" not in "\n".join(err)


def test_settings_variants_set_and_restore():
    """``defaults+split64`` and ``defaults+rowgroups16`` set their module values on top of the defaults, and put
    them back after."""
    from specdec.models import expert_kernel
    before = (split_attention._SPLIT_ENV, expert_kernel.ROW_GROUPS, _state())
    with ab_flags.flags(ab_flags.VARIANTS["defaults+split64"]):
        assert split_attention.split_keys(256) == 64 and split_attention.split_keys(128) == 128
    with ab_flags.flags(ab_flags.VARIANTS["defaults+rowgroups16"]):
        assert expert_kernel.ROW_GROUPS == 16 and expert_kernel.FUSED_MOE
    assert (split_attention._SPLIT_ENV, expert_kernel.ROW_GROUPS, _state()) == before


def test_the_timed_step_is_plain_decodings_padded_step(monkeypatch):
    """The plain steps timed are the ones decoding runs: STEP_ROWS rows with one real (until 2026-12-04 it was
    a 1-row step, whatever the docstring said), and a row-exact target's unpadded 1-row step, each its own key."""
    import torch

    from specdec.engine.generate import STEP_ROWS
    from specdec.models.graphs import GraphedTarget
    from specdec.shapes import build_shape
    seen = []
    real_call = GraphedTarget.__call__

    def spy(self, ids, rows=None):
        seen.append((ids.shape[0], rows))
        return real_call(self, ids, rows)
    monkeypatch.setattr(GraphedTarget, "__call__", spy)
    model = build_shape("tiny", torch.device("cpu"), torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (9,))
    out = ab_flags.time_variant(model, ids, 8, 4, 2, {})
    assert out["plain_step_ms"] > 0 and out["row_step_ms"] > 0 and out["prefill_ms"] > 0
    assert out["row_exact"] == float(model.row_exact())
    assert seen and set(seen) == {(1, STEP_ROWS), (1, 1)} and seen.count((1, 1)) == seen.count((1, STEP_ROWS))
