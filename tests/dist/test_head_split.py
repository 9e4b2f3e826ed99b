"""The sequence split <-> head split all-to-all of the split mixers (engine/head_split.py), on 2 and 4
gloo ranks, against the full tensor itself: every layout, dense and packed rows, forward and backward.

Forward: ``tokens_to_heads`` gives rank ``r`` the channels ``r`` of every token of the row in natural
order (the full tensor sliced, nothing of ours); ``heads_to_tokens`` is its inverse.  Backward: each
rank's loss weighs its own slice by a weight known to every rank, so the gradient of a local token's
channel chunk ``j`` is the weight of rank ``j``'s loss at that token and chunk.  The local tokens of
the dense layouts are written out here (``r, r + N, ...``; chunks ``r`` and ``2N - 1 - r``; one
contiguous chunk); the packed row's are ``striped_sp.positions``' (the public sharding rule)."""

import pytest
import torch
import torch.distributed as dist

from dist_helper import check_case, run_cases

S, B, C = 32, 2, 3
BOUNDS = (0, 5, 6, 19, 32)


def _full(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, n, C, generator=g, dtype=torch.float64)


def _mine(layout, n, rank, bounds):
    if bounds is not None or layout == "striped":  # the default's order on one document is the cost model's
        from striped_sp import positions

        return positions(S, n, rank, layout, None if bounds is None else list(bounds))
    if layout == "contiguous":
        return torch.arange(rank * S // n, (rank + 1) * S // n)
    chunk = S // (2 * n)  # zigzag
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * n - 1 - rank) * chunk, (2 * n - rank) * chunk)])


def _case(layout, bounds):
    from striped_sp.engine.head_split import heads_to_tokens, tokens_to_heads
    from striped_sp.engine.natural_order import natural_order

    n, rank = dist.get_world_size(), dist.get_rank()
    full, weight = _full(0, n), _full(1, n)
    mine = _mine(layout, n, rank, bounds)
    order = natural_order(S, n, rank, layout, bounds)
    x = full.index_select(1, mine).requires_grad_(True)
    heads = tokens_to_heads(x, None, order)
    assert torch.equal(heads, full[:, :, rank]), (heads - full[:, :, rank]).abs().max()
    (heads * weight[:, :, rank]).sum().backward()
    assert torch.equal(x.grad, weight.index_select(1, mine))
    y = full[:, :, rank].clone().requires_grad_(True)
    back = heads_to_tokens(y, None, order)
    assert torch.equal(back, full.index_select(1, mine))
    (back * weight.index_select(1, mine)).sum().backward()
    assert torch.equal(y.grad, weight[:, :, rank])


def _case_refusals():
    from striped_sp.engine.head_split import heads_to_tokens, tokens_to_heads
    from striped_sp.engine.natural_order import natural_order

    n, rank = dist.get_world_size(), dist.get_rank()
    order = natural_order(S, n, rank, "striped", None)
    with pytest.raises(ValueError, match=r"local tokens x ranks: .* does not match the row's order \(32 tokens"):
        tokens_to_heads(torch.zeros(B, S // n + 1, n, C), None, order)
    with pytest.raises(ValueError, match="the rank dimension"):
        tokens_to_heads(torch.zeros(B, S // n, n + 1, C), None, order)
    with pytest.raises(ValueError, match=r"must be \[batch, tokens, channels\]"):
        heads_to_tokens(torch.zeros(B, S, n, C), None, order)


LAYOUTS = ("striped", "zigzag", "contiguous")
CASES = [(f"{lay}_dense", _case, (lay, None)) for lay in LAYOUTS]
CASES += [("striped_packed", _case, ("striped", BOUNDS)), ("contiguous_packed", _case, ("contiguous", BOUNDS)),
          ("refusals", _case_refusals, ())]


@pytest.fixture(scope="module", params=[4])
def results(request):
    return request.param, run_cases(request.param, CASES, timeout_s=300)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_head_split(results, name):
    check_case(results[1], name)
