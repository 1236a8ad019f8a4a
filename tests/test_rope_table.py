"""SPECDEC_ROPE_TABLE (models/base.py): a static step's cos / sin gathered from a table by position, and
its mask's positions from a kept arange, give the values computed from the positions bit for bit, so a
static step's logits do not change."""

import torch

from specdec.engine import SpeculativeGenerator
from specdec.models import base
from specdec.shapes import build_shape


def _model(dtype=torch.float32):
    return build_shape("tiny", torch.device("cpu"), dtype)


def test_static_context_from_tables_equals_computed(monkeypatch):
    for dtype in (torch.float32, torch.bfloat16):
        m = _model(dtype)
        for start, t, max_len in ((0, 1, 40), (7, 16, 64), (1500, 3, 2100), (30, 16, 48)):
            monkeypatch.setattr(base, "ROPE_TABLE", False)
            want = m.static_context(torch.tensor(start), t, max_len)
            monkeypatch.setattr(base, "ROPE_TABLE", True)
            got = m.static_context(torch.tensor(start), t, max_len)
            for name in ("cos", "sin", "mask"):
                a, b = getattr(got, name), getattr(want, name)
                assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), (dtype, start, t, name)
        tables = m._position_tables[(m.device, m.dtype)]
        assert len(tables) == 2 and tables[-1][2].numel() >= 2100 + 3  # grown past 1024, the first kept


def test_static_steps_from_tables_decode_alike(monkeypatch):
    m = _model()
    prompt = torch.randint(0, 500, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    outs = []
    for on in (False, True):
        monkeypatch.setattr(base, "ROPE_TABLE", on)
        g = SpeculativeGenerator(m, None, 0, batch_invariant=True)  # static 16-row steps on the CPU
        outs.append(g.generate(prompt, 24).token_ids)
    assert outs[0] == outs[1]
