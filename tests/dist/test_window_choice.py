"""Issue 57, windows: where the window is known when the batch is sharded (the striped window hint
``"striped:window=W,global_every=K"``; Megatron's ``--window-size``), a row of one document runs the
placement the cost model predicts fastest for the model's layers (striped_sp/plan/window_choice.py):
zigzag's order, stripes of 1, or larger stripes up to ``S / N``.  The choice is a pure function of the
row length, N, the window and the layer mix, the data and the ring follow it, and it stays exact.

References: float64 attention on the full row (tests/support/reference.py), positions and ring steps
written out by hand."""

from __future__ import annotations

import types

import pytest

from local_exact import check_simulation_exact
import striped_sp
from striped_sp.plan.layouts import Striped, get_layout
from striped_sp.plan.masks import make_mask
from striped_sp.plan.search import MIN_GAIN
from striped_sp.plan.window_choice import window_candidates, window_choice

pytestmark = pytest.mark.dist

SEQ, N = 1024, 4  # 256 tokens per rank


def _round_by_hand(seq_len: int, n: int, rank: int, stripe: int) -> list[int]:
    return [p for p in range(seq_len) if (p // stripe) % n == rank]


def _zigzag_by_hand(seq_len: int, n: int, rank: int) -> list[int]:
    c = seq_len // (2 * n)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * n - 1 - rank) * c, (2 * n - rank) * c))


def test_candidates_by_hand():
    assert window_candidates(1024, 4, 64) == ["doc", 1, 64, 128, 256]
    assert window_candidates(8192, 2, 1024) == ["doc", 1, 128, 256, 512, 1024, 2048, 4096]  # from W / 8
    assert window_candidates(2 * 192, 2, 64) == ["doc", 1, 64]  # 192 per rank: of 64, 128, 256 only 64 divides
    assert window_candidates(7 * 4, 4, 64) == [1]  # 7 per rank: no 2N split, no stripe of 64


@pytest.mark.parametrize("seq, n, window, layers", [
    (1024, 4, 64, (1, 0)), (1024, 4, 64, (1, 3)), (8192, 2, 1024, (5, 1)), (16384, 8, 1024, (1, 0))])
def test_the_choice_is_the_fastest_prediction(seq, n, window, layers):
    stripe, preds = window_choice(seq, n, window, *layers, model="cpu", striped=Striped)
    assert [p.stripe_size for p in preds] == window_candidates(seq, n, window)
    best = min(p.ms for p in preds)
    chosen = next(p for p in preds if p.stripe_size == stripe)
    assert chosen.ms <= best / (1 - MIN_GAIN)
    earlier = preds[:preds.index(chosen)]  # a later candidate must beat every earlier one by MIN_GAIN
    assert all(chosen.ms < p.ms * (1 - MIN_GAIN) for p in earlier)


def test_every_layer_windowed_takes_large_stripes_and_skips_steps():
    """Every layer under a window of 64 on 4 x 256 tokens: stripes of 128 (the CPU model), dealt
    round-robin; a query's 64 keys lie in its own stripe or the one before, so the ring runs 2 steps."""
    lay = get_layout("striped:window=64")
    assert lay.row_stripe(SEQ, N) == 128
    for r in range(N):
        assert striped_sp.positions(SEQ, N, r, lay.key).tolist() == _round_by_hand(SEQ, N, r, 128)
    assert lay.ring_steps(N, SEQ // N, make_mask(SEQ, N, lay, window_size=(63, 0))) == 2
    assert lay.ring_steps(N, SEQ // N, make_mask(SEQ, N, lay, window_size=(200, 0))) == 3  # 2 stripes back
    assert "stripes of 128" in lay.decision(SEQ, N) and "zigzag's order" in lay.decision(SEQ, N)
    for layer in ({"window_size": (63, 0)}, {"window_size": (200, 0)}, {}):
        check_simulation_exact(N, SEQ // N, dict(layer, layout=lay.key), f"wchoice-large-{sorted(layer)}",
                               heads=2, kv_heads=2)


def test_global_layers_pull_the_choice_to_zigzags_order():
    """Every other layer global, on 2 x 512 tokens: zigzag's order (rank r holds chunks r and 2N-1-r of
    S / 2N), whose global layers run zigzag's dense block plans."""
    from striped_sp.plan.ring_plan import build_host_plan

    n = 2
    lay = get_layout("striped:window=64,global_every=2")
    assert lay.row_stripe(SEQ, n) == "doc"
    for r in range(n):
        assert striped_sp.positions(SEQ, n, r, lay.key).tolist() == _zigzag_by_hand(SEQ, n, r)
    assert lay.dense_row(SEQ, n)
    zig = get_layout("zigzag")
    for r in range(n):
        assert (build_host_plan(lay, None, True, n, r, SEQ // n).calls
                == build_host_plan(zig, None, True, n, r, SEQ // n).calls)
    assert "zigzag's order" in lay.decision(SEQ, n).split(":")[1]
    for layer in ({"window_size": (63, 0)}, {}):
        check_simulation_exact(n, SEQ // n, dict(layer, layout=lay.key), f"wchoice-zig-{sorted(layer)}",
                               heads=2, kv_heads=2)


def _megatron_args(**kw):
    base = dict(context_parallel_algo="striped", context_parallel_size=N, seq_length=SEQ, num_layers=4,
                striped_stripe_size=None, striped_doc_placement="split", window_size=(64, 0),
                window_attn_skip_freq=None, sft=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_megatron_window_follows_the_same_choice():
    """Megatron knows the window from --window-size: the default resolves the same placement, pinned
    (zigzag's order as S / 2N stripes dealt mirrored), and deals the same tokens as the hint."""
    import striped_sp.megatron as sm

    every = sm.algo_of(_megatron_args())
    assert every == "striped:stripe=128"
    assert [striped_sp.positions(SEQ, N, r, every).tolist() for r in range(N)] == [
        striped_sp.positions(SEQ, N, r, "striped:window=64").tolist() for r in range(N)]
    mixed = sm.algo_of(_megatron_args(window_attn_skip_freq=2, context_parallel_size=2))  # layers 2, 4: full
    assert mixed == f"striped:stripe={SEQ // 4},order=mirror"
    for r in range(2):
        assert striped_sp.positions(SEQ, 2, r, mixed).tolist() == _zigzag_by_hand(SEQ, 2, r)
    check_simulation_exact(2, SEQ // 2, {"layout": mixed, "window_size": (63, 0)}, "wchoice-megatron-mirror",
                           heads=2, kv_heads=2)
    # packed rows (--sft) keep their rule (the per-batch search on fewer than 4 ranks)
    assert sm.algo_of(_megatron_args(sft=True, context_parallel_size=2)) == "striped:stripe=auto"


@pytest.mark.parametrize("kw, key", [
    ({"striped_stripe_size": 128, "striped_order": "mirror"}, "striped:stripe=128,order=mirror"),
    ({"striped_stripe_size": 128, "striped_order": "round", "window_size": None}, "striped:stripe=128"),
    ({"striped_stripe_size": 64, "striped_order": "mirror", "window_size": None,
      "striped_doc_placement": "auto", "sft": True}, "striped:stripe=64,place=auto,order=mirror"),
])
def test_megatron_order_flag(kw, key):
    import striped_sp.megatron as sm

    assert sm.algo_of(_megatron_args(**kw)) == key
    assert get_layout(key).key == key


@pytest.mark.parametrize("kw, words", [
    ({"striped_order": "snake"}, "--striped-order 'snake' must be round"),
    ({"striped_order": "mirror"}, "--striped-order mirror deals stripes of an integer --striped-stripe-size, got 'auto'"),
    ({"striped_order": "mirror", "striped_stripe_size": "doc"}, "--striped-order mirror deals stripes of an integer"),
    ({"striped_order": "mirror", "striped_stripe_size": 64, "context_parallel_algo": "zigzag"},
     "--striped-order mirror applies to --context-parallel-algo striped only, not zigzag"),
])
def test_megatron_order_flag_errors_name_the_flag(kw, words):
    import striped_sp.megatron as sm

    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        sm.algo_of(_megatron_args(**kw))


def test_megatron_parser_takes_the_order_flag():
    import argparse

    import striped_sp.megatron as sm

    parser = sm.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--context-parallel-algo", "striped", "--striped-stripe-size", "64",
                              "--striped-order", "mirror"])
    assert args.striped_order == "mirror"
    with pytest.raises(SystemExit):
        parser.parse_args(["--striped-order", "snake"])
