"""What a striped layout with a window hint (``"striped:window=W,global_every=K"``) runs on a row of one
document: the placement the kernel's cost model predicts fastest for the model's layers, window and
global alike, since the data layout is shared by all of them.

Candidates (:func:`window_candidates`): zigzag's order (``"doc"``: ``2N`` stripes of ``S / 2N`` dealt
mirrored, zigzag's dense block plans on the global layers), the paper's stripes of 1, and stripes of
every power of two ``s`` from ``W / 8`` (at least :data:`~striped_sp.plan.stripe_choice.MIN_STRIPE`) up
to ``S / N`` that divides ``S / N`` (stripes of ``S / N`` are contiguous chunks).  Packed rows under the
hint take these stripes where they are larger than ``W / 8``
(:meth:`~striped_sp.plan.striped_layout.Striped.packed_stripe`).  Each is priced as the engine runs it: every rank's host plan
(:func:`~striped_sp.plan.ring_plan.build_host_plan`) for the windowed mask and, with global layers,
for the plain causal row; per ring step the slowest rank's calls
(:meth:`~striped_sp.plan.cost.CostModel.each_segment_ns`, :meth:`~striped_sp.plan.cost.CostModel.call`)
and the rows the ring carries (:meth:`~striped_sp.plan.cost.CostModel.ring_ns`): a window skips the
ring steps past it, which is why larger stripes win where every layer has the window (under a window
of ``W <= S / N`` contiguous chunks are balanced and need one step), and why global layers, where
only balanced placements are fast, pull the choice back towards zigzag's order or stripes of 1.

A pure function of the row length, ``N``, the window, the layer mix and the model, cached: the data
loader, ``shard`` / ``positions`` and every rank's ring reach the same stripes without a message, once
per row length.
"""

from __future__ import annotations

import functools

from .cost import model_named
from .search import MIN_GAIN, Prediction
from .stripe_choice import MIN_STRIPE, window_layer_counts

__all__ = ["window_candidates", "window_choice", "window_decision"]


def window_candidates(seq_len: int, world_size: int, window: int) -> list:
    """The stripe sizes :func:`window_choice` prices on a row of ``seq_len`` tokens on ``world_size``
    ranks under a window of ``window`` keys, simplest first: ``"doc"`` (zigzag's order, where the row
    splits into ``2N`` equal stripes), 1, then the powers of two from ``W / 8`` (at least ``MIN_STRIPE``;
    smaller stripes cut a query's band into more calls than they balance) up to ``seq_len / world_size``
    that divide it."""
    local = seq_len // world_size
    out = ["doc"] if world_size > 1 and seq_len % (2 * world_size) == 0 else []
    out.append(1)
    s = MIN_STRIPE
    while s * 2 <= window // 8:
        s *= 2
    while s <= local:
        if local % s == 0:
            out.append(s)
        s *= 2
    return out


def window_choice(seq_len: int, world_size: int, window: int, window_layers: int = 1, global_layers: int = 0,
                  model=None, *, striped: type) -> tuple:
    """``(stripe_size, predictions)``: the stripes a row of one document of ``seq_len`` tokens runs on
    ``world_size`` ranks for a model of ``window_layers`` layers with a window of ``window`` keys and
    ``global_layers`` global causal ones, and every candidate's
    :class:`~striped_sp.plan.search.Prediction` (``ms``: those layers' forward+backward time per head),
    in :func:`window_candidates` order.  A later candidate must beat every earlier one by
    :data:`~striped_sp.plan.search.MIN_GAIN` of its time to be chosen.  ``striped``: the
    striped layout class (:class:`~striped_sp.plan.striped_layout.Striped`), passed in by its callers
    since the layouts call this module and it cannot import them back."""
    return _window_choice(int(seq_len), int(world_size), int(window), int(window_layers), int(global_layers),
                          model_named(model), striped)


@functools.lru_cache(maxsize=64)
def _window_choice(seq_len: int, world_size: int, window: int, window_layers: int, global_layers: int,
                   model, striped: type) -> tuple:
    preds = []
    for stripe in window_candidates(seq_len, world_size, window):
        ms = window_layers * _ring_ms(seq_len, world_size, striped(stripe_size=stripe), window, model)
        if global_layers:
            ms += global_layers * _ring_ms(seq_len, world_size, striped(stripe_size=stripe), None, model)
        preds.append(Prediction(stripe, 0, ms, 0, (), ()))
    best = preds[0]
    for p in preds[1:]:
        if p.ms < best.ms * (1 - MIN_GAIN):
            best = p
    return best.stripe_size, tuple(preds)


def _ring_ms(seq_len: int, world_size: int, layout, window, model) -> float:
    """Forward+backward ms per head of one layer's ring under ``layout`` (``window``: its left window;
    ``None``: the plain causal row), as the engine plans it."""
    from .masks import make_mask
    from .ring_plan import _predicted_ms, build_host_plan

    n = seq_len // world_size
    mask = None
    if window is not None or not layout.dense_row(seq_len, world_size):
        mask = make_mask(seq_len, world_size, layout, None, None if window is None else (window, 0))
    hosts = [build_host_plan(layout, mask, True, world_size, r, n) for r in range(world_size)]
    steps = max(h.steps for h in hosts)
    per_rank = [_predicted_ms(h, model) for h in hosts]
    compute = [max(p[t] if t < len(p) else 0.0 for p in per_rank) * 1e6 for t in range(steps)]
    carried = [0 if t + 1 >= steps else max(n if h.shared is None else h.shared[(h.rank - t) % world_size]
                                             for h in hosts) for t in range(steps)]
    return model.ring_ns(compute, carried) / 1e6


def window_decision(seq_len: int, world_size: int, window: int, global_every: int | None = None, model=None, *,
                    striped: type) -> str:
    """The setup line of :func:`window_choice` under the hint ``window=W,global_every=K``: what a row of
    one document runs and why."""
    model = model_named(model)
    stripe, preds = window_choice(seq_len, world_size, window, *window_layer_counts(global_every), model, striped=striped)
    chosen = next(p for p in preds if p.stripe_size == stripe)
    every = "every layer" if global_every is None else f"one global layer in {global_every}"
    name = {"doc": "zigzag's order (2N stripes mirrored)", 1: "stripes of 1"}
    others = ", ".join(f"{name.get(p.stripe_size, f'stripes of {p.stripe_size}')} {p.ms:.2f}"
                       for p in preds if p is not chosen)
    return (f"a row of one document under the window hint {window} ({every}): "
            f"{name.get(stripe, f'stripes of {stripe}')}, by the cost model {model.label!r}: predicted "
            f"{chosen.ms:.2f} ms fwd+bwd per head{' per block' if global_every else ''} against {others}")
