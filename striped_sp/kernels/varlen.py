"""Varlen calls (many band segments at once) straight into the ring's accumulators.

``q`` ``[b, Lq, h, d]`` and ``k``/``v`` ``[b, Lk, kv_heads, d]`` are a rank's whole local tensors;
the segments say which rows take part (:class:`~striped_sp.plan.masks.Segments`).  Forward merges each
result into float32 accumulators ``acc_out`` ``[b, Lq, h, d]`` / ``acc_lse`` ``[b, h, Lq]`` (rows
not seen yet hold 0 / -inf); backward adds float32 gradients into ``dq`` / ``dk`` / ``dv``.  No
input is copied as a whole: direct calls take slices, batched calls gather only their rows.

* :func:`varlen_forward` / :func:`varlen_backward`: kernels without a varlen entry point, through
  the pieces of :func:`striped_sp.kernels.schedule.schedule` (a row may be covered by several pieces);
* :func:`native_varlen_forward` / :func:`native_varlen_backward`: kernels with one (flash-attn,
  PyTorch's CUDA flash op), called once per window class on the gathered rows.
"""

from __future__ import annotations

import torch

from .merge import merge_block_safe as _merge
from .segments import Segments, _ranges
from .schedule import TILE, Batch, schedule

__all__ = ["TILE", "schedule", "varlen_forward", "varlen_backward", "native_varlen_forward",
           "native_varlen_backward"]


def _gather(x: torch.Tensor, index: torch.Tensor, packs: int, width: int) -> torch.Tensor:
    """Rows ``index`` of ``x`` ``[b, L, h, d]`` as a batch ``[b * packs, width, h, d]``."""
    return x.index_select(1, index).view(x.size(0) * packs, width, *x.shape[2:])


def _flat(x: torch.Tensor, b: int, packs: int, width: int) -> torch.Tensor:
    return x.reshape(b, packs * width, *x.shape[2:])


def _batched_mask(p: Batch, b: int, device):
    if p.mask is None:
        return None
    if b == 1 or p.mask.size(0) == 1:
        return p.mask.to(device)
    return p.mask.unsqueeze(0).expand(b, *p.mask.shape).reshape(b * p.packs, 1, p.cq, p.ck).to(device)


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


def _strided_forward(kernel, p: Batch, q, k, v, mask, scale, acc_out, acc_lse) -> None:
    qf, kf, step = p.strided
    o, l = _attend(kernel, _windows(q, qf, p.cq, p.packs, p.cq), _windows(k, kf, step, p.packs, p.ck),
                   _windows(v, kf, step, p.packs, p.ck), mask, scale)
    r1 = qf + p.packs * p.cq
    h = q.size(2)
    _merge(acc_out[:, qf:r1], acc_lse[:, :, qf:r1], o.reshape(1, p.packs * p.cq, *o.shape[2:]),
           l.transpose(0, 1).reshape(1, h, p.packs * p.cq))


def _strided_backward(kernel, p: Batch, dout, q, k, v, out, lse, mask, scale, dq, dk, dv) -> None:
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


def varlen_forward(kernel, q, k, v, segs: Segments, scale: float, acc_out, acc_lse) -> None:
    """Merge the varlen call ``segs`` into ``acc_out`` / ``acc_lse`` (kernels without varlen)."""
    plan = schedule(segs)
    b, _, h, d = q.shape
    for p in plan.direct:
        o, l = kernel.forward(q[:, p.q0:p.q1], k[:, p.k0:p.k1], v[:, p.k0:p.k1], p.causal, scale)
        _merge(acc_out[:, p.q0:p.q1], acc_lse[:, :, p.q0:p.q1], o, l)
    for p in plan.batches:
        mask = _batched_mask(p, b, q.device)
        if p.strided is not None and b == 1:
            _strided_forward(kernel, p, q, k, v, mask, scale, acc_out, acc_lse)
            continue
        qi, ki = p.q_index.to(q.device), p.k_index.to(q.device)
        qb, kb, vb = _gather(q, qi, p.packs, p.cq), _gather(k, ki, p.packs, p.ck), _gather(v, ki, p.packs, p.ck)
        o, l = _attend(kernel, qb, kb, vb, mask, scale)
        o = _flat(o, b, p.packs, p.cq)
        l = l.view(b, p.packs, h, p.cq).transpose(1, 2).reshape(b, h, p.packs * p.cq)
        real = None if p.q_real is None else p.q_real.to(q.device)
        _merge_rows(acc_out, acc_lse, _real(qi, real, 0), _real(o, real), _real(l, real, 2))


def varlen_backward(kernel, dout, q, k, v, out, lse, segs: Segments, scale: float, dq, dk, dv) -> None:
    """Add the gradients of the varlen call ``segs`` (given the *final* ``out`` / ``lse`` of its
    rows) into float32 ``dq`` / ``dk`` / ``dv`` (kernels without varlen)."""
    plan = schedule(segs)
    b, _, h, d = q.shape
    for p in plan.direct:
        g = kernel.backward(dout[:, p.q0:p.q1], q[:, p.q0:p.q1], k[:, p.k0:p.k1], v[:, p.k0:p.k1],
                            out[:, p.q0:p.q1], lse[:, :, p.q0:p.q1], p.causal, scale)
        dq[:, p.q0:p.q1] += g[0]
        dk[:, p.k0:p.k1] += g[1]
        dv[:, p.k0:p.k1] += g[2]
    for p in plan.batches:
        if p.strided is not None and b == 1:
            _strided_backward(kernel, p, dout, q, k, v, out, lse, _batched_mask(p, b, q.device), scale, dq, dk, dv)
            continue
        qi, ki = p.q_index.to(q.device), p.k_index.to(q.device)
        do_b, q_b = _gather(dout, qi, p.packs, p.cq), _gather(q, qi, p.packs, p.cq)
        lse_b = lse.index_select(2, qi)
        if p.q_real is not None:
            # padding rows: query 0 (every score 0, so exp(score - lse) = 1 with lse 0) and output
            # gradient 0: they add nothing to any gradient, however large the real scores are
            pad = torch.ones(p.packs * p.cq, dtype=torch.bool, device=q.device)
            pad[p.q_real.to(q.device)] = False
            do_b.view(b, p.packs * p.cq, h, -1)[:, pad] = 0  # v's head dim (MLA)
            q_b.view(b, p.packs * p.cq, h, d)[:, pad] = 0
            lse_b[:, :, pad] = 0
        lse_b = lse_b.view(b, h, p.packs, p.cq).transpose(1, 2).reshape(b * p.packs, h, p.cq)
        args = (do_b, q_b, _gather(k, ki, p.packs, p.ck), _gather(v, ki, p.packs, p.ck),
                _gather(out, qi, p.packs, p.cq), lse_b.contiguous())
        mask = _batched_mask(p, b, q.device)
        g = kernel.backward(*args, False, scale) if mask is None else kernel.backward_masked(*args, mask, scale)
        q_real = None if p.q_real is None else p.q_real.to(q.device)
        k_real = None if p.k_real is None else p.k_real.to(q.device)
        dq.index_add_(1, _real(qi, q_real, 0), _real(_flat(g[0], b, p.packs, p.cq), q_real).to(dq.dtype))
        dk.index_add_(1, _real(ki, k_real, 0), _real(_flat(g[1], b, p.packs, p.ck), k_real).to(dk.dtype))
        dv.index_add_(1, _real(ki, k_real, 0), _real(_flat(g[2], b, p.packs, p.ck), k_real).to(dv.dtype))


# -- kernels with a native varlen entry point (flash-attn, PyTorch's CUDA flash op) ------------

def _window_groups(segs: Segments):
    """Segment ids grouped by their window ``(wl, wr)``: one native varlen call per group."""
    keys = segs.wl * (1 << 32) + (segs.wr + 1)
    for key in torch.unique(keys).tolist():
        ids = (keys == key).nonzero().flatten()
        yield int(segs.wl[ids[0]]), int(segs.wr[ids[0]]), ids


def _group_rows(starts: torch.Tensor, lens: torch.Tensor, length: int, batch: int, device):
    """Rows (in the ``[b * L]`` flattening) of the segments, every batch row in turn, their
    cu_seqlens (int32) and the longest segment."""
    rows = _ranges(starts, lens)
    rows = torch.cat([rows + i * length for i in range(batch)])
    lens_b = lens.repeat(batch)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens_b, 0)])
    return rows.to(device), cu.to(device=device, dtype=torch.int32), int(lens.max())


def _groups(segs: Segments, nq: int, nk: int, b: int, device):
    for wl, wr, ids in _window_groups(segs):
        qr, cu_q, mq = _group_rows(segs.q_start[ids], segs.lq[ids], nq, b, device)
        kr, cu_k, mk = _group_rows(segs.k_start[ids], segs.lk[ids], nk, b, device)
        # flash-attn turns an unbounded side of a one-sided window into max_seqlen_k; with
        # bottom-right alignment that is exact only when max_seqlen_k >= every segment's lq
        yield wl, wr, qr, cu_q, mq, kr, cu_k, max(mq, mk)


def native_varlen_forward(call, q, k, v, segs: Segments, acc_out, acc_lse) -> None:
    """``call(q, k, v, cu_q, cu_k, max_q, max_k, wl, wr) -> (out [T, h, d], lse [h, T])`` once per
    window group on the gathered rows, merged into the accumulators."""
    b, nq, h, d = q.shape
    nk = k.size(1)
    qf, kf, vf = q.reshape(b * nq, h, d), k.reshape(b * nk, *k.shape[2:]), v.reshape(b * nk, *v.shape[2:])
    acc_f = acc_out.view(b * nq, h, d).unsqueeze(0)
    lse_f = acc_lse.transpose(0, 1).reshape(1, h, b * nq)
    for wl, wr, qr, cu_q, mq, kr, cu_k, mk in _groups(segs, nq, nk, b, q.device):
        o, l = call(qf.index_select(0, qr), kf.index_select(0, kr), vf.index_select(0, kr), cu_q, cu_k, mq, mk, wl, wr)
        _merge_rows(acc_f, lse_f, qr, o.unsqueeze(0), l[:, : qr.numel()].to(lse_f.dtype).unsqueeze(0))
    res = lse_f.view(h, b, nq).transpose(0, 1)
    if not (b == 1 and res.data_ptr() == acc_lse.data_ptr()):  # b == 1: lse_f is a view of acc_lse
        acc_lse.copy_(res)


def native_varlen_backward(call, dout, q, k, v, out, lse, segs: Segments, dq, dk, dv) -> None:
    """``call(dout, q, k, v, out, lse [h, T], cu_q, cu_k, max_q, max_k, wl, wr) -> (dq, dk, dv)`` per
    window group, added into the float32 gradients."""
    b, nq, h, d = q.shape
    nk = k.size(1)

    def flat(x, n):
        return x.reshape(b * n, *x.shape[2:])

    qf, kf, vf, dof, of = flat(q, nq), flat(k, nk), flat(v, nk), flat(dout, nq), flat(out, nq)
    lf = lse.transpose(0, 1).reshape(h, b * nq)
    dqf, dkf, dvf = dq.view(b * nq, h, d), dk.view(b * nk, *k.shape[2:]), dv.view(b * nk, *v.shape[2:])
    for wl, wr, qr, cu_q, mq, kr, cu_k, mk in _groups(segs, nq, nk, b, q.device):
        g = call(dof.index_select(0, qr), qf.index_select(0, qr), kf.index_select(0, kr), vf.index_select(0, kr),
                 of.index_select(0, qr), lf.index_select(1, qr).contiguous(), cu_q, cu_k, mq, mk, wl, wr)
        dqf.index_add_(0, qr, g[0].to(dqf.dtype))
        dkf.index_add_(0, kr, g[1].to(dkf.dtype))
        dvf.index_add_(0, kr, g[2].to(dvf.dtype))
