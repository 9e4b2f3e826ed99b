"""The plan cache's rules (engine/plans.py), each checked by what breaks without it:

* a compiled plan is keyed by the batch size (a masked plan's programs index the batch's rows): one
  windowed request at batch 1 and then at batch 2 in one process gets two plans, and both runs
  match float64;
* it is bounded and evicts the least recently used entry, not the newest (else every new plan is
  evicted at once and every layer plans again).

The ring runs on the in-process LocalRing (every rank of the ring in this process, on the engine's
own executor), against a float64 reference that does not run the engine."""

from __future__ import annotations

import pytest
import torch

from reference import reference_attention
from seeds import seed_for
from striped_sp.engine.autograd import forward_steps
from striped_sp.engine.plans import PLANS, PlanCache, plan_for
from striped_sp.engine.request import RingRequest
from striped_sp.engine.transport import LocalRing, run_local
from striped_sp.kernels import KERNELS
from striped_sp.plan.layouts import shard, unshard

pytestmark = pytest.mark.dist

N, PER_RANK, HEADS, DIM = 4, 12, 2, 8
WINDOW = (7, 0)


def _ring_forward(q, k, v, request):
    """Every rank's plan from the plan cache (as RingRequest asks for it) and the forward ring on a
    LocalRing; returns (full-sequence output, the plans)."""
    layout, n = request.layout, N
    mask = request._mask(PER_RANK, n)
    kernel = KERNELS["torch"]
    plans = [plan_for(layout, mask, True, n, r, PER_RANK, kernel=kernel, scale=DIM ** -0.5, dtype=q.dtype,
                      head_dim=DIM, batch=q.size(0), heads=q.size(2)) for r in range(n)]
    ring = LocalRing(n)
    parts = [[shard(t, n, r, layout=layout) for r in range(n)] for t in (q, k, v)]
    outs = run_local([forward_steps(parts[0][r], parts[1][r], parts[2][r], plans[r], ring.transports[r])
                      for r in range(n)])
    return unshard([o for o, _ in outs], layout=layout), plans


def test_a_windowed_request_at_batch_1_then_2_gets_two_plans_both_exact():
    PLANS.clear()
    request = RingRequest(None, layout="striped", window_size=WINDOW)
    gen = torch.Generator().manual_seed(seed_for("plan-cache-batch"))
    seq = N * PER_RANK
    runs = []
    for batch in (1, 2):
        q, k, v = (torch.randn(batch, seq, HEADS, DIM, generator=gen, dtype=torch.float64) for _ in range(3))
        out, plans = _ring_forward(q, k, v, request)
        ref = reference_attention(q, k, v, True, DIM ** -0.5, None, WINDOW)
        err = (out - ref).abs().max().item()
        assert err < 1e-10, f"batch {batch}: max error {err:.3g} against float64"
        runs.append(plans)
    assert all(a is not b for a, b in zip(*runs)), "batch 2 reused batch 1's compiled plans"
    # and each batch size's plan is the cache's own: asked again, nothing is built
    builds = PLANS.builds
    _ring_forward(*(torch.zeros(2, seq, HEADS, DIM, dtype=torch.float64) for _ in range(3)), request)
    assert PLANS.builds == builds


def test_the_cache_evicts_its_least_recently_used_plan():
    cache = PlanCache(2)
    built = []

    def get(key):
        return cache.get(key, lambda: built.append(key) or f"plan {key}")

    for key in (1, 2, 1, 3):  # 1 is used again after 2: 2 is the oldest when 3 arrives
        assert get(key) == f"plan {key}"
    assert built == [1, 2, 3]
    assert get(3) == "plan 3" and get(1) == "plan 1" and built == [1, 2, 3], built  # both still cached
    assert get(2) == "plan 2" and built == [1, 2, 3, 2], built  # 2 was evicted, built again
    assert cache.builds == 4
