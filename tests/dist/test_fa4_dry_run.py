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
import pathlib
import sys

if __name__ == "__main__":  # run as a script (the report of the counts): tests/support on the path, as under pytest
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "support"))

import pytest  # noqa: E402
import torch  # noqa: E402

import striped_sp.kernels as kernels  # noqa: E402
import striped_sp.kernels.fa4_kernel as fa4_mod  # noqa: E402
from fa4_shapes import install_fa4_shapes  # noqa: E402
from striped_sp.bench.overhead import CudaBranch, HostWork  # noqa: E402
from striped_sp.engine import local  # noqa: E402
from striped_sp.engine.step import head_splits  # noqa: E402
from striped_sp.kernels.base import Kernel  # noqa: E402

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


def _fake_gpu(monkeypatch):
    """``make(arch)``: a fake GPU of compute capability ``arch`` // 10 with FA4 installed (shape-only)
    and PyTorch's CUDA flash op present; returns the FA4 stand-in and the per-class call counter."""

    def make(arch: int):
        monkeypatch.setattr(fa4_mod, "_capability", lambda device: (arch // 10, 0))
        monkeypatch.setitem(kernels.KERNELS, "torch", CudaBranch())
        fa4 = install_fa4_shapes(monkeypatch, arch=arch)
        for kernel in (kernels.KERNELS["fa4"], kernels.KERNELS["fa4"].deterministic_variant()):
            monkeypatch.setattr(kernel, "_fns", None)  # the interface is read again: this stand-in's
            monkeypatch.setattr(kernel, "_softcap_variants", {}, raising=False)  # capped copies: likewise
        return fa4, KernelCalls(monkeypatch)

    return make


@pytest.fixture
def gpu(monkeypatch):
    return _fake_gpu(monkeypatch)


def _step(args, shape, plans=None, sinks=None):
    h, kvh, d, dv = shape
    q = torch.empty(1, SEQ, h, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, SEQ, kvh, d, dtype=torch.bfloat16, device="meta")
    v = torch.empty(1, SEQ, kvh, dv, dtype=torch.bfloat16, device="meta")
    do = torch.empty(1, SEQ, h, dv, dtype=torch.bfloat16, device="meta")
    return local.simulate(q, k, v, N, do, plans=plans, sinks=sinks, **args)


def training_step_counts(fake_gpu, arch: int, layout: str, row: str, shape: str) -> dict:
    """One training step's dry run on ``fake_gpu(arch)``, then the batch's next layer counted: its
    attention calls per kernel class (``classes``), FA4's per pass and kind (``fa4``), the forward
    launches its plans say (``planned``), the masked flag, aten attention ops, host-to-device copies
    and synchronisations of the next layer, and the first layer's copies and syncs."""
    fa4, calls = fake_gpu(arch)
    args, dims = _args(layout, row), SHAPES[shape]
    with HostWork() as first:
        sim = _step(args, dims)
    plans = sim.plans[0]
    fa4.count.clear()
    calls.count.clear()
    with HostWork() as later:  # the batch's next layer: its plans as built
        _step(args, dims, plans=sim.plans)
    return {"classes": dict(calls.count), "fa4": dict(fa4.count), "masked": plans[0].masked,
            "planned": sum(p.launches(t) for p in plans for t in range(p.steps)),
            "aten_attention_ops": sum(later.kernels.values()), "copies": later.copies,
            "syncs": sum(later.syncs.values()), "first_copies": first.copies, "first_syncs": sum(first.syncs.values())}


@pytest.mark.parametrize("row, shape", ROWS, ids=[f"{r}-{s}" for r, s in ROWS])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", [90, 100], ids=["sm90", "sm100"])
def test_every_call_of_a_training_step_runs_on_fa4(gpu, arch, layout, row, shape):
    got = training_step_counts(gpu, arch, layout, row, shape)
    masked = got["masked"]
    assert got["first_copies"] == (N if masked else 0) and got["first_syncs"] == 0, got
    assert set(got["classes"]) == {"fa4"}, got["classes"]  # 0 calls on any other class
    assert got["aten_attention_ops"] == 0  # no aten attention op (PyTorch's flash / efficient / cuDNN)
    assert got["copies"] == 0 and got["syncs"] == 0, got
    fwd = sum(c for (p, _), c in got["fa4"].items() if p == "forward")
    bwd = sum(c for (p, _), c in got["fa4"].items() if p == "backward")
    assert fwd == got["planned"] > 0, got
    heads, kv_heads = SHAPES[shape][:2]
    halves = 1 if masked else len(head_splits(heads, kv_heads))  # dense backward calls in head halves
    assert bwd == got["planned"] * halves, (got, halves)
    assert got["classes"]["fa4"] == fwd + bwd
    if masked:  # packed documents, windows and stripe=doc's rows: FA4's varlen calls in both passes
        assert got["fa4"].get(("forward", "varlen")) and got["fa4"].get(("backward", "varlen")), got


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


def _report() -> None:
    """Print the counts of every (architecture, layout, row) of the test: ``python tests/dist/test_fa4_dry_run.py``."""
    rows, total = [], collections.Counter()
    for arch in (90, 100):
        for layout in LAYOUTS:
            for row, shape in ROWS:
                with pytest.MonkeyPatch.context() as mp:
                    got = training_step_counts(_fake_gpu(mp), arch, layout, row, shape)
                other = sum(c for cls, c in got["classes"].items() if cls != "fa4")
                total.update({"fa4": got["classes"].get("fa4", 0), "other": other, "copies": got["copies"],
                              "syncs": got["syncs"]})
                rows.append(f"sm{arch:<4} {layout:<19} {row + '/' + shape:<18} {got['classes'].get('fa4', 0):>5} "
                            f"{other:>6} {got['copies']:>6} {got['syncs']:>6}")
    print(f"one training step (fwd+bwd), N={N}, {SEQ} tokens, bf16, backend auto, FA4 present (dry run, meta)\n"
          f"{'arch':<6} {'layout':<19} {'row':<18} {'fa4':>5} {'other':>6} {'h2d':>6} {'syncs':>6}  (the layer after the first)")
    print("\n".join(rows))
    print(f"total: {total['fa4']} calls on FA4, {total['other']} on other classes, {total['copies']} host-to-device "
          f"copies, {total['syncs']} synchronisations")


if __name__ == "__main__":
    _report()


@pytest.mark.parametrize("arch", [90, 100], ids=["sm90", "sm100"])
def test_sinks_and_softcap_step_runs_on_fa4(gpu, arch):
    """Issue 47 on the CUDA path: one training step with sinks (``[h]`` bf16, folded into the merged
    lse by the engine, no kernel argument) and one with soft-capping (FA4's own ``softcap``), packed
    GQA rows with a window: every call on FA4; the cap reaches every forward and backward call; the
    sink case passes no cap; the batch's next layer copies and synchronises nothing."""
    args, dims = _args("striped", "packed-window"), SHAPES["gqa"]
    fa4, calls = gpu(arch)
    sinks = torch.empty(dims[0], dtype=torch.bfloat16, device="meta", requires_grad=True)
    sim = _step(dict(args), dims, sinks=sinks)
    assert set(calls.count) == {"fa4"} and fa4.calls, dict(calls.count)
    assert all(not c[1]["softcap"] for c in fa4.calls), "a sink is no cap"
    with HostWork() as later:
        _step(dict(args), dims, plans=sim.plans, sinks=sinks)
    assert later.copies == 0 and sum(later.syncs.values()) == 0
    fa4, calls = gpu(arch)
    _step(dict(args, softcap=30.0), dims)
    assert set(calls.count) == {"fa4"}, dict(calls.count)
    passes = {c[0] for c in fa4.calls}
    assert passes == {"_flash_attn_fwd", "_flash_attn_bwd"}, passes
    assert all(c[1]["softcap"] == 30.0 for c in fa4.calls), [c[1]["softcap"] for c in fa4.calls]
