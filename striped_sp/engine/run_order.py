"""Rows in the plan's run order and back (:attr:`~striped_sp.plan.ring_plan.RingPlan.order`).

A plan may run its rows in another order than the caller holds them: pure Ulysses (a ring of one,
:mod:`striped_sp.plan.grouped`) runs the gathered tokens of its group in natural order, so that the
causal ring is one causal call.  The executor (:mod:`striped_sp.engine.autograd`) permutes its
inputs on entry and its results on exit with the plan's index tensors, already on the device: one
gather per tensor and pass, fused with the tensor format's copy where there is one; no host work,
no copy from the host, no synchronisation.
"""

from __future__ import annotations

import torch

from .step import from_format, to_format

__all__ = ["to_run_format", "from_run_format", "rows_in"]


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
