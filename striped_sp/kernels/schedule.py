"""How a varlen call (many band segments) is covered with few fused kernel calls.

For kernels without a varlen entry point (PyTorch's CPU flash op, the math reference, the CUDA
memory-efficient op), :func:`schedule_steps` turns the :class:`~striped_sp.kernels.segments.Segments`
of a plan's calls, all at once (one pass of tensor ops, not one per ring step), into *pieces*,
every one a single kernel call whose rows all see at least one key; the executor
(:mod:`striped_sp.kernels.varlen`) merges the pieces' ``(out, lse)`` row by row, so a row may be covered
by several pieces:

* **direct**: one plain call on slices: a large full rectangle, or a causal square.  A large
  causal square may be halved recursively into causal triangles of at most ``2 * LEAF`` rows and
  full rectangles, because fused CPU kernels skip masked keys only in wide tiles (512 on this CPU),
  so a causal call of a few hundred rows costs almost its full square.  Each halving adds two
  calls: given a price (the plan's cost model for the compiled heads, plus the host time of a
  call), a square is halved only where that pays (:func:`halving_rule`); without one, always;
* **class**: one batched call over many items with a mask.  Long bands (sliding windows) are cut
  into tiles of ``TILE`` rows; a tile whose band is wide becomes a left edge, a dense middle and a
  right edge, so that only the edges carry a mask (the batches' builders:
  :mod:`~striped_sp.kernels.batched`).  Small causal squares (16 to 128 rows) are
  padded at their end to a size class (of :data:`CAUSAL_CLASSES`, which ones priced by
  :func:`class_rule`) and called causal with no mask (equal ones back to back as one strided
  call).  Items of one shape and band share a single broadcast mask (or none); the rest (short
  documents, odd tiles) go into packs of consecutive items with a block-diagonal band mask, one
  batched call per size class.

Slots that no item owns gather row 0 and are dropped from the results (padding rows see one key
or only keys of padding, and get a zero output gradient, so their gradients are exact zeros: the
executor adds them to row 0 with the rest).
"""

from __future__ import annotations

import dataclasses

import torch

from .batched import (CAUSAL_CLASSES, UNIFORM_COUNT, Batch, _causal_batches, _excl_cumsum, _expand, _pack_batches,
                      _runs, _strided_batch, _uniform_batch)
from .segments import INF, Segments

__all__ = ["TILE", "LEAF", "Direct", "Batch", "Schedule", "schedule", "schedule_steps", "halving_rule",
           "class_rule"]

#: query rows per tile of a long band (and the largest pack class)
TILE = 128
#: causal squares of at least 2 * LEAF rows are halved into triangles and rectangles
LEAF = 128
#: smallest pack class (query rows)
MIN_CLASS = 16
#: a full or causal segment with at least this many score entries is called directly
DIRECT_ENTRIES = TILE * TILE
#: items of one shape and band, at least this tall (and :data:`UNIFORM_COUNT` many), share one
#: broadcast mask
UNIFORM_ROWS = 32
#: a tile is split into edges and a dense middle when the middle is at least this wide
MIDDLE_MIN = 64


@dataclasses.dataclass(frozen=True)
class Direct:
    """Rows ``q0:q1`` against keys ``k0:k1`` of the packed tensors, full or causal (square)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


@dataclasses.dataclass
class Schedule:
    """One call's pieces: :class:`Direct` calls and :class:`~striped_sp.kernels.batched.Batch` es."""

    direct: list
    batches: list


def _unique_rows(*cols: torch.Tensor):
    """``torch.unique(torch.stack(cols, 1), dim=0, return_inverse=True, return_counts=True)`` by
    one int64 key (each column numbered first): a 1-D unique is many times faster than ``dim=0``."""
    key, ids = None, []
    for c in cols:
        vals, inv = torch.unique(c, return_inverse=True)
        ids.append(vals)
        key = inv if key is None else key * vals.numel() + inv
    keys, inverse, counts = torch.unique(key, return_inverse=True, return_counts=True)
    digits = []
    for vals in reversed(ids):
        digits.append(vals[keys % vals.numel()])
        keys = torch.div(keys, vals.numel(), rounding_mode="floor")
    return torch.stack(digits[::-1], 1), inverse, counts


def _groups(inverse: torch.Tensor, counts: torch.Tensor):
    """``members(u)``: the items of group ``u`` of a unique's ``inverse`` / ``counts``, in order
    (one stable sort instead of a scan of every item per group)."""
    order = torch.argsort(inverse, stable=True)
    starts = _excl_cumsum(counts).tolist()
    sizes = counts.tolist()
    return lambda u: order[starts[u]:starts[u] + sizes[u]]


def halving_rule(price, call_ns: float):
    """``halve(m)``: whether a causal square of ``m`` rows is cheaper halved (two squares of half
    the rows, each in turn as cheap as it gets, and one full rectangle) than called whole.
    ``price(rows, keys, causal)``: one call's kernel time (ns); ``call_ns``: what one more call
    costs beside it (its host work)."""
    memo: dict = {}

    def best(m: int) -> float:
        if m not in memo:
            whole = price(m, m, True)
            if m < 2 * LEAF:
                memo[m] = (whole, False)
            else:
                h = m // 2
                split = best(h) + best(m - h) + price(m - h, h, False) + 2 * call_ns
                memo[m] = (min(whole, split), split < whole)
        return memo[m][0]

    def halve(m: int) -> bool:
        best(m)
        return memo[m][1]

    return halve


def class_rule(item_ns, batch_ns: float):
    """``choose(lq, st)``: the size classes (a subset of :data:`CAUSAL_CLASSES`, ascending) that
    small causal squares of ``lq`` rows in the calls ``st`` are padded to, each square to the
    smallest chosen class that holds it.  Fewest predicted nanoseconds: ``item_ns(c)``, the kernel
    time of one square padded to ``c`` (both passes), for every square, plus ``batch_ns`` for every
    (call, class) batch, what one batched call costs beside its squares (its launch, its gathers
    and scatters).  A dynamic program over the classes: ``O(classes^2)`` after one pass over the
    squares."""
    classes = CAUSAL_CLASSES
    each = [float(item_ns(c)) for c in classes]

    def choose(lq: torch.Tensor, st: torch.Tensor) -> tuple:
        if lq.numel() == 0:
            return classes
        bucket = torch.searchsorted(torch.tensor(classes), lq)  # the smallest class that holds each
        count = torch.bincount(bucket, minlength=len(classes)).tolist()
        calls = int(st.max()) + 1
        present = torch.zeros(calls, len(classes) + 1, dtype=torch.int64)
        present[st, bucket + 1] = 1
        upto = present.cumsum(1)  # [call, j]: buckets below j that the call has
        # batches[i][j]: calls with a square in buckets i .. j - 1 (one batch each if one class holds them)
        batches = ((upto.unsqueeze(2) - upto.unsqueeze(1)) < 0).sum(0).tolist()
        top = int(bucket.max())
        best, prev = [0.0] + [float("inf")] * len(classes), [0] * (len(classes) + 1)
        for j in range(1, top + 2):  # class j - 1 chosen, holding buckets i .. j - 1
            for i in range(j):
                cost = best[i] + sum(count[i:j]) * each[j - 1] + batches[i][j] * batch_ns
                if cost < best[j]:
                    best[j], prev[j] = cost, i
        chosen, j = [], top + 1
        while j:
            chosen.append(classes[j - 1])
            j = prev[j]
        return tuple(reversed(chosen))

    return choose


def _halve_causal(q0: int, k0: int, m: int, out: list, halve=None) -> None:
    """Cover the causal square of ``m`` rows at (q0, k0) with triangles and rectangles, halving
    while ``halve(rows)`` says so (``None``: down to squares under ``2 * LEAF`` rows)."""
    if m < 2 * LEAF or (halve is not None and not halve(m)):
        out.append(Direct(q0, q0 + m, k0, k0 + m, True))
        return
    h = m // 2
    _halve_causal(q0, k0, h, out, halve)
    _halve_causal(q0 + h, k0 + h, m - h, out, halve)
    out.append(Direct(q0 + h, q0 + m, k0, k0 + h, False))


# Items below are tuples of int64 tensors ``(q0, lq, k0, lk, lo, hi, step)``, one entry per item:
# rows ``q0 .. q0 + lq - 1`` against keys ``k0 .. k0 + lk - 1`` seeing ``lo <= y - x <= hi``, of
# the call ``step`` of :func:`schedule_steps` (the calls are scheduled together, never mixed), in
# call order.

def _tiles(q0, lq, k0, lk, lo, hi, st):
    """Cut band segments into tiles of at most ``TILE`` rows, each keeping only its keys."""
    ntiles = (lq + TILE - 1) // TILE
    seg, t = _expand(ntiles)
    x0 = t * TILE
    x1 = torch.minimum(x0 + TILE, lq[seg])
    lo_s, hi_s = lo[seg], hi[seg]
    y0 = torch.clamp(x0 + lo_s, min=0)
    y1 = torch.minimum(x1 - 1 + hi_s, lk[seg] - 1) + 1
    return q0[seg] + x0, x1 - x0, k0[seg] + y0, y1 - y0, lo_s + x0 - y0, hi_s + x0 - y0, st[seg]


def _split_tiles(items):
    """Tiles with a wide band -> (left edges, dense middles, right edges, narrow tiles).

    In tile coordinates (rows ``0..lt``, keys ``0..kt``, visible ``lo <= y - x <= hi``): the left
    edge holds keys ``lo .. lt-1+lo`` (only lower bounds cut it), the middle ``lt+lo .. hi-1``
    (seen by every row), the right edge ``hi .. lt-1+hi`` (only upper bounds cut it).  Every row
    sees at least one key of each non-empty part."""
    q0, lt, k0, kt, lo, hi, st = items
    lo_c = torch.maximum(lo, -lt)
    hi_c = torch.minimum(hi, kt)
    mid0, mid1 = torch.clamp(lt + lo_c, min=0), torch.minimum(hi_c - 1, kt - 1)
    wide = mid1 - mid0 + 1 >= MIDDLE_MIN
    narrow = tuple(t[~wide] for t in items)
    q0, lt, k0, kt, lo_c, hi_c, mid0, mid1, st = (t[wide] for t in (q0, lt, k0, kt, lo_c, hi_c, mid0, mid1, st))
    l0, l1 = torch.clamp(lo_c, min=0), lt - 1 + lo_c
    has_l = l1 >= 0
    left = (q0[has_l], lt[has_l], (k0 + l0)[has_l], (l1 - l0 + 1)[has_l], (lo_c - l0)[has_l],
            torch.full_like(lt[has_l], INF), st[has_l])
    r0, r1 = hi_c, torch.minimum(lt - 1 + hi_c, kt - 1)
    has_r = r0 <= kt - 1
    right = (q0[has_r], lt[has_r], (k0 + r0)[has_r], (r1 - r0 + 1)[has_r], torch.full_like(lt[has_r], -INF),
             (hi_c - r0)[has_r], st[has_r])
    middle = (q0, lt, k0 + mid0, mid1 - mid0 + 1, st)
    return left, middle, right, narrow


def _square_batches(q0, lq, k0, st, out: list, classes=None) -> None:
    """Small causal squares: runs of equal ones back to back (the diagonal tiles of a long band)
    as strided views, the others by class (:func:`_causal_batches`)."""
    rest = torch.ones(lq.numel(), dtype=torch.bool)
    # one pass over every call and size: in (call, size, first row) order a run also breaks where
    # the call or the size changes
    group = st * (TILE + 1) + lq
    order = torch.argsort(group * (int(q0.max()) + 1) + q0)
    for a, b in _runs(q0[order], k0[order], lq[order], group[order]):
        idx = order[a:b]
        m = int(lq[idx[0]])
        out[int(st[idx[0]])].batches.append(_strided_batch(q0[idx], k0[idx], m, m, None, causal=True))
        rest[idx] = False
    if bool(rest.any()):
        q0, lq, k0, st = q0[rest], lq[rest], k0[rest], st[rest]
        _causal_batches(q0, lq, k0, st, out, CAUSAL_CLASSES if classes is None else classes(lq, st))


def _masked_batches(items, out: list, classes=None) -> None:
    """Batches for band items with distinct rows (per call): causal squares by class, uniform
    shapes, then packs by size."""
    if items[1].numel() == 0:
        return
    q0, lq, k0, lk, lo, hi, st = items
    square = (lq == lk) & (lo <= 1 - lq) & (hi == 0) & (lq <= TILE) & (lq >= CAUSAL_CLASSES[0])
    if bool(square.any()):
        _square_batches(q0[square], lq[square], k0[square], st[square], out, classes)
        if bool(square.all()):
            return
        q0, lq, k0, lk, lo, hi, st = items = tuple(t[~square] for t in items)
    uniq, inverse, counts = _unique_rows(st, lq, lk, torch.maximum(lo, -lq), torch.minimum(hi, lk))
    chosen = (counts >= UNIFORM_COUNT) & (uniq[:, 1] >= UNIFORM_ROWS)
    members = _groups(inverse, counts)
    for u in chosen.nonzero().flatten().tolist():
        sel = members(u)
        t, a, b, c, d = uniq[u].tolist()
        out[t].batches += _uniform_batch(q0[sel], k0[sel], a, b, c, d)
    rest = ~chosen[inverse]
    items = tuple(t[rest] for t in items)
    lq, lk = items[1], items[3]
    if lq.numel():
        size = torch.maximum(lq, torch.clamp(lk, max=TILE))
        cls = torch.clamp(2 ** torch.ceil(torch.log2(size.double())).long(), min=MIN_CLASS)
        _pack_batches(items, cls, out)


def _dense_pieces(q0, lq, k0, lk, st, out: list) -> None:
    """Dense items: repeated shapes as one batched call, the others as direct calls (a pack's
    block-diagonal mask would cost their compute several times over: at 8 heads of 64, zigzag's
    small full rectangles measured about 5% slower as packs)."""
    if lq.numel() == 0:
        return
    uniq, inverse, counts = _unique_rows(st, lq, lk)
    members = _groups(inverse, counts)
    for u in (counts >= UNIFORM_COUNT).nonzero().flatten().tolist():
        sel = members(u)
        t, a, b = uniq[u].tolist()
        out[t].batches += _uniform_batch(q0[sel], k0[sel], a, b, None, None)
    few = counts[inverse] < UNIFORM_COUNT
    for t, s, a, c, b in zip(st[few].tolist(), q0[few].tolist(), lq[few].tolist(), k0[few].tolist(),
                             lk[few].tolist()):
        out[t].direct.append(Direct(s, s + a, c, c + b, False))


def schedule_steps(calls: list, halve=None, classes=None) -> list:
    """The pieces that cover each :class:`Segments` of ``calls`` (one :class:`Schedule` each,
    compiled once per batch into a :class:`~striped_sp.kernels.varlen.ScheduledCall`), derived
    for all of them at once: a plan's ring steps cost one pass of tensor ops, not one each.
    ``halve``: a :func:`halving_rule` (``None``: causal squares are halved down to the smallest);
    ``classes``: a :func:`class_rule` (``None``: every class of :data:`CAUSAL_CLASSES`)."""
    out = [Schedule([], []) for _ in calls]
    if not calls:
        return out
    st = torch.repeat_interleave(torch.arange(len(calls)), torch.tensor([len(s) for s in calls]))
    lq, lk = torch.cat([s.lq for s in calls]), torch.cat([s.lk for s in calls])
    bands = [s.offsets() for s in calls]
    lo, hi = torch.cat([b[0] for b in bands]), torch.cat([b[1] for b in bands])
    q0, k0 = torch.cat([s.q_start for s in calls]), torch.cat([s.k_start for s in calls])
    wl, wr = torch.cat([s.wl for s in calls]), torch.cat([s.wr for s in calls])
    full = (wl < 0) & (wr < 0)
    causal = (wl < 0) & (wr == 0) & (lq == lk)
    direct_sel = (full | causal) & (lq * lk >= DIRECT_ENTRIES)
    for t, a, n, c, m, cz in zip(st[direct_sel].tolist(), q0[direct_sel].tolist(), lq[direct_sel].tolist(),
                                 k0[direct_sel].tolist(), lk[direct_sel].tolist(), causal[direct_sel].tolist()):
        if cz:
            _halve_causal(a, c, n, out[t].direct, halve)
        else:
            out[t].direct.append(Direct(a, a + n, c, c + m, False))
    rest = ~direct_sel
    tiles = _tiles(q0[rest], lq[rest], k0[rest], lk[rest], lo[rest], hi[rest], st[rest])
    left, middle, right, narrow = _split_tiles(tiles)
    # each group has distinct rows (a row may appear once in each group); narrow tiles and middles
    # share none with a direct piece (those are other segments, or the middles of other tiles):
    # batches carry their group, for the merge layers
    done = [0] * len(out)
    for group, items in enumerate((narrow, left, right, middle)):
        if group < 3:
            _masked_batches(items, out, classes)
        else:
            _dense_pieces(*items, out)
        for t, sched in enumerate(out):
            for p in sched.batches[done[t]:]:
                p.group = group
            done[t] = len(sched.batches)
    return out


def schedule(segs: Segments, halve=None, classes=None) -> Schedule:
    """The pieces that cover ``segs`` (:func:`schedule_steps` of one call)."""
    return schedule_steps([segs], halve, classes)[0]
