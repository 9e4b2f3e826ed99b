"""Megatron's THD slicing builds the batch's plan ahead: the one the core attention of every layer
then finds in the plan cache (no processes: the slicing takes cp_size / cp_rank)."""

import pytest
import torch

pytestmark = pytest.mark.integration

DOCS = [13, 3, 9, 1, 6, 8]  # 40 tokens, two documents shorter than CP=4


@pytest.mark.parametrize("algo,padded", [("striped", False), ("zigzag", True), ("striped:stripe=doc", False)])
def test_thd_slicing_builds_the_plan_the_layers_use(algo, padded):
    pytest.importorskip("megatron.core")
    import striped_sp.megatron as sm
    from striped_sp import RingRequest
    from striped_sp.engine.plans import PLANS, host_plan_for
    from striped_sp.megatron import packed
    from striped_sp.megatron.arguments import layout_of

    cp, rank = 4, 2
    unit = 2 * cp if padded else 1
    slots = [-(-n // unit) * unit for n in DOCS]
    total = sum(slots)
    bounds = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
    padded_bounds = torch.tensor([0, *torch.tensor(slots).cumsum(0).tolist()], dtype=torch.int32) if padded else None
    batch = {"tokens": torch.arange(total).view(1, -1), "position_ids": torch.zeros(1, total, dtype=torch.int64)}
    PLANS.clear()
    local, params = sm.get_thd_batch_on_this_cp_rank(batch, bounds, padded_bounds, max(slots), cp_size=cp,
                                                     cp_rank=rank, algo=algo)
    assert PLANS.builds == 1  # this rank's host plan, built where the batch is made
    # what ContextParallelAttention asks for in every layer (its layout and the params' documents)
    layout = layout_of(algo)
    request = RingRequest(None, layout=layout).derive(cu_seqlens=packed.documents_of(params, total, layout))
    n_local = local["tokens"].size(1)
    host_plan_for(request.layout, request._mask(n_local, cp), True, cp, rank, n_local)
    assert PLANS.builds == 1  # found, not built again


def test_reset_mask_rows_flattened_once_per_batch():
    """The [b, s] reset-mask path: every layer flattens the batch's rows into one packed row; the
    documents are looped over once per batch, later layers find the result (and it is exact)."""
    from striped_sp.megatron import packed

    rows = ((0, 3, 8), (0, 8), (0, 5, 6, 8))
    want = (0, 3, 8, 16, 21, 22, 24)
    packed.flatten_rows.cache_clear()
    assert packed.flatten_rows(rows, 3) == want
    assert packed.flatten_rows(((0, 3, 8),), 2) == (0, 3, 8, 11, 16)  # one row's documents for every row
    for _ in range(4):  # the next layers of the batch
        assert packed.flatten_rows(tuple(tuple(r) for r in rows), 3) == want
    assert packed.flatten_rows.cache_info().misses == 2, "the rows were flattened again for another layer"
