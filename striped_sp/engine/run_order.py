"""Rows in the plan's run order and back (:attr:`~striped_sp.plan.ring_plan.RingPlan.order`).

A plan may run its rows in another order than the caller holds them: pure Ulysses (a ring of one,
:mod:`striped_sp.plan.grouped`) runs the gathered tokens of its group in natural order, so that the
causal ring is one causal call.  The executor (:mod:`striped_sp.engine.autograd`) permutes its
inputs on entry and its results on exit with the plan's index tensors, already on the device: one
gather per tensor and pass, fused with the tensor format's copy where there is one; no host work,
no copy from the host, no synchronisation.

A dense plan in run order is a ring of one (:meth:`~striped_sp.plan.layouts.Layout.run_order`):
its backward (:func:`dense_backward`) gathers its tensors straight into the kernel's format, where
PyTorch's CPU op runs faster than on ``[b, s, h, d]`` views (docs/tuning.md, "Kernels"), at no
cost beyond the gathers the run order takes anyway.
"""

from __future__ import annotations

import torch

from ..kernels import accumulator_dtype
from .step import backward_step, from_format, to_format

__all__ = ["to_run_format", "from_run_format", "rows_in", "dense_backward"]


def to_run_format(x: torch.Tensor, order: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """``x`` ``[b, s, h, d]`` in ``fmt``, contiguous, its rows in run order (one copy, as
    :func:`~striped_sp.engine.step.to_format` makes)."""
    if order is None:
        return to_format(x, fmt)
    return x.index_select(1, order) if fmt == "bshd" else x.transpose(1, 2).index_select(2, order)


def from_run_format(x: torch.Tensor, inverse: torch.Tensor | None, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``fmt`` and run order back to a contiguous ``[b, s, h, d]`` of ``dtype`` in the
    caller's order."""
    if inverse is None:
        return from_format(x, fmt, dtype)
    view = x if fmt == "bshd" else x.transpose(1, 2)
    return view.index_select(1, inverse).to(dtype)


def rows_in(order: torch.Tensor | None, *tensors: torch.Tensor, dim: int = 1) -> tuple:
    """``tensors`` with their rows (dimension ``dim``) taken in ``order`` (as they are for ``None``)."""
    if order is None:
        return tensors
    return tuple(t.index_select(dim, order) for t in tensors)


def dense_backward(dout, q, k, v, out, lse, plan) -> tuple:
    """The backward of a dense plan in run order (one step, no transfer): ``dout``, ``q``, ``k``,
    ``v``, ``out`` ``[b, s, h, d]`` and ``lse`` ``[b, h, s]`` in the caller's order, as the forward
    returned them; returns ``(dq, dk, dv)`` in the caller's order and the inputs' dtypes."""
    fmt, order = plan.kernel.tensor_format, plan.order
    dout, q, k, v, out = (to_run_format(t, order, fmt) for t in (dout, q, k, v, out))
    lse = lse.index_select(2, order)
    acc = accumulator_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    backward_step(plan.kernel, dout, q, k, v, out, lse, plan.calls[0], plan.scale, dq, fmt, plan.aligned,
                  dk=dk, dv=dv, split_heads=True)
    return tuple(from_run_format(g, plan.inverse, fmt, t.dtype) for g, t in ((dq, q), (dk, k), (dv, v)))
