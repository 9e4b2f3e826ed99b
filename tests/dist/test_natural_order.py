"""The whole sequence in natural order for a non-attention mixer (engine/natural_order.py), on 2
and 3 gloo ranks, against the full tensor itself: every layout, dense and packed rows.

Forward: every rank's gathered tensor is the full row.  Backward: each rank sends its own
gradient for the whole row (different per rank); a rank's local tokens must get the sum over
ranks of those gradients at their positions.  The NCCL branch (a reduce-scatter) runs here with
``reduce_scatter_tensor`` emulated by its documented rule (input: world_size contiguous blocks;
output: the sum of block ``rank`` over ranks)."""

import pytest
import torch
import torch.distributed as dist

from dist_helper import check_case, run_cases

S = 24
BOUNDS = (0, 5, 6, 17, 24)


def _full(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, S, 3, generator=g, dtype=dtype)


def _case(layout, bounds, nccl=False):
    from striped_sp import positions
    from striped_sp.engine import natural_order as no

    n, rank = dist.get_world_size(), dist.get_rank()
    if nccl:
        def reduce_scatter_tensor(out, inp, group=None):
            total = inp.clone()
            dist.all_reduce(total, group=group)
            out.copy_(total.reshape(n, *out.shape)[dist.get_rank(group)])

        real = (dist.get_backend, dist.reduce_scatter_tensor)
        dist.get_backend, dist.reduce_scatter_tensor = (lambda group=None: "nccl"), reduce_scatter_tensor
    try:
        full = _full(0)
        mine = positions(S, n, rank, layout, None if bounds is None else list(bounds))
        x = full.index_select(1, mine).requires_grad_(True)
        order = no.natural_order(S, n, rank, layout, bounds)
        gathered = no.gather_natural(x, None, order)
        assert torch.equal(gathered, full)
        assert torch.equal(no.take_local(gathered, order), x.detach())
        grads = [_full(10 + r) for r in range(n)]
        gathered.backward(grads[rank])
        expected = sum(grads).index_select(1, mine)
        assert torch.allclose(x.grad, expected, rtol=0, atol=1e-12), (x.grad - expected).abs().max()
    finally:
        if nccl:
            dist.get_backend, dist.reduce_scatter_tensor = real


def _case_host_work_per_layer():
    """After a batch's first mixer layer, each layer's gather costs two collectives (an all-gather
    forward, gloo's all-reduce backward), no data-dependent op (no host sync on a GPU), and builds
    no permutation: the order is built once per row shape."""
    from striped_sp.bench.overhead import HostWork
    from striped_sp.engine import natural_order as no

    n, rank = dist.get_world_size(), dist.get_rank()
    no.natural_order.cache_clear()
    weight = torch.randn(S, 3, dtype=torch.float64)

    def layer(x):
        order = no.natural_order(S, n, rank, "striped", BOUNDS)
        y = no.gather_natural(x, None, order).cumsum(1) * weight  # a mixer that needs the whole row
        return no.take_local(y, order)

    x = _full(0).index_select(1, torch.arange(rank, S, n)).requires_grad_(True)
    layer(x).sum().backward()  # the batch's first layer
    with HostWork() as later:
        out = x
        for _ in range(3):
            out = layer(out)
        out.sum().backward()
    assert later.comm == 2 * 3, later.ops
    assert later.data_dependent == 0 and later.copies == 0, (later.data_dependent, later.copies)
    assert no.natural_order.cache_info().misses == 1, no.natural_order.cache_info()


CASES = [(f"{lay}_{'packed' if b else 'dense'}", _case, (lay, b))
         for lay in ("striped", "striped:stripe=2", "zigzag", "contiguous") for b in (None, BOUNDS)
         if not (lay == "zigzag" and b)]
CASES += [("host_work_per_layer", _case_host_work_per_layer, ())]
CASES += [("striped_packed_nccl_branch", _case, ("striped", BOUNDS, True)),
          ("zigzag_dense_nccl_branch", _case, ("zigzag", None, True))]


@pytest.fixture(scope="module")
def results2():
    return run_cases(2, CASES)


@pytest.fixture(scope="module")
def results3():
    return run_cases(3, [c for c in CASES if c[2] and c[2][0] != "zigzag"])


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_natural_order_2_ranks(results2, name):
    check_case(results2, name)


@pytest.mark.parametrize("name", [c[0] for c in CASES if c[2] and c[2][0] != "zigzag"])
def test_natural_order_3_ranks(results3, name):
    check_case(results3, name)
