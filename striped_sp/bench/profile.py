"""``bench run --profile``: where forward and backward time goes inside our ring attention (kernel
calls, the fp32 merge, waits on the ring transfers), by timing wrappers installed in the worker
processes only."""

from __future__ import annotations

import time

import torch

from ..engine import autograd as _attention
from ..engine import transport as _ring
from ..engine import step as _step
from ..kernels import Kernel
from ..plan.layouts import get_layout
from .common import sync

__all__ = ["Clock", "install_profiler", "profiled_step"]

# ---------------------------------------------------------------------------------------------

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


def install_profiler(clock: Clock):
    merge = _step.merge_block
    wait = _ring.Transfer.wait
    _step.merge_block = lambda *a: clock.timed("merge", merge, *a)
    _ring.Transfer.wait = lambda self: clock.timed("wait", wait, self)


def profiled_step(q, k, v, dout, group, layout, kernel, clock):
    """One fwd+bwd of our ring attention with the timing kernel; phase totals in ``clock``."""
    for t in (q, k, v):
        t.grad = None
    timed = _TimedKernel(kernel, clock)
    strict = _step.strict_block_mode(kernel, q.device, q.dtype, q.size(-1), applies=layout == "striped")
    t0 = time.perf_counter()
    out = _attention._RingAttention.apply(q, k, v, group, get_layout(layout), True, q.size(-1) ** -0.5, timed,
                                          None, torch.float32, strict)
    sync(clock.device)
    clock.t["fwd_total"] = time.perf_counter() - t0
    clock.phase = "bwd"
    t0 = time.perf_counter()
    (out * dout).sum().backward()
    sync(clock.device)
    clock.t["bwd_total"] = time.perf_counter() - t0
    return out
