"""One calibrated cost model for a whole group: measured on its first rank, adopted by every rank.

``auto`` choices (:mod:`striped_sp.plan.search`) must agree on every rank, since they decide which
tokens a rank holds.  Timings differ slightly between devices, so each rank calibrating for itself
could place documents differently.  :func:`calibrate_cost_model` times the kernel on the group's
first rank (:func:`striped_sp.plan.cost.calibrate`), broadcasts the fitted numbers, and every rank
adopts the same :class:`~striped_sp.plan.cost.CostModel` (:func:`~striped_sp.plan.cost.use_model`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels import resolve_kernel
from ..plan import search
from ..plan.cost import CostModel, calibrate, fitted_model, use_model

__all__ = ["calibrate_cost_model"]

#: the numbers a calibration fits, broadcast from the first rank (a constant)
_FITTED = ("ns_per_entry", "causal_waste", "call_ns")


def calibrate_cost_model(group=None, backend: str = "auto", device=None, dtype=None, head_dim: int = 64) -> CostModel:
    """Calibrate the cost model of ``backend``'s kernel on this device on the first rank of ``group``
    (``None``: the default group, or this process alone without ``torch.distributed``), hand it to
    every rank and adopt it.  Collective: every rank of the group calls it, before its first batch
    (``ValueError`` after one: that batch was placed with another model).  Returns the model, which
    then prices ``backend``'s kernel on this device type (:func:`~striped_sp.plan.cost.model_for`):
    the ``auto`` placements and every plan compiled for that kernel there."""
    if search.placements_made():
        raise ValueError("calibrate_cost_model() after a batch was placed: call it on every rank before the "
                         "first batch, or the ranks' earlier and later batches would use different models")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype if dtype is not None else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    kernel = resolve_kernel(backend, device, dtype, head_dim)
    distributed = dist.is_available() and dist.is_initialized()
    first = 0 if not distributed else dist.get_global_rank(group, 0) if group is not None else 0
    mine = not distributed or dist.get_rank() == first
    model = calibrate(kernel, device, dtype, head_dim) if mine else None
    values = torch.tensor([getattr(model, f) for f in _FITTED] if mine else [0.0] * len(_FITTED), dtype=torch.float64)
    if distributed:
        comm = values.to(device) if dist.get_backend(group) == "nccl" else values
        dist.broadcast(comm, src=first, group=group)
        values = comm.cpu()
    # every rank (the first too): the first rank's fit on the table's model of the kernel (the same
    # table on every rank), so every rank adopts an equal model
    model = fitted_model(kernel.name, device.type, **{f: float(v) for f, v in zip(_FITTED, values.tolist())})
    use_model(model)
    return model
