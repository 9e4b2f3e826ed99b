"""What the default ``striped`` runs on a row of one document: the paper's stripes of 1 (the dense
striped plans) or zigzag's order (``2N`` stripes of ``S / 2N`` dealt mirrored, :mod:`striped_sp.plan.mirror`,
and zigzag's dense block plans), by the cost model of the default kernel on this device type.
"""

from __future__ import annotations

import functools

from .cost import model_named
from .search import Prediction

__all__ = ["dense_choice", "dense_decision"]


def dense_choice(seq_len: int, world_size: int, model=None) -> tuple:
    """``(stripe_size, stripes of 1, zigzag's order)``: what the default ``striped`` runs on a row of one
    document of ``seq_len`` tokens on ``world_size`` ranks: ``1`` (the paper's stripes, the dense striped
    plans) or ``"doc"`` (``2N`` stripes of ``S / 2N`` mirrored: zigzag's placement and block plans), whichever
    the cost model of the default kernel on this device type predicts faster (ties: zigzag's order, which
    skips the diagonal-masked strided blocks), with both predictions (:class:`~striped_sp.plan.search.Prediction`;
    the second ``None`` where the row does not split into ``2N`` equal stripes).  A pure function of the
    length, ``N`` and the model: the data loader and every rank agree without a message."""
    return _dense_choice(int(seq_len), int(world_size), model_named(model))


@functools.lru_cache(maxsize=64)
def _dense_choice(seq_len: int, world_size: int, model) -> tuple:
    n, steps = seq_len // world_size, world_size

    def ring(stripe, compute):
        carried = [n] * (steps - 1) + [0]
        return Prediction(stripe, 0, model.ring_ns(compute, carried) / 1e6, steps, tuple(c / 1e6 for c in compute),
                          tuple(carried))

    # the dense plans' calls (striped_layout.causal_plan, chunk_layouts.Zigzag.causal_plan), the slowest rank's
    one = ring(1, [model.call(n, n, True)] * steps)
    if world_size == 1 or seq_len % (2 * world_size):
        return 1, one, None
    zig = ring("doc", [model.call(n, n, True)] + [max(model.call(n, n / 2, False), model.call(n / 2, n, False))]
               * (steps - 1))
    return ("doc" if zig.ms <= one.ms else 1), one, zig


def dense_decision(seq_len: int, world_size: int, model=None) -> str:
    """The setup line of the default on a row of one document (:func:`dense_choice`): what runs and why."""
    model = model_named(model)
    stripe, one, zig = dense_choice(seq_len, world_size, model)
    if zig is None:
        return (f"a row of one document: stripes of 1, the dense plans ({seq_len} tokens do not split into "
                f"2N = {2 * world_size} equal stripes, zigzag's order)")
    words = {1: "stripes of 1, the dense striped plans", "doc": "zigzag's order (2N stripes of S / 2N dealt "
             "mirrored, rank r holding stripes r and 2N-1-r) and its dense block plans"}
    chosen, other = (one, zig) if stripe == 1 else (zig, one)
    return (f"a row of one document: {words[stripe]}, by the cost model {model.label!r}: predicted {chosen.ms:.2f} ms "
            f"fwd+bwd per head against {other.ms:.2f} ms ({other.ms / chosen.ms - 1:+.1%}) for "
            f"{words[1 if stripe == 'doc' else 'doc'].split(',')[0].split(' (')[0]}")
