"""Masks beyond one causal triangle: packed documents and sliding windows, as block plans.

A mask is data: the document boundaries of the packed row (``cu_seqlens``, global positions) and
a window ``(left, right)`` in the flash-attn / Megatron convention.  A query at global position
``p`` sees the keys of its own document at positions ``p - left .. p + right`` (``left = -1`` or
``right = -1``: unbounded on that side; ``right = 0`` under ``causal``).

Every layout describes a rank's tokens as runs of one stride (:meth:`Layout.runs`).  Cut at the
document bounds, runs become *pieces* (one document, one stride).  A query piece and a key piece
of the same document meet in a *band*: with local indices ``a`` (queries) and ``b`` (keys) the
visible entries are exactly ``lo <= b - a <= hi`` for two integers that follow from the pieces'
first positions, the stride and the window.  After trimming the rows that see nothing and the
keys nobody sees, each band is one *segment* of a varlen kernel call, written with flash-attn's
bottom-right aligned window ``(wl, wr)`` (``-1`` = unbounded).  Under ``striped`` every segment is
a square causal call (inclusive or strict, as in the dense case), and a block's segments form at
most two window classes, so short documents cost one fused call per block, not one each.

A block plan is a list of :class:`SegmentCall`; each query row appears at most once per call, so
a call's ``(out, lse)`` merges into the accumulators row by row.  ``zigzag`` can pair one query
piece with two key pieces of the same document (its two chunks): those go to two calls.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import torch

from ..kernels.segments import Segments, _ranges

__all__ = ["MaskSpec", "Segments", "SegmentCall", "check_cu_seqlens", "check_window", "make_mask", "shared_rows",
           "block_plan", "ring_plans"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


_INT64_MAX = 2 ** 63 - 1


def as_bounds(cu_seqlens) -> tuple[int, ...]:
    """``cu_seqlens`` (1-D integer tensor, array or sequence of ints) as a tuple of ints;
    ``ValueError`` for any other shape or type."""
    if not isinstance(cu_seqlens, (torch.Tensor, list, tuple)) and hasattr(cu_seqlens, "__array__"):
        try:
            cu_seqlens = torch.as_tensor(cu_seqlens)
        except (TypeError, RuntimeError):
            raise ValueError(f"cu_seqlens of type {type(cu_seqlens).__name__} is not an integer array") from None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type == "meta":
            raise ValueError("cu_seqlens is on the meta device, which holds no values: pass the boundaries as a "
                             "CPU or device tensor, or a list of ints")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens has shape {tuple(cu_seqlens.shape)}: it must be 1-D "
                             "(document boundaries [0, l1, l1+l2, ..., S] of the global packed row)")
        if cu_seqlens.dtype not in _INT_DTYPES:
            raise ValueError(f"cu_seqlens has dtype {cu_seqlens.dtype}: it must be an integer tensor")
        bounds = tuple(cu_seqlens.tolist())
    elif isinstance(cu_seqlens, (list, tuple)):
        if set(map(type, cu_seqlens)) <= {int}:  # plain ints (the adapters' tuples): no Python-level loop
            return cu_seqlens if isinstance(cu_seqlens, tuple) else tuple(cu_seqlens)
        if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in cu_seqlens):
            raise ValueError(f"cu_seqlens={list(cu_seqlens)[:8]}...: every boundary must be an int")
        bounds = tuple(int(x) for x in cu_seqlens)
    else:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor or a list of ints, got {type(cu_seqlens).__name__}")
    return bounds


def check_cu_seqlens(cu_seqlens, seq_len: int, world_size: int, layout=None) -> tuple[int, ...]:
    """Validate document boundaries of the global packed row; returns them as a tuple of ints.

    Rules: 1-D, integer, starting at 0, strictly increasing, ending at ``seq_len``; every document a
    multiple of the ``layout``'s :meth:`~striped_sp.plan.layouts.Layout.document_multiple` (``zigzag``:
    ``2 * world_size``; pad with :func:`striped_sp.pad_documents`)."""
    bounds = as_bounds(cu_seqlens)
    shown = list(bounds[:6]) + (["..."] if len(bounds) > 6 else [])
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"cu_seqlens={shown} must start at 0 and hold at least one document")
    lengths = torch.tensor(bounds[1:], dtype=torch.int64) - torch.tensor(bounds[:-1], dtype=torch.int64)
    bad = (lengths <= 0).nonzero()
    if bad.numel():
        i = int(bad[0]) + 1
        raise ValueError(f"cu_seqlens must be strictly increasing: entry {i} is {bounds[i]}, "
                         f"after {bounds[i - 1]} (cu_seqlens={shown})")
    if bounds[-1] != seq_len:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the global row holds {seq_len} tokens "
                         f"(local length x world_size); the last boundary must equal it")
    unit = 1 if layout is None else layout.document_multiple(world_size)
    bad = (lengths % unit).nonzero() if unit > 1 else bad
    if unit > 1 and bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"document {i} has {bounds[i + 1] - bounds[i]} tokens: under layout {getattr(layout, 'name', layout)!r} "
            f"every document must be a multiple of 2 * world_size = {unit} (pad them with "
            "striped_sp.pad_documents, as Transformer Engine does); 'striped' and 'contiguous' need no padding")
    return bounds


def check_window(window_size, causal: bool) -> tuple[int, int]:
    """Validate ``window_size=(left, right)``; ``None`` means no window.  Returns ``(left, right)``
    with ``right = 0`` under ``causal``."""
    if window_size is None:
        return -1, (0 if causal else -1)
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size={window_size!r} must be a pair (left, right)") from None
    for name, val in (("left", left), ("right", right)):
        if isinstance(val, torch.Tensor) and val.numel() == 1 and not val.is_floating_point():
            val = int(val)
        if not isinstance(val, numbers.Integral) or isinstance(val, bool) or val < -1:
            raise ValueError(f"window_size {name}={val!r} must be an int >= -1 (-1: no limit)")
        if val > _INT64_MAX:
            raise ValueError(f"window_size {name}={val!r} is beyond int64 (at most {_INT64_MAX}; a side as long as "
                             "the row or longer is no limit: -1 says so)")
    left, right = int(left), int(right)
    if causal and right != 0:
        raise ValueError(f"window_size=({left}, {right}): right must be 0 when causal=True "
                         "(a query sees keys p-left .. p)")
    return left, right


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The mask of one packed row: document bounds and window; ``right == 0`` is causal."""

    seq_len: int
    bounds: tuple
    left: int = -1
    right: int = 0

    @property
    def causal(self) -> bool:
        return self.right == 0


def make_mask(seq_len, world_size, layout, cu_seqlens=None, window_size=None, causal=True) -> MaskSpec:
    """Checked :class:`MaskSpec` (``ValueError`` on a bad ``cu_seqlens`` or ``window_size``)."""
    bounds = (0, seq_len) if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seq_len, world_size, layout)
    left, right = check_window(window_size, causal)
    # a side that reaches past the row bounds nothing: no limit (the plans' index arithmetic would
    # overflow int64 on a side near 2**63)
    left, right = (-1 if side >= seq_len else side for side in (left, right))
    return MaskSpec(seq_len, bounds, left, right)


@dataclasses.dataclass
class SegmentCall:
    """One varlen kernel call of a ring block: ``segments`` (the bands, with their local row
    starts: what the kernels run) and ``entries`` (visible score entries, for the work model).
    ``q`` / ``kv`` list the call's local rows in packed order (a ``slice`` when they are one
    contiguous range, else an int64 tensor), built on first access, for inspection and tests.
    Query rows are distinct inside a call; key rows may repeat."""

    segments: Segments
    entries: int

    @functools.cached_property
    def q(self) -> slice | torch.Tensor:
        return _as_index(_ranges(self.segments.q_start, self.segments.lq))

    @functools.cached_property
    def kv(self) -> slice | torch.Tensor:
        return _as_index(_ranges(self.segments.k_start, self.segments.lk))

    def q_len(self, n: int) -> int:
        return int(self.segments.cu_q[-1])

    def kv_len(self, n: int) -> int:
        return int(self.segments.cu_k[-1])

    def score_entries(self, n: int) -> int:
        return self.entries


def _as_index(rows: torch.Tensor) -> slice | torch.Tensor:
    if rows.numel() > 0 and (rows.numel() == 1 or bool((rows[1:] - rows[:-1] == 1).all())):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows


def _diagonal_plan(doc, local, pos, count, step) -> list[SegmentCall] | None:
    """A rank's own block under a plain causal mask, when every document's pieces lie back to
    back in local rows and in position order: then local order is position order inside each
    document, and the block is one causal square per document (one call, instead of a square per
    piece plus a rectangle per pair).  ``None`` when some document's pieces are not laid out so."""
    if doc.numel() == 0:
        return []
    same = doc[1:] == doc[:-1]
    after_prev = (local[1:] == local[:-1] + count[:-1]) & (pos[1:] > pos[:-1] + (count[:-1] - 1) * step[:-1])
    if not bool((after_prev | ~same).all()):
        return None
    first = torch.ones(doc.numel(), dtype=torch.bool)
    first[1:] = ~same
    group = torch.cumsum(first.long(), 0) - 1
    starts = local[first]
    lengths = torch.zeros(starts.numel(), dtype=torch.int64).index_add_(0, group, count)
    zero = torch.zeros(1, dtype=torch.int64)
    cu = torch.cat([zero, torch.cumsum(lengths, 0)])
    causal = torch.zeros(starts.numel(), dtype=torch.int64)
    segs = Segments(cu, cu.clone(), causal - 1, causal, starts, starts.clone())
    return [SegmentCall(segs, segs.entries())]


def block_plan(layout, spec: MaskSpec, world_size: int, rank: int, source: int, pieces=None) -> list[SegmentCall]:
    """The varlen calls that cover exactly the visible entries of queries on ``rank`` against
    keys from ``source`` (local indices); ``[]`` when nothing is visible.  ``pieces``: an optional
    dict shared by the blocks of one row, which keeps :func:`~striped_sp.plan.ring_blocks.all_pieces`."""
    from .ring_blocks import all_pieces

    pieces = {} if pieces is None else pieces
    if "all" not in pieces:
        pieces["all"] = all_pieces(layout, spec, world_size)
    return _steps(spec, world_size, rank, [(rank - source) % world_size], pieces["all"])[0]


def _steps(spec: MaskSpec, world_size: int, rank: int, steps: list, pieces) -> list[list[SegmentCall]]:
    """The block plans of ``steps``: a rank's own block under a plain causal mask as one square per
    document where its pieces allow (:func:`_diagonal_plan`), every other from one pass."""
    from .ring_blocks import ring_blocks

    plans, todo = {}, list(steps)
    if 0 in todo and spec.left < 0 and spec.right == 0:
        mine = pieces[0] == rank
        merged = _diagonal_plan(*(x[mine] for x in pieces[1:]))
        if merged is not None:
            plans[0] = merged
            todo.remove(0)
    for t, calls in ring_blocks(spec, world_size, rank, todo, pieces).items():
        plans[t] = [SegmentCall(segs, segs.entries()) for segs in calls]
    return [plans[t] for t in steps]


def shared_rows(layout, spec: MaskSpec, world_size: int, rank: int) -> int:
    """How many leading local rows of ``rank`` other ranks' queries can see: all but the documents
    that close its local order and lie wholly on it (kept whole by a ``doc_placement``, or short
    enough to fall in one run), whose keys only their own rank's queries see.  The ring sends only
    these rows (and their dK/dV) on."""
    runs = layout.run_table(spec.seq_len, world_size, rank, spec.bounds)
    length = {a: b - a for a, b in zip(spec.bounds[:-1], spec.bounds[1:])}
    private = 0
    for _, first, count, step in reversed(runs.tolist()):
        if count == 0:
            continue
        if length.get(first) != count or (count > 1 and step != 1):
            break
        private += count
    return spec.seq_len // world_size - private


def ring_plans(layout, spec: MaskSpec, world_size: int, rank: int, steps: int | None = None) -> list[list[SegmentCall]]:
    """``plans[t]``: the block plan of ring step ``t`` (source ``(rank - t) % world_size``), for the
    first ``steps`` steps (``None``: all ``world_size``), every step from one tensor pass
    (:func:`~striped_sp.plan.ring_blocks.ring_blocks`).  Not cached: a batch's
    :class:`~striped_sp.plan.ring_plan.RingPlan` holds it (the plan cache of
    :mod:`striped_sp.engine.plans` keeps the plans of a few batches)."""
    from .ring_blocks import all_pieces

    steps = world_size if steps is None else steps
    return _steps(spec, world_size, rank, list(range(steps)), all_pieces(layout, spec, world_size))
