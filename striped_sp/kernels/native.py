"""Varlen programs for kernels with a varlen entry point (flash-attn, PyTorch's CUDA flash op):
one call per window class on the rows of its segments, compiled for a whole plan at once
(:func:`native_programs`).  Formats as in :mod:`striped_sp.kernels.varlen`.

A native call packs every segment's keys back to back, so segments that share keys gather them
once each.  Stripes of one document against a block of it are such a case: query stripe ``j``
sees the keys of the whole prefix up to its own stripe (a staircase), and 32 stripes of 512 rows
gathered about 15 times the block's keys per step.  :func:`unfold_staircases` rewrites such runs
before the grouping, exactly and with no key twice: one causal segment over the whole run, shifted
so that each stripe's last row sees its whole prefix, and per stripe the triangle of keys that the
causal edge cuts off from its other rows (window ``(0, -1)``): two calls instead of one.

Window classes are launches: a varlen kernel takes one window per call, and a ring step's calls
share their launches (:func:`native_programs`' launch sets: their outputs merge call by call).  A
window cuts the segments of a windowed packed row at offsets of their own (``(wl, -1)`` and
``(wl, 0)`` for many ``wl``: 3-6 classes per ring step under per-document stripes and zigzag).
Where a step has more than two classes, :func:`split_bands` cuts each causal band into causal
squares and window edges, :func:`fold_window_edges` each edge into at most a full rectangle and
a causal square on reversed rows (keys from row ``u`` on are, read backwards, keys up to row
``u``), and the unfolded triangles likewise run reversed: exactly, in the causal and full
launches (2 per step).  A step of at most two classes keeps its windows (spans, no gathers)."""

from __future__ import annotations

import dataclasses

import torch

from .arena import Arena, Slot
from .merge import merge_block_safe as _merge
from .merge import merge_rows as _merge_rows
from .segments import _ranges

__all__ = ["NativeCall", "native_programs", "unfold_staircases"]


@dataclasses.dataclass
class _Group:
    """One native varlen call: the segments of one window ``(wl, wr)``, their rows in the
    ``[b * L]`` flattening (every batch row in turn), int32 cu_seqlens and longest segments.
    Rows that are one range in order (a striped row's every document, back to back) are a span:
    the call takes a slice of the tensors instead of gathering them, and merges into a slice."""

    wl: int
    wr: int
    q_rows: Slot | None  # None: the rows are q_span
    cu_q: Slot
    max_q: int
    k_rows: Slot | None
    cu_k: Slot
    max_k: int
    total_q: int
    q_span: tuple | None = None  # (first, count): the rows are first .. first + count - 1, in order
    k_span: tuple | None = None
    #: ``(offset, count)`` of the output rows merged at once: one part, or (calls of one launch set
    #: whose query rows repeat) one per call, each with distinct rows
    parts: tuple = ()
    part_rows: tuple = ()  # each part's rows (views of q_rows, placed with it)

    @property
    def window(self) -> tuple:
        """``(wl, wr)`` as kernels take it: the neutral form, ``None`` for an open side."""
        return (None if self.wl < 0 else self.wl), (None if self.wr < 0 else self.wr)


class NativeCall:
    """A varlen call for kernels with a varlen entry point, compiled for batch size ``b`` and
    local lengths ``nq`` / ``nk``: one call per window class (:func:`native_programs`)."""

    def __init__(self, groups: list):
        self.groups = groups

    def launches(self) -> int:
        return len(self.groups)

    def gathered_keys(self) -> int:
        """Key rows gathered per forward (the values' the same): the groups' rows that are no span."""
        return sum(g.k_rows.t.numel() for g in self.groups if g.k_span is None)

    def forward(self, kernel, q, k, v, scale, acc_out, acc_lse) -> None:
        """``kernel.varlen_forward_op(q, k, v, cu_q, cu_k, max_q, max_k, wl, wr, scale) -> (out [T, h, d],
        lse [h, T])`` once per window group on the gathered rows, merged into the accumulators."""
        b, nq, h, d = q.shape
        nk = k.size(1)
        qf, kf, vf = q.reshape(b * nq, h, d), k.reshape(b * nk, *k.shape[2:]), v.reshape(b * nk, *v.shape[2:])
        acc_f = acc_out.view(b * nq, h, acc_out.size(-1)).unsqueeze(0)
        lse_f = acc_lse.transpose(0, 1).reshape(1, h, b * nq)
        for g in self.groups:
            kg, vg = _take(kf, g.k_span, g.k_rows), _take(vf, g.k_span, g.k_rows)
            o, l = kernel.varlen_forward_op(_take(qf, g.q_span, g.q_rows), kg, vg, g.cu_q.t, g.cu_k.t, g.max_q,
                                            g.max_k, *g.window, scale)
            o, l = o.unsqueeze(0), l[:, : g.total_q].to(lse_f.dtype).unsqueeze(0)
            if g.q_span is not None:
                a, n = g.q_span
                _merge(acc_f[:, a:a + n], lse_f[:, :, a:a + n], o, l)
            elif len(g.parts) < 2:
                _merge_rows(acc_f, lse_f, g.q_rows.t, o, l)
            else:  # a row merges once per part: the parts' rows repeat
                sizes = [n for _, n in g.parts]
                for rows, o_p, l_p in zip(g.part_rows, o.split(sizes, 1), l.split(sizes, 2)):
                    _merge_rows(acc_f, lse_f, rows.t, o_p, l_p)
        if b != 1 or not acc_lse.is_contiguous():  # else lse_f is a view of acc_lse
            acc_lse.copy_(lse_f.view(h, b, nq).transpose(0, 1))

    def backward(self, kernel, dout, q, k, v, out, lse, scale, dq, dk, dv) -> None:
        """``kernel.varlen_backward_op(dout, q, k, v, out, lse [h, T], cu_q, cu_k, max_q, max_k, wl, wr, scale)
        -> (dq, dk, dv)`` per window group, added into the float32 gradients."""
        b, nq, h, d = q.shape
        nk = k.size(1)

        def flat(x, n):
            return x.reshape(b * n, *x.shape[2:])

        qf, kf, vf, dof, of = flat(q, nq), flat(k, nk), flat(v, nk), flat(dout, nq), flat(out, nq)
        lf = lse.transpose(0, 1).reshape(h, b * nq)
        dqf, dkf, dvf = dq.view(b * nq, h, d), dk.view(b * nk, *k.shape[2:]), dv.view(b * nk, *v.shape[2:])
        for g in self.groups:
            qs, qr, ks, kr = g.q_span, g.q_rows, g.k_span, g.k_rows
            lse_g = lf.narrow(1, *qs) if qs is not None else lf.index_select(1, qr.t)
            grads = kernel.varlen_backward_op(_take(dof, qs, qr), _take(qf, qs, qr), _take(kf, ks, kr),
                                              _take(vf, ks, kr), _take(of, qs, qr), lse_g.contiguous(), g.cu_q.t,
                                              g.cu_k.t, g.max_q, g.max_k, *g.window, scale)
            _add(dqf, qs, qr, grads[0].to(dqf.dtype))
            _add(dkf, ks, kr, grads[1].to(dkf.dtype))
            _add(dvf, ks, kr, grads[2].to(dvf.dtype))


def _take(x: torch.Tensor, span: tuple | None, rows: Slot | None) -> torch.Tensor:
    """Rows of ``x`` ``[T, ...]``: a slice for a span, else gathered."""
    return x.narrow(0, *span) if span is not None else x.index_select(0, rows.t)


def _add(x: torch.Tensor, span: tuple | None, rows: Slot | None, value: torch.Tensor) -> None:
    if span is not None:
        x.narrow(0, *span).add_(value)
    else:
        x.index_add_(0, rows.t, value)


def native_programs(calls: list, b: int, nq: int, nk: int, arena: Arena, launch_sets: list | None = None) -> list:
    """:class:`NativeCall` programs of many varlen calls at once (``calls``: their
    :class:`Segments`), vectorised over every call and window class: the rows, int32 cu_seqlens
    and longest segments of all groups come from one pass, their slots are views of four arena
    tensors.  Within a group, entries run call by call, batch row by batch row, each in segment
    order.

    ``launch_sets``: per call, the program it joins (default: a program per call).  The calls of
    one set share their launches, one per window class (a ring step's calls: zigzag's and
    per-document stripes' second key piece of a document is a call of its own, since its query
    rows repeat the first's); their outputs then merge call by call.  One program per set.  An
    unfolded staircase's triangles run with the causal class on reversed rows, merged apart."""
    if not calls:
        return []
    counts = torch.tensor([len(c) for c in calls], dtype=torch.int64)
    call = torch.repeat_interleave(torch.arange(len(calls)), counts)
    sets = torch.arange(len(calls)) if launch_sets is None else torch.as_tensor(launch_sets, dtype=torch.int64)
    wl, wr, q0, k0, lq, lk = (torch.cat([getattr(c, f) for c in calls]) for f in ("wl", "wr", "q_start", "k_start",
                                                                                  "lq", "lk"))
    # window edges as full and (reversed) causal segments: before the unfolding, whose triangles
    # share the rows of their causal run and so must stay a class of their own
    # a call whose stripes gather a block's worth of keys more than once is unfolded; its triangles
    # (the window (0, -1) segments it makes) share their causal run's rows
    orig = torch.ones_like(call, dtype=torch.bool)
    call, wl, wr, q0, k0, lq, lk, orig = unfold_staircases(call, wl, wr, q0, k0, lq, lk, min_saving=nk, extra=(orig,))
    tri = ~orig & (wl == 0) & (wr < 0)
    # in a launch set of more than two window classes: causal bands as causal squares and window
    # edges (whose rows are the squares'), every edge as full and (reversed) causal segments; the
    # pieces that share rows with others of their class are merged apart (parts)
    crowded = _crowded(sets, call, wl, wr)
    call, wl, wr, q0, k0, lq, lk, lower, tri = split_bands(call, wl, wr, q0, k0, lq, lk, only=crowded[sets[call]],
                                                           extra=(tri,))
    call, wl, wr, q0, k0, lq, lk, rev, _, lower, tri = fold_window_edges(call, wl, wr, q0, k0, lq, lk,
                                                                         extra=(lower, tri), only=crowded[sets[call]])
    part = call * 3 + torch.where(tri, 1, torch.where(lower, 2, 0))
    # one int64 key per (call, window): windows numbered first (1-D uniques are fast, dim=0 is not)
    wls, wl_id = torch.unique(wl, return_inverse=True)
    wrs, wr_id = torch.unique(wr, return_inverse=True)
    uniq, group = torch.unique((sets[call] * wls.numel() + wl_id) * wrs.numel() + wr_id, return_inverse=True)
    keys = torch.stack([uniq // (wls.numel() * wrs.numel()), wls[uniq // wrs.numel() % wls.numel()],
                        wrs[uniq % wrs.numel()]], 1)
    # entries (segment, batch row) ordered by group, then call, then batch row, then segment order
    seg = torch.arange(call.numel()).repeat(b)
    row = torch.arange(b).repeat_interleave(call.numel())
    order = torch.argsort(((group[seg] * 3 * len(calls) + part[seg]) * b + row) * max(call.numel(), 1) + seg)
    seg, row = seg[order], row[order]
    g_of = group[seg]
    sizes = torch.bincount(g_of, minlength=keys.size(0))
    lens_q, lens_k, rev_e = lq[seg], lk[seg], rev[seg]
    firsts = torch.cumsum(sizes, 0) - sizes  # each group's first entry

    def cu(lens):  # per group [0, cumsum of its lens]: groups back to back, (entries + 1) each
        csum = torch.cumsum(lens, 0)
        base = (csum - lens)[firsts]
        vals = csum - torch.repeat_interleave(base, sizes)
        out = torch.zeros(lens.numel() + keys.size(0), dtype=torch.int64)
        at = torch.arange(lens.numel()) + torch.repeat_interleave(torch.arange(keys.size(0)), sizes) + 1
        out[at] = vals
        return out.to(torch.int32)

    def per_group(x, how):
        return torch.zeros(keys.size(0), dtype=torch.int64).scatter_reduce(0, g_of, x, how, include_self=False)

    max_q, max_k = per_group(lens_q, "amax").tolist(), per_group(lens_k, "amax").tolist()
    tot_q, tot_k = per_group(lens_q, "sum"), per_group(lens_k, "sum")
    cu_first = (torch.cumsum(sizes + 1, 0) - (sizes + 1)).tolist()  # group g holds sizes[g] + 1 values
    cus_q, cus_k = arena.add(cu(lens_q)), arena.add(cu(lens_k))
    q_rows = _group_rows(q0[seg] + row * nq, lens_q, g_of, sizes, tot_q, arena, rev_e)
    k_rows = _group_rows(k0[seg] + row * nk, lens_k, g_of, sizes, tot_k, arena, rev_e)
    parts = _parts(g_of, part[seg], lens_q, q0[seg] + row * nq, keys.size(0))
    tot_q, sizes = tot_q.tolist(), sizes.tolist()
    programs = [[] for _ in range(int(sets.max()) + 1)]
    for g, (c, w_l, w_r) in enumerate(keys.tolist()):
        (q_span, q_slot), (k_span, k_slot) = q_rows[g], k_rows[g]
        # flash-attn turns an unbounded side of a one-sided window into max_seqlen_k; with
        # bottom-right alignment that is exact only when max_seqlen_k >= every segment's lq
        programs[c].append(_Group(w_l, w_r, q_slot, arena.view(cus_q, cu_first[g], sizes[g] + 1), max_q[g], k_slot,
                                  arena.view(cus_k, cu_first[g], sizes[g] + 1), max(max_q[g], max_k[g]), tot_q[g],
                                  q_span, k_span, parts[g],
                                  tuple(arena.view(q_slot, a, n) for a, n in parts[g]) if q_slot is not None else ()))
    return [NativeCall(groups) for groups in programs]


def _parts(g_of, call_e, lens_q, starts, groups: int) -> list:
    """Per group, the ``(offset, count)`` of its output rows per part (a call, or a call's
    unfolded triangles) when its query rows repeat, else ``()``: one merge.  Entries (int64, in
    entry order: a group's back to back) give their group, part, rows and first row; rows repeat
    where two of a group's ranges overlap, found on the ranges sorted by start (no row expanded)."""
    out = [()] * groups
    if g_of.numel() == 0:
        return out
    same = g_of[1:] == g_of[:-1]
    multi = torch.zeros(groups, dtype=torch.bool)
    multi[g_of[1:][same & (call_e[1:] != call_e[:-1])]] = True  # groups of more than one part
    if not bool(multi.any()):
        return out
    live = multi[g_of] & (lens_q > 0)
    if not bool(live.any()):
        return out
    g, start, end = g_of[live], starts[live], (starts + lens_q)[live]
    span = int(end.max()) + 1  # a group's ranges sorted by start, each group above the ones before
    order = torch.argsort(g * span + start)
    g, start, end = g[order], start[order] + g[order] * span, end[order] + g[order] * span
    reach = torch.cummax(end, 0).values  # the furthest row reached so far, within the group
    repeats = torch.zeros(groups, dtype=torch.bool)
    repeats[g[1:][start[1:] < reach[:-1]]] = True
    if not bool(repeats.any()):
        return out
    # per group, its runs of one part in entry order and their rows
    run_start = torch.ones_like(g_of, dtype=torch.bool)
    run_start[1:] = ~same | (call_e[1:] != call_e[:-1])
    run = torch.cumsum(run_start, 0) - 1
    rows_per = torch.zeros(int(run[-1]) + 1, dtype=torch.int64).index_add_(0, run, lens_q)
    run_group = g_of[run_start]
    for grp in repeats.nonzero().flatten().tolist():
        counts = rows_per[run_group == grp]
        offsets = torch.cumsum(counts, 0) - counts
        out[grp] = tuple(zip(offsets.tolist(), counts.tolist()))
    return out


def _runs_of(link: torch.Tensor) -> tuple:
    """``(in_run, run, first)`` of segments that ``link`` to the one before: members of runs of
    at least two, every segment's run number (a lone segment its own), the runs' first segments."""
    in_run = link.clone()
    in_run[:-1] |= link[1:]
    return in_run, torch.cumsum(~link, 0) - 1, in_run & ~link


def _crowded(sets, call, wl, wr) -> torch.Tensor:
    """Per launch set, whether its segments hold more than two window classes (launches)."""
    if call.numel() == 0:
        return torch.zeros(int(sets.max()) + 1, dtype=torch.bool)
    key = (sets[call] * (wl.max() + 2) + wl + 1) * (wr.max() + 2) + wr + 1
    uniq = torch.unique(key)
    per_set = torch.bincount(uniq // ((wl.max() + 2) * (wr.max() + 2)), minlength=int(sets.max()) + 1)
    return per_set > 2


def split_bands(call, wl, wr, q0, k0, lq, lk, only=None, extra: tuple = ()) -> tuple:
    """Segments (int64, in call order) with every causal band ``(wl >= 0, wr = 0)`` cut into
    blocks of ``B = max(wl, 1)`` rows, each a causal square (its rows against the ``B`` keys
    ending on its diagonal) and a window edge (the same rows against the ``wl`` keys before,
    ``y >= x + sh - wl``) for :func:`fold_window_edges`; the same fields and a bool ``lower`` (an
    edge made here: its rows are its square's), still in call order.  A band's first
    ``lq - lk`` rows, which see no key, go.  ``only``: the segments that may be split; ``extra``:
    more per-segment tensors, carried (``False`` / 0 for the new segments), returned last."""
    band = (wl >= 0) & (wr == 0)
    if only is not None:
        band &= only
    lower = torch.zeros_like(call, dtype=torch.bool)
    if not bool(band.any()):
        return call, wl, wr, q0, k0, lq, lk, lower, *extra
    blind = (lq - lk).clamp(min=0)[band]
    b_wl, b_lq = wl[band], lq[band] - blind
    size = b_wl.clamp(min=1)
    blocks = (b_lq + size - 1) // size
    which = torch.repeat_interleave(torch.arange(b_wl.numel()), blocks)
    j = torch.arange(which.numel()) - torch.repeat_interleave(torch.cumsum(blocks, 0) - blocks, blocks)
    w, sz, sh = b_wl[which], size[which], (lk[band] - b_lq)[which]  # sh >= 0
    x0 = j * sz
    rows = torch.minimum(sz, b_lq[which] - x0)
    bq0, bk0, bcall = (q0[band] + blind)[which] + x0, k0[band][which], call[band][which]
    ks = (x0 + sh - w).clamp(min=0)  # the edge's keys: [ks, x0 + sh), the square's: [x0 + sh, x0 + sh + rows)
    e_lk = x0 + sh - ks
    e_wl = e_lk - rows - (x0 + sh - w - ks)  # y >= x + sh - w, bottom-right: >= 0 as rows <= max(w, 1)
    minus, zero = torch.full_like(w, -1), torch.zeros_like(w)
    parts = [  # (call, wl, wr, q0, k0, lq, lk, lower, *extra): kept, the squares, the edges
        (call[~band], wl[~band], wr[~band], q0[~band], k0[~band], lq[~band], lk[~band], lower[~band],
         *(x[~band] for x in extra)),
        (bcall, minus, zero, bq0, bk0 + x0 + sh, rows, rows, zero.bool(), *(torch.zeros_like(x[which]) for x in extra)),
        (bcall, e_wl.clamp(min=0), minus, bq0, bk0 + ks, rows, e_lk, ~zero.bool(),
         *(torch.zeros_like(x[which]) for x in extra)),
    ]
    n = call.numel()
    idx = torch.arange(n)[band][which]
    where = torch.cat([torch.arange(n)[~band], idx, idx])
    fields = [torch.cat(f) for f in zip(*parts)]
    keep = ((fields[5] > 0) & (fields[6] > 0)).nonzero().flatten()
    keep = keep[torch.argsort(fields[0][keep] * n + where[keep], stable=True)]  # one gather per field
    return tuple(f[keep] for f in fields)


def fold_window_edges(call, wl, wr, q0, k0, lq, lk, extra: tuple = (), only=None) -> tuple:
    """Segments (int64, concatenated, in call order) with every window edge ``(wl >= 0, wr = -1)``
    rewritten into at most three that need no window (module docstring); the same fields and a
    bool ``rev`` per segment (its rows, queries and keys, read backwards) and a bool ``folded``
    (a piece of an edge), still in call order; then ``extra`` (per-segment tensors, each piece
    taking its edge's value).  ``only``: the segments that may be folded.

    Edge ``t`` shows query ``x`` the keys ``y >= x + c`` with ``c = lk - lq - wl``.  With
    ``c > 0`` its first ``c`` keys are seen by no query and go; with ``c <= 0`` its first
    ``1 - c`` queries see every key (a full rectangle) and the rest, one key later, see ``y >= x``.
    Then the keys from row ``lq`` on are seen by every query (a full rectangle), queries from row
    ``lk`` on see none, and the square left, ``y >= x``, is a bottom-right causal square on
    reversed rows.  Query rows stay distinct within each class."""
    edge = (wl >= 0) & (wr < 0)
    if only is not None:
        edge &= only
    rev = torch.zeros_like(call, dtype=torch.bool)
    if not bool(edge.any()):
        return call, wl, wr, q0, k0, lq, lk, rev, rev, *extra
    e_call, e_q0, e_k0, e_lq, e_lk = call[edge], q0[edge], k0[edge], lq[edge], lk[edge]
    c = e_lk - e_lq - wl[edge]
    drop = c.clamp(min=0)  # keys no query sees
    full_rows = torch.minimum((1 - c).clamp(min=0), e_lq)  # queries that see every key
    # the rest: queries from full_rows on, keys one on (c <= 0) or ``drop`` on (c > 0): y >= x
    shift = torch.where(c > 0, drop, torch.where(full_rows > 0, torch.ones_like(c), torch.zeros_like(c)))
    r_q0, r_lq = e_q0 + full_rows, e_lq - full_rows
    r_k0, r_lk = e_k0 + shift, (e_lk - shift).clamp(min=0)
    r_lq = torch.minimum(r_lq, r_lk)  # queries past the last key see none
    full = torch.full_like(c, -1)
    no, yes = rev[edge], torch.ones_like(rev[edge])
    parts = [  # (call, wl, wr, q0, k0, lq, lk, rev, folded, *extra): kept, the full rows, the square, the keys past it
        (call[~edge], wl[~edge], wr[~edge], q0[~edge], k0[~edge], lq[~edge], lk[~edge], rev[~edge], rev[~edge],
         *(x[~edge] for x in extra)),
        (e_call, full, full, e_q0, e_k0, full_rows, e_lk, no, yes, *(x[edge] for x in extra)),
        (e_call, full, torch.zeros_like(c), r_q0, r_k0, r_lq, r_lq, yes, yes, *(x[edge] for x in extra)),
        (e_call, full, full, r_q0, r_k0 + r_lq, r_lq, r_lk - r_lq, no, yes, *(x[edge] for x in extra)),
    ]
    n = call.numel()
    where = torch.cat([torch.arange(n)[~edge], *(torch.arange(n)[edge] for _ in range(3))])
    fields = [torch.cat(f) for f in zip(*parts)]
    keep = ((fields[5] > 0) & (fields[6] > 0)).nonzero().flatten()
    keep = keep[torch.argsort(fields[0][keep] * n + where[keep], stable=True)]  # one gather per field
    out = [f[keep] for f in fields]
    out[7] = out[7] & (out[5] > 1)  # a reversed single row is the row itself
    return tuple(out)


def unfold_staircases(call, wl, wr, q0, k0, lq, lk, min_saving: int = 0, extra: tuple = (), fixed=None) -> tuple:
    """Segments (int64, concatenated, ``call``: each one's call, in call order) with every
    staircase run rewritten (module docstring); the same fields, still in call order.

    A run: full segments of one call, one after the other, whose rows lie back to back, whose
    keys all start at one row, each with as many more keys than the one before as it has rows,
    and the first with at least as many keys as rows.  Its stripe ``j`` (rows ``l_j``, keys
    ``e_j``) becomes the rows of a causal segment over the run (keys ``e_last``, so each stripe's
    last row sees exactly its ``e_j`` keys) and, for ``l_j > 1``, a triangle: its first
    ``l_j - 1`` rows against its last ``l_j - 1`` keys with window ``(0, -1)`` (row ``u`` sees
    keys from ``u`` on), the keys that the causal edge leaves out.  Only calls that gather at
    least ``min_saving`` fewer key rows so are rewritten.  ``extra``: more per-segment tensors,
    carried along (0 / ``False`` for the new segments) and returned after the fields; ``fixed``
    (bool per segment): segments never taken into a run."""
    n = call.numel()
    if n < 2:
        return call, wl, wr, q0, k0, lq, lk, *extra
    full = (wl < 0) & (wr < 0)
    if fixed is not None:
        full = full & ~fixed
    link = torch.zeros(n, dtype=torch.bool)
    link[1:] = ((call[1:] == call[:-1]) & full[1:] & full[:-1] & (q0[1:] == q0[:-1] + lq[:-1])
                & (k0[1:] == k0[:-1]) & (lk[1:] == lk[:-1] + lq[1:]) & (lk[:-1] >= lq[:-1]))
    if not bool(link.any()):
        return call, wl, wr, q0, k0, lq, lk, *extra
    in_run, run, first = _runs_of(link)
    # the keys a call would gather less, unfolded: a run's last keys once and l - 1 per stripe
    # instead of every stripe's prefix; only a call that gathers at least ``min_saving`` fewer
    # unfolds (one or two more launches against a duplicated gather)
    last_keys = torch.zeros(int(run[-1]) + 1, dtype=torch.int64).scatter_reduce_(
        0, run[in_run], lk[in_run], "amax", include_self=False)
    calls = int(call[-1]) + 1
    saving = torch.zeros(calls, dtype=torch.int64).index_add_(0, call[in_run], (lk - torch.clamp(lq - 1, min=0))[in_run])
    saving.index_add_(0, call[first], -last_keys[run[first]])
    link &= (saving >= min_saving)[call]
    if not bool(link.any()):
        return call, wl, wr, q0, k0, lq, lk, *extra
    in_run, run, first = _runs_of(link)
    runs = run[first]  # the runs that are rewritten, in order
    rows = torch.zeros(int(run[-1]) + 1, dtype=torch.int64).index_add_(0, run[in_run], lq[in_run])[runs]
    last_keys = torch.zeros(int(run[-1]) + 1, dtype=torch.int64).scatter_reduce_(
        0, run[in_run], lk[in_run], "amax", include_self=False)[runs]
    tri = in_run & (lq > 1)
    keep = ~in_run
    parts = (  # (call, wl, wr, q0, k0, lq, lk, *extra) of the kept segments, the causal runs, the triangles
        (call[keep], wl[keep], wr[keep], q0[keep], k0[keep], lq[keep], lk[keep], *(x[keep] for x in extra)),
        (call[first], torch.full_like(rows, -1), torch.zeros_like(rows), q0[first], k0[first], rows, last_keys,
         *(torch.zeros_like(x[first]) for x in extra)),
        (call[tri], torch.zeros_like(lq[tri]), torch.full_like(lq[tri], -1), q0[tri], (k0 + lk - lq + 1)[tri],
         lq[tri] - 1, lq[tri] - 1, *(torch.zeros_like(x[tri]) for x in extra)),
    )
    # back in call order; inside a call the kept and causal segments in their order, then the triangles
    where = torch.cat([torch.arange(n)[keep], torch.arange(n)[first], n + torch.arange(n)[tri]])
    fields = [torch.cat(f) for f in zip(*parts)]
    order = torch.argsort(fields[0] * (2 * n) + where)
    return tuple(f[order] for f in fields)


def _group_rows(starts, lens, g_of, sizes, totals, arena, rev=None) -> list:
    """Per group ``(span, None)`` when its entries' rows (``starts`` / ``lens`` in entry order, a
    group's back to back; an entry with ``rev`` backwards) run as one range, else ``(None,
    slot)``: a view of one arena tensor that holds the rows of every group that is not a span
    (expanded only for those)."""
    groups = sizes.numel()
    gap = (starts[1:] != starts[:-1] + lens[:-1]) & (g_of[1:] == g_of[:-1])
    broken = torch.zeros(groups, dtype=torch.bool)
    broken[g_of[1:][gap]] = True
    if rev is not None and bool(rev.any()):
        broken[g_of[rev]] = True
    firsts = torch.cumsum(sizes, 0) - sizes
    first_row = starts[firsts.clamp(max=max(starts.numel() - 1, 0))] if starts.numel() else firsts
    out = [None] * groups
    for g, (b, a, n) in enumerate(zip(broken.tolist(), first_row.tolist(), totals.tolist())):
        if not b:
            out[g] = ((a, n), None)
    if bool(broken.any()):
        sel = broken[g_of]
        rows = _ranges(starts[sel], lens[sel], rev[sel] if rev is not None else None)
        tot = torch.where(broken, totals, torch.zeros_like(totals))
        at = (torch.cumsum(tot, 0) - tot).tolist()
        parent = arena.add(rows)
        for g in broken.nonzero().flatten().tolist():
            out[g] = (None, arena.view(parent, at[g], int(totals[g])))
    return out
