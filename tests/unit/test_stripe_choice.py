"""stripe_size="auto" (striped_sp.plan.stripe_choice): the rule against hand-computed shares, and the
Megatron flag resolving it from the model's arguments."""

import types

import pytest

from striped_sp.plan.stripe_choice import WINDOW_SHARE_MIN, choose_stripe_size, window_share


def test_window_share_against_a_hand_count():
    # 10 tokens, window 3: rows see 1, 2, 3, 4, 4, ... keys -> 1+2+3+4*7 = 34; global 55
    assert window_share(10, 3, 1, 1) == pytest.approx(34 / (34 + 55))
    assert window_share(10, 3, 5, 1) == pytest.approx(5 * 34 / (5 * 34 + 55))
    assert window_share(10, None, 4, 1) == 0.0 and window_share(10, 3, 0, 4) == 0.0
    assert window_share(10, 20, 1, 0) == 1.0


@pytest.mark.parametrize("seq, n, packed, window, wl, gl, expect", [
    (65536, 8, True, None, 0, 1, "auto"),         # packed, no window: the per-batch search
    (65536, 8, False, None, 0, 1, 1),             # one document, no window: the paper's layout
    (65536, 8, False, 4096, 1, 0, 1024),          # all layers windowed: W/4
    (65536, 8, False, 4096, 5, 1, 1024),          # one global layer in 6: share 0.38
    (65536, 8, False, 4096, 1, 1, 1),             # one in 2: share 0.11, below the crossover
    (65536, 8, True, 4096, 1, 1, 512),            # packed rows: W/8 at any share
    (65536, 4, True, 4096, 1, 0, 512),            # from 4 ranks on
    (65536, 2, True, 4096, 1, 0, "auto"),         # on fewer the per-batch search (measured faster there)
    (65536, 8, False, 256, 1, 0, 64),             # never below MIN_STRIPE
    (8 * 3 * 64, 8, False, 4096, 1, 0, 64),       # S / N = 192: the largest power of two dividing it
    (8 * 3 * 16, 8, False, 4096, 1, 0, 16),
])
def test_choose_stripe_size(seq, n, packed, window, wl, gl, expect):
    assert choose_stripe_size(seq, n, packed, window, wl, gl) == expect


def test_crossover_is_the_documented_share():
    seq, w = 65536, 4096
    k_lo = next(k for k in range(1, 20) if window_share(seq, w, k, 1) >= WINDOW_SHARE_MIN)
    assert choose_stripe_size(seq, 8, False, w, k_lo, 1) == 1024
    assert choose_stripe_size(seq, 8, False, w, k_lo - 1, 1) == 1


@pytest.mark.parametrize("seq, window, wl, gl, n, stripe", [
    (104, 13, 1, 1, 2, 4),    # 1365 window entries against 5460 global: exactly 1 / 5
    (464, 29, 2, 1, 2, 8),    # two window layers of 13485 against 107880: exactly 1 / 5
])
def test_exactly_the_documented_share_takes_stripes(seq, window, wl, gl, n, stripe):
    """docs/tuning.md, "Stripe size": window layers holding *at least* WINDOW_SHARE_MIN (20%) of the
    entries take stripes of W / 4; at exactly 0.20 (a ratio the float division gives exactly) the
    row is striped, one global layer more drops below the share and back to stripes of 1."""
    assert window_share(seq, window, wl, gl) == WINDOW_SHARE_MIN == 0.20
    assert choose_stripe_size(seq, n, False, window, wl, gl) == stripe
    assert window_share(seq, window, wl, gl + 1) < WINDOW_SHARE_MIN
    assert choose_stripe_size(seq, n, False, window, wl, gl + 1) == 1
    # the Megatron flag on the same layers (the window ones first, then the full-attention ones) takes
    # the cost model's placement for them instead (issue 57, plan/window_choice.py)
    args = _megatron_args(seq_length=seq, context_parallel_size=n, num_layers=wl + gl, window_size=(window, 0),
                          window_attn_skip_freq=[1] * wl + [0] * gl)
    import striped_sp.megatron as sm
    from striped_sp.plan.layouts import Striped
    from striped_sp.plan.window_choice import window_choice

    chosen = window_choice(seq, n, window, wl, gl, striped=Striped)[0]
    assert sm.algo_of(args) == (f"striped:stripe={seq // (2 * n)},order=mirror" if chosen == "doc" else
                                f"striped:stripe={chosen}" if chosen != 1 else "striped:stripe=1")


def test_bad_counts_are_value_errors():
    with pytest.raises(ValueError, match="seq_len=0"):
        choose_stripe_size(0, 8, False)
    with pytest.raises(ValueError, match="window_layers=0, global_layers=0"):
        choose_stripe_size(64, 8, False, 8, 0, 0)


def _megatron_args(**kw):
    base = dict(context_parallel_algo="striped", context_parallel_size=8, seq_length=65536, num_layers=12,
                striped_stripe_size="auto", window_size=None, window_attn_skip_freq=None, sft=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


# rows of one document under a window: the CPU cost model's placement for the layers (issue 57,
# plan/window_choice.py; tests/dist/test_window_choice.py), on 4 ranks of 4096 tokens, window 1024
_W = {"window_size": (1024, 0), "seq_length": 16384, "context_parallel_size": 4}


@pytest.mark.parametrize("kw, key", [
    ({}, "striped"),
    ({"sft": True}, "striped:stripe=auto"),
    (_W, "striped:stripe=4096"),                                                      # S / N: 2 ring steps
    ({**_W, "window_attn_skip_freq": 6}, "striped:stripe=1024"),                      # 10 of 12 windowed
    ({"window_size": (4096, 0), "sft": True}, "striped:stripe=512"),                  # packed rows: W/8
    ({**_W, "window_attn_skip_freq": 2}, "striped:stripe=2048,order=mirror"),         # 6 of 12: zigzag's order
    ({**_W, "window_attn_skip_freq": [1, 0] * 6}, "striped:stripe=2048,order=mirror"),
    ({**_W, "window_attn_skip_freq": [1] * 11 + [0]}, "striped:stripe=2048"),
])
def test_megatron_auto_flag(kw, key):
    import striped_sp.megatron as sm

    assert sm.algo_of(_megatron_args(**kw)) == key
