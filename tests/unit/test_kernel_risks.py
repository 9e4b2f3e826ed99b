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


# -- cuDNN only where PyTorch itself would run it (issue 48, item 2) -------------------------------

CAPS = [(7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (10, 3), (10, 7), (11, 0), (12, 0), (12, 1)]
CUDNNS = [None, 8907, 90100, 91100, 91501, 92300, 92600]
DIMS = [(64, 64), (128, 128), (160, 160), (192, 192), (192, 128), (256, 256), (256, 128), (72, 72)]


def _cudnn_env(monkeypatch, cap, cudnn, d256, cuda="13.0"):
    import striped_sp.kernels as kernels
    import striped_sp.kernels.torch_sdpa as kernels_torch

    monkeypatch.setattr(kernels_torch, "_cudnn_facts", lambda device: (cap, cudnn, d256, cuda), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(kernels, "_SAID", set())


def test_cudnn_runs_exactly_where_pytorch_would(monkeypatch):
    """backend='torch_cudnn' is available for exactly the devices, cuDNN releases and head dims that
    PyTorch's can_use_cudnn_attention admits (tests/support/sdp_rules.py), forward and backward.
    Before issue 48 only multiples of 8 were checked: head dim 256 on an A100, 160 anywhere..."""
    from sdp_rules import can_use_cudnn
    from striped_sp.kernels import TorchKernel

    kernel, wrong = TorchKernel("cudnn"), []
    for cap in CAPS:
        for cudnn in CUDNNS:
            for d256 in (False, True):
                _cudnn_env(monkeypatch, cap, cudnn, d256)
                for d, dv in DIMS:
                    want = can_use_cudnn(*cap, cudnn, d256, d, dv)
                    why = kernel.unavailable_reason(torch.device("cuda"), torch.bfloat16, (d, dv))
                    if (why is None) != want:
                        wrong.append((cap, cudnn, d256, (d, dv), want, why))
    assert not wrong, wrong[:5]


@pytest.mark.parametrize("cuda", ["12.8", "13.0"])
def test_auto_picks_cudnn_only_where_pytorch_prefers_it(monkeypatch, cuda):
    """auto (dense calls, no FA4 / flash-attn) picks cuDNN only where PyTorch ranks it first
    (check_prefer_cudnn_attention) and runs it; elsewhere PyTorch's flash op."""
    import sys

    from sdp_rules import can_use_cudnn, prefers_cudnn
    from striped_sp.kernels import resolve_kernel

    monkeypatch.setitem(sys.modules, "flash_attn", None)
    wrong = []
    for cap in [c for c in CAPS if c >= (8, 0)]:
        for cudnn in CUDNNS:
            _cudnn_env(monkeypatch, cap, cudnn, True, cuda)
            for d in (64, 128, 256):
                want = "torch_cudnn" if prefers_cudnn(*cap, cudnn, cuda) and can_use_cudnn(*cap, cudnn, True, d, d) \
                    else "torch"
                got = resolve_kernel("auto", torch.device("cuda"), torch.bfloat16, d, varlen=False).name
                if got != want:
                    wrong.append((cap, cudnn, d, want, got))
    assert not wrong, wrong[:5]


class _KeyLengthAten:
    """cuDNN's op refuses a key length of 1 (as PyTorch's gate does); the efficient op runs it."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return getattr(torch.ops.aten, name)

    def _scaled_dot_product_cudnn_attention(self, q, k, v, *args, scale=None):
        assert k.size(2) != 1, "cudnn SDPA does not support key/value sequence length 1"
        self.calls.append("cudnn")
        return torch.zeros_like(q), torch.zeros(*q.shape[:3], 1), None, None, q.size(2), k.size(2), None, None, None

    def _scaled_dot_product_efficient_attention(self, q, k, v, *args, scale=None):
        self.calls.append("efficient")
        return torch.zeros_like(q), torch.zeros(*q.shape[:2], -(-q.size(2) // 32) * 32), None, None

    def _scaled_dot_product_efficient_attention_backward(self, dout, q, k, v, *args, scale=None):
        self.calls.append("efficient_backward")
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None


def test_cudnn_key_length_one_runs_on_the_efficient_op(monkeypatch):
    import types

    import striped_sp.kernels.torch_sdpa as kernels_torch
    from striped_sp.kernels import TorchKernel

    aten = _KeyLengthAten()
    monkeypatch.setattr(kernels_torch, "torch", type("T", (), {"__getattr__": lambda s, n: getattr(torch, n),
                                                               "ops": types.SimpleNamespace(aten=aten)})())
    monkeypatch.setattr(kernels_torch, "_uses_cpu_op", lambda t: False)
    kernel = TorchKernel("cudnn")
    q, k = torch.zeros(1, 2, 2, 8, dtype=torch.bfloat16), torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16)
    out, lse = kernel.forward(q, k, k, False, 0.125)
    kernel.backward(torch.zeros_like(out), q, k, k, out, lse, False, 0.125)
    assert aten.calls == ["efficient", "efficient_backward"]
    kernel.forward(q, q, q, False, 0.125)
    assert aten.calls[-1] == "cudnn"


# -- FA4 at head dims (256, 256) on SM100: no local attention (issue 48, item 1) -------------------

def _hd256_segments(folded: bool = False):
    from striped_sp.kernels.segments import Segments

    if folded:  # with causal runs: folded into causal and full launches, nothing local (FA4 runs them)
        return Segments(torch.tensor([0, 7, 19, 31, 40]), torch.tensor([0, 7, 19, 36, 45]),
                        torch.tensor([5, 5, 0, -1]), torch.tensor([0, 0, -1, 0]))

    # two windows (5, 0) and a triangle (0, open) on more keys: two window classes (a call with
    # causal runs folds into causal and full launches, kernels/native.py); the triangle's wl = 0 is
    # local to FA4 with no user window
    return Segments(torch.tensor([0, 7, 19, 31]), torch.tensor([0, 7, 19, 36]), torch.tensor([5, 5, 0]),
                    torch.tensor([0, 0, -1]))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("folded", [False, True], ids=["windowed", "folded"])
def test_fa4_hd256_local_calls_run_where_they_can_on_sm100(monkeypatch, heads, folded):
    """FA4's dedicated (256, 256) kernels on SM100 assert ``not is_local``, forward and backward
    (tests/support/fa4_double.py): before issue 48 every windowed or packed call there raised.  Its
    local calls now run on PyTorch's flash varlen op (checked by aten_contracts.AtenShim), its causal
    and full ones on FA4; together exact against the float64 math kernel."""
    import striped_sp.kernels as kernels
    import striped_sp.kernels.fa4_kernel as fa4_mod
    import striped_sp.kernels.torch_sdpa as kernels_torch
    from aten_contracts import AtenShim, TorchProxy
    from fa4_double import install_fa4
    from striped_sp.kernels import FA4Kernel, MathKernel

    monkeypatch.setattr(fa4_mod, "_capability", lambda device: (10, 0))
    monkeypatch.setattr(kernels.KERNELS["fa4"], "_fns", None)
    double = install_fa4(monkeypatch, arch=100)
    shim = AtenShim("values", 0.0625)
    monkeypatch.setattr(kernels_torch, "torch", TorchProxy(shim))
    segs, d = _hd256_segments(folded), 256
    nq, nk = int(segs.cu_q[-1]), int(segs.cu_k[-1])
    gen = torch.Generator().manual_seed(7)
    q, do = (torch.randn(1, nq, heads[0], d, generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, nk, heads[1], d, generator=gen).to(torch.bfloat16) for _ in range(2))

    def run(kernel, tq, tk, tv, tdo):
        acc = torch.zeros(1, nq, heads[0], d, dtype=torch.float64 if tq.dtype == torch.float64 else torch.float32)
        lse = torch.full((1, heads[0], nq), float("-inf"), dtype=acc.dtype)
        kernel.forward_varlen(tq, tk, tv, segs, 0.0625, acc, lse)
        grads = [torch.zeros(t.shape, dtype=acc.dtype) for t in (tq, tk, tv)]
        kernel.backward_varlen(tdo, tq, tk, tv, acc.to(tq.dtype), lse, segs, 0.0625, *grads)
        return acc, lse, grads

    got = run(FA4Kernel(), q, k, v, do)
    want = run(MathKernel(), *(t.double() for t in (q, k, v, do)))
    fa4_calls = {(c[1]["causal"], c[1]["window_size_left"], c[1]["window_size_right"]) for c in double.calls}
    assert all(not fa4_mod.is_local(*w) for w in fa4_calls)  # FA4 got no local call
    if folded:
        assert fa4_calls and not shim.calls
    else:
        assert {"_flash_attention_forward", "_flash_attention_backward"} <= set(shim.calls)

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    assert rel(got[0], want[0]) < 2e-2 and rel(got[1], want[1]) < 1e-5
    for g, w in zip(got[2], want[2]):
        assert rel(g, w) < 3e-2


@pytest.mark.parametrize("causal, wl, wr, local", [
    (True, None, None, False), (False, None, 0, False), (False, None, None, False), (False, -1, -1, False),
    (False, 0, None, True), (False, 5, 0, True), (True, 5, None, True), (False, None, 3, True)])
def test_fa4_local_rule_is_upstreams(causal, wl, wr, local):
    """is_local is upstream's _resolve_causal_local_window (a triangle's wl = 0 is local)."""
    from striped_sp.kernels.fa4_kernel import is_local, no_local_hd256

    assert is_local(causal, wl, wr) is local
    assert no_local_hd256(10, 256, 256) and not no_local_hd256(9, 256, 256) and not no_local_hd256(10, 192, 128)
