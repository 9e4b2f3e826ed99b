"""plan/search.py: the rows a candidate's ring carries per step are the block less what the
*emptiest* rank keeps private (``local - min(private)``): every rank's block travels, so the one
with the fewest private rows sets the size of a step's transfer.

Bounds ``(0, 100, 130, 600, 610, 1024)`` on 2 ranks (512 tokens each; documents of 100, 30, 470,
10 and 414 tokens), by hand:

* stripes of 1 with documents up to 64 tokens whole: only the 10-token document stays whole, on one
  rank; the other rank keeps nothing private, so 512 rows travel (not 502);
* per-document stripes with documents up to 64 whole: the 30- and 10-token documents, one per rank
  (balanced): 512 - 10 = 502 rows (not 482);
* per-document stripes with documents up to 512 whole: 470 tokens on one rank, 414 + 30 + 10 = 454
  on the other: 512 - 454 = 58 rows (not 42).

The last step carries nothing home in the forward (0)."""

from __future__ import annotations

import pytest

from striped_sp.plan.search import predict_ring

BOUNDS = (0, 100, 130, 600, 610, 1024)


@pytest.mark.parametrize("stripe, whole_max, carried", [(1, 64, (512, 0)), ("doc", 64, (502, 0)),
                                                        ("doc", 512, (58, 0))])
def test_the_ring_carries_what_the_emptiest_rank_does_not_keep(stripe, whole_max, carried):
    for model in ("cpu", "flash_attn"):  # rows are arithmetic of the placement, whatever the model
        p = predict_ring(BOUNDS, 2, stripe, whole_max, model)
        assert p.steps == 2 and p.carried_rows == carried, (model, p)
