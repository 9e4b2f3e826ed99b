"""plan/search.py: the per-batch choice of stripe size and placement by predicted ring time."""

from __future__ import annotations

import pytest

from striped_sp.bench.docs import workload
from striped_sp.plan.cost import COST_MODELS
from striped_sp.plan.search import predict_ring, search

WEB600 = tuple(workload("striped", 2, 4096, "lognormal:median=600,sigma=1.2", None).mask.bounds)


def test_a_fixed_stripe_size_with_auto_placement_is_always_predicted():
    """Stripes longer than some documents are outside the search's own candidates, never refused
    when the user fixed them (a bench run once failed on striped:stripe=128,place=auto)."""
    chosen, tried = search(WEB600, 2, "cpu", 128, "auto")
    assert chosen.stripe_size == 128 and all(p.stripe_size == 128 for p in tried) and len(tried) > 3
    _, every = search(WEB600, 2, "cpu")
    assert not any(p.stripe_size == 128 and p.whole_max == 0 for p in every)  # too coarse for 600-token documents


def test_whole_documents_skip_the_ring_and_its_transfer():
    bounds = tuple(range(0, 2 * 4096 + 1, 512))  # 16 documents of 512 tokens: 8 whole per rank
    whole = predict_ring(bounds, 2, 1, 4096, "cpu")
    split = predict_ring(bounds, 2, 1, 0, "cpu")
    assert (whole.steps, whole.carried_rows) == (1, (0,)) and split.steps == 2 and split.carried_rows[0] == 4096
    assert whole.compute_ms[0] == pytest.approx(sum(whole.compute_ms)) and len(whole.compute_ms) == 1


def test_the_transfer_hides_behind_compute_only_where_the_device_overlaps_them():
    import dataclasses

    gpu, cpu = COST_MODELS["flash_attn"], COST_MODELS["cpu"]
    assert gpu.overlaps_transfer and not cpu.overlaps_transfer
    hidden = gpu.ring_ns([1e9, 1e9], [10, 0])
    exposed = gpu.ring_ns([1.0, 1.0], [10_000, 0])
    assert hidden == pytest.approx(2 * 1e9 * (1 + gpu.backward_factor) + 2 * gpu.step_ns)
    assert exposed == pytest.approx(10_000 * gpu.transfer_ns_per_row * 3 + 1.0 * (1 + gpu.backward_factor)
                                    + 2 * gpu.step_ns)
    serial = dataclasses.replace(gpu, overlaps_transfer=False)
    assert serial.ring_ns([1e9, 1e9], [10, 0]) == pytest.approx(hidden + 30 * gpu.transfer_ns_per_row)
    # on the CPU a row of documents that all stay whole saves the whole transfer (measured: 16
    # documents of 512 tokens at N=2, all whole 551 ms against 723 ms split, docs/tuning.md)
    assert search(tuple(range(0, 8193, 512)), 2, "cpu")[0].steps == 1


def test_every_rank_gets_the_same_choice_from_the_same_row():
    a = search(list(WEB600), 2, "cpu")[0]
    b = search(tuple(int(x) for x in WEB600), 2, "cpu")[0]
    assert (a.stripe_size, a.whole_max) == (b.stripe_size, b.whole_max)
