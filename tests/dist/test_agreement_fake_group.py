"""The agreement's error path on PyTorch's fake process group (issue 46, item 5): a rank whose own checks
failed raises its own error, whatever table the exchange brings back (the fake group's receives hold
no peer's values, so the table need not show this rank's failure)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import striped_sp
from striped_sp.engine import agreement


@pytest.fixture
def fake_pair():
    """Rank 0 of a fake group of 2 as the default group, destroyed after the test."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.fail("a process group is already initialized in the test process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    agreement.clear_cache()
    try:
        yield dist.group.WORLD
    finally:
        agreement.clear_cache()
        dist.destroy_process_group()


def _table(rows):
    """The fake group's exchange, its result replaced by ``rows`` (what its receives happened to hold)."""
    real = agreement._all_gather

    def gather(mine, group, timeout, what, skipped=True):
        every = real(mine, group, timeout, what, skipped)  # the fake group's own (no-op) all-gather
        if mine.numel() != 2:
            return every
        return torch.tensor(rows, dtype=mine.dtype).view(every.shape)
    return gather


@pytest.mark.parametrize("rows", [[[0, 0], [0, 0]], [[0, 0], [0, 7]], None],
                         ids=["zeros", "digests-differ", "as-received"])
def test_own_error_raised_whatever_the_table(fake_pair, monkeypatch, rows):
    """agree(error=...) raises that error, not an UnboundLocalError or a TypeError of the fall-through."""
    if rows is not None:
        monkeypatch.setattr(agreement, "_all_gather", _table(rows))
    mine = ValueError("rank 0's own check: cu_seqlens must start at 0")
    with pytest.raises(ValueError, match="rank 0's own check") as raised:
        agreement.agree(fake_pair, None, error=mine, enabled=True)
    assert raised.value is mine


def test_ring_attention_raises_its_own_argument_error(fake_pair, monkeypatch):
    """Through ring_attention: a bad argument on this rank is the error it raises (its type and text)."""
    monkeypatch.setattr(agreement, "_all_gather", _table([[0, 0], [0, 0]]))
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    with pytest.raises(TypeError, match="causal='yes' must be a bool"):
        striped_sp.ring_attention(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="cu_seqlens=.* must start at 0"):
        striped_sp.ring_attention(q, k, v, cu_seqlens=[1, 8])
