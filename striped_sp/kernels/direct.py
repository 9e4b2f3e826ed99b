"""The direct calls of a scheduled varlen call, compiled into groups that are merged at once.

A :class:`~striped_sp.kernels.schedule.Direct` piece is one plain kernel call on slices of the
whole local tensors.  Merging each piece's ``(out, lse)`` into the accumulators as it comes costs
about ten host ops per piece; here the pieces of a :class:`DirectGroup` run back to back, their
results are concatenated and merged in one pass that does not depend on the piece count (rows
covered by several pieces, as a halved causal square's are, are combined by a scatter
log-sum-exp).  Backward likewise concatenates the pieces' gradients and adds them with one
``index_add_`` per tensor.

The pieces run in the kernel's :attr:`~striped_sp.kernels.Kernel.tensor_format` on views of the
``[b, s, h, d]`` tensors (for ``"bhsd"`` kernels, one transpose per tensor and call instead of
one per tensor and piece).  A group's concatenated rows are bounded (:data:`GROUP_ROWS`, at least
the local length) so that its buffers stay within a few local tensors.
"""

from __future__ import annotations

import dataclasses

import torch

from .merge import merge_block_safe

__all__ = ["DirectGroup", "direct_groups"]

#: the concatenated query (and key) rows of one group, at least (else the local length)
GROUP_ROWS = 4096


@dataclasses.dataclass
class DirectGroup:
    """Pieces ``(q0, q1, k0, k1, causal)`` and, as arena slots (int64), their rows in the
    ``[b * L]`` flattening of the local tensors (every batch row in turn): query rows back to
    back (``rows`` ``[b * R]``), key rows back to back (``k_rows`` ``[b * C]``), the distinct query
    rows (``unique`` ``[U]``, one batch row's) and each row's place among them (``inverse``
    ``[R]``, one batch row's; ``inverse_flat`` ``[b * R]``, into ``[b * U]``); the last three
    ``None`` when the rows are distinct.  ``span``: ``(a, b)`` when the rows are exactly
    ``a .. b-1`` in order (the merge then works on slices)."""

    pieces: tuple
    rows: object
    k_rows: object
    unique: object
    unique_flat: object
    inverse: object
    inverse_flat: object
    span: tuple | None


def _ranges(pairs) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in pairs]) if pairs else torch.zeros(0, dtype=torch.int64)


def _flat(rows: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    return rows if batch == 1 else torch.cat([rows + i * length for i in range(batch)])


def _budget(nq: int) -> int:
    """A group's most query rows: a few local tensors' worth of buffers at most."""
    return max(GROUP_ROWS, nq)


def direct_groups(pieces: list, batch: int, nq: int, nk: int, arena) -> list:
    """``pieces`` (:class:`~striped_sp.kernels.schedule.Direct`) cut, in order, into groups of at
    most ``max(GROUP_ROWS, nq)`` query rows, compiled for ``batch`` rows of ``nq`` queries and
    ``nk`` keys, their indices added to ``arena``."""
    budget = _budget(nq)
    groups, current, rows = [], [], 0
    for p in pieces:
        if current and rows + (p.q1 - p.q0) > budget:
            groups.append(_group(current, batch, nq, nk, arena))
            current, rows = [], 0
        current.append((p.q0, p.q1, p.k0, p.k1, p.causal))
        rows += p.q1 - p.q0
    if current:
        groups.append(_group(current, batch, nq, nk, arena))
    return groups


def _group(pieces: list, batch: int, nq: int, nk: int, arena) -> DirectGroup:
    rows = _ranges([(a, b) for a, b, *_ in pieces])
    k_rows = _ranges([(c, d) for _, _, c, d, _ in pieces])
    unique, inverse = torch.unique(rows, return_inverse=True)
    span = None
    if unique.numel() == rows.numel():
        unique = inverse = None
        if bool((rows == torch.arange(int(rows[0]), int(rows[0]) + rows.numel())).all()):
            span = (int(rows[0]), int(rows[0]) + rows.numel())
    add = arena.add
    return DirectGroup(
        tuple(pieces), add(_flat(rows, batch, nq)), add(_flat(k_rows, batch, nk)), add(unique),
        None if unique is None else add(_flat(unique, batch, nq)), add(inverse),
        None if inverse is None else add(_flat(inverse, batch, unique.numel())), span)


def _view(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` ``[b, s, h, d]`` as a view in ``fmt``."""
    return x if fmt == "bshd" else x.transpose(1, 2)


def _cat(parts: list, dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _bshd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return x if fmt == "bshd" else x.transpose(1, 2)


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    """``[b, s, h, d]`` as ``[b * s, h * d]`` (a view of a contiguous tensor, else a copy)."""
    return x.reshape(x.size(0) * x.size(1), -1)


def _add_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:, rows] += src`` for ``dst`` ``[b, L, ...]`` and ``src`` ``[b, R, ...]``, ``rows``
    in the ``[b * L]`` flattening (``[b * R]``): one 2-D ``index_add_`` (the fast one on the CPU)
    where ``dst`` is contiguous, else one per batch row."""
    if dst.is_contiguous():
        dst.view(dst.size(0) * dst.size(1), -1).index_add_(0, rows, _rows2d(src))
        return
    r = src.size(1)
    for i in range(dst.size(0)):
        dst[i].index_add_(0, rows[i * r:(i + 1) * r] - i * dst.size(1), src[i])


def forward_groups(groups: list, kernel, q, k, v, scale, acc_out, acc_lse) -> None:
    """Every group's pieces, merged into ``acc_out`` ``[b, Lq, h, dv]`` (contiguous) / ``acc_lse``
    ``[b, h, Lq]``."""
    if not groups:
        return
    fmt = kernel.tensor_format
    sd = 1 if fmt == "bshd" else 2
    qv, kv, vv = _view(q, fmt), _view(k, fmt), _view(v, fmt)
    for g in groups:
        outs, lses = [], []
        for a, b, c, d, causal in g.pieces:
            o, l = kernel.forward_native(qv.narrow(sd, a, b - a), kv.narrow(sd, c, d - c), vv.narrow(sd, c, d - c),
                                         causal, scale)
            outs.append(o)
            lses.append(l)
        out, lse = _bshd(_cat(outs, sd), fmt), _cat(lses, 2)
        if g.span is not None:
            a, b = g.span
            merge_block_safe(acc_out[:, a:b], acc_lse[:, :, a:b], out, lse)
        elif g.inverse is None:
            _merge_distinct(acc_out, acc_lse, g, out, lse)
        else:
            _merge_repeated(acc_out, acc_lse, g, out, lse)


def _merge_distinct(acc_out, acc_lse, g: DirectGroup, out, lse) -> None:
    """Merge ``out`` ``[b, R, h, d]`` / ``lse`` ``[b, h, R]`` into the accumulators' rows (distinct)."""
    flat = acc_out.view(acc_out.size(0) * acc_out.size(1), -1)  # the accumulator: contiguous
    rows = g.rows.t
    cur = flat.index_select(0, rows).view(out.shape)
    cur_lse = acc_lse.index_select(2, rows[: lse.size(2)])
    merge_block_safe(cur, cur_lse, out, lse)
    flat.index_copy_(0, rows, _rows2d(cur))
    acc_lse.index_copy_(2, rows[: lse.size(2)], cur_lse)


def _merge_repeated(acc_out, acc_lse, g: DirectGroup, out, lse) -> None:
    """Merge results whose rows repeat (result ``r`` belongs to row ``unique[inverse[r]]``): a
    scatter log-sum-exp against the running maximum.  Every result row saw a key, so the maximum
    is finite wherever a result lands."""
    b, h = lse.shape[:2]
    unique, inverse = g.unique.t, g.inverse.t
    lse = lse.to(acc_lse.dtype)
    cur_lse = acc_lse.index_select(2, unique)
    top = cur_lse.scatter_reduce(2, inverse.view(1, 1, -1).expand_as(lse), lse, "amax")  # the running lse counts
    w = torch.exp(lse - top.index_select(2, inverse))  # [b, h, R]
    w_cur = torch.exp(cur_lse - top)  # 0 for rows with no key seen yet
    total = w_cur.index_add(2, inverse, w)
    flat = acc_out.view(-1, h, acc_out.size(-1))
    cur = flat.index_select(0, g.unique_flat.t)  # [b * U, h, dv]
    cur.mul_(w_cur.transpose(1, 2).reshape(-1, h, 1))
    cur.view(cur.size(0), -1).index_add_(0, g.inverse_flat.t,
                                         _rows2d(out.to(cur.dtype) * w.transpose(1, 2).unsqueeze(-1)))
    cur.div_(total.transpose(1, 2).reshape(-1, h, 1))
    flat.index_copy_(0, g.unique_flat.t, cur)
    acc_lse.index_copy_(2, unique, top.add_(total.log_()))


def backward_groups(groups: list, kernel, dout, q, k, v, out, lse, scale, dq, dk, dv) -> None:
    """Every group's pieces' gradients added into the float32 ``dq`` / ``dk`` / ``dv`` ``[b, s, h, d]``."""
    if not groups:
        return
    fmt = kernel.tensor_format
    sd = 1 if fmt == "bshd" else 2
    dov, qv, kv, vv, ov = (_view(t, fmt) for t in (dout, q, k, v, out))
    for g in groups:
        gq, gk, gv = [], [], []
        for a, b, c, d, causal in g.pieces:
            grads = kernel.backward_native(dov.narrow(sd, a, b - a), qv.narrow(sd, a, b - a), kv.narrow(sd, c, d - c),
                                           vv.narrow(sd, c, d - c), ov.narrow(sd, a, b - a), lse[:, :, a:b], causal,
                                           scale)
            gq.append(grads[0])
            gk.append(grads[1])
            gv.append(grads[2])
        _add_rows(dq, g.rows.t, _bshd(_cat(gq, sd), fmt).to(dq.dtype))
        _add_rows(dk, g.k_rows.t, _bshd(_cat(gk, sd), fmt).to(dk.dtype))
        _add_rows(dv, g.k_rows.t, _bshd(_cat(gv, sd), fmt).to(dv.dtype))
