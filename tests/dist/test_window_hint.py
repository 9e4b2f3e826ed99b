"""The striped window hint (``"striped:window=W,global_every=K"``, issue 36): the default search on
packed rows, and on a row of one document the placement the cost model predicts fastest for the
hint's layers (issue 57: zigzag's order, stripes of 1 or larger stripes; plan/window_choice.py), for
every layer of the model: window layers skip the ring steps past the window, global layers run the
masked plans of the same stripes (zigzag's dense plans for zigzag's order).

References: float64 attention on the full row (tests/support/reference.py) and positions written out
by hand, never the module under test at CP = 1."""

from __future__ import annotations

import pytest
import torch

from local_exact import check_simulation_exact
import striped_sp
from striped_sp.engine.request import RingRequest
from striped_sp.plan.layouts import LAYOUTS, get_layout
from striped_sp.plan.masks import make_mask

pytestmark = pytest.mark.dist


def _stripes_by_hand(seq_len: int, n: int, rank: int, stripe: int) -> list[int]:
    """Rank ``rank``'s positions under stripes of ``stripe`` dealt round-robin."""
    return [p for p in range(seq_len) if (p // stripe) % n == rank]


def test_key_round_trip_and_defaults():
    lay = get_layout("striped:window=4096")
    assert lay.key == "striped:window=4096" and lay.auto and not lay.default and lay.window == 4096
    assert get_layout(lay.key).key == lay.key
    mixed = get_layout("striped:window=4096,global_every=6")
    assert (mixed.window, mixed.global_every, mixed.key) == (4096, 6, "striped:window=4096,global_every=6")
    assert get_layout("striped:stripe=auto,window=4096").key == "striped:window=4096"  # the same search
    assert get_layout("striped:stripe=auto,place=auto,window=4096").key == "striped:window=4096"
    assert get_layout("striped") is LAYOUTS["striped"] and LAYOUTS["striped"].window is None
    assert not lay.dense_plans and LAYOUTS["striped"].dense_plans


@pytest.mark.parametrize("text, words", [
    ("striped:window=0", "window=0 must be a positive int"),
    ("striped:window=-8", "window=-8 must be a positive int"),
    ("striped:window=big", "window='big' must be a positive int"),
    ("striped:global_every=6", "global_every=6 needs window=W"),
    ("striped:window=4096,global_every=0", "global_every=0 must be a positive int"),
    ("striped:stripe=128,window=4096", "window=4096 applies to stripe=auto.*stripe_size=128 pins"),
    ("striped:stripe=doc,window=4096", "window=4096 applies to stripe=auto"),
    ("striped:place=split,window=4096", "doc_placement='split' without a stripe size keeps stripes of 1"),
    ("striped:place=auto,window=4096", "doc_placement='auto' without a stripe size keeps stripes of 1"),
    ("zigzag:window=4096", "only 'striped' takes"),
])
def test_bad_hints_are_named(text, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        get_layout(text)


def test_bool_window_is_refused():
    from striped_sp.plan.layouts import Striped

    with pytest.raises(ValueError, match="window=True must be a positive int"):
        Striped(window=True)


def _zigzag_by_hand(seq_len: int, n: int, rank: int) -> list[int]:
    """Rank ``rank``'s positions under zigzag's order: chunks ``rank`` and ``2N-1-rank`` of ``S / 2N``."""
    c = seq_len // (2 * n)
    return [p for p in range(seq_len) if p // c in (rank, 2 * n - 1 - rank)]


# the CPU cost model's choices (plan/window_choice.py; tests/dist/test_window_choice.py checks that a
# choice is the fastest prediction): every layer windowed, stripes up to S / N, which skip the ring
# steps past the window; global layers pull the choice to zigzag's order
@pytest.mark.parametrize("hint, seq_len, n, stripe", [
    ("window=512", 4096, 4, 1024),  # S / N: contiguous chunks, two ring steps
    ("window=2048", 4096, 4, 256),  # a window wider than S / N
    ("window=100", 4096, 4, 128),
    ("window=1024", 2 * 192, 2, "doc"),  # a short row: zigzag's order
    ("window=512,global_every=2", 4096, 4, "doc"),  # every other layer global
    ("window=8,global_every=2", 64, 2, 1),
])
def test_one_document_rows_run_the_cost_models_placement(hint, seq_len, n, stripe):
    lay = get_layout(f"striped:{hint}")
    assert lay.row_stripe(seq_len, n) == stripe
    for r in (0, n - 1):
        want = _zigzag_by_hand(seq_len, n, r) if stripe == "doc" else _stripes_by_hand(seq_len, n, r, stripe)
        assert striped_sp.positions(seq_len, n, r, lay.key).tolist() == want
    assert lay.dense_row(seq_len, n) == (stripe in (1, "doc"))
    mask = make_mask(seq_len, n, lay, window_size=(lay.window - 1, 0))
    assert lay.window_block(n, seq_len // n, mask) == (None if stripe == "doc" else stripe)
    words = "zigzag's order" if stripe == "doc" else f"stripes of {stripe},"
    chosen = lay.decision(seq_len, n).split(": ")[1]  # "<window hint W (...)>: <chosen>, by the cost model"
    assert chosen.startswith(words) and str(lay.window) in lay.decision(seq_len, n)


def test_packed_rows_keep_the_search_on_two_or_three_ranks():
    bounds = [0, 40, 100, 230, 300, 420, 500, 610, 700, 800, 880, 1024]
    hinted = get_layout("striped:window=512")
    for n in (2, 3):
        row = bounds[:-1] + [1024 // n * n] if n == 3 else bounds
        seq = row[-1]
        for r in range(n):
            assert torch.equal(striped_sp.positions(seq, n, r, hinted.key, cu_seqlens=row),
                               striped_sp.positions(seq, n, r, "striped", cu_seqlens=row))
        assert hinted.decision(seq, n, row) == LAYOUTS["striped"].decision(seq, n, row)


@pytest.mark.parametrize("n, seq, window, stripe", [
    (4, 4096, 1024, 1024),  # the cost model's stripes for one document of 4096 tokens: S / N, above W / 8
    (8, 8192, 4096, 1024),
    (4, 4 * 192, 1024, 64),  # W / 8 halved until S / N holds whole stripes (one document: zigzag's order)
    (4, 4 * 96, 1024, None),  # no stripe of 64 or more fits: the search
])
def test_packed_rows_run_w8_stripes_from_four_ranks(n, seq, window, stripe):
    bounds = [0, 7, seq // 3, seq // 3 + 5, seq]
    hinted = get_layout(f"striped:window={window}")
    assert hinted.packed_stripe(seq, n) == stripe
    for r in (0, n - 1):
        got = striped_sp.positions(seq, n, r, hinted.key, cu_seqlens=bounds).tolist()
        if stripe is None:
            assert got == striped_sp.positions(seq, n, r, "striped", cu_seqlens=bounds).tolist()
        else:
            assert got == _stripes_by_hand(seq, n, r, stripe)
    mask = make_mask(seq, n, hinted, bounds, window_size=(window - 1, 0))
    assert hinted.window_block(n, seq // n, mask) == stripe
    if stripe is not None:
        assert f"stripes of {stripe}" in hinted.decision(seq, n, bounds)


def test_window_layers_skip_the_steps_past_the_window():
    lay = get_layout("striped:window=100")  # stripes of 128 on 4 ranks of 1024 tokens
    mask = make_mask(4096, 4, lay, window_size=(300, 0))
    assert lay.row_stripe(4096, 4) == 128 and lay.ring_steps(4, 1024, mask) == 4  # ceil(300 / 128) + 1 = 4
    assert lay.ring_steps(4, 1024, make_mask(4096, 4, lay, window_size=(100, 0))) == 2
    assert lay.ring_steps(4, 1024, make_mask(4096, 4, lay)) == 4


def test_the_global_layers_run_masked_plans_only_where_the_stripes_are_larger_than_one():
    def mask_of(layout, seq_len, n):
        return RingRequest(None, layout=layout)._mask(seq_len // n, n)

    assert mask_of("striped:window=512", 4096, 4) is not None  # stripes of 1024: the masked plans
    assert mask_of("striped:window=512,global_every=2", 4096, 4) is None  # zigzag's order: its dense plans
    assert mask_of("striped:window=8,global_every=2", 64, 2) is None  # stripes of 1: the dense plans
    assert mask_of("striped", 4096, 4) is None


_LAYERS = [
    {"window_size": (100, 0)},  # a window layer
    {},  # a global causal layer of the same model
    {"docs": True},  # a packed row: the search
    {"docs": True, "window_size": (50, 0)},
    {"causal": False},
]
#: (layer, N) run by make test: each layer once, each N at least once; the rest of the grid is
#: marked release (make test-release)
_EVERY_RUN = {(0, 8), (1, 2), (2, 3), (3, 4), (4, 4)}


# one row of 512 (N = 8: 256) tokens per rank under window=512: the cost model's stripes
@pytest.mark.parametrize("n, layer", [
    pytest.param(n, layer, id=f"layer{i}-{n}", marks=() if (i, n) in _EVERY_RUN else pytest.mark.release)
    for i, layer in enumerate(_LAYERS) for n in (2, 3, 4, 8)])
def test_exact_against_float64(n, layer):
    per_rank = 256 if n == 8 else 512
    check_simulation_exact(n, per_rank, dict(layer, layout="striped:window=512"), f"hint-{n}-{sorted(layer)}",
                           heads=4, kv_heads=2)


# make test runs one hint of each of the two below (large stripes), the zigzag's-order hint of each
# is marked release (make test-release: ~25 s each on 2 cores)
@pytest.mark.parametrize("hint", [pytest.param("striped:window=512,global_every=2", marks=pytest.mark.release),
                                  "striped:window=2048"])
def test_exact_with_other_resolved_stripes(hint):
    for layer in ({"window_size": (300, 0)}, {}):
        check_simulation_exact(4, 1024, dict(layer, layout=hint), f"{hint}-{sorted(layer)}", heads=4, kv_heads=4)


@pytest.mark.parametrize("hint", ["striped:window=512",  # stripes of 1024; zigzag's order
                                  pytest.param("striped:window=512,global_every=2", marks=pytest.mark.release)])
def test_exact_under_ulysses(hint):
    for layer in ({"window_size": (100, 0)}, {}):
        check_simulation_exact(4, 1024, dict(layer, layout=hint, ulysses_size=2), f"{hint}-ulysses-{sorted(layer)}",
                               heads=4, kv_heads=2)


def test_bench_plan_lines_name_the_stripes_a_row_of_one_document_runs():
    from striped_sp.bench.report import plan_report

    assert plan_report("striped:window=1024", (0, 8192), 2, False, 8)["plan"].endswith(
        "one document: stripes of 4096 (the window hint)")  # S / N: every layer windowed
    assert plan_report("striped:stripe=auto", (0, 8192), 2, False, 8)["plan"].endswith(
        "one document: zigzag's order (2N stripes mirrored)")  # the CPU model's choice on one document
    assert "stripe_size doc" in plan_report("striped:window=1024", (0, 100, 8192), 2, False, 8)["plan"]


def test_the_dense_plans_are_refused_where_the_row_runs_larger_stripes():
    """A direct caller that builds a plan without a mask must not get the stripes-of-1 plan for a
    row whose hint resolves to larger stripes (the data would be dealt in those)."""
    from striped_sp.plan.ring_plan import build_host_plan

    hinted = get_layout("striped:window=512")  # stripes of 1024 at 4 x 1024
    with pytest.raises(NotImplementedError, match="masked plans"):
        build_host_plan(hinted, None, True, 4, 1, 1024)
    low = get_layout("striped:window=512,global_every=2")  # zigzag's order: its dense plans
    assert build_host_plan(low, None, True, 4, 1, 1024).calls


def test_bench_prediction_prices_the_masked_plans_of_the_hint():
    from striped_sp.bench.predict import _hosts

    hosts = _hosts("striped:window=1024", 2, 4096, None)
    assert hosts[0].masked  # stripes of 4096: the masked plans the engine runs
    assert not _hosts("striped", 2, 4096, None)[0].masked


def test_numpy_lengths_are_taken():
    import numpy as np

    assert striped_sp.positions(np.int64(8192), 2, 0, "striped:window=1024").tolist() == _stripes_by_hand(8192, 2, 0, 4096)


def test_exact_on_packed_rows_where_the_window_spans_several_stripes():
    """Stripes of 256 on 8 ranks and a window of 300 keys: the ring skips the steps past ceil(300 / 256) + 1,
    never one that still holds visible keys."""
    lay = get_layout("striped:window=512")
    assert lay.packed_stripe(8 * 256, 8) == 256
    check_simulation_exact(8, 256, {"layout": lay.key, "docs": True, "window_size": (300, 0)}, "hint-packed-300",
                           heads=2, kv_heads=1)
