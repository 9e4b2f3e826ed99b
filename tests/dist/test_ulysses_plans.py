"""Hierarchical CP's plans (plan/grouped.py) on the in-process executor: kernel calls per Ulysses
member (pure Ulysses: one causal call over the row in natural order; an outer ring: the members'
block pairs on the dense plans), exactness against float64 up to N = 64, and the dry run of the
CUDA path (the permutation adds no copy and no synchronisation per layer)."""

from __future__ import annotations

import pytest
import torch

from local_exact import check_simulation_exact
from seeds import seed_for
from striped_sp.bench.overhead import HostWork
from striped_sp.engine import local
from striped_sp.engine.request import RingRequest
from striped_sp.engine.step import head_splits
from striped_sp.kernels import KERNELS, TorchKernel
from striped_sp.plan.grouped import GroupedLayout
from striped_sp.plan.layouts import get_layout, positions

pytestmark = pytest.mark.dist


def _kernel_calls(n, seq, heads, kv_heads, d, **args) -> tuple[float, float, bool]:
    """``(forward, backward)`` CPU kernel calls per Ulysses member (per rank) of one layer, on average,
    and whether every member ran a dense plan."""
    gen = torch.Generator().manual_seed(seed_for(f"calls-{n}-{args}"))
    q, do = (torch.randn(1, seq, heads, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, seq, kv_heads, d, generator=gen) for _ in range(2))
    with HostWork() as fwd:
        local.simulate(q, k, v, n, backend="torch", **args)
    with HostWork() as both:
        sim = local.simulate(q, k, v, n, do, backend="torch", **args)
    forward = fwd.kernels["forward"]
    return forward / n, (both.kernels["forward"] - forward) / n, not any(p.masked for ps in sim.plans for p in ps)


# the table (N = 2, 2048 tokens, 4 heads x 32) and the outer ring at N = 4: a dense call's
# backward runs in head halves (head_splits), so it counts twice
HALVES = len(head_splits(2, 2))
CALLS = [  # (N, request arguments, forward calls per member, backward calls per member)
    (2, dict(layout="striped", ulysses_size=2), 1, HALVES),  # was 28 and 28 (masked grouped plan)
    (2, dict(layout="zigzag", ulysses_size=2), 1, HALVES),
    (2, dict(layout="contiguous", ulysses_size=2), 1, HALVES),
    (4, dict(layout="striped", ulysses_size=4), 1, HALVES),
    (4, dict(layout="striped", ulysses_size=2), 2 * 4, 2 * 4 * HALVES),  # 2 steps of u*u pairs (was 12 a step)
    (4, dict(layout="zigzag", ulysses_size=2), 2 * 4, 2 * 4 * HALVES),
    (4, dict(layout="contiguous", ulysses_size=2), 1.5, 1.5 * HALVES),  # a slice per group: the ring of 2
]


@pytest.mark.parametrize("n,args,forward,backward", CALLS,
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) if isinstance(c, dict) else str(c))
def test_kernel_calls_per_member(n, args, forward, backward):
    """Dense rows: pure Ulysses runs one causal call, an outer ring at most u * u calls per step."""
    heads = 2 * args["ulysses_size"]  # two heads per member
    assert _kernel_calls(n, 64 * n, heads, heads, 32, **args) == (forward, backward, True)


def _fields(segments) -> list:
    return [t.tolist() for t in (segments.cu_q, segments.cu_k, segments.wl, segments.wr, segments.q_start,
                                 segments.k_start)]


def test_pure_ulysses_on_documents_runs_natural_order():
    """Packed rows under pure Ulysses: the plan of one contiguous rank holding the row in natural
    order, with the documents' bounds as given (no document cut by the members' order)."""
    for layout, bounds in (("striped", [0, 100, 101, 333, 512]), ("zigzag", [0, 128, 384, 512]),
                           ("striped:stripe=doc", [0, 100, 101, 333, 512]), ("striped:place=auto", [0, 9, 40, 512])):
        plan, one = (local.local_plans(RingRequest(None, layout=lay, cu_seqlens=bounds, ulysses_size=u), 1, 512,
                                       device="cpu", dtype=torch.float32, head_dim=32, scale=0.2)[0]
                     for lay, u in ((layout, 4), ("contiguous", 1)))
        assert plan.steps == 1 and plan.order is not None and plan.shared is None
        assert [_fields(c.segments) for c in plan.calls[0]] == [_fields(c.segments) for c in one.calls[0]], layout
        assert plan.launches(0) == one.launches(0), layout


@pytest.mark.parametrize("base", ["striped", "zigzag", "striped:stripe=doc", "striped:place=auto"])
def test_run_order_is_the_natural_order(base):
    """A ring of one: the gathered rows (member after member) taken in run_order are the row."""
    n, seq = 4, 96
    cu = [0, 24, 40, 72, 96] if base == "zigzag" else [0, 5, 30, 31, 96]
    lay = GroupedLayout(get_layout(base), n)
    gathered = torch.cat([positions(seq, n, r, base, cu_seqlens=cu) for r in range(n)])
    order = lay.run_order(seq, 1, 0, cu)
    assert torch.equal(gathered[order], torch.arange(seq))
    assert GroupedLayout(get_layout("contiguous"), n).run_order(seq, 1, 0, cu) is None  # nothing to permute
    assert lay.run_order(seq, 2, 0, cu) is None  # an outer ring runs the gathered order


EXACT = [  # (N, tokens per rank, request arguments; "docs" = random documents), against float64
    (16, 6, dict(layout="striped", ulysses_size=16)),
    (64, 2, dict(layout="zigzag", ulysses_size=64)),
    (32, 2, dict(layout="striped", ulysses_size=8)),
    (16, 8, dict(layout="striped", ulysses_size=4)),
    (32, 4, dict(layout="contiguous", ulysses_size=8)),
    (16, 8, dict(layout="zigzag", ulysses_size=2)),
    (16, 8, dict(layout="striped", ulysses_size=16, docs=True, window_size=(11, 0))),
    (32, 4, dict(layout="zigzag", ulysses_size=32, docs="padded")),
    (32, 4, dict(layout="striped:stripe=doc", ulysses_size=32, docs=True)),
    (16, 8, dict(layout="striped:place=auto", ulysses_size=16, docs=True)),
    (32, 4, dict(layout="striped", ulysses_size=4, window_size=(9, 0))),
    (16, 8, dict(layout="striped", ulysses_size=4, causal=False)),
    (16, 8, dict(layout="zigzag", ulysses_size=16, causal=False)),
]


@pytest.mark.parametrize("n,per_rank,args", EXACT, ids=lambda c: str(c) if not isinstance(c, dict) else
                         ",".join(f"{k}={v}" for k, v in c.items()))
def test_hierarchical_is_exact_at_large_n(n, per_rank, args):
    u = args["ulysses_size"]  # kv heads 2: replicated when u > 2
    check_simulation_exact(n, per_rank, args, f"ulysses-{n}-{args}", heads=max(u, 4), kv_heads=2, head_dim=4)


@pytest.fixture
def cuda_branch_on_meta(monkeypatch):
    """TorchKernel's CUDA branch for meta tensors: the flash op (bf16 on an sm80+ GPU)."""
    monkeypatch.setattr(TorchKernel, "_cuda_op_for", lambda self, device, dtype, head_dim=None: "flash")
    return KERNELS["torch"]


@pytest.mark.parametrize("args", [
    dict(layout="striped", ulysses_size=8),
    dict(layout="striped", ulysses_size=8, cu_seqlens=[0, 700, 701, 2500, 4096]),
    dict(layout="zigzag", ulysses_size=2),
], ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
def test_dry_run_of_the_cuda_path(cuda_branch_on_meta, args):
    """The permutation's indices reach the device with the plan (one copy per member and batch, none
    for a plan without them), and a later layer copies nothing and synchronises nowhere."""
    n, seq, h, d = 8, 4096, 8, 64
    q, do = (torch.empty(1, seq, h, d, dtype=torch.bfloat16, device="meta") for _ in range(2))
    k, v = (torch.empty(1, seq, 8, d, dtype=torch.bfloat16, device="meta") for _ in range(2))
    with HostWork() as first:
        sim = local.simulate(q, k, v, n, do, kernel=cuda_branch_on_meta, **args)
    plans = [p for ring in sim.plans for p in ring]
    placed = sum(p.masked or p.order is not None for p in plans)
    assert first.copies == placed and not first.syncs, (first.copies, placed, first.syncs)
    with HostWork() as later:  # the batch's next layer: its plans as built
        local.simulate(q, k, v, n, do, kernel=cuda_branch_on_meta, plans=sim.plans, **args)
    assert later.copies == 0 and not later.syncs, (later.copies, later.syncs)
    if args["ulysses_size"] == n:
        assert all(p.order is not None and p.order.device.type == "meta" for p in plans)
        assert all(sum(p.launches(t) for t in range(p.steps)) == 1 for p in plans)
        if "cu_seqlens" not in args:  # one causal call forward, its backward in head halves, per member
            assert later.kernels["forward"] == n * (1 + len(head_splits(h // n, 8 // n))), later.kernels
