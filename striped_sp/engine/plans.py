"""The plan cache: one per process, bounded, shared by every layer and request.

A batch's plan is built once, by :func:`striped_sp.prepare_plans` where the batch is made or by the
first layer that asks, in two parts: the :class:`~striped_sp.plan.ring_plan.HostPlan` (what the
documents and window decide) and its compilation for a kernel and device (the
:class:`~striped_sp.plan.ring_plan.RingPlan`).  Keys are the call's signature and the batch's
boundaries (and, for a compiled plan, the cost model that priced it).  Beside it one thing keeps
a cache: the ``auto`` search (:mod:`striped_sp.plan.search`), whose choice per row is a pure
function of the row, ``N`` and the cost model that every rank's plan and the data loader ask for;
it is bounded too and keyed by the model.
"""

from __future__ import annotations

import collections
import threading

import torch

from ..plan.cost import model_for
from ..plan.masks import MaskSpec
from ..plan.ring_plan import HostPlan, RingPlan, build_host_plan, compile_plan

__all__ = ["PlanCache", "PLANS", "PLAN_CACHE_SIZE", "host_plan_for", "plan_for"]


class PlanCache:
    """The plan cache: the last :data:`PLAN_CACHE_SIZE` batches' :class:`~striped_sp.plan.ring_plan.RingPlan`
    per rank, keyed by the call's signature and the batch's boundaries, shared by every layer and
    request of a process (so a batch is planned once, whichever layer asks first).  The only cache of
    plans (the ``auto`` search keeps its choices per row, :mod:`striped_sp.plan.search`)."""

    def __init__(self, size: int):
        self.size = size
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0

    def get(self, key, build) -> RingPlan:
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = build()
        with self._lock:
            self.builds += 1
            self._plans[key] = plan
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self.builds = 0


#: plans of a few batches (the running one and those built ahead) for every layer kind of a model
PLAN_CACHE_SIZE = 32
#: the process's one plan cache: every layer and request of a process shares a batch's plans
PLANS = PlanCache(PLAN_CACHE_SIZE)


def host_plan_for(layout, mask: MaskSpec | None, causal: bool, world_size: int, rank: int,
                  local_len: int) -> HostPlan:
    """The cached :class:`~striped_sp.plan.ring_plan.HostPlan` of one rank for one batch."""
    key = ("host", layout.key, mask, causal, world_size, rank, local_len)
    return PLANS.get(key, lambda: build_host_plan(layout, mask, causal, world_size, rank, local_len))


def plan_for(layout, mask: MaskSpec | None, causal: bool, world_size: int, rank: int, local_len: int, *, kernel,
             scale: float, comm_dtype=torch.float32, strict_block: str = "sliced", device="cpu",
             dtype=torch.float32, head_dim: int | None = None, batch: int = 1, heads: int = 1) -> RingPlan:
    """The cached plan of one rank for one batch: its :func:`host_plan_for` (built ahead by
    :func:`prepare_plans`, or here) compiled for the kernel and device, priced by the kernel's cost
    model there (in the key: a model adopted later compiles anew)."""
    device = torch.device(device)
    key = (layout.key, mask, causal, world_size, rank, local_len, kernel, scale, comm_dtype, strict_block,
           device, dtype, head_dim, (batch, heads) if mask is not None else None, model_for(kernel.name, device.type))
    return PLANS.get(key, lambda: compile_plan(
        host_plan_for(layout, mask, causal, world_size, rank, local_len), kernel=kernel, scale=scale,
        comm_dtype=comm_dtype, strict_block=strict_block, device=device, dtype=dtype, head_dim=head_dim,
        batch=batch, heads=heads))
