"""Batched calls of a schedule (:mod:`~striped_sp.kernels.schedule`): the :class:`Batch` format and
the builders that lay items out as batch entries: strided runs (views, no gather), uniform shapes
(one shared mask), small causal squares padded to a size class (no mask) and packs of short items
(a block-diagonal band mask per entry).  Each builder takes the items of several calls at once and
appends every call's batches to that call's schedule (``out[call].batches``).
"""

from __future__ import annotations

import dataclasses

import torch

from .segments import _ranges

#: items of one shape and band, at least this many, share one broadcast mask (and runs of at least
#: this many back to back become strided views)
UNIFORM_COUNT = 4
#: the sizes small causal squares are padded to (one batched call each; a square of ``m`` rows
#: costs at most ``(class / m) ** 2``, about 2, of its own entries); smaller ones go into packs
CAUSAL_CLASSES = (16, 24, 32, 48, 64, 96, 128)


@dataclasses.dataclass
class Batch:
    """``packs`` batch entries of ``cq`` rows x ``ck`` keys gathered by ``q_index`` / ``k_index``
    (local rows; padding slots gather row 0); ``mask``: ``None`` (dense), bool ``[1, 1, cq, ck]``
    (shared) or ``[packs, 1, cq, ck]``.  ``q_real`` / ``k_real``: the slots that hold real rows
    (``None``: all of them); ``q_pad``: the others (``None`` with ``q_real``), ``rows``: the local
    rows of the real slots, in slot order (the builders derive both for all batches at once; left
    ``None``, :meth:`pad_slots` / :meth:`real_rows` derive them)."""

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
    q_pad: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    #: the schedule's item group (0 narrow tiles, 1 left edges, 2 right edges, 3 dense middles):
    #: batches of one group share no row, and those of groups 0 and 3 none with a direct piece (an
    #: edge shares its tile's rows with the middle, which may be one); -1: not known
    group: int = -1

    def pad_slots(self) -> torch.Tensor | None:
        """The slots that hold no real row (``None``: there are none)."""
        if self.q_real is None or self.q_pad is not None:
            return self.q_pad
        keep = torch.ones(self.packs * self.cq, dtype=torch.bool)
        keep[self.q_real] = False
        return keep.nonzero().flatten()

    def real_rows(self) -> torch.Tensor:
        """The local query rows of the real slots, in slot order."""
        if self.rows is not None:
            return self.rows
        return self.q_index if self.q_real is None else self.q_index[self.q_real]


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _expand(lengths: torch.Tensor):
    """(item id, offset inside the item) of every element of the concatenated items."""
    item = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return item, torch.arange(item.numel()) - _excl_cumsum(lengths)[item]


def _runs(q0, k0, lq, group=None) -> list:
    """The runs ``(a, b)`` of items in query order, each of at least :data:`UNIFORM_COUNT` items
    of one size (``lq``: an int or one per item) and ``group``, rows back to back and keys at a
    fixed step."""
    n = q0.numel()
    if n < UNIFORM_COUNT:
        return []
    # a run breaks where the rows are not back to back or the key step changes
    dq, dk = q0[1:] - q0[:-1], k0[1:] - k0[:-1]
    breaks = torch.ones(n, dtype=torch.bool)
    breaks[1:] = dq != (lq if isinstance(lq, int) else lq[:-1])
    if group is not None:
        breaks[1:] |= group[1:] != group[:-1]
    breaks[2:] |= (dk[1:] != dk[:-1]) & ~breaks[1:-1]
    breaks[1:] |= dk <= 0
    starts = breaks.nonzero().flatten().tolist() + [n]
    return [(a, b) for a, b in zip(starts[:-1], starts[1:]) if b - a >= UNIFORM_COUNT]


def _strided_batch(q0, k0, lq: int, lk: int, mask, causal: bool = False) -> Batch:
    """Items back to back with keys at a fixed step (a run of :func:`_runs`), in order."""
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
    order = torch.argsort(q0)
    q0, k0 = q0[order], k0[order]
    runs = _runs(q0, k0, lq)
    batches = [_strided_batch(q0[a:b], k0[a:b], lq, lk, mask) for a, b in runs]
    rest = torch.ones(q0.numel(), dtype=torch.bool)
    for a, b in runs:
        rest[a:b] = False
    if bool(rest.any()):
        n = int(rest.sum())
        batches.append(Batch(_ranges(q0[rest], torch.full((n,), lq)), _ranges(k0[rest], torch.full((n,), lk)), mask,
                             n, lq, lk))
    return batches


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


def _pack_batches(items, cls, out: list) -> None:
    """Per call and size class ``cls`` (one per item), consecutive items whose first row falls in
    one ``cls``-wide window share a pack; one batch per (call, class), laid out for all at once."""
    key = items[6] * (int(cls.max()) + 1) + cls
    order = torch.argsort(key, stable=True)
    q0, lq, k0, lk, lo, hi, st = (t[order] for t in items)
    key, cls = key[order], cls[order]
    _, gsize = torch.unique_consecutive(key, return_counts=True)
    ngroups = gsize.numel()
    grp = torch.repeat_interleave(torch.arange(ngroups), gsize)
    g_item = _excl_cumsum(gsize)  # each group's first item
    q_at, k_at = _excl_cumsum(lq), _excl_cumsum(lk)  # each item's first row / key, all groups back to back
    start = q_at - q_at[g_item][grp]  # inside its group
    pk = torch.unique_consecutive(grp * (int(start.max()) + 1) + torch.div(start, cls, rounding_mode="floor"),
                                  return_inverse=True)[1]
    npk = int(pk[-1]) + 1
    pack_grp = torch.zeros(npk, dtype=torch.int64).scatter_(0, pk, grp)
    pin = torch.arange(npk) - pk[g_item][pack_grp]  # a pack's place in its group
    q_tot = torch.zeros(npk, dtype=torch.int64).index_add_(0, pk, lq)
    k_tot = torch.zeros(npk, dtype=torch.int64).index_add_(0, pk, lk)
    q_in, k_in = q_at - _excl_cumsum(q_tot)[pk], k_at - _excl_cumsum(k_tot)[pk]
    npacks = torch.bincount(pack_grp, minlength=ngroups)
    cq = torch.zeros(ngroups, dtype=torch.int64).scatter_reduce_(0, pack_grp, q_tot, "amax", include_self=False)
    ck = torch.zeros(ngroups, dtype=torch.int64).scatter_reduce_(0, pack_grp, k_tot, "amax", include_self=False)

    def lay_out(lengths, first, inside, width):
        # items in order, each pack's back to back from its slot 0: ``flat`` is increasing
        base = _excl_cumsum(npacks * width)
        item, off = _expand(lengths)
        flat = (base[pack_grp] + pin * width[pack_grp])[pk[item]] + inside[item] + off
        vals = first[item] + off
        index = torch.zeros(int((npacks * width).sum()), dtype=torch.int64).scatter_(0, flat, vals)
        return index, item, off, flat, base, vals

    q_index, item, off, q_flat, q_base, q_rows = lay_out(lq, q0, q_in, cq)
    row_item = torch.full_like(q_index, -1).scatter_(0, q_flat, item)
    row_x = torch.zeros_like(q_index).scatter_(0, q_flat, off)
    k_index, _, _, k_flat, k_base, _ = lay_out(lk, k0, k_in, ck)
    # A row sees one run of its pack's key slots: its item's keys inside the band.  The mask is
    # two int32 comparisons per entry against those bounds (its build is most of a CPU plan's
    # compile); a padding row sees the first key of its pack.
    it = torch.clamp(row_item, min=0)
    first = k_in[it] + torch.clamp(row_x + lo[it], min=0)
    end = k_in[it] + torch.minimum(lk[it] - 1, row_x + hi[it]) + 1
    pad = row_item < 0
    first, end = torch.where(pad, 0, first).int(), torch.where(pad, 1, end).int()
    # every group's slot numbers (real and padding) at once, local to its group: slices below
    q_end, k_end = q_base + npacks * cq, k_base + npacks * ck
    pad_at = pad.nonzero().flatten()
    pad_bounds = torch.searchsorted(pad_at, q_end).tolist()
    pad_at = pad_at - q_base[torch.searchsorted(q_end, pad_at, right=True)]
    q_real_at = q_flat - q_base[torch.searchsorted(q_end, q_flat, right=True)]
    k_real_at = k_flat - k_base[torch.searchsorted(k_end, k_flat, right=True)]
    rows_at, keys_at = q_at[g_item].tolist() + [int(lq.sum())], k_at[g_item].tolist() + [int(lk.sum())]
    pads_from = 0
    for g, (t, n, c_q, c_k, qb, kb) in enumerate(zip(st[g_item].tolist(), npacks.tolist(), cq.tolist(), ck.tolist(),
                                                     q_base.tolist(), k_base.tolist())):
        qs, ks = slice(qb, qb + n * c_q), slice(kb, kb + n * c_k)
        col = torch.arange(c_k, dtype=torch.int32)
        mask = (col >= first[qs].view(n, c_q, 1)) & (col < end[qs].view(n, c_q, 1))
        real = slice(rows_at[g], rows_at[g + 1])
        whole_q = rows_at[g + 1] - rows_at[g] == n * c_q
        q_real = None if whole_q else q_real_at[real]
        q_pad = None if whole_q else pad_at[pads_from:pad_bounds[g]]
        pads_from = pad_bounds[g]
        k_real = None if keys_at[g + 1] - keys_at[g] == n * c_k else k_real_at[keys_at[g]:keys_at[g + 1]]
        qi, ki = q_index[qs], k_index[ks]
        out[t].batches.append(Batch(qi, ki, mask.unsqueeze(1), n, c_q, c_k, q_real, k_real,
                                    _strided(qi, ki, n, c_q, c_k) if q_real is None and k_real is None else None,
                                    q_pad=q_pad, rows=q_rows[real]))


def _causal_batches(q0, lq, k0, st, out: list, classes: tuple = CAUSAL_CLASSES) -> None:
    """Causal squares of at most ``TILE`` rows, one batch per call and class of ``classes``
    (ascending, the last holding the largest square), each square padded at its end to the smallest
    class that holds it and called causal without a mask: a real row sees only keys before it, so
    never a padding key (padding rows are dropped, and add no gradient)."""
    which = torch.searchsorted(torch.tensor(classes), lq)
    for ci in torch.unique(which).tolist():
        c = classes[ci]
        sel = (which == ci).nonzero().flatten()
        steps, counts = torch.unique_consecutive(st[sel], return_counts=True)  # items come in call order
        off = torch.arange(c)
        real = (off.unsqueeze(0) < lq[sel].unsqueeze(1)).flatten()  # [n * c]
        q_index = torch.where(real, (q0[sel].unsqueeze(1) + off).flatten(), 0)
        k_index = torch.where(real, (k0[sel].unsqueeze(1) + off).flatten(), 0)
        # every call's real and padding slots at once, numbered inside the call's batch
        ends = torch.cumsum(counts, 0) * c
        real_at, pad_at = real.nonzero().flatten(), (~real).nonzero().flatten()
        real_bounds = [0] + torch.searchsorted(real_at, ends).tolist()
        pad_bounds = [0] + torch.searchsorted(pad_at, ends).tolist()
        rows = q_index[real_at]
        base = ends - counts * c
        real_at = real_at - base[torch.searchsorted(ends, real_at, right=True)]
        pad_at = pad_at - base[torch.searchsorted(ends, pad_at, right=True)]
        at = 0
        for j, (t, n) in enumerate(zip(steps.tolist(), counts.tolist())):
            qi, ki = q_index[at * c:(at + n) * c], k_index[at * c:(at + n) * c]
            whole = pad_bounds[j + 1] == pad_bounds[j]
            slots = None if whole else real_at[real_bounds[j]:real_bounds[j + 1]]
            pads = None if whole else pad_at[pad_bounds[j]:pad_bounds[j + 1]]
            strided = _strided(qi, ki, n, c, c) if slots is None else None
            out[t].batches.append(Batch(qi, ki, None, n, c, c, slots, slots, strided, causal=True, q_pad=pads,
                                        rows=rows[real_bounds[j]:real_bounds[j + 1]]))
            at += n
