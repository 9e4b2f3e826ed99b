"""One parametrized test over a module's cases, every case run in one spawn of ``world_size`` gloo ranks
(:func:`dist_helper.run_cases`, started at the first case the session runs): ``test_x = cases_test(2, CASES)``."""

from __future__ import annotations

import pytest

from dist_helper import check_case, run_cases


def cases_test(world_size: int, cases: list, **run_kwargs):
    """A test function parametrized by the names of ``cases`` (``(name, fn, args)``); each checks its
    case's report (:func:`dist_helper.check_case`)."""
    results = {}

    @pytest.mark.parametrize("name", [c[0] for c in cases])
    def test(name):
        if "all" not in results:
            results["all"] = run_cases(world_size, cases, **run_kwargs)
        check_case(results["all"], name)

    return test
