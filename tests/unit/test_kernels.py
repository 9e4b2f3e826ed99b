"""Block kernels against a float64 reference, the merge, and the flash-attn adapter's plumbing."""

import math
import sys
import types

import pytest
import torch

from reference import reference_attention, rel_err
from striped_sp.kernels.merge import merge_block
from striped_sp.kernels import KERNELS, FlashAttnKernel, MathKernel, available_backends, resolve_kernel

SCALE = 0.3  # not head_dim ** -0.5 (0.25 for d=16): a kernel that drops the scale fails

# PyTorch's CPU flash kernel runs the softmax of bf16/fp16 inputs in fp32 but with a fast
# exponential (``fexp_u20``, a cubic documented as accurate to 1 ULP of bf16: relative 2**-8;
# measured on this build: 1.2e-4 ~ 2**-13), while fp32 inputs get the accurate one.  With
# lse = m + log(sum_i e^(s_i - m) (1 + eps_i)), |eps_i| <= delta, the error of lse is at most
# log1p(delta) (absolute, whatever |lse| is), plus the fp32 rounding of the scores and of lse
# (a few 2**-24 |lse|).  An lse off by 5e-3 fails it.
LSE_FAST_EXP_ATOL = math.log1p(2**-8)


def _lse_ok(backend, dtype, lse, ref):
    """``lse`` within the derived bound for (backend, dtype): absolute for the fast-exp path,
    relative 1e-5 wherever the exponential is the accurate fp32 one."""
    if backend == "torch" and dtype in (torch.bfloat16, torch.float16):
        return (lse.double() - ref).abs().max().item() <= LSE_FAST_EXP_ATOL + 2**-20 * ref.abs().max().item()
    return rel_err(lse, ref) < 1e-5


def _inputs(s=13, h=8, kvh=2, d=16, dtype=torch.float32, seed=None):
    """Random inputs from ``seed``, else from the global generator (seeded per test by conftest)."""
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(2**31, ())))
    # an extra leading query/key row so that sliced (non-contiguous-offset) views are exercised
    q = torch.randn(2, s + 1, h, d, generator=gen).to(dtype)[:, 1:]
    k = torch.randn(2, s + 1, kvh, d, generator=gen).to(dtype)[:, :-1]
    v = torch.randn(2, s + 1, kvh, d, generator=gen).to(dtype)[:, :-1]
    dout = torch.randn(2, s, h, d, generator=gen).to(dtype)
    return q, k, v, dout


def _reference_with_grads(q, k, v, dout, causal):
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    out = reference_attention(qr, kr, vr, causal, SCALE)
    (out * dout.double()).sum().backward()
    s = torch.einsum("bqhd,bkhd->bhqk", qr.detach(), kr.detach().repeat_interleave(q.size(2) // k.size(2), 2)) * SCALE
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return out.detach(), torch.logsumexp(s, -1), qr.grad, kr.grad, vr.grad


@pytest.mark.parametrize("backend", ["torch", "math"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_forward_backward(backend, causal, heads, dtype, tol):
    kernel = resolve_kernel(backend, torch.device("cpu"), dtype)
    q, k, v, dout = _inputs(h=heads[0], kvh=heads[1], dtype=dtype)
    out, lse = kernel.forward(q, k, v, causal, SCALE)
    ref_out, ref_lse, dq_ref, dk_ref, dv_ref = _reference_with_grads(q, k, v, dout, causal)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, heads[0], q.size(1)) and lse.is_contiguous()
    assert rel_err(out, ref_out) < tol
    assert _lse_ok(backend, dtype, lse, ref_lse), (lse.double() - ref_lse).abs().max().item()
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, SCALE)
    assert dk.shape == k.shape and dv.shape == v.shape
    for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert rel_err(got, want) < tol


@pytest.mark.parametrize("kernel_name", ["torch", "math"])
def test_merge_of_key_blocks_equals_full_attention(kernel_name):
    """Splitting the keys in three blocks and merging gives full (non-causal) attention."""
    kernel = KERNELS[kernel_name]
    q, k, v, _ = _inputs(s=12)
    ref = reference_attention(q, k, v, False, SCALE)
    out, lse = kernel.forward(q, k[:, :5], v[:, :5], False, SCALE)
    out, lse = out.float().clone(), lse.clone()
    for sl in (slice(5, 9), slice(9, 12)):
        bo, bl = kernel.forward(q, k[:, sl], v[:, sl], False, SCALE)
        merge_block(out, lse, bo, bl)
    assert rel_err(out, ref) < 1e-5


def test_merge_is_stable_for_far_apart_lse():
    out = torch.randn(1, 3, 2, 4)
    lse = torch.full((1, 2, 3), 1e4)
    block = torch.randn(1, 3, 2, 4)
    merge_block(out, lse, block, torch.full((1, 2, 3), -1e4))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_auto_backend_on_cpu():
    assert resolve_kernel("auto", torch.device("cpu"), torch.bfloat16).name == "torch"
    assert "math" in available_backends("cpu", torch.float32)
    assert "flash_attn" not in available_backends("cpu", torch.float16)


def _install_fake_flash_attn(monkeypatch, old_api):
    """A stand-in for flash_attn.flash_attn_interface with the documented private signatures,
    computing with the math kernel: checks our argument plumbing, not flash-attn itself."""
    math = MathKernel()
    mod = types.ModuleType("flash_attn.flash_attn_interface")
    seen = {}

    if old_api:  # flash-attn 2.5: window_size tuple, 8-tuple result
        def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
            seen["window_size"] = window_size
            out, lse = math.forward(q, k, v, causal, softmax_scale)
            return out, q, k, v, out, lse, None, None

        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                 window_size, alibi_slopes, deterministic, rng_state=None):
            g = math.backward(dout, q, k, v, out, softmax_lse, causal, softmax_scale)
            for buf, val in zip((dq, dk, dv), g):
                buf.copy_(val)
    else:  # flash-attn 2.6+
        def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                softcap, alibi_slopes, return_softmax):
            seen["window_size"] = (window_size_left, window_size_right)
            seen["softcap"] = softcap
            out, lse = math.with_softcap(softcap).forward(q, k, v, causal, softmax_scale)
            return out, lse, None, None

        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                 window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                 rng_state=None):
            seen["deterministic"] = deterministic
            seen["softcap_bwd"] = softcap
            g = math.with_softcap(softcap).backward(dout, q, k, v, out, softmax_lse, causal, softmax_scale)
            for buf, val in zip((dq, dk, dv), g):
                buf.copy_(val)

    mod._flash_attn_forward = _flash_attn_forward
    mod._flash_attn_backward = _flash_attn_backward
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", mod)
    return seen


@pytest.mark.parametrize("old_api", [False, True])
def test_flash_attn_adapter_plumbing(monkeypatch, old_api):
    seen = _install_fake_flash_attn(monkeypatch, old_api)
    kernel = FlashAttnKernel()
    assert "CUDA devices only" in kernel.unavailable_reason(torch.device("cpu"), torch.float16)
    q, k, v, dout = _inputs()
    out, lse = kernel.forward(q, k, v, True, SCALE)
    assert seen["window_size"] == (-1, -1)
    ref_out, ref_lse, dq_ref, dk_ref, dv_ref = _reference_with_grads(q, k, v, dout, True)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(lse, ref_lse) < 1e-5
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, SCALE)
    for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert rel_err(got, want) < 1e-5
    if not old_api:  # --deterministic-mode reaches flash-attn's backward
        assert seen["deterministic"] is False
        FlashAttnKernel(deterministic=True).backward(dout, q, k, v, out, lse, True, SCALE)
        assert seen["deterministic"] is True


def test_flash_attn_softcap_reaches_the_kernel(monkeypatch):
    """``with_softcap(c)``: flash-attn 2's forward and backward get ``softcap=c`` (0.0 when off)."""
    seen = _install_fake_flash_attn(monkeypatch, old_api=False)
    q, k, v, dout = _inputs()
    out, lse = FlashAttnKernel().forward(q, k, v, True, SCALE)
    assert seen["softcap"] == 0.0
    kernel = FlashAttnKernel().with_softcap(2.5)
    assert kernel.softcap == 2.5 and kernel.softcap_unavailable_reason() is None
    out, lse = kernel.forward(q, k, v, True, SCALE)
    kernel.backward(dout, q, k, v, out, lse, True, SCALE)
    assert seen["softcap"] == 2.5 and seen["softcap_bwd"] == 2.5
    assert kernel.deterministic_variant().softcap == 2.5  # --deterministic-mode keeps the cap


def _install_custom_op_flash_attn(monkeypatch):
    """flash-attn >= 2.7 registers its private functions as torch.library custom ops, whose
    ``__call__`` signature is ``(*args, **kwargs)``; the adapter must still find the parameters."""
    from typing import Optional

    math = MathKernel()

    @torch.library.custom_op("striped_sp_test::flash_attn_forward", mutates_args=())
    def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                            softmax_scale: float, causal: bool, window_size_left: int = -1,
                            window_size_right: int = -1, softcap: float = 0.0,
                            alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out, lse = math.forward(q, k, v, causal, softmax_scale)
        return out, lse, q.new_empty(0), q.new_empty(2, dtype=torch.int64)

    @torch.library.custom_op("striped_sp_test::flash_attn_backward", mutates_args=("dq", "dk", "dv"))
    def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, softmax_lse: torch.Tensor, dq: torch.Tensor,
                             dk: torch.Tensor, dv: torch.Tensor, dropout_p: float, softmax_scale: float,
                             causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                             alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                             rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
        for buf, val in zip((dq, dk, dv), math.backward(dout, q, k, v, out, softmax_lse, causal, softmax_scale)):
            buf.copy_(val)
        return softmax_lse.new_empty(softmax_lse.shape)

    mod = types.ModuleType("flash_attn.flash_attn_interface")
    mod._flash_attn_forward = _flash_attn_forward
    mod._flash_attn_backward = _flash_attn_backward
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", mod)


def test_flash_attn_adapter_with_custom_ops(monkeypatch):
    _install_custom_op_flash_attn(monkeypatch)
    kernel = FlashAttnKernel()
    q, k, v, dout = _inputs(s=11)
    q, k, v = (t.contiguous() for t in (q, k, v))
    out, lse = kernel.forward(q, k, v, True, SCALE)
    ref_out, ref_lse, dq_ref, dk_ref, dv_ref = _reference_with_grads(q, k, v, dout, True)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(lse, ref_lse) < 1e-5
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, SCALE)
    for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert rel_err(got, want) < 1e-5


def test_cuda_head_dim_rules_without_a_gpu():
    """The fused CUDA ops are called directly (no padding): unaligned head_dim falls back to math."""
    cuda = torch.device("cuda")
    torch_kernel = KERNELS["torch"]
    assert "multiple of 8" in torch_kernel.unavailable_reason(cuda, torch.bfloat16, 12)
    assert "multiple of 4" in torch_kernel.unavailable_reason(cuda, torch.float32, 6)
    assert torch_kernel.unavailable_reason(cuda, torch.bfloat16, 128) is None
    assert resolve_kernel("auto", cuda, torch.bfloat16, 12).name == "math"
    with pytest.raises(ValueError, match="head_dim=12 must be a multiple of 8"):
        resolve_kernel("torch", cuda, torch.bfloat16, 12)


def test_deterministic_kernel_choice():
    """--deterministic-mode: CPU kernels are kept; on CUDA the fused torch ops are refused by name,
    flash-attn runs its deterministic backward (checked on meta-free objects, no GPU needed)."""
    from striped_sp.kernels import KERNELS, _DETERMINISTIC_FLASH_ATTN, _deterministic_reason, resolve_kernel

    assert resolve_kernel("torch", "cpu", torch.float32, 64, deterministic=True) is KERNELS["torch"]
    assert resolve_kernel("auto", "cpu", torch.float32, 64, deterministic=True) is KERNELS["torch"]
    assert "no deterministic backward" in _deterministic_reason("torch", torch.device("cuda"))
    assert "no deterministic backward" in _deterministic_reason("torch_cudnn", torch.device("cuda"))
    assert _deterministic_reason("flash_attn", torch.device("cuda")) is None
    assert _DETERMINISTIC_FLASH_ATTN.deterministic and not KERNELS["flash_attn"].deterministic
