"""Risks a GPU would show, guarded on CPU: a row that sees no key in the merge.

Kernels report a row with no visible key in three ways: lse ``+inf`` (flash-attn 2, PyTorch's flash
op), ``-inf`` (FA3, FA4) with output 0, or NaN.  The merge must give it weight 0 and leave the
accumulators as they are, also where the accumulators themselves hold no key yet (``-inf``).
(flash-attn's ``rng_state`` in the backward: tests/unit/test_cuda_contracts.py, ``_check_fa_args``.)
"""

from __future__ import annotations

import pytest
import torch

from striped_sp.kernels.merge import merge_block, merge_block_safe

INF = float("inf")


def _acc(gen, lse_value=None):
    out = torch.randn(1, 3, 2, 4, generator=gen)  # [b, s, h, d]
    lse = torch.randn(1, 2, 3, generator=gen) if lse_value is None else torch.full((1, 2, 3), lse_value)
    return out, lse


@pytest.mark.parametrize("empty", [INF, -INF, float("nan")], ids=["+inf", "-inf", "nan"])
def test_merge_gives_a_row_without_keys_weight_zero(empty):
    gen = torch.Generator().manual_seed(0)
    out, lse = _acc(gen)
    block_out, block_lse = torch.randn(1, 3, 2, 4, generator=gen), torch.randn(1, 2, 3, generator=gen)
    block_out[:, 1] = 0.0  # row 1 saw no key: output 0, lse as the kernel reports it
    block_lse[:, :, 1] = empty
    want_out, want_lse = out.clone(), lse.clone()
    merge_block(out, lse, block_out, block_lse)
    assert torch.equal(out[:, 1], want_out[:, 1]) and torch.equal(lse[:, :, 1], want_lse[:, :, 1])
    # the other rows merged as softmax says
    w = torch.sigmoid(block_lse - want_lse).transpose(1, 2).unsqueeze(-1)
    for r in (0, 2):
        assert torch.allclose(out[:, r], (want_out + w * (block_out - want_out))[:, r])
        assert torch.allclose(lse[:, :, r], torch.logaddexp(want_lse, block_lse)[:, :, r])


@pytest.mark.parametrize("empty", [INF, -INF, float("nan")], ids=["+inf", "-inf", "nan"])
def test_safe_merge_keeps_rows_that_saw_nothing_yet(empty):
    """Accumulators still at (out 0, lse -inf) meet a block whose row saw no key either: they stay
    so (no NaN), and a later block with keys gives exactly its own result."""
    gen = torch.Generator().manual_seed(1)
    out, lse = torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), -INF)
    block_out, block_lse = torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), empty)
    merge_block_safe(out, lse, block_out, block_lse)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    real_out, real_lse = torch.randn(1, 3, 2, 4, generator=gen), torch.randn(1, 2, 3, generator=gen)
    merge_block_safe(out, lse, real_out, real_lse)
    assert torch.equal(out, real_out) and torch.equal(lse, real_lse)


# -- a broken FA4 / flash-attn install (issue 48, item 6) ------------------------------------------

def _broken_flash_attn(tmp_path, monkeypatch, error="AttributeError: module 'cutlass.cute' has no attribute 'ThrMma'"):
    """A ``flash_attn`` package whose import raises what a broken flash-attn 2 over FA4's namespace
    raises (not an ImportError): the package on ``sys.path``, every cached ``flash_attn*`` module gone."""
    import sys

    kind, _, message = error.partition(": ")
    pkg = tmp_path / "flash_attn"
    (pkg / "cute").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"raise {kind}({message!r})\n")
    (pkg / "cute" / "__init__.py").write_text("")
    (pkg / "cute" / "interface.py").write_text("")
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("error", ["AttributeError: module 'cutlass.cute' has no attribute 'ThrMma'",
                                   "RuntimeError: CUDA driver version is insufficient",
                                   "ImportError: libcuda.so.1: cannot open shared object file"])
def test_a_broken_fa4_install_costs_only_its_own_backends(tmp_path, monkeypatch, error):
    """Importing ``flash_attn.cute.interface`` may raise anything; before issue 48 the FA4 probe
    caught ImportError only and ``available_backends`` / ``auto`` raised for every backend.  Now
    FA4 and flash-attn are passed over with the exception named, the others still run."""
    import striped_sp.kernels as kernels
    import striped_sp.kernels.fa4_kernel as fa4_mod
    from striped_sp.kernels import available_backends, resolve_kernel

    _broken_flash_attn(tmp_path, monkeypatch, error)
    cuda = torch.device("cuda")
    monkeypatch.setattr(fa4_mod, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    names = available_backends(cuda, torch.bfloat16, 64)
    assert "fa4" not in names and "flash_attn" not in names and "torch" in names
    kind = error.split(":")[0]
    for name in ("fa4", "flash_attn"):
        why = kernels.KERNELS[name].unavailable_reason(cuda, torch.bfloat16, 64)
        assert kind in why and "failed" in why and "not installed" not in why, why
    assert resolve_kernel("auto", cuda, torch.bfloat16, 64, varlen=True).name == "torch"
    with pytest.raises(ValueError, match=kind):
        resolve_kernel("fa4", cuda, torch.bfloat16, 64)


def test_fa4_not_installed_still_says_so(monkeypatch):
    """A missing package (not a broken one) keeps its install hint."""
    import sys

    from striped_sp.kernels.fa4_kernel import import_reason

    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert "not installed" in import_reason() and "striped_sp[fa4]" in import_reason()


# -- cuDNN's lse by torch release (issue 48, item 5) -----------------------------------------------

class _CudnnAten:
    """``torch.ops.aten`` with the cuDNN attention ops of torch ``version``: the forward returns lse
    ``[B, H, S, 1]`` from 2.9, ``[B, H, S]`` before; the backward's C++ (2.6-2.8) unsqueezes the lse
    it gets, so it must get the 3-D one there, and the 4-D one from 2.9 (the forward's, as returned)."""

    def __init__(self, version: str):
        self.trailing = tuple(int(x) for x in version.split(".")[:2]) >= (2, 9)

    def __getattr__(self, name):
        return getattr(torch.ops.aten, name)

    def _scaled_dot_product_cudnn_attention(self, q, k, v, bias, lse_on, dropout, causal, debug, scale=None):
        b, h, s, _ = q.shape
        lse = torch.zeros(b, h, s, *((1,) if self.trailing else ()))
        return torch.zeros_like(q), lse, None, None, s, k.size(2), None, None, None

    def _scaled_dot_product_cudnn_attention_backward(self, dout, q, k, v, out, lse, *rest, scale=None):
        want = (*q.shape[:3], 1) if self.trailing else tuple(q.shape[:3])
        lse = lse if self.trailing else lse.unsqueeze(-1)  # what 2.6-2.8's C++ does to it
        assert tuple(lse.shape) == (*q.shape[:3], 1), f"cuDNN backward got lse {tuple(lse.shape)}, wants {want}"
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@pytest.mark.parametrize("version", ["2.6.0", "2.8.0+cu128", "2.9.0", "2.11.0+cu130"])
def test_cudnn_backward_gets_the_lse_its_release_wants(monkeypatch, version):
    """We passed ``lse.unsqueeze(-1)`` always: right from torch 2.9, a 5-D lse on 2.6-2.8 (which
    setup.cfg accepts)."""
    import types

    import striped_sp.kernels.torch_sdpa as kernels_torch
    from striped_sp.kernels import TorchKernel

    aten = _CudnnAten(version)
    proxy = types.SimpleNamespace(ops=types.SimpleNamespace(aten=aten))
    monkeypatch.setattr(kernels_torch, "torch", type("T", (), {"__getattr__": lambda s, n: getattr(torch, n),
                                                               "ops": proxy.ops})())
    monkeypatch.setattr(kernels_torch, "_TORCH_VERSION", version, raising=False)
    kernel = TorchKernel("cudnn")
    q, k, v = (torch.zeros(1, 2, 5, 8, dtype=torch.bfloat16) for _ in range(3))
    out, lse = kernel._cuda_forward("cudnn", q, k, v, True, 0.125, expand=False)
    assert lse.shape == (1, 2, 5)  # the ring's form, whichever the release returned
    kernel._cuda_backward("cudnn", torch.zeros_like(q), q, k, v, out, lse, True, 0.125, expand=False)
