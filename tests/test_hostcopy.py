"""specdec.hostcopy.device_ints: the values and dtype torch.tensor gives (nested lists too); on the
CPU (and with SPECDEC_SYNC_COPIES=1) it is torch.tensor itself. Its CUDA form (pinned staging, a
copy without a stream sync) runs in the GPU checks (scripts/device_check.py: every engine path)."""

import pytest
import torch

from specdec import hostcopy


@pytest.mark.parametrize("values", [[3], [0, 5, 2**40], [[1, 2, 0], [7, 0, 0]], []])
@pytest.mark.parametrize("sync", [False, True])
def test_device_ints_equals_torch_tensor(values, sync, monkeypatch):
    monkeypatch.setattr(hostcopy, "SYNC_COPIES", sync)
    got = hostcopy.device_ints(values, "cpu")
    want = torch.tensor(values, dtype=torch.int64)
    assert got.dtype == torch.int64 and got.shape == want.shape and torch.equal(got, want)
    assert hostcopy.device_ints([[4, 1]], torch.device("cpu"), torch.int32).dtype == torch.int32
