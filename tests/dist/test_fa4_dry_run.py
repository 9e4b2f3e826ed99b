"""Every attention call of a training step on FA4 where FA4 is present (issue 35), counted in a dry run.

A fake SM90 and a fake SM100 device: only the device predicate (``fa4_kernel._capability``) and the
availability of the ops are patched; FlashAttention-4 is :class:`fa4_shapes.FA4Shapes` (shape-only,
its architecture's rules checked on every call), PyTorch's CUDA flash op is present too (the torch
kernel's CUDA branch, as ``bench overhead``'s dry run runs it).  ``backend="auto"`` then resolves
as on that GPU, and one training step (forward + backward of every rank, the engine's executor on
meta tensors) runs on dense, packed, windowed and packed+windowed rows, with GQA and with MLA's
(192, 128) head dims, under every layout.  Counted per kernel class: every call is FA4's (0 on any
other class), as many forward calls as the plans launch; the batch's next layer copies nothing to
the device and synchronises nowhere.  Seen failing with ``auto`` planted to pass FA4 over for
varlen calls on SM100 (and, before the fix, on SM90 where FA4's varlen backward was refused).
"""

from __future__ import annotations

import collections

import pytest
import torch

import striped_sp.kernels as kernels
import striped_sp.kernels.fa4_kernel as fa4_mod
from fa4_shapes import install_fa4_shapes
from striped_sp.bench.overhead import CudaBranch, HostWork
from striped_sp.engine import local
from striped_sp.engine.step import head_splits
from striped_sp.kernels.base import Kernel

N, PER_RANK = 4, 32
SEQ = N * PER_RANK
LAYOUTS = ["striped", "zigzag", "contiguous", "striped:stripe=doc"]
SHAPES = {"gqa": (4, 2, 64, 64), "mla": (4, 4, 192, 128), "gqa-mla": (4, 2, 192, 128)}  # heads, kv heads, d, dv
ROWS = [("dense", "gqa"), ("packed", "gqa"), ("window", "mla"), ("packed-window", "mla")]
CALLS = ("forward", "backward", "forward_native", "backward_native", "forward_masked", "backward_masked",
         "varlen_forward_op", "varlen_backward_op")
CUDA = torch.device("cuda")


def _docs(layout: str) -> list[int]:
    """Document bounds with documents shorter than N (zigzag: multiples of 2N, which it needs)."""
    if layout == "zigzag":
        return [0, 2 * N, 6 * N, 10 * N, SEQ]
    return [0, 1, 3, 40, 41, 90, SEQ]


def _args(layout: str, row: str) -> dict:
    args = dict(layout=layout, backend="auto")
    if row.startswith("packed"):
        args["cu_seqlens"] = _docs(layout)
    if row.endswith("window"):
        args["window_size"] = (19, 0)
    return args


class KernelCalls:
    """Attention calls per kernel class: every entry point of every kernel class (the outermost call
    only: ``forward_native`` running ``forward`` is one call), its class as on a CUDA device."""

    def __init__(self, monkeypatch):
        self.count = collections.Counter()
        self._depth = 0
        classes = {type(k) for k in kernels.KERNELS.values()} | {CudaBranch}
        for cls in classes:
            for name in CALLS:
                if name in vars(cls) or cls is Kernel:
                    monkeypatch.setattr(cls, name, self._wrap(getattr(cls, name)))
        for name in CALLS:  # the base class's defaults
            monkeypatch.setattr(Kernel, name, self._wrap(vars(Kernel)[name]))

    def _wrap(self, fn):
        spy = self

        def wrapper(kernel, *args, **kwargs):
            if spy._depth == 0:
                t = next(a for a in args if isinstance(a, torch.Tensor))
                spy.count[kernel.kernel_class(CUDA, t.dtype, t.size(-1), True)] += 1
            spy._depth += 1
            try:
                return fn(kernel, *args, **kwargs)
            finally:
                spy._depth -= 1

        return wrapper


@pytest.fixture
def gpu(monkeypatch):
    """A fake GPU of compute capability ``arch`` // 10 with FA4 installed (shape-only) and PyTorch's
    CUDA flash op present; returns the FA4 stand-in and the per-class call counter."""

    def make(arch: int):
        monkeypatch.setattr(fa4_mod, "_capability", lambda device: (arch // 10, 0))
        monkeypatch.setitem(kernels.KERNELS, "torch", CudaBranch())
        fa4 = install_fa4_shapes(monkeypatch, arch=arch)
        for kernel in (kernels.KERNELS["fa4"], kernels.KERNELS["fa4"].deterministic_variant()):
            monkeypatch.setattr(kernel, "_fns", None)  # the interface is read again: this stand-in's
        return fa4, KernelCalls(monkeypatch)

    return make


def _step(args, shape, plans=None):
    h, kvh, d, dv = shape
    q = torch.empty(1, SEQ, h, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, SEQ, kvh, d, dtype=torch.bfloat16, device="meta")
    v = torch.empty(1, SEQ, kvh, dv, dtype=torch.bfloat16, device="meta")
    do = torch.empty(1, SEQ, h, dv, dtype=torch.bfloat16, device="meta")
    return local.simulate(q, k, v, N, do, plans=plans, **args)


@pytest.mark.parametrize("row, shape", ROWS, ids=[f"{r}-{s}" for r, s in ROWS])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", [90, 100], ids=["sm90", "sm100"])
def test_every_call_of_a_training_step_runs_on_fa4(gpu, arch, layout, row, shape):
    fa4, calls = gpu(arch)
    args, dims = _args(layout, row), SHAPES[shape]
    with HostWork() as first:
        sim = _step(args, dims)
    plans = sim.plans[0]
    masked = plans[0].masked
    assert first.copies == (N if masked else 0) and not first.syncs, (first.copies, first.syncs)
    fa4.count.clear()
    calls.count.clear()
    with HostWork() as later:  # the batch's next layer: its plans as built
        _step(args, dims, plans=sim.plans)
    assert set(calls.count) == {"fa4"}, dict(calls.count)  # 0 calls on any other class
    assert sum(later.kernels.values()) == 0  # no aten attention op (PyTorch's flash / efficient / cuDNN)
    assert later.copies == 0 and not later.syncs, (later.copies, later.syncs)
    fwd = sum(c for (p, _), c in fa4.count.items() if p == "forward")
    bwd = sum(c for (p, _), c in fa4.count.items() if p == "backward")
    planned = sum(p.launches(t) for p in plans for t in range(p.steps))
    assert fwd == planned > 0, (fwd, planned)
    halves = 1 if masked else len(head_splits(dims[0], dims[1]))  # dense backward calls in head halves
    assert bwd == planned * halves, (bwd, planned, halves)
    assert calls.count["fa4"] == fwd + bwd
    if masked:  # packed documents, windows and stripe=doc's rows: FA4's varlen calls in both passes
        assert fa4.count[("forward", "varlen")] and fa4.count[("backward", "varlen")], dict(fa4.count)


@pytest.mark.parametrize("arch", [90, 100], ids=["sm90", "sm100"])
def test_deterministic_step_runs_on_fa4(gpu, arch):
    """``deterministic=True`` on packed GQA rows with a window: FA4's deterministic backward (SM90
    from 4.0.0b12, the stand-in's 4.0.0b36)."""
    fa4, calls = gpu(arch)
    _step(dict(_args("striped", "packed-window"), deterministic=True), SHAPES["gqa"])
    assert set(calls.count) == {"fa4"}, dict(calls.count)
    bwd = [c[1] for c in fa4.calls if c[0] == "_flash_attn_bwd"]
    assert bwd and all(a["deterministic"] is True for a in bwd)


def test_gqa_with_mla_head_dims_falls_back_on_sm90_only(gpu):
    """The one call FA4 does not take on these devices: SM90's backward of GQA with (192, 128)
    (``flash_bwd_sm90`` asserts one head dim): every call then runs on the next class, none on FA4;
    SM100 takes the same row on FA4."""
    args = _args("striped", "packed")
    fa4, calls = gpu(90)
    _step(args, SHAPES["gqa-mla"])
    assert set(calls.count) == {"torch_flash"} and not fa4.calls, dict(calls.count)
    fa4, calls = gpu(100)
    _step(args, SHAPES["gqa-mla"])
    assert set(calls.count) == {"fa4"} and fa4.calls, dict(calls.count)
