"""calibrate_cost_model: measured on the group's first rank (by its *global* rank), the same model
adopted on every rank, refused once a batch was placed (an earlier batch would have used another
model).  Agreement alone is not enough: every rank adopting an untimed all-zero model agrees too,
so each case also checks that the model is a timing (positive numbers) and which rank timed it,
on the default group and on subgroups whose first rank is not global rank 0."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_helper import run_cases

pytestmark = pytest.mark.dist


class _CountTimings:
    """Counts this rank's calls of the timing itself (``plan.cost.calibrate``, as calibration.py
    calls it) while inside the ``with``."""

    def __enter__(self):
        from striped_sp.engine import calibration

        self._module, self._real, self.count = calibration, calibration.calibrate, 0

        def counted(*args, **kwargs):
            self.count += 1
            return self._real(*args, **kwargs)

        calibration.calibrate = counted
        return self

    def __exit__(self, *exc):
        self._module.calibrate = self._real


def _check_timed(model, timed: int, want: int):
    assert timed == want, f"rank {dist.get_rank()} timed the kernel {timed} times, expected {want}"
    # an untimed model is all zeros; a timing's slope is at least 1e-6 (its call_ns may fit to 0 under load)
    assert model.ns_per_entry > 0, f"rank {dist.get_rank()} adopted an untimed model: {model}"


def _case_every_rank_adopts_rank_0s_model():
    from striped_sp import calibrate_cost_model
    from striped_sp.plan import cost, search

    search._placed_runs.cache_clear()
    try:
        with _CountTimings() as timings:
            model = calibrate_cost_model()
        assert cost.default_model() is model and model.measured and model.name.endswith("@cpu")
        _check_timed(model, timings.count, 1 if dist.get_rank() == 0 else 0)
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


def _case_a_subgroup_times_on_its_own_first_rank():
    """Each rank calibrates on a group of its own (``[0]`` and ``[1]``): the group's first rank is
    the rank itself, rank 1 included, whose rank in its group (0) is not its global rank (1)."""
    from striped_sp import calibrate_cost_model
    from striped_sp.plan import cost, search

    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: every rank, every group
    search._placed_runs.cache_clear()
    try:
        with _CountTimings() as timings:
            model = calibrate_cost_model(group=groups[dist.get_rank()])
        assert cost.default_model() is model and model.measured
        _check_timed(model, timings.count, 1)
    finally:
        cost.use_model(None)
        search._placed_runs.cache_clear()


def test_a_subgroups_first_rank_is_found_by_its_global_rank(monkeypatch):
    """Without processes (fast, before the ranks start): this process as each member of the group of
    global ranks [3, 5].  Global rank 3, the group's rank 0, times; global rank 5 adopts what it
    broadcasts.  Asking for the rank in the group instead (0 and 1, never 3) times nowhere."""
    from striped_sp import calibrate_cost_model
    from striped_sp.plan import cost, search

    members, group, sent = [3, 5], object(), {}

    def broadcast(tensor, src, group=None):
        if "values" in sent:  # a later member receives the first's numbers
            tensor.copy_(sent["values"])
        else:
            sent["values"] = tensor.clone()
        sent.setdefault("src", set()).add(src)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_global_rank", lambda g, r: members[r])
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "gloo")
    monkeypatch.setattr(dist, "broadcast", broadcast)
    models = []
    try:
        for me in members:
            monkeypatch.setattr(dist, "get_rank", lambda g=None, me=me: me if g is None else members.index(me))
            search._placed_runs.cache_clear()
            with _CountTimings() as timings:
                models.append(calibrate_cost_model(group=group))
            assert timings.count == (1 if me == 3 else 0), (me, timings.count)
            assert models[-1].ns_per_entry > 0, (me, models[-1])
    finally:
        cost.use_model(None)
        search._placed_runs.cache_clear()
    assert sent["src"] == {3} and models[0] == models[1]


def test_calibration_is_one_model_for_the_group():
    results = run_cases(2, [("adopt", _case_every_rank_adopts_rank_0s_model, ()),
                            ("subgroup", _case_a_subgroup_times_on_its_own_first_rank, ())])
    assert results["adopt"] is None, results["adopt"]
    assert results["subgroup"] is None, results["subgroup"]


def test_use_model_refuses_what_is_not_a_model():
    from striped_sp.plan.cost import use_model

    with pytest.raises(ValueError, match="expected a CostModel"):
        use_model("cpu")
