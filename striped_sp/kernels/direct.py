"""The direct calls of a scheduled varlen call, in layers that take their views in one op each.

A :class:`~striped_sp.kernels.schedule.Direct` piece is one plain kernel call on slices of the
whole local tensors.  Taking each piece's slices one by one costs a host op per tensor and piece
(three forward, ten backward), and adding its gradients two more per gradient.  Pieces are
therefore cut into :class:`DirectLayer` s: within a layer no two pieces share a query row, so a
layer's pieces are chunks of one partition of the query rows, and every query-side tensor is cut
into all of its pieces' views by one ``split``; so are the key-side ones for the pieces whose
keys no earlier piece of the layer takes (the others, query stripes of one document that see the
same keys, take views of their own).  Backward adds a layer's gradients into the views of ``dq``
/ ``dk`` / ``dv`` by one ``_foreach_add_`` each over views that do not overlap (no gradient is
copied).  A halved causal square's rectangle shares query rows with its second triangle: it goes
into another layer.

The pieces run in the kernel's :attr:`~striped_sp.kernels.Kernel.tensor_format` on views of the
``[b, s, h, d]`` tensors (for ``"bhsd"`` kernels one transpose per tensor and layer instead of one
per tensor and piece).  The forward results are handed back, one per piece, for the caller's one
merge per layer (:class:`~striped_sp.kernels.varlen.ScheduledCall`).
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

__all__ = ["DirectLayer", "direct_layers", "layer_forward", "layer_backward", "as_format"]


@dataclasses.dataclass(frozen=True)
class DirectLayer:
    """Pieces ``(q0, q1, k0, k1, causal)`` in query order, no query row twice.

    ``q_sizes`` / ``k_sizes``: split sizes of the first rows of the query / key tensors, up to
    the last row a piece takes (a ring step's keys may be more: :func:`_chunks`); piece ``i`` is
    query chunk ``q_chunk[i]`` and key chunk ``k_chunk[i]`` (-1: keys that an earlier piece of
    the layer shares, taken by a view of their own)."""

    pieces: tuple
    q_sizes: tuple
    q_chunk: tuple
    k_sizes: tuple
    k_chunk: tuple
    q_extent: int  # sum(q_sizes)
    k_extent: int

    @property
    def rows(self) -> list:
        """The query row ranges ``(q0, q1)`` of the pieces, in order."""
        return [(p[0], p[1]) for p in self.pieces]


def _partition(ranges: list) -> tuple[tuple, tuple]:
    """Split sizes of the rows up to the end of the last of disjoint ``ranges``, cut at their
    edges, and each range's chunk."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    sizes, chunk, at = [], [0] * len(ranges), 0
    for i in order:
        a, b = ranges[i]
        if a > at:
            sizes.append(a - at)
        chunk[i] = len(sizes)
        sizes.append(b - a)
        at = b
    return tuple(sizes), tuple(chunk)


def _chunks(x: torch.Tensor, sizes: tuple, extent: int, dim: int) -> tuple:
    """``x`` cut by ``sizes`` along ``dim`` (rows past their sum ``extent`` left out): one
    ``split``, and a ``narrow`` before it where there are such rows."""
    return (x if x.size(dim) == extent else x.narrow(dim, 0, extent)).split(sizes, dim)


class _Intervals:
    """Disjoint half-open intervals, sorted: does a new one overlap any?"""

    def __init__(self):
        self.starts, self.ends = [], []

    def free(self, a: int, b: int) -> bool:
        i = bisect.bisect_right(self.starts, a)
        if i and self.ends[i - 1] > a:
            return False
        return i == len(self.starts) or self.starts[i] >= b

    def add(self, a: int, b: int) -> None:
        i = bisect.bisect_right(self.starts, a)
        self.starts.insert(i, a)
        self.ends.insert(i, b)


def direct_layers(pieces: list) -> list:
    """``pieces`` (:class:`~striped_sp.kernels.schedule.Direct`) in layers, each piece in the first
    layer where its query rows are not taken (pieces in query order).  Inside a layer, the pieces
    whose key rows no earlier piece of it takes share the key split (``k_chunk``); the others
    (``k_chunk`` -1: documents whose query stripes see the same keys) take their own views."""
    found = [(p.q0, p.q1, p.k0, p.k1, p.causal) for p in sorted(pieces, key=lambda p: (p.q0, p.k0))]
    if all(a[1] <= b[0] for a, b in zip(found, found[1:])):
        groups = [sorted(found)] if found else []  # no two share a query row: one layer
    else:
        groups = []  # [pieces, q intervals]
        for p in found:
            for layer in groups:
                if layer[1].free(p[0], p[1]):
                    break
            else:
                layer = [[], _Intervals()]
                groups.append(layer)
            layer[0].append(p)
            layer[1].add(p[0], p[1])
        groups = [sorted(g) for g, _ in groups]
    return [_layer(g) for g in groups]


def _layer(found: list) -> DirectLayer:
    """The :class:`DirectLayer` of pieces in query order, no query row twice."""
    q_sizes, q_chunk = _partition([(a, b) for a, b, _, _, _ in found])
    keys = sorted((c, d) for _, _, c, d, _ in found)
    if all(x[1] <= y[0] for x, y in zip(keys, keys[1:])):
        shared = [True] * len(found)  # no two share a key row
    else:
        free, shared = _Intervals(), []
        for _, _, c, d, _ in found:
            shared.append(free.free(c, d))
            if shared[-1]:
                free.add(c, d)
    k_sizes, chunks = _partition([(c, d) for (_, _, c, d, _), s in zip(found, shared) if s])
    it = iter(chunks)
    k_chunk = tuple(next(it) if s else -1 for s in shared)
    return DirectLayer(tuple(found), q_sizes, q_chunk, k_sizes, k_chunk, sum(q_sizes), sum(k_sizes))


def as_format(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` ``[b, s, h, d]`` as a view in ``fmt`` (and back: the transpose is its own inverse)."""
    return x if fmt == "bshd" else x.transpose(1, 2)


def _key_views(layer: DirectLayer, x: torch.Tensor, sd: int) -> list:
    """Each piece's key rows of ``x`` (in the kernel's format): the shared split's chunk, or a
    view of its own."""
    chunks = _chunks(x, layer.k_sizes, layer.k_extent, sd) if layer.k_sizes else ()
    return [chunks[j] if j >= 0 else x.narrow(sd, p[2], p[3] - p[2]) for p, j in zip(layer.pieces, layer.k_chunk)]


def layer_forward(layer: DirectLayer, kernel, q, k, v, scale) -> tuple[list, list]:
    """The layer's results, one per piece in the layer's order: outputs in the kernel's
    :attr:`~striped_sp.kernels.Kernel.tensor_format` and log-sum-exps ``[b, h, rows]``."""
    fmt = kernel.tensor_format
    sd = 1 if fmt == "bshd" else 2
    qs = _chunks(as_format(q, fmt), layer.q_sizes, layer.q_extent, sd)
    ks, vs = _key_views(layer, as_format(k, fmt), sd), _key_views(layer, as_format(v, fmt), sd)
    outs, lses = [], []
    for p, i, kk, vv in zip(layer.pieces, layer.q_chunk, ks, vs):
        o, l = kernel.forward_native(qs[i], kk, vv, p[4], scale)
        outs.append(o)
        lses.append(l)
    return outs, lses


def layer_backward(layer: DirectLayer, kernel, dout, q, k, v, out, lse, scale, dq, dk, dv) -> None:
    """Every piece's gradients added into the float32 ``dq`` / ``dk`` / ``dv`` ``[b, s, h, d]``:
    one ``_foreach_add_`` each over views that do not overlap, then the pieces of their own key
    views one by one."""
    fmt = kernel.tensor_format
    sd = 1 if fmt == "bshd" else 2
    qsz, qe = layer.q_sizes, layer.q_extent
    dos, qs, os_, dqs = (_chunks(as_format(t, fmt), qsz, qe, sd) for t in (dout, q, out, dq))
    ks, vs, dks, dvs = (_key_views(layer, as_format(t, fmt), sd) for t in (k, v, dk, dv))
    lses = _chunks(lse, qsz, qe, 2)
    gq, shared, own = [], ([], [], [], []), []
    for n, (p, i, j) in enumerate(zip(layer.pieces, layer.q_chunk, layer.k_chunk)):
        g = kernel.backward_native(dos[i], qs[i], ks[n], vs[n], os_[i], lses[i], p[4], scale)
        gq.append(g[0])
        if j >= 0:
            for lst, x in zip(shared, (dks[n], g[1], dvs[n], g[2])):
                lst.append(x)
        else:
            own.append((dks[n], g[1], dvs[n], g[2]))
    torch._foreach_add_([dqs[i] for i in layer.q_chunk], gq)
    if shared[0]:
        torch._foreach_add_(shared[0], shared[1])
        torch._foreach_add_(shared[2], shared[3])
    for dk_view, gk, dv_view, gv in own:
        dk_view.add_(gk)
        dv_view.add_(gv)
