"""``bench run --profile``: where forward and backward time goes inside the engine's executor
(kernel calls, the fp32 merge, waits on the ring transfers), by timing wrappers installed in the
worker processes only."""

from __future__ import annotations

import dataclasses
import time

from ..engine import step as _step
from ..engine import transport as _ring
from ..engine.autograd import RingAttention
from ..engine.transport import TorchTransport, ring_timeout
from ..kernels import Kernel
from ..plan.layouts import get_layout
from ..plan.masks import make_mask
from ..plan.ring_plan import build_ring_plan
from .common import sync

__all__ = ["Clock", "install_profiler", "profiled_step"]

class Clock:
    def __init__(self, device):
        self.device = device
        self.phase = "fwd"
        self.t = {}

    def add(self, what, dt):
        key = f"{self.phase}_{what}"
        self.t[key] = self.t.get(key, 0.0) + dt

    def timed(self, what, fn, *a, **kw):
        sync(self.device)
        t0 = time.perf_counter()
        res = fn(*a, **kw)
        sync(self.device)
        self.add(what, time.perf_counter() - t0)
        return res


class _TimedKernel(Kernel):
    def __init__(self, inner: Kernel, clock: Clock):
        self.inner, self.clock, self.name = inner, clock, inner.name
        self.tensor_format, self.default_strict_block = inner.tensor_format, inner.default_strict_block

    def causal_alignment(self, *a):
        return self.inner.causal_alignment(*a)

    def forward(self, *a):
        return self.clock.timed("kernel", self.inner.forward, *a)

    def backward(self, *a):
        return self.clock.timed("kernel", self.inner.backward, *a)

    def forward_native(self, *a):
        return self.clock.timed("kernel", self.inner.forward_native, *a)

    def backward_native(self, *a):
        return self.clock.timed("kernel", self.inner.backward_native, *a)

    def forward_varlen(self, *a):
        return self.clock.timed("kernel", self.inner.forward_varlen, *a)

    def backward_varlen(self, *a):
        return self.clock.timed("kernel", self.inner.backward_varlen, *a)


def install_profiler(clock: Clock):
    merge = _step.merge_block
    wait = _ring.Transfer.wait
    _step.merge_block = lambda *a: clock.timed("merge", merge, *a)
    _ring.Transfer.wait = lambda self: clock.timed("wait", wait, self)


def profiled_step(q, k, v, dout, group, layout, kernel, clock):
    """One fwd+bwd of the engine's executor (``RingAttention.apply(q, k, v, plan, transport)``) with
    the timing kernel; phase totals in ``clock``.  The plan is built before the clock starts (the
    engine builds it once per batch)."""
    for t in (q, k, v):
        t.grad = None
    transport = TorchTransport(group, ring_timeout())
    lay, n = get_layout(layout), transport.world_size
    mask = None if lay.dense_row(q.size(1) * n, n) else make_mask(q.size(1) * n, n, lay)
    strict = _step.strict_block_mode(kernel, q.device, q.dtype, q.size(-1),
                                     applies=lay.strict_block and mask is None)
    plan = build_ring_plan(lay, mask, True, n, transport.rank, q.size(1), kernel=kernel, scale=q.size(-1) ** -0.5,
                           strict_block=strict, device=q.device, dtype=q.dtype, head_dim=q.size(-1), batch=q.size(0),
                           heads=q.size(2))
    # compiled for the kernel itself, its calls timed
    plan = dataclasses.replace(plan, kernel=_TimedKernel(kernel, clock))
    t0 = time.perf_counter()
    out = RingAttention.apply(q, k, v, plan, transport)
    sync(clock.device)
    clock.t["fwd_total"] = time.perf_counter() - t0
    clock.phase = "bwd"
    t0 = time.perf_counter()
    (out * dout).sum().backward()
    sync(clock.device)
    clock.t["bwd_total"] = time.perf_counter() - t0
    return out
