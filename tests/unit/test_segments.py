"""The varlen call format's arithmetic (striped_sp.kernels.segments) against brute force."""

import pytest
import torch

from seeds import seed_for
from striped_sp.kernels.segments import INF, Segments, _band_entries

pytestmark = pytest.mark.unit


def test_band_entries_closed_form_counts_every_visible_pair():
    gen = torch.Generator().manual_seed(seed_for("band-entries"))
    rows = []
    for _ in range(600):
        lq, lk = torch.randint(1, 12, (2,), generator=gen).tolist()
        lo, hi = torch.randint(-15, 15, (2,), generator=gen).tolist()
        lo = -INF if torch.rand(1, generator=gen) < 0.2 else lo
        hi = INF if torch.rand(1, generator=gen) < 0.2 else hi
        rows.append((lq, lk, lo, hi, sum(1 for x in range(lq) for y in range(lk) if lo <= y - x <= hi)))
    lq, lk, lo, hi, want = (torch.tensor(c) for c in zip(*rows))
    assert torch.equal(_band_entries(lq, lk, lo, hi), want)


def test_entries_equal_the_dense_mask():
    cu = torch.tensor([0, 5, 9, 16])
    segs = Segments(cu, torch.tensor([0, 7, 9, 20]), torch.tensor([-1, 2, 0]), torch.tensor([0, -1, 3]))
    assert segs.entries() == int(segs.dense_mask().sum())
