"""The ring step (striped_sp.engine.step) on one process: every (rank, source) block of an N-rank ring
run with forward_step / backward_step in the kernel's tensor format, against a float64 reference.

Covers both tensor formats, the sliced and the aligned strict block (with a bottom-right causal
stand-in kernel on CPU, tests/support/bottom_right_kernel.py), MHA and GQA, and the strict-block choice.
"""

import random

import pytest
import torch

from bottom_right_kernel import BottomRightMathKernel
from ring_emulation import check_emulated as _check
from striped_sp.kernels import KERNELS, MathKernel
from striped_sp.engine.step import STRICT_BLOCK_ENV, strict_block_mode

SEED = random.randrange(2**31)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["striped", "zigzag", "contiguous"])
@pytest.mark.parametrize("backend", ["torch", "math"])
def test_sliced_step_in_each_kernel_format(backend, layout, n):
    kernel = KERNELS[backend]
    assert kernel.tensor_format == {"torch": "bhsd", "math": "bshd"}[backend]
    local = 8 if layout == "zigzag" else 7
    _check(kernel, layout, n, (8, 2), False, SEED + n, local)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("fmt", ["bshd", "bhsd"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_aligned_strict_block(fmt, heads, n):
    kernel = BottomRightMathKernel(fmt)
    _check(kernel, "striped", n, heads, True, SEED + 10 * n)
    local = 7
    # the strict blocks ran as all queries against k[:-1]: (n, n-1) causal calls, never (n-1, n-1)
    for calls in (kernel.calls, kernel.bwd_calls):
        assert (local, local - 1, True) in calls
        assert (local - 1, local - 1, True) not in calls


def test_aligned_strict_block_in_bfloat16():
    _check(BottomRightMathKernel("bhsd"), "striped", 4, (8, 2), True, SEED, local=33, dtype=torch.bfloat16, tol=2e-2)


def test_sliced_form_on_the_bottom_right_kernel():
    kernel = BottomRightMathKernel("bhsd")
    _check(kernel, "striped", 3, (8, 2), False, SEED)
    assert (6, 6, True) in kernel.calls and (7, 6, True) not in kernel.calls


def test_strict_block_choice(monkeypatch):
    cpu, f32 = torch.device("cpu"), torch.float32
    monkeypatch.delenv(STRICT_BLOCK_ENV, raising=False)
    assert strict_block_mode(KERNELS["torch"], cpu, f32, 64) == "sliced"  # every kernel's default today
    assert strict_block_mode(BottomRightMathKernel(), cpu, f32, 64, "aligned") == "aligned"
    with pytest.raises(ValueError, match=r"'aligned' \(requested\) needs a kernel whose non-square causal mask is bottom-right"):
        strict_block_mode(KERNELS["torch"], cpu, f32, 64, "aligned")
    with pytest.raises(ValueError, match="aligns it top_left"):
        strict_block_mode(MathKernel(), cpu, f32, 64, "aligned")
    monkeypatch.setenv(STRICT_BLOCK_ENV, "aligned")
    assert strict_block_mode(BottomRightMathKernel(), cpu, f32, 64) == "aligned"
    with pytest.raises(ValueError, match=STRICT_BLOCK_ENV):
        strict_block_mode(KERNELS["torch"], cpu, f32, 64)
    monkeypatch.setenv(STRICT_BLOCK_ENV, "bottom")
    with pytest.raises(ValueError, match="'bottom' .* must be 'sliced' or 'aligned'"):
        strict_block_mode(BottomRightMathKernel(), cpu, f32, 64)


def test_causal_alignment_declared_per_kernel(monkeypatch):
    """flash-attn aligns bottom-right from 2.1 on; PyTorch's CPU op top-left."""
    import sys
    import types

    from striped_sp.kernels import FlashAttnKernel

    assert KERNELS["torch"].causal_alignment(torch.device("cpu"), torch.float32) == "top_left"
    for version, want in (("2.0.9", "top_left"), ("2.6.3", "bottom_right")):
        pkg = types.ModuleType("flash_attn")
        pkg.__version__ = version
        monkeypatch.setitem(sys.modules, "flash_attn", pkg)
        assert FlashAttnKernel().causal_alignment(torch.device("cuda"), torch.bfloat16) == want
