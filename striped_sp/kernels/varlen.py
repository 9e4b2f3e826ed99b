"""Varlen calls (many band segments at once) straight into the ring's accumulators, from programs
compiled once per batch.

``q`` ``[b, Lq, h, d]`` and ``k``/``v`` ``[b, Lk, kv_heads, d]`` are a rank's whole local tensors;
the segments say which rows take part (:class:`~striped_sp.kernels.segments.Segments`).  Forward
merges each result into float32 accumulators ``acc_out`` ``[b, Lq, h, d]`` / ``acc_lse``
``[b, h, Lq]`` (rows not seen yet hold 0 / -inf); backward adds float32 gradients into ``dq`` /
``dk`` / ``dv``.  No input is copied as a whole: direct calls take slices, batched calls gather
only their rows.

A call runs from a *program* compiled once per batch (:func:`compile_call`), which holds every
index, mask and ``cu_seqlens`` it needs, already on the device (all of a plan's in one copy, by an
:class:`Arena`).  Running a program does no host work beyond its kernel calls: no index is built,
nothing is copied to the device, nothing waits for the device.

* :class:`ScheduledCall`: kernels without a varlen entry point, through the pieces of
  :func:`striped_sp.kernels.schedule.schedule` (a row may be covered by several pieces);
* :class:`NativeCall`: kernels with one (flash-attn, PyTorch's CUDA flash op), called once per
  window class on the gathered rows.
"""

from __future__ import annotations

import dataclasses

import torch

from .direct import backward_groups, direct_groups, forward_groups
from .merge import merge_block_safe as _merge
from .schedule import TILE, Batch, schedule
from .segments import Segments, _ranges

__all__ = ["TILE", "Arena", "ScheduledCall", "NativeCall", "compile_call", "compile_steps", "native_programs"]


class Arena:
    """The index tensors of one plan, placed on a device together: :meth:`add` collects CPU
    tensors, :meth:`place` moves them all with one copy (pinned and non-blocking on CUDA) and
    fills in each :class:`Slot`; on the CPU they stay where they are."""

    def __init__(self):
        self.slots: list[Slot] = []
        self.views: list = []  # (slot, parent, start, length): slots that view another's tensor
        self.staging = None  # the pinned buffer, alive until the copy has run
        self.copies = 0

    def add(self, t: torch.Tensor | None) -> "Slot | None":
        if t is None:
            return None
        slot = Slot(t.contiguous())
        self.slots.append(slot)
        return slot

    def view(self, parent: "Slot", start: int, length: int) -> "Slot":
        """A slot for ``parent``'s elements ``start .. start + length - 1`` (of a 1-D tensor):
        a view, on the device once placed (no copy of its own)."""
        slot = Slot(parent.t[start:start + length])
        self.views.append((slot, parent, start, length))
        return slot

    def place(self, device: torch.device, force: bool = False) -> None:
        """``force``: pack and copy on the CPU too (the device path's packing, for tests)."""
        device = torch.device(device)
        if (device.type == "cpu" and not force) or not self.slots:
            return
        offsets, total = [], 0
        for slot in self.slots:
            offsets.append(total)
            total += -(-slot.t.numel() * slot.t.element_size() // 8) * 8  # 8-byte aligned views
        buf = torch.empty(total, dtype=torch.uint8)
        for slot, off in zip(self.slots, offsets):
            nbytes = slot.t.numel() * slot.t.element_size()
            buf[off:off + nbytes] = slot.t.reshape(-1).view(torch.uint8)
        if device.type == "cuda":
            buf = buf.pin_memory()
            self.staging = buf
        placed = buf.to(device, non_blocking=True)
        self.copies += 1
        for slot, off in zip(self.slots, offsets):
            t = slot.t
            slot.t = placed[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        for slot, parent, start, length in self.views:
            slot.t = parent.t[start:start + length]


@dataclasses.dataclass
class Slot:
    """One tensor of an :class:`Arena`: a CPU tensor until placed, then its device view."""

    t: torch.Tensor


@dataclasses.dataclass
class _Batch:
    """A :class:`~striped_sp.kernels.schedule.Batch` compiled for a batch size: every index and
    mask it needs, as slots."""

    packs: int
    cq: int
    ck: int
    strided: tuple | None
    mask: Slot | None          # [b * packs or 1, 1, cq, ck], bool or the kernel.compile_mask form (None: dense)
    q_index: Slot | None        # [packs * cq] local rows gathered (None when strided)
    k_index: Slot | None
    q_real: Slot | None         # slots of real rows (None: all)
    k_real: Slot | None
    q_rows: Slot | None         # the real slots' local rows (the merge / dq scatter)
    k_rows: Slot | None
    q_pad: Slot | None          # the padding slots (backward zeroes them)


def _v(slot: Slot | None):
    return None if slot is None else slot.t


def _compile_batch(p: Batch, b: int, arena: Arena, mask_form) -> _Batch:
    mask = p.mask
    if mask is not None and b > 1 and mask.size(0) > 1:
        mask = mask.unsqueeze(0).expand(b, *mask.shape).reshape(b * p.packs, 1, p.cq, p.ck)
    if mask is not None:
        mask = mask_form(mask)
    strided = p.strided if b == 1 else None
    if strided is not None:
        return _Batch(p.packs, p.cq, p.ck, strided, arena.add(mask), *([None] * 7))
    q_rows = p.q_index if p.q_real is None else p.q_index[p.q_real]
    k_rows = p.k_index if p.k_real is None else p.k_index[p.k_real]
    q_pad = None
    if p.q_real is not None:
        keep = torch.ones(p.packs * p.cq, dtype=torch.bool)
        keep[p.q_real] = False
        q_pad = keep.nonzero().flatten()
    return _Batch(p.packs, p.cq, p.ck, None, arena.add(mask), arena.add(p.q_index), arena.add(p.k_index),
                  arena.add(p.q_real), arena.add(p.k_real), arena.add(q_rows), arena.add(k_rows), arena.add(q_pad))


class ScheduledCall:
    """A varlen call for kernels without a varlen entry point: direct calls on slices and batched
    masked calls (:func:`~striped_sp.kernels.schedule.schedule`), compiled for batch size ``b`` and
    ``nq`` local query rows; the direct calls in groups merged at once (:mod:`~striped_sp.kernels.direct`)."""

    def __init__(self, segs: Segments, b: int, arena: Arena, nq: int, nk: int, halve=None, mask_form=None):
        plan = schedule(segs, halve)
        self.direct = plan.direct
        self.groups = direct_groups(plan.direct, nq)
        form = mask_form or (lambda m: m)
        self.batches = [_compile_batch(p, b, arena, form) for p in plan.batches]

    def launches(self) -> int:
        """Kernel calls per forward (the same per backward)."""
        return len(self.direct) + len(self.batches)

    def forward(self, kernel, q, k, v, scale, acc_out, acc_lse) -> None:
        b, _, h, _ = q.shape
        forward_groups(self.groups, kernel, q, k, v, scale, acc_out, acc_lse)
        for p in self.batches:
            mask = _v(p.mask)
            if p.strided is not None:
                _strided_forward(kernel, p, q, k, v, mask, scale, acc_out, acc_lse)
                continue
            qi, ki = p.q_index.t, p.k_index.t
            qb, kb, vb = _gather(q, qi, p.packs, p.cq), _gather(k, ki, p.packs, p.ck), _gather(v, ki, p.packs, p.ck)
            o, l = _attend(kernel, qb, kb, vb, mask, scale)
            o = _flat(o, b, p.packs, p.cq)
            l = l.view(b, p.packs, h, p.cq).transpose(1, 2).reshape(b, h, p.packs * p.cq)
            real = _v(p.q_real)
            _merge_rows(acc_out, acc_lse, p.q_rows.t, _real(o, real), _real(l, real, 2))

    def backward(self, kernel, dout, q, k, v, out, lse, scale, dq, dk, dv) -> None:
        b, _, h, d = q.shape
        backward_groups(self.groups, kernel, dout, q, k, v, out, lse, scale, dq, dk, dv)
        for p in self.batches:
            mask = _v(p.mask)
            if p.strided is not None:
                _strided_backward(kernel, p, dout, q, k, v, out, lse, mask, scale, dq, dk, dv)
                continue
            qi, ki = p.q_index.t, p.k_index.t
            do_b, q_b = _gather(dout, qi, p.packs, p.cq), _gather(q, qi, p.packs, p.cq)
            lse_b = lse.index_select(2, qi)
            if p.q_pad is not None:
                # padding rows: query 0 (every score 0, so exp(score - lse) = 1 with lse 0) and output
                # gradient 0: they add nothing to any gradient, however large the real scores are
                pad = p.q_pad.t
                do_b.view(b, p.packs * p.cq, h, -1).index_fill_(1, pad, 0)  # v's head dim (MLA)
                q_b.view(b, p.packs * p.cq, h, d).index_fill_(1, pad, 0)
                lse_b.index_fill_(2, pad, 0)
            lse_b = lse_b.view(b, h, p.packs, p.cq).transpose(1, 2).reshape(b * p.packs, h, p.cq)
            args = (do_b, q_b, _gather(k, ki, p.packs, p.ck), _gather(v, ki, p.packs, p.ck),
                    _gather(out, qi, p.packs, p.cq), lse_b.contiguous())
            g = kernel.backward(*args, False, scale) if mask is None else kernel.backward_masked(*args, mask, scale)
            q_real, k_real = _v(p.q_real), _v(p.k_real)
            _index_add_rows(dq, p.q_rows.t, _real(_flat(g[0], b, p.packs, p.cq), q_real).to(dq.dtype))
            _index_add_rows(dk, p.k_rows.t, _real(_flat(g[1], b, p.packs, p.ck), k_real).to(dk.dtype))
            _index_add_rows(dv, p.k_rows.t, _real(_flat(g[2], b, p.packs, p.ck), k_real).to(dv.dtype))


def _index_add_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:, rows] += src`` (``dst`` ``[b, L, ...]``, ``src`` ``[b, R, ...]``): for one contiguous
    batch row as one 2-D ``index_add_`` over dim 0, which the CPU runs several times faster than
    the same add over dim 1 (0.1 vs 0.46 ms for 4000 rows of 1 x 8 on this CPU)."""
    if dst.size(0) == 1 and dst.is_contiguous():
        dst.view(dst.size(1), -1).index_add_(0, rows, src.reshape(src.size(1), -1))
    else:
        dst.index_add_(1, rows, src)


def _gather(x: torch.Tensor, index: torch.Tensor, packs: int, width: int) -> torch.Tensor:
    """Rows ``index`` of ``x`` ``[b, L, h, d]`` as a batch ``[b * packs, width, h, d]``."""
    return x.index_select(1, index).view(x.size(0) * packs, width, *x.shape[2:])


def _flat(x: torch.Tensor, b: int, packs: int, width: int) -> torch.Tensor:
    return x.reshape(b, packs * width, *x.shape[2:])


def _merge_rows(acc_out, acc_lse, rows: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge ``out`` ``[b, R, h, d]`` / ``lse`` ``[b, h, R]`` into accumulator rows ``rows`` (distinct)."""
    cur, cur_lse = acc_out.index_select(1, rows), acc_lse.index_select(2, rows)
    _merge(cur, cur_lse, out, lse)
    acc_out.index_copy_(1, rows, cur)
    acc_lse.index_copy_(2, rows, cur_lse)


def _windows(x: torch.Tensor, first: int, step: int, count: int, width: int) -> torch.Tensor:
    """``count`` windows of ``width`` rows of ``x`` ``[1, L, h, d]``, ``step`` rows apart, as one
    strided view ``[count, width, h, d]`` (windows may overlap: read only)."""
    s = x.stride()
    return x.as_strided((count, width, *x.shape[2:]), (step * s[1], s[1], *s[2:]), x.storage_offset() + first * s[1])


def _add_windows(acc: torch.Tensor, value: torch.Tensor, first: int, step: int, width: int) -> None:
    """``acc`` windows (as :func:`_windows`) += ``value`` ``[count, width, ...]``; overlapping
    windows are added in phases that do not overlap."""
    count = value.size(0)
    phases = max(1, -(-width // step))
    for ph in range(min(phases, count)):
        part = value[ph::phases]
        _windows(acc, first + ph * step, phases * step, part.size(0), width).add_(part)


def _strided_forward(kernel, p: _Batch, q, k, v, mask, scale, acc_out, acc_lse) -> None:
    qf, kf, step = p.strided
    o, l = _attend(kernel, _windows(q, qf, p.cq, p.packs, p.cq), _windows(k, kf, step, p.packs, p.ck),
                   _windows(v, kf, step, p.packs, p.ck), mask, scale)
    r1 = qf + p.packs * p.cq
    h = q.size(2)
    _merge(acc_out[:, qf:r1], acc_lse[:, :, qf:r1], o.reshape(1, p.packs * p.cq, *o.shape[2:]),
           l.transpose(0, 1).reshape(1, h, p.packs * p.cq))


def _strided_backward(kernel, p: _Batch, dout, q, k, v, out, lse, mask, scale, dq, dk, dv) -> None:
    qf, kf, step = p.strided
    r1 = qf + p.packs * p.cq
    h = q.size(2)
    lse_b = lse[0, :, qf:r1].reshape(h, p.packs, p.cq).transpose(0, 1).contiguous()
    args = (_windows(dout, qf, p.cq, p.packs, p.cq), _windows(q, qf, p.cq, p.packs, p.cq),
            _windows(k, kf, step, p.packs, p.ck), _windows(v, kf, step, p.packs, p.ck),
            _windows(out, qf, p.cq, p.packs, p.cq), lse_b)
    g = kernel.backward(*args, False, scale) if mask is None else kernel.backward_masked(*args, mask, scale)
    dq[:, qf:r1] += g[0].reshape(1, p.packs * p.cq, *g[0].shape[2:])
    _add_windows(dk, g[1].to(dk.dtype), kf, step, p.ck)
    _add_windows(dv, g[2].to(dv.dtype), kf, step, p.ck)


def _attend(kernel, q, k, v, mask, scale):
    return kernel.forward(q, k, v, False, scale) if mask is None else kernel.forward_masked(q, k, v, mask, scale)


def _real(x: torch.Tensor, real: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    return x if real is None else x.index_select(dim, real)


# -- kernels with a native varlen entry point (flash-attn, PyTorch's CUDA flash op) ------------

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


class NativeCall:
    """A varlen call for kernels with a varlen entry point, compiled for batch size ``b`` and
    local lengths ``nq`` / ``nk``: one call per window class (:func:`native_programs`)."""

    def __init__(self, groups: list):
        self.groups = groups

    def launches(self) -> int:
        return len(self.groups)

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
                                            g.max_k, g.wl, g.wr, scale)
            o, l = o.unsqueeze(0), l[:, : g.total_q].to(lse_f.dtype).unsqueeze(0)
            if g.q_span is not None:
                a, n = g.q_span
                _merge(acc_f[:, a:a + n], lse_f[:, :, a:a + n], o, l)
            else:
                _merge_rows(acc_f, lse_f, g.q_rows.t, o, l)
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
                                              g.cu_k.t, g.max_q, g.max_k, g.wl, g.wr, scale)
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


def native_programs(calls: list, b: int, nq: int, nk: int, arena: Arena) -> list:
    """:class:`NativeCall` programs of many varlen calls at once (``calls``: their
    :class:`Segments`), vectorised over every call and window class: the rows, int32 cu_seqlens
    and longest segments of all groups come from one pass, their slots are views of four arena
    tensors.  Within a group, entries run batch row by batch row, each in segment order."""
    if not calls:
        return []
    counts = torch.tensor([len(c) for c in calls], dtype=torch.int64)
    call = torch.repeat_interleave(torch.arange(len(calls)), counts)
    cat = lambda f: torch.cat([f(c) for c in calls]) if calls else torch.zeros(0, dtype=torch.int64)  # noqa: E731
    wl, wr, q0, k0 = cat(lambda c: c.wl), cat(lambda c: c.wr), cat(lambda c: c.q_start), cat(lambda c: c.k_start)
    lq, lk = cat(lambda c: c.lq), cat(lambda c: c.lk)
    # one int64 key per (call, window): windows numbered first (1-D uniques are fast, dim=0 is not)
    wls, wl_id = torch.unique(wl, return_inverse=True)
    wrs, wr_id = torch.unique(wr, return_inverse=True)
    uniq, group = torch.unique((call * wls.numel() + wl_id) * wrs.numel() + wr_id, return_inverse=True)
    keys = torch.stack([uniq // (wls.numel() * wrs.numel()), wls[uniq // wrs.numel() % wls.numel()],
                        wrs[uniq % wrs.numel()]], 1)
    # entries (segment, batch row) ordered by group, then batch row, then segment order
    seg = torch.arange(call.numel()).repeat(b)
    row = torch.arange(b).repeat_interleave(call.numel())
    order = torch.argsort((group[seg] * b + row) * max(call.numel(), 1) + seg)
    seg, row = seg[order], row[order]
    g_of = group[seg]
    sizes = torch.bincount(g_of, minlength=keys.size(0))
    lens_q, lens_k = lq[seg], lk[seg]
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
    q_rows = _group_rows(q0[seg] + row * nq, lens_q, g_of, sizes, tot_q, arena)
    k_rows = _group_rows(k0[seg] + row * nk, lens_k, g_of, sizes, tot_k, arena)
    tot_q, sizes = tot_q.tolist(), sizes.tolist()
    programs = [[] for _ in calls]
    for g, (c, w_l, w_r) in enumerate(keys.tolist()):
        (q_span, q_slot), (k_span, k_slot) = q_rows[g], k_rows[g]
        # flash-attn turns an unbounded side of a one-sided window into max_seqlen_k; with
        # bottom-right alignment that is exact only when max_seqlen_k >= every segment's lq
        programs[c].append(_Group(w_l, w_r, q_slot, arena.view(cus_q, cu_first[g], sizes[g] + 1), max_q[g], k_slot,
                                  arena.view(cus_k, cu_first[g], sizes[g] + 1), max(max_q[g], max_k[g]), tot_q[g],
                                  q_span, k_span))
    return [NativeCall(groups) for groups in programs]


def _group_rows(starts, lens, g_of, sizes, totals, arena) -> list:
    """Per group ``(span, None)`` when its entries' rows (``starts`` / ``lens`` in entry order, a
    group's back to back) run as one range, else ``(None, slot)``: a view of one arena tensor
    that holds the rows of every group that is not a span (expanded only for those)."""
    groups = sizes.numel()
    gap = (starts[1:] != starts[:-1] + lens[:-1]) & (g_of[1:] == g_of[:-1])
    broken = torch.zeros(groups, dtype=torch.bool)
    broken[g_of[1:][gap]] = True
    firsts = torch.cumsum(sizes, 0) - sizes
    first_row = starts[firsts.clamp(max=max(starts.numel() - 1, 0))] if starts.numel() else firsts
    out = [None] * groups
    for g, (b, a, n) in enumerate(zip(broken.tolist(), first_row.tolist(), totals.tolist())):
        if not b:
            out[g] = ((a, n), None)
    if bool(broken.any()):
        sel = broken[g_of]
        rows = _ranges(starts[sel], lens[sel])
        tot = torch.where(broken, totals, torch.zeros_like(totals))
        at = (torch.cumsum(tot, 0) - tot).tolist()
        parent = arena.add(rows)
        for g in broken.nonzero().flatten().tolist():
            out[g] = (None, arena.view(parent, at[g], int(totals[g])))
    return out


def compile_call(kernel, segs: Segments, b: int, nq: int, nk: int, device, dtype, head_dim: int | None,
                 arena: Arena, halve=None) -> "ScheduledCall | NativeCall":
    """The program of one varlen call for ``kernel`` on ``device`` / ``dtype`` (its slots in
    ``arena``, placed by the caller); ``halve``: the schedule's
    :func:`~striped_sp.kernels.schedule.halving_rule` (kernels without a varlen entry point)."""
    if kernel.native_varlen(torch.device(device), dtype, head_dim):
        return native_programs([segs], b, nq, nk, arena)[0]
    return ScheduledCall(segs, b, arena, nq, nk, halve, lambda m: kernel.compile_mask(m, torch.device(device), dtype))


def compile_steps(kernel, steps: list, b: int, nq: int, nk: int, device, dtype, head_dim: int | None, arena: Arena,
                  halve=None) -> tuple:
    """The programs of a plan's varlen calls (``steps[t]``: step ``t``'s :class:`Segments`), as
    ``steps`` is nested: native ones compiled together (:func:`native_programs`), scheduled ones
    call by call."""
    if not kernel.native_varlen(torch.device(device), dtype, head_dim):
        return tuple(tuple(compile_call(kernel, segs, b, nq, nk, device, dtype, head_dim, arena, halve) for segs in step)
                     for step in steps)
    flat = iter(native_programs([segs for step in steps for segs in step], b, nq, nk, arena))
    return tuple(tuple(next(flat) for _ in step) for step in steps)


def as_program(kernel, call, q: torch.Tensor, k: torch.Tensor):
    """``call`` as a program: a compiled one as it is; :class:`Segments` compiled (and placed) for
    this one call: the path of one-off calls and tests, not of the ring, which compiles once per batch."""
    if not isinstance(call, Segments):
        return call
    arena = Arena()
    program = compile_call(kernel, call, q.size(0), q.size(1), k.size(1), q.device, q.dtype, q.size(-1), arena)
    arena.place(q.device)
    return program
