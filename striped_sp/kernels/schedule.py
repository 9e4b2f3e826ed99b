"""How a varlen call (many band segments) is covered with few fused kernel calls.

For kernels without a varlen entry point (PyTorch's CPU flash op, the math reference, the CUDA
memory-efficient op), :func:`schedule` turns :class:`~striped_sp.plan.masks.Segments` into *pieces*,
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
  right edge, so that only the edges carry a mask.  Small causal squares (16 to 128 rows) are
  padded at their end to a size class (:data:`CAUSAL_CLASSES`) and called causal with no mask
  (equal ones back to back as one strided call).  Items of one shape and band share a single
  broadcast mask (or none); the rest (short documents, odd tiles) go into packs of consecutive
  items with a block-diagonal band mask, one batched call per size class.

Slots that no item owns gather row 0 and are dropped from the results (padding rows see one key
or only keys of padding, and get a zero output gradient, so their gradients are exact zeros: the
executor adds them to row 0 with the rest).
"""

from __future__ import annotations

import dataclasses

import torch

from .segments import INF, Segments, _ranges

__all__ = ["TILE", "LEAF", "Direct", "Batch", "Schedule", "schedule", "halving_rule"]

#: query rows per tile of a long band (and the largest pack class)
TILE = 128
#: causal squares of at least 2 * LEAF rows are halved into triangles and rectangles
LEAF = 128
#: smallest pack class (query rows)
MIN_CLASS = 16
#: a full or causal segment with at least this many score entries is called directly
DIRECT_ENTRIES = TILE * TILE
#: items of one shape and band, at least this many and this tall, share one broadcast mask
UNIFORM_COUNT, UNIFORM_ROWS = 4, 32
#: a tile is split into edges and a dense middle when the middle is at least this wide
MIDDLE_MIN = 64
#: the sizes small causal squares are padded to (one batched call each; a square of ``m`` rows
#: costs at most ``(class / m) ** 2``, about 2, of its own entries); smaller ones go into packs
CAUSAL_CLASSES = (16, 24, 32, 48, 64, 96, 128)


@dataclasses.dataclass(frozen=True)
class Direct:
    """Rows ``q0:q1`` against keys ``k0:k1`` of the packed tensors, full or causal (square)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


@dataclasses.dataclass
class Batch:
    """``packs`` batch entries of ``cq`` rows x ``ck`` keys gathered by ``q_index`` / ``k_index``
    (local rows; padding slots gather row 0); ``mask``: ``None`` (dense), bool ``[1, 1, cq, ck]``
    (shared) or ``[packs, 1, cq, ck]``.  ``q_real`` / ``k_real``: the slots that hold real rows
    (``None``: all of them)."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    mask: torch.Tensor | None
    packs: int
    cq: int
    ck: int
    q_real: torch.Tensor | None = None
    k_real: torch.Tensor | None = None
    #: ``(q_first, k_first, k_step)`` when entry ``p`` holds rows ``q_first + p*cq ..`` and keys
    #: ``k_first + p*k_step ..`` (the tiles of one long band): strided views replace the gathers
    strided: tuple | None = None
    #: (``mask`` ``None``) each entry a causal square (top-left: row ``x`` sees keys ``<= x``)
    causal: bool = False


@dataclasses.dataclass
class Schedule:
    direct: list
    batches: list


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


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


def _expand(lengths: torch.Tensor):
    """(item id, offset inside the item) of every element of the concatenated items."""
    item = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return item, torch.arange(item.numel()) - _excl_cumsum(lengths)[item]


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


def _tiles(q0, lq, k0, lk, lo, hi):
    """Cut band segments into tiles of at most ``TILE`` rows, each keeping only its keys."""
    ntiles = (lq + TILE - 1) // TILE
    seg, t = _expand(ntiles)
    x0 = t * TILE
    x1 = torch.minimum(x0 + TILE, lq[seg])
    lo_s, hi_s = lo[seg], hi[seg]
    y0 = torch.clamp(x0 + lo_s, min=0)
    y1 = torch.minimum(x1 - 1 + hi_s, lk[seg] - 1) + 1
    return q0[seg] + x0, x1 - x0, k0[seg] + y0, y1 - y0, lo_s + x0 - y0, hi_s + x0 - y0


def _split_tiles(items):
    """Tiles with a wide band -> (left edges, dense middles, right edges, narrow tiles).

    In tile coordinates (rows ``0..lt``, keys ``0..kt``, visible ``lo <= y - x <= hi``): the left
    edge holds keys ``lo .. lt-1+lo`` (only lower bounds cut it), the middle ``lt+lo .. hi-1``
    (seen by every row), the right edge ``hi .. lt-1+hi`` (only upper bounds cut it).  Every row
    sees at least one key of each non-empty part."""
    q0, lt, k0, kt, lo, hi = items
    lo_c = torch.maximum(lo, -lt)
    hi_c = torch.minimum(hi, kt)
    mid0, mid1 = torch.clamp(lt + lo_c, min=0), torch.minimum(hi_c - 1, kt - 1)
    wide = mid1 - mid0 + 1 >= MIDDLE_MIN
    narrow = tuple(t[~wide] for t in items)
    q0, lt, k0, kt, lo_c, hi_c, mid0, mid1 = (t[wide] for t in (q0, lt, k0, kt, lo_c, hi_c, mid0, mid1))
    l0, l1 = torch.clamp(lo_c, min=0), lt - 1 + lo_c
    has_l = l1 >= 0
    left = (q0[has_l], lt[has_l], (k0 + l0)[has_l], (l1 - l0 + 1)[has_l], (lo_c - l0)[has_l],
            torch.full_like(lt[has_l], INF))
    r0, r1 = hi_c, torch.minimum(lt - 1 + hi_c, kt - 1)
    has_r = r0 <= kt - 1
    right = (q0[has_r], lt[has_r], (k0 + r0)[has_r], (r1 - r0 + 1)[has_r], torch.full_like(lt[has_r], -INF),
             (hi_c - r0)[has_r])
    middle = (q0, lt, k0 + mid0, mid1 - mid0 + 1)
    return left, middle, right, narrow


def _runs(q0, k0, lq) -> list:
    """The runs ``(a, b)`` of items in query order, each of at least :data:`UNIFORM_COUNT` items
    of one size (``lq``: an int or one per item), rows back to back and keys at a fixed step."""
    n = q0.numel()
    if n < UNIFORM_COUNT:
        return []
    # a run breaks where the rows are not back to back or the key step changes
    dq, dk = q0[1:] - q0[:-1], k0[1:] - k0[:-1]
    breaks = torch.ones(n, dtype=torch.bool)
    breaks[1:] = dq != (lq if isinstance(lq, int) else lq[:-1])
    if not isinstance(lq, int):
        breaks[1:] |= lq[1:] != lq[:-1]
    breaks[2:] |= (dk[1:] != dk[:-1]) & ~breaks[1:-1]
    breaks[1:] |= dk <= 0
    starts = breaks.nonzero().flatten().tolist() + [n]
    return [(a, b) for a, b in zip(starts[:-1], starts[1:]) if b - a >= UNIFORM_COUNT]


def _strided_runs(q0, k0, lq: int) -> tuple[torch.Tensor, list]:
    """Items of ``lq`` rows in query order (``order``) and the runs ``(a, b)`` of that order, each
    of at least :data:`UNIFORM_COUNT` items, whose rows are back to back and whose keys start at a
    fixed step: one strided view each, no gather."""
    order = torch.argsort(q0)
    return order, _runs(q0[order], k0[order], lq)


def _strided_batch(q0, k0, lq: int, lk: int, mask, causal: bool = False) -> Batch:
    """Items back to back with keys at a fixed step (a run of :func:`_strided_runs`), in order."""
    n = q0.numel()
    step = int(k0[1] - k0[0])
    return Batch(_ranges(q0, torch.full((n,), lq)), _ranges(k0, torch.full((n,), lk)), mask, n, lq, lk,
                 strided=(int(q0[0]), int(k0[0]), step), causal=causal)


def _uniform_batch(q0, k0, lq: int, lk: int, lo: int | None, hi: int | None) -> list:
    """Items of one shape and band (``lo is None``: dense): one item per batch entry, one mask.
    Runs of consecutive tiles (rows back to back, keys at a fixed step) become strided batches."""
    mask = None
    if lo is not None:
        d = torch.arange(lk).unsqueeze(0) - torch.arange(lq).unsqueeze(1)
        mask = ((d >= lo) & (d <= hi)).view(1, 1, lq, lk)
    order, runs = _strided_runs(q0, k0, lq)
    q0, k0 = q0[order], k0[order]
    batches = [_strided_batch(q0[a:b], k0[a:b], lq, lk, mask) for a, b in runs]
    rest = torch.ones(q0.numel(), dtype=torch.bool)
    for a, b in runs:
        rest[a:b] = False
    if bool(rest.any()):
        n = int(rest.sum())
        batches.append(Batch(_ranges(q0[rest], torch.full((n,), lq)), _ranges(k0[rest], torch.full((n,), lk)), mask,
                             n, lq, lk))
    return batches


def _pack_batch(q0, lq, k0, lk, lo, hi, cls: int) -> Batch:
    """Consecutive items whose first row falls in one ``cls``-wide window share a pack."""
    start = _excl_cumsum(lq)
    pack = torch.unique_consecutive(torch.div(start, cls, rounding_mode="floor"), return_inverse=True)[1]
    npacks = int(pack[-1]) + 1
    q_tot = torch.zeros(npacks, dtype=torch.int64).index_add_(0, pack, lq)
    k_tot = torch.zeros(npacks, dtype=torch.int64).index_add_(0, pack, lk)
    q_in = start - _excl_cumsum(q_tot)[pack]
    k_in = _excl_cumsum(lk) - _excl_cumsum(k_tot)[pack]
    cq, ck = int(q_tot.max()), int(k_tot.max())

    def lay_out(lengths, first, inside, width):
        # items in order, each pack's back to back from its slot 0: ``flat`` is increasing
        item, off = _expand(lengths)
        flat = pack[item] * width + inside[item] + off
        index = torch.zeros(npacks * width, dtype=torch.int64).scatter_(0, flat, first[item] + off)
        return index, item, off, flat, None if flat.numel() == npacks * width else flat

    q_index, item, off, flat, q_real = lay_out(lq, q0, q_in, cq)
    row_item = torch.full((npacks * cq,), -1, dtype=torch.int64).scatter_(0, flat, item).view(npacks, cq)
    row_x = torch.zeros(npacks * cq, dtype=torch.int64).scatter_(0, flat, off).view(npacks, cq)
    k_index, _, _, _, k_real = lay_out(lk, k0, k_in, ck)
    # A row sees one run of its pack's key slots: its item's keys inside the band.  The mask is
    # two int32 comparisons per entry against those bounds (its build is most of a CPU plan's
    # compile); a padding row sees the first key of its pack.
    item = torch.clamp(row_item, min=0)
    first = k_in[item] + torch.clamp(row_x + lo[item], min=0)
    end = k_in[item] + torch.minimum(lk[item] - 1, row_x + hi[item]) + 1
    pad = row_item < 0
    first, end = torch.where(pad, 0, first).int().unsqueeze(2), torch.where(pad, 1, end).int().unsqueeze(2)
    col = torch.arange(ck, dtype=torch.int32)
    mask = (col >= first) & (col < end)
    return Batch(q_index, k_index, mask.unsqueeze(1), npacks, cq, ck, q_real, k_real,
                 _strided(q_index, k_index, npacks, cq, ck) if q_real is None and k_real is None else None)


def _strided(q_index, k_index, npacks: int, cq: int, ck: int) -> tuple | None:
    """``(q_first, k_first, k_step)`` when the packs' rows are back to back and their keys are
    windows at a fixed step (documents of one length, no padding), else ``None``."""
    qi, ki = q_index.view(npacks, cq), k_index.view(npacks, ck)
    if not bool((qi == qi[:1, :1] + torch.arange(npacks * cq).view(npacks, cq)).all()):
        return None
    step = int(ki[1, 0] - ki[0, 0]) if npacks > 1 else ck
    expect = ki[:1, :1] + step * torch.arange(npacks).unsqueeze(1) + torch.arange(ck).unsqueeze(0)
    if step <= 0 or not bool((ki == expect).all()):
        return None
    return int(qi[0, 0]), int(ki[0, 0]), step


def _causal_batches(q0, lq, k0) -> list:
    """Causal squares of at most ``TILE`` rows, one batch per :data:`CAUSAL_CLASSES` class, each
    square padded at its end to its class and called causal without a mask: a real row sees only
    keys before it, so never a padding key (padding rows are dropped, and add no gradient)."""
    classes = torch.tensor(CAUSAL_CLASSES)
    cls = classes[torch.searchsorted(classes, lq)]
    batches = []
    for c in torch.unique(cls).tolist():
        sel = cls == c
        n = int(sel.sum())
        off = torch.arange(c)
        real = off.unsqueeze(0) < lq[sel].unsqueeze(1)  # [n, c]
        q_index = torch.where(real, q0[sel].unsqueeze(1) + off, 0).flatten()
        k_index = torch.where(real, k0[sel].unsqueeze(1) + off, 0).flatten()
        slots = None if bool(real.all()) else real.flatten().nonzero().flatten()
        strided = _strided(q_index, k_index, n, c, c) if slots is None else None
        batches.append(Batch(q_index, k_index, None, n, c, c, slots, slots, strided, causal=True))
    return batches


def _square_batches(q0, lq, k0) -> list:
    """Small causal squares: runs of equal ones back to back (the diagonal tiles of a long band)
    as strided views, the others by class (:func:`_causal_batches`)."""
    batches, rest = [], torch.ones(lq.numel(), dtype=torch.bool)
    # one pass over every size: in (size, first row) order a run also breaks where the size changes
    order = torch.argsort(lq * (int(q0.max()) + 1) + q0) if lq.numel() else lq
    for a, b in _runs(q0[order], k0[order], lq[order]):
        idx = order[a:b]
        m = int(lq[idx[0]])
        batches.append(_strided_batch(q0[idx], k0[idx], m, m, None, causal=True))
        rest[idx] = False
    if bool(rest.any()):
        batches += _causal_batches(q0[rest], lq[rest], k0[rest])
    return batches


def _masked_batches(items) -> list:
    """Batches for band items with distinct rows: causal squares by class, uniform shapes, then
    packs by size."""
    if items[1].numel() == 0:
        return []
    q0, lq, k0, lk, lo, hi = items
    square = (lq == lk) & (lo <= 1 - lq) & (hi == 0) & (lq <= TILE) & (lq >= CAUSAL_CLASSES[0])
    batches = _square_batches(q0[square], lq[square], k0[square]) if bool(square.any()) else []
    if bool(square.all()):
        return batches
    q0, lq, k0, lk, lo, hi = items = tuple(t[~square] for t in items)
    uniq, inverse, counts = _unique_rows(lq, lk, torch.maximum(lo, -lq), torch.minimum(hi, lk))
    chosen = (counts >= UNIFORM_COUNT) & (uniq[:, 0] >= UNIFORM_ROWS)
    for u in chosen.nonzero().flatten().tolist():
        sel = inverse == u
        a, b, c, d = uniq[u].tolist()
        batches += _uniform_batch(q0[sel], k0[sel], a, b, c, d)
    rest = ~chosen[inverse]
    q0, lq, k0, lk, lo, hi = (t[rest] for t in items)
    if lq.numel():
        size = torch.maximum(lq, torch.clamp(lk, max=TILE))
        cls = torch.clamp(2 ** torch.ceil(torch.log2(size.double())).long(), min=MIN_CLASS)
        for c in torch.unique(cls).tolist():
            sel = cls == c
            batches.append(_pack_batch(q0[sel], lq[sel], k0[sel], lk[sel], lo[sel], hi[sel], int(c)))
    return batches


def _dense_pieces(q0, lq, k0, lk, direct: list) -> list:
    """Dense items: repeated shapes as one batched call, the others as direct calls (a pack's
    block-diagonal mask would cost their compute several times over: at 8 heads of 64, zigzag's
    small full rectangles measured about 5% slower as packs)."""
    batches = []
    if lq.numel() == 0:
        return batches
    uniq, inverse, counts = _unique_rows(lq, lk)
    for u in (counts >= UNIFORM_COUNT).nonzero().flatten().tolist():
        sel = inverse == u
        a, b = uniq[u].tolist()
        batches += _uniform_batch(q0[sel], k0[sel], a, b, None, None)
    few = counts[inverse] < UNIFORM_COUNT
    direct += [Direct(s, s + a, t, t + b, False) for s, a, t, b in zip(q0[few].tolist(), lq[few].tolist(),
                                                                       k0[few].tolist(), lk[few].tolist())]
    return batches


def schedule(segs: Segments, halve=None) -> Schedule:
    """The pieces that cover ``segs`` (compiled once per batch into a
    :class:`~striped_sp.kernels.varlen.ScheduledCall`); ``halve``: a :func:`halving_rule` (``None``:
    causal squares are halved down to the smallest)."""
    lq, lk = segs.lq, segs.lk
    lo, hi = segs.offsets()
    q0, k0 = segs.q_start, segs.k_start
    full = (segs.wl < 0) & (segs.wr < 0)
    causal = (segs.wl < 0) & (segs.wr == 0) & (lq == lk)
    direct_sel = (full | causal) & (lq * lk >= DIRECT_ENTRIES)
    direct: list = []
    for a, n, c, m, cz in zip(q0[direct_sel].tolist(), lq[direct_sel].tolist(), k0[direct_sel].tolist(),
                              lk[direct_sel].tolist(), causal[direct_sel].tolist()):
        if cz:
            _halve_causal(a, c, n, direct, halve)
        else:
            direct.append(Direct(a, a + n, c, c + m, False))
    rest = ~direct_sel
    tiles = _tiles(q0[rest], lq[rest], k0[rest], lk[rest], lo[rest], hi[rest])
    left, middle, right, narrow = _split_tiles(tiles)
    # each group has distinct rows; a row may appear once in each group
    batches = _masked_batches(narrow) + _masked_batches(left) + _masked_batches(right)
    batches += _dense_pieces(*middle, direct)
    return Schedule(direct, batches)
