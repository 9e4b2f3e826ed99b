"""calibrate_cost_model: measured on the group's first rank, the same model adopted on every rank,
refused once a batch was placed (an earlier batch would have used another model)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_helper import run_cases

pytestmark = pytest.mark.dist


def _case_every_rank_adopts_rank_0s_model():
    from striped_sp import calibrate_cost_model
    from striped_sp.plan import cost, search

    search._placed_runs.cache_clear()
    try:
        model = calibrate_cost_model()
        assert cost.default_model() is model and model.measured and model.name.endswith("@cpu")
        mine = torch.tensor([model.ns_per_entry, model.causal_waste, model.call_ns], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        assert all(torch.equal(t, every[0]) for t in every), every  # bit-identical on every rank
        # the auto choices then agree too, whatever each rank would have measured for itself
        bounds = (0, 100, 130, 600, 610, 1024)
        choice = search.search(bounds, 2, None)[0]
        theirs = [None] * dist.get_world_size()
        dist.all_gather_object(theirs, (choice.stripe_size, choice.whole_max))
        assert len(set(theirs)) == 1, theirs
        search.placed_runs(bounds, 2, "auto", "auto")
        with pytest.raises(ValueError, match="before the first batch"):
            calibrate_cost_model()
    finally:
        cost.use_model(None)
        search._placed_runs.cache_clear()


def test_calibration_is_one_model_for_the_group():
    results = run_cases(2, [("adopt", _case_every_rank_adopts_rank_0s_model, ())])
    assert results["adopt"] is None, results["adopt"]


def test_use_model_refuses_what_is_not_a_model():
    from striped_sp.plan.cost import use_model

    with pytest.raises(ValueError, match="expected a CostModel"):
        use_model("cpu")
