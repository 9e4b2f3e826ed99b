"""``backend="fa4"`` (FlashAttention-4's ``flash_attn.cute.interface``) checked without a GPU.

The kernel runs on CPU tensors against :class:`fa4_double.FA4Double`, a float64 double written from
the upstream source's semantics (bottom-right masks, ``None`` for an open window side, lse
``[b, h, s]`` / ``[h, total]``, empty rows lse ``-inf``); only the device predicate
(``fa4_kernel._capability``) is patched.  Results against float64 references that do not run the
kernel; the availability rules per compute capability / dtype / head dims; the interface checked
once, naming the installed version; ``auto``'s choice on CUDA.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

import striped_sp.kernels as kernels
import striped_sp.kernels.fa4_kernel as fa4_mod
from fa4_double import install_fa4
from striped_sp.kernels import FA4Kernel, MathKernel, resolve_kernel
from striped_sp.kernels.segments import Segments

SCALE = 0.125
N = 29
CUDA = torch.device("cuda")


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture
def fa4(monkeypatch):
    """Install the double; the device predicate reports compute capability ``cap``."""

    def install(cap=(10, 0), **kwargs):
        monkeypatch.setattr(fa4_mod, "_capability", lambda device: cap if torch.device(device).type == "cuda" else None)
        for shared in (kernels.KERNELS["fa4"], fa4_mod._DETERMINISTIC):  # read this double's interface
            monkeypatch.setattr(shared, "_fns", None)
        return install_fa4(monkeypatch, arch=cap[0] * 10, **kwargs)

    return install


def _math_block(q, k, v, do, visible):
    """float64 attention of [b, sq, h, d] against [b, sk, kvh, dv] with a bool [sq, sk] mask."""
    out, lse = MathKernel().forward_masked(q.double(), k.double(), v.double(), visible[None, None], SCALE)
    seen = torch.isfinite(lse)
    out = out.nan_to_num(0.0)
    grads = MathKernel().backward_masked(do.double(), q.double(), k.double(), v.double(), out, lse, visible[None, None],
                                         SCALE) if bool(seen.all()) else None
    return out, lse, grads


def _inputs(h, kvh, d, dv, dtype, seed, sq=N, sk=N, b=2):
    gen = torch.Generator().manual_seed(seed)
    q, do = torch.randn(b, sq, h, d, generator=gen).to(dtype), torch.randn(b, sq, h, dv, generator=gen).to(dtype)
    k, v = torch.randn(b, sk, kvh, d, generator=gen).to(dtype), torch.randn(b, sk, kvh, dv, generator=gen).to(dtype)
    return q, k, v, do


@pytest.mark.parametrize("version", ["4.0.0b18", "4.0.0b19", "4.0.0b36"])
@pytest.mark.parametrize("dtype, heads, dims", [
    (torch.float32, (8, 2), (64, 64)), (torch.bfloat16, (4, 4), (128, 128)), (torch.float32, (4, 1), (192, 128)),
    (torch.float16, (8, 2), (256, 256))], ids=["fp32-gqa", "bf16-mha", "fp32-mla", "fp16-256"])
def test_dense_blocks_against_float64(fa4, version, dtype, heads, dims):
    """Diagonal, striped strict ((n-1) x (n-1)), dense half and full blocks: out, lse, dq/dk/dv
    (kv heads unexpanded, v's head dim kept), whatever the forward tuple's length."""
    double = fa4(version=version, fp32=True)
    kernel = FA4Kernel()
    q, k, v, do = _inputs(*heads, *dims, dtype, seed=dims[0] + heads[1])
    tol = 2e-6 if dtype == torch.float32 else 3e-2
    for qs, ks, causal in ((slice(None), slice(None), True), (slice(1, None), slice(0, N - 1), True),
                           (slice(None), slice(0, N // 2), False), (slice(None), slice(None), False)):
        qb, kb, vb, dob = q[:, qs], k[:, ks], v[:, ks], do[:, qs]
        vis = torch.ones(qb.size(1), kb.size(1), dtype=torch.bool)
        vis = vis.tril() if causal else vis
        want_out, want_lse, want_grads = _math_block(qb, kb, vb, dob, vis)
        out, lse = kernel.forward(qb, kb, vb, causal, SCALE)
        assert out.shape == (*qb.shape[:3], dims[1]) and out.dtype == dtype
        assert lse.shape == want_lse.shape and lse.dtype == torch.float32
        assert _rel(out, want_out) < tol and _rel(lse, want_lse) < 2e-6
        grads = kernel.backward(dob, qb, kb, vb, out, lse, causal, SCALE)
        for g, w, t in zip(grads, want_grads, (qb, kb, vb)):
            assert g.shape == t.shape and _rel(g, w) < tol
    assert all(c[1]["k"].size(-2) == heads[1] for c in double.calls)  # GQA native: never expanded


def test_aligned_strict_block(fa4):
    """All n queries against k[:-1], causal: bottom-right, so row 0 sees nothing (lse -inf, out 0)
    and rows 1.. are the sliced call's."""
    fa4(fp32=True)
    q, k, v, _ = _inputs(8, 2, 64, 64, torch.float32, seed=4)
    kernel = FA4Kernel()
    out, lse = kernel.forward(q, k[:, :-1], v[:, :-1], True, SCALE)
    ref_out, ref_lse = kernel.forward(q[:, 1:], k[:, :-1], v[:, :-1], True, SCALE)
    assert torch.isneginf(lse[:, :, 0]).all() and (out[:, 0] == 0).all()
    assert torch.equal(lse[:, :, 1:], ref_lse) and torch.equal(out[:, 1:], ref_out)


SEGS = Segments(torch.tensor([0, 7, 19, 33, 45]), torch.tensor([0, 7, 19, 33, 50]), torch.tensor([-1, -1, 5, 0]),
                torch.tensor([0, 0, 0, -1]))  # two causal pieces, a window (5, 0), a triangle (0, -1) on more keys
# two window classes (a call of more runs folded into causal and full launches, kernels/native.py)
WINDOWED = Segments(torch.tensor([0, 7, 19, 31]), torch.tensor([0, 7, 19, 36]), torch.tensor([5, 5, 0]),
                    torch.tensor([0, 0, -1]))


@pytest.mark.parametrize("segs, windows", [
    (SEGS, {(True, None, None), (False, None, None)}),  # three classes: folded into two launches
    (WINDOWED, {(False, 5, 0), (False, 0, None)}),  # the neutral form, no -1
], ids=["folded", "windowed"])
@pytest.mark.parametrize("dims", [(64, 64), (192, 128)])
def test_varlen_against_float64(fa4, dims, segs, windows):
    """Packed segments with causal, windowed and one-sided (0, open) bands on FA4's varlen call,
    against the float64 math kernel's schedule of the same segments."""
    nq, nk = int(segs.cu_q[-1]), int(segs.cu_k[-1])
    double = fa4(fp32=True)
    gen = torch.Generator().manual_seed(5)
    q, do = torch.randn(2, nq, 8, dims[0], generator=gen), torch.randn(2, nq, 8, dims[1], generator=gen)
    k, v = torch.randn(2, nk, 2, dims[0], generator=gen), torch.randn(2, nk, 2, dims[1], generator=gen)

    def run(kernel, tq, tk, tv, tdo):
        acc = torch.zeros(2, nq, 8, dims[1], dtype=torch.float64)
        lse = torch.full((2, 8, nq), float("-inf"), dtype=torch.float64)
        kernel.forward_varlen(tq, tk, tv, segs, SCALE, acc, lse)
        grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (tq, tk, tv)]
        kernel.backward_varlen(tdo, tq, tk, tv, acc.to(tq.dtype), lse.float() if tq.dtype != torch.float64 else lse,
                               segs, SCALE, *grads)
        return acc, lse, grads

    got = run(FA4Kernel(), q, k, v, do)
    want = run(MathKernel(), *(t.double() for t in (q, k, v, do)))
    assert {c[0] for c in double.calls} == {"_flash_attn_fwd", "_flash_attn_bwd"}
    assert {(c[1]["causal"], c[1]["window_size_left"], c[1]["window_size_right"]) for c in double.calls} == windows
    assert all(c[1]["max_seqlen_q"] is not None and c[1]["max_seqlen_k"] is not None for c in double.calls)
    assert _rel(got[0], want[0]) < 2e-6 and _rel(got[1], want[1]) < 2e-6
    for g, w in zip(got[2], want[2]):
        assert _rel(g, w) < 2e-6


# -- availability, the interface check, determinism, auto --------------------------------------

@pytest.mark.parametrize("cap, dtype, dims, ok", [
    ((9, 0), torch.bfloat16, 64, True), ((9, 0), torch.bfloat16, 256, True), ((9, 0), torch.float16, 8, True),
    ((9, 0), torch.bfloat16, 12, False), ((9, 0), torch.bfloat16, 264, False), ((9, 0), torch.bfloat16, (192, 128), True),
    ((9, 0), torch.bfloat16, (256, 96), True), ((9, 0), torch.bfloat16, (192, 260), False),
    ((10, 0), torch.bfloat16, 128, True), ((10, 0), torch.bfloat16, (192, 128), True),
    ((10, 0), torch.bfloat16, (256, 256), True), ((10, 0), torch.bfloat16, 192, False),
    ((10, 0), torch.bfloat16, (128, 192), False), ((10, 0), torch.bfloat16, 160, False),
    ((10, 0), torch.float32, 64, False), ((8, 0), torch.bfloat16, 64, False), ((12, 0), torch.bfloat16, 64, False)])
def test_unavailable_reason_rules(fa4, cap, dtype, dims, ok):
    fa4(cap)
    reason = FA4Kernel().unavailable_reason(CUDA, dtype, dims)
    assert (reason is None) == ok, reason
    assert FA4Kernel().unavailable_reason(torch.device("cpu"), torch.bfloat16, 64) is not None


def test_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)
    assert "pip install 'striped_sp[fa4]'" in FA4Kernel().unavailable_reason(CUDA, torch.bfloat16, 64)


def test_interface_checked_once_naming_the_version(fa4, monkeypatch):
    """A release whose private function lacks a parameter the kernel passes is refused, with the
    installed version and the supported range, before any call."""
    fa4((10, 0))
    iface = sys.modules["flash_attn.cute.interface"]

    def old_fwd(q, k, v, softmax_scale=None, causal=False):  # no return_lse, no varlen
        raise AssertionError("never called")

    monkeypatch.setattr(iface, "_flash_attn_fwd", old_fwd)
    monkeypatch.setattr(fa4_mod, "installed_version", lambda: "4.0.0b2")
    reason = FA4Kernel().unavailable_reason(CUDA, torch.bfloat16, 64)
    assert "4.0.0b2" in reason and fa4_mod.SUPPORTED in reason and "return_lse" in reason
    with pytest.raises(ValueError, match="4.0.0b2"):
        resolve_kernel("fa4", CUDA, torch.bfloat16, 64)


def test_gqa_with_mla_head_dims_not_on_sm90(fa4):
    """SM90's backward takes GQA calls with one head dim only: (192, 128) runs there without GQA
    (known: ``gqa=False``), is refused with GQA or when unknown; SM100 takes it either way."""
    fa4((9, 0))
    assert resolve_kernel("fa4", CUDA, torch.bfloat16, (192, 128), gqa=False).name == "fa4"
    for gqa in (True, None):
        with pytest.raises(ValueError, match="head_dim == head_dim_v"):
            resolve_kernel("fa4", CUDA, torch.bfloat16, (192, 128), gqa=gqa)
    assert resolve_kernel("fa4", CUDA, torch.bfloat16, 128, gqa=True).name == "fa4"
    fa4((10, 0))
    assert resolve_kernel("fa4", CUDA, torch.bfloat16, (192, 128), gqa=True).name == "fa4"


@pytest.mark.parametrize("cap, version, ok", [((10, 0), "4.0.0b5", True), ((9, 0), "4.0.0b36", True),
                                              ((9, 0), "4.0.0b12", True), ((9, 0), "4.0.0b8", False),
                                              ((9, 0), "unknown", True), ((9, 0), "4.0.0.dev5", False),
                                              ((9, 0), "4.0.0a3", False), ((9, 0), "4.0.0rc1", True)])
def test_deterministic_backward(fa4, monkeypatch, cap, version, ok):
    """FA4's deterministic backward: SM100, and SM90 from 4.0.0b12 (before it SM90's GQA backward
    summed dK/dV with atomics); the refusal names the installed release."""
    double = fa4(cap, fp32=True)
    monkeypatch.setattr(fa4_mod, "installed_version", lambda: version)
    if not ok:
        with pytest.raises(ValueError, match=f"4.0.0b12.*{version}"):
            resolve_kernel("fa4", CUDA, torch.bfloat16, 64, deterministic=True)
        return
    kernel = resolve_kernel("fa4", CUDA, torch.bfloat16, 64, deterministic=True)
    assert kernel.name == "fa4" and kernel.deterministic
    q, k, v, do = _inputs(4, 2, 64, 64, torch.float32, seed=1)
    out, lse = kernel.forward(q, k, v, True, SCALE)
    kernel.backward(do, q, k, v, out, lse, True, SCALE)
    assert double.calls[-1][1]["deterministic"] is True


@pytest.mark.parametrize("cap, varlen, dims, gqa, want", [
    ((9, 0), False, 64, None, "fa4"), ((10, 0), None, 64, None, "fa4"), ((10, 0), True, 64, True, "fa4"),
    ((9, 0), True, 64, True, "fa4"), ((9, 0), True, (192, 128), False, "fa4"), ((9, 0), True, (192, 128), True, "torch"),
    ((8, 0), None, 64, None, "torch")])
def test_auto_picks_fa4_where_it_runs(fa4, monkeypatch, caplog, cap, varlen, dims, gqa, want):
    """auto on CUDA: FA4 on SM90 / SM100 for dense, packed and windowed calls (SM90's varlen and
    windowed backward from 4.0.0b5), MLA's (192, 128) on SM90 without GQA only, else the next
    class; one log line with the choice and why."""
    fa4(cap)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "_SAID", set())
    with caplog.at_level(logging.INFO, logger="striped_sp.kernels"):
        kernel = resolve_kernel("auto", CUDA, torch.bfloat16, dims, varlen=varlen, gqa=gqa)
    assert kernel.name == want
    lines = [r.getMessage() for r in caplog.records if r.name == "striped_sp.kernels"]
    assert len(lines) == 1 and f"'{want}'" in lines[0] and "fastest class" in lines[0]
    if want != "fa4":
        assert "fa4:" in lines[0]  # why FA4 was passed over
    if gqa and dims == (192, 128):
        assert "head_dim == head_dim_v" in lines[0]


def test_auto_prices_cudnn_for_dense_calls_only(monkeypatch):
    """Without FA4 / FA3: cuDNN for calls known to be dense, PyTorch's flash op otherwise (on an
    SM 9.0 with a cuDNN PyTorch itself prefers: tests/unit/test_kernel_risks.py for the rest)."""
    import striped_sp.kernels.torch_sdpa as kernels_torch

    monkeypatch.setattr(kernels_torch, "_cudnn_facts", lambda device: ((9, 0), 91600, False, "13.0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)
    assert resolve_kernel("auto", CUDA, torch.bfloat16, 64, varlen=False).name == "torch_cudnn"
    assert resolve_kernel("auto", CUDA, torch.bfloat16, 64, varlen=True).name == "torch"
    assert resolve_kernel("auto", CUDA, torch.bfloat16, 64).name == "torch"


def test_a_new_backend_is_one_registration(monkeypatch):
    """register() is the only edit: auto ranks it by its class, resolve_kernel asks it the rest."""

    class Fast(MathKernel):
        name = "fast"

        def kernel_class(self, device, dtype, head_dim=None, varlen=False):
            return "fa4"

    monkeypatch.setattr(kernels, "KERNELS", dict(kernels.KERNELS))
    kernels.register(Fast())
    assert resolve_kernel("auto", torch.device("cpu"), torch.float32, 64).name == "fast"
    assert resolve_kernel("fast", torch.device("cpu"), torch.float32, 64).name == "fast"
    assert "fast" in kernels.available_backends("cpu", torch.float32)


# -- the double catches what it should -----------------------------------------------------------

def test_flash2_window_form_would_be_caught(fa4):
    """FA4 reads flash-attn 2's ``-1`` (an open side) as a number: a causal band (-1, 0) becomes
    ``wl + wr < 0``, both sides open, full attention.  A kernel that passed that form is caught."""
    fa4(fp32=True)
    q, k, v, _ = _inputs(4, 2, 64, 64, torch.float32, seed=2, b=1)
    iface = sys.modules["flash_attn.cute.interface"]
    cu = torch.tensor([0, N], dtype=torch.int32)
    good = iface._flash_attn_fwd(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=N, max_seqlen_k=N,
                                 softmax_scale=SCALE, causal=False, window_size_left=None, window_size_right=0,
                                 return_lse=True)
    bad = iface._flash_attn_fwd(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=N, max_seqlen_k=N,
                                softmax_scale=SCALE, causal=False, window_size_left=-1, window_size_right=0,
                                return_lse=True)
    want = MathKernel().forward(q.double(), k.double(), v.double(), True, SCALE)[0][0]
    assert _rel(good[0], want) < 2e-6 and _rel(bad[0], want) > 1e-2


# -- torch's flash registry: the flash op only where its implementation runs -------------------------

@pytest.mark.parametrize("impl, cap, want", [(None, (9, 0), "flash"), ("FA3", (9, 0), "flash"),
                                             ("FA3", (10, 0), "efficient"), ("FA3", (8, 0), "efficient"),
                                             ("FA4", (9, 0), "efficient"), (None, (7, 5), "efficient")])
def test_torch_kernel_asks_the_flash_registry(monkeypatch, caplog, impl, cap, want):
    """FA3 through torch's registry runs on compute capability 9.x only; torch 2.13's FA4 route
    fails on every call: elsewhere the memory-efficient op, and the reason logged once."""
    import striped_sp.kernels.torch_sdpa as sdpa

    monkeypatch.setattr(torch.nn.attention, "current_flash_attention_impl", lambda: impl)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(sdpa, "_SAID", set())
    kernel = kernels.TorchKernel()
    with caplog.at_level(logging.WARNING, logger="striped_sp.kernels.torch_sdpa"):
        for _ in range(3):
            assert kernel._cuda_op_for(CUDA, torch.bfloat16, 64) == want
    said = [r.getMessage() for r in caplog.records if r.name == "striped_sp.kernels.torch_sdpa"]
    assert len(said) == (1 if want == "efficient" and cap[0] >= 8 else 0)
    if said:
        assert impl in said[0] and "memory-efficient" in said[0]
    assert kernel.native_varlen(CUDA, torch.bfloat16, 64) == (want == "flash")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernel.kernel_class(CUDA, torch.bfloat16, 64) == {"flash": "fa3" if impl == "FA3" else "torch_flash",
                                                              "efficient": "efficient"}[want]


def test_predict_mode_prices_fa4_for_packed_calls_on_hopper():
    """``bench sim --predict``'s auto: FA4 on H100 / H200 / B200 for packed and windowed calls too
    (SM90's varlen backward from 4.0.0b5), FA2 on A100."""
    from striped_sp.bench.predict import kernel_class_of

    for arch in ("H100", "H800", "H200", "B200"):
        assert kernel_class_of("auto", arch, True) == kernel_class_of("auto", arch, False) == "fa4"
    assert kernel_class_of("auto", "A100", True) == "fa2"


def test_the_setup_line_names_the_kernel_the_ring_runs_for_mla_without_gqa(fa4, monkeypatch):
    """The setup line resolves the kernel as the ring's calls do: an MLA model without GQA runs on
    FA4 on SM90, and the line says so; with GQA (or unknown) FA4 is passed over, with its reason."""
    from striped_sp import setup_report

    from striped_sp.plan import cost

    fa4(cap=(9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cost, "gpu_arch", lambda: "H100")  # not the cached probe of the real device
    assert setup_report.kernel_choice("fa4", CUDA, torch.bfloat16, (192, 128), gqa=False)[0] == "fa4"
    line = setup_report.setup_line("test", "striped", "CP size 2", "fa4", CUDA, torch.bfloat16, (192, 128),
                                   "calibrate", gqa=False)
    assert "kernel fa4 on cuda" in line, line
    name, why = setup_report.kernel_choice("auto", CUDA, torch.bfloat16, (192, 128), gqa=True)
    assert name != "fa4" and "fa4: FA4's SM90 backward takes GQA calls with one head dim only" in why, why
