"""The varlen call format's arithmetic (striped_sp.kernels.segments) against brute force."""

import pytest
import torch

from seeds import seed_for
from striped_sp.kernels.segments import INF, Segments, _band_entries

pytestmark = pytest.mark.unit


def test_band_entries_closed_form_counts_every_visible_pair():
    gen = torch.Generator().manual_seed(seed_for("band-entries"))
    rows = []
    for _ in range(600):
        lq, lk = torch.randint(1, 12, (2,), generator=gen).tolist()
        lo, hi = torch.randint(-15, 15, (2,), generator=gen).tolist()
        lo = -INF if torch.rand(1, generator=gen) < 0.2 else lo
        hi = INF if torch.rand(1, generator=gen) < 0.2 else hi
        rows.append((lq, lk, lo, hi, sum(1 for x in range(lq) for y in range(lk) if lo <= y - x <= hi)))
    lq, lk, lo, hi, want = (torch.tensor(c) for c in zip(*rows))
    assert torch.equal(_band_entries(lq, lk, lo, hi), want)


def test_entries_equal_the_dense_mask():
    cu = torch.tensor([0, 5, 9, 16])
    segs = Segments(cu, torch.tensor([0, 7, 9, 20]), torch.tensor([-1, 2, 0]), torch.tensor([0, -1, 3]))
    assert segs.entries() == int(segs.dense_mask().sum())


def test_cost_models_by_kernel_and_device():
    from striped_sp.plan.cost import COST_MODELS, default_model, model_for_kernel, model_named

    assert model_for_kernel("torch", "cpu") is COST_MODELS["cpu"] and COST_MODELS["cpu"].measured
    assert model_for_kernel("flash_attn", "cuda") is COST_MODELS["flash_attn"] and not COST_MODELS["flash_attn"].measured
    assert default_model() is model_for_kernel("auto", "cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown cost model 'tpu'"):
        model_named("tpu")
    model = COST_MODELS["cpu"]
    rows, keys = torch.tensor([0, 3, 64, 300]), torch.tensor([5, 3, 128, 300])
    causal = torch.tensor([False, True, False, True])
    want = sum(model.call(r, k, c) for r, k, c in zip(rows.tolist(), keys.tolist(), causal.tolist()))
    assert abs(model.calls(rows, keys, causal) - want) < 1e-6 * want


def test_calibrated_model_is_measured_and_orders_calls_by_size():
    from striped_sp.kernels import KERNELS
    from striped_sp.plan.cost import calibrate

    model = calibrate(KERNELS["torch"], "cpu", sizes=(64, 256), reps=1)
    assert model.measured and model.ns_per_entry > 0
    assert model.call(256, 256, False) > model.call(64, 64, False)


def test_arena_places_every_tensor_with_one_copy():
    """The packing a device placement runs (one buffer, 8-byte aligned views), checked by value."""
    from striped_sp.kernels.varlen import Arena

    gen = torch.Generator().manual_seed(seed_for("arena"))
    tensors = [torch.randint(-2**40, 2**40, (13,), generator=gen), torch.randint(0, 9, (3, 5), generator=gen).int(),
               torch.rand(2, 1, 3, 7, generator=gen) > 0.5, torch.zeros(0, dtype=torch.int64),
               torch.randint(0, 100, (5,), generator=gen).int()]
    arena = Arena()
    slots = [arena.add(t) for t in tensors]
    arena.place("cpu", force=True)
    assert arena.copies == 1
    for slot, t in zip(slots, tensors):
        assert slot.t.dtype == t.dtype and torch.equal(slot.t, t)
        assert slot.t.numel() == 0 or slot.t.data_ptr() != t.data_ptr()  # a view of the one placed buffer
