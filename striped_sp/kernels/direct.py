"""The direct calls of a scheduled varlen call, their forward results merged per run of rows.

A :class:`~striped_sp.kernels.schedule.Direct` piece is one plain kernel call on slices of the
whole local tensors.  Merging each piece's ``(out, lse)`` into the accumulators as it comes costs
about ten host ops per piece.  Consecutive pieces whose query rows follow one another (the
documents of a striped row, back to back) form a :class:`DirectGroup`: their results are
concatenated and merged into the accumulators' slice of those rows in one pass.  Pieces that
cover rows already covered (a halved causal square's rectangle) start a new group, so a merge
never sees a row twice and never needs an index.  Backward adds each piece's gradients into
slices of ``dq`` / ``dk`` / ``dv`` at once: concatenating them first would copy every gradient
once more (measured slower at 8 heads of 64 than the few ops it saves).

The pieces run in the kernel's :attr:`~striped_sp.kernels.Kernel.tensor_format` on views of the
``[b, s, h, d]`` tensors (for ``"bhsd"`` kernels one transpose per tensor and call instead of one
per tensor and piece).  A group's rows are bounded (:func:`_budget`) so that its concatenated
results stay within about one local tensor.
"""

from __future__ import annotations

import dataclasses

import torch

from .merge import merge_block_safe

__all__ = ["DirectGroup", "direct_groups", "forward_groups", "backward_groups"]

#: the most query rows of one group, at least (else the local length)
GROUP_ROWS = 4096


@dataclasses.dataclass(frozen=True)
class DirectGroup:
    """Pieces ``(q0, q1, k0, k1, causal)`` whose query rows run back to back, ``rows[0] ..
    rows[1] - 1`` in all."""

    pieces: tuple
    rows: tuple


def _budget(nq: int) -> int:
    """A group's most query rows: one local tensor's worth of concatenated results at most."""
    return max(GROUP_ROWS, nq)


def direct_groups(pieces: list, nq: int) -> list:
    """``pieces`` (:class:`~striped_sp.kernels.schedule.Direct`) cut, in order, into groups of
    consecutive rows, each of at most :func:`_budget` rows."""
    budget = _budget(nq)
    groups, current = [], []

    def close():
        if current:
            groups.append(DirectGroup(tuple(current), (current[0][0], current[-1][1])))

    for p in pieces:
        if current and (p.q0 != current[-1][1] or p.q1 - current[0][0] > budget):
            close()
            current = []
        current.append((p.q0, p.q1, p.k0, p.k1, p.causal))
    close()
    return groups


def _view(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` ``[b, s, h, d]`` as a view in ``fmt`` (and back: the transpose is its own inverse)."""
    return x if fmt == "bshd" else x.transpose(1, 2)


def forward_groups(groups: list, kernel, q, k, v, scale, acc_out, acc_lse) -> None:
    """Every group's pieces, merged into ``acc_out`` ``[b, Lq, h, dv]`` / ``acc_lse`` ``[b, h, Lq]``."""
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
        out = outs[0] if len(outs) == 1 else torch.cat(outs, sd)
        lse = lses[0] if len(lses) == 1 else torch.cat(lses, 2)
        a, b = g.rows
        merge_block_safe(acc_out[:, a:b], acc_lse[:, :, a:b], _view(out, fmt), lse)


def backward_groups(groups: list, kernel, dout, q, k, v, out, lse, scale, dq, dk, dv) -> None:
    """Every piece's gradients added into the float32 ``dq`` / ``dk`` / ``dv`` ``[b, s, h, d]``."""
    if not groups:
        return
    fmt = kernel.tensor_format
    sd = 1 if fmt == "bshd" else 2
    dov, qv, kv, vv, ov, dqv, dkv, dvv = (_view(t, fmt) for t in (dout, q, k, v, out, dq, dk, dv))
    for g in groups:
        for a, b, c, d, causal in g.pieces:
            grads = kernel.backward_native(dov.narrow(sd, a, b - a), qv.narrow(sd, a, b - a), kv.narrow(sd, c, d - c),
                                           vv.narrow(sd, c, d - c), ov.narrow(sd, a, b - a), lse[:, :, a:b], causal,
                                           scale)
            dqv.narrow(sd, a, b - a).add_(grads[0])
            dkv.narrow(sd, c, d - c).add_(grads[1])
            dvv.narrow(sd, c, d - c).add_(grads[2])
