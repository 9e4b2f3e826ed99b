"""``deterministic=True`` (Megatron's ``--deterministic-mode``) reaches the kernel choice.

Without a GPU: the CUDA resolution refuses PyTorch's fused ops by name and picks flash-attn's
deterministic backward (a stand-in module makes flash-attn importable), and ``ring_attention``
hands the flag to the resolution on a real one-rank ring."""

import sys
import types

import pytest
import torch

import striped_sp
from reference import reference_attention, rel_err
from striped_sp.kernels import KERNELS, resolve_kernel

CUDA = torch.device("cuda")


@pytest.fixture
def flash_attn_importable(monkeypatch):
    """flash_attn.flash_attn_interface importable (never called: resolution only)."""
    mod = types.ModuleType("flash_attn.flash_attn_interface")
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", mod)


@pytest.mark.parametrize("backend", ["torch", "torch_cudnn"])
def test_cuda_fused_ops_refused_when_deterministic(backend):
    assert resolve_kernel(backend, CUDA, torch.bfloat16, 64) is KERNELS[backend]  # usable otherwise
    with pytest.raises(ValueError, match=f"deterministic=True: backend '{backend}'.*no deterministic backward"):
        resolve_kernel(backend, CUDA, torch.bfloat16, 64, deterministic=True)


def test_cuda_auto_skips_the_fused_ops_when_deterministic():
    assert resolve_kernel("auto", CUDA, torch.bfloat16, 64).name == "torch"
    assert resolve_kernel("auto", CUDA, torch.bfloat16, 64, deterministic=True) is KERNELS["math"]


@pytest.mark.parametrize("backend", ["flash_attn", "auto"])
def test_flash_attn_runs_its_deterministic_backward(flash_attn_importable, backend):
    plain = resolve_kernel(backend, CUDA, torch.bfloat16, 64)
    assert plain.name == "flash_attn" and not plain.deterministic
    kernel = resolve_kernel(backend, CUDA, torch.bfloat16, 64, deterministic=True)
    assert kernel.name == "flash_attn" and kernel.deterministic


@pytest.mark.parametrize("deterministic", [False, True])
def test_ring_attention_hands_deterministic_to_the_kernel(world_of_one, deterministic_flags, deterministic):
    """On a one-rank ring: the flag reaches resolve_kernel, and the result is still attention."""
    q, k, v = torch.randn(1, 9, 4, 8), torch.randn(1, 9, 2, 8), torch.randn(1, 9, 2, 8)
    out = striped_sp.ring_attention(q, k, v, softmax_scale=0.3, deterministic=deterministic)
    assert deterministic_flags and all(flag is deterministic for flag in deterministic_flags), deterministic_flags
    assert rel_err(out, reference_attention(q, k, v, True, 0.3)) < 1e-5
