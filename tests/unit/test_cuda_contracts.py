"""The CUDA branch of every kernel, forward and backward, checked without a GPU.

PyTorch's fused CUDA ops (flash, memory-efficient, cuDNN; the flash varlen op): the kernel runs
its CUDA branch on CPU tensors with ``torch.ops.aten`` replaced by :class:`aten_contracts.AtenShim`,
which checks each call against the op's schema and the per-argument contract (shapes and dtypes
from torch's own meta kernels), then answers with the op's semantics in float64.  The kernel's
outputs are compared with a float64 reference of the block: MHA and GQA, bf16 / fp16 / fp32 where
the op takes them, head_dim 64 / 128 / 256, the ring's block shapes (diagonal, the striped strict
``n-1`` block, dense halves and full blocks).

flash-attn (not installed here): stand-in modules with the documented private signatures of
2.5, 2.6 and 2.7+ (custom ops), binding every call by parameter name and checking each argument.

Mutation check (``test_swapped_out_and_lse_is_caught``): swapping ``out`` and ``lse`` in the flash
backward call passes torch's parser and meta kernel (the plain meta run, level ``meta``) and the
schema binding (both are ``Tensor``); the per-argument contract catches it (``out`` has the
forward's lse shape), and so do the float64 values.  Swapping ``k`` and ``v`` (same shapes) is
caught by the values only.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
import types
from typing import Optional

import pytest
import torch

import striped_sp.kernels as kernels
import striped_sp.kernels.torch_sdpa as kernels_torch
from aten_contracts import AtenShim, ContractError, TorchProxy, isclose_rel
from ring_emulation import check_emulated
from striped_sp.kernels import FlashAttnKernel, TorchKernel

SCALE = 0.125  # also the scale of TorchKernel's GQA probe, so the shim's scale check admits its calls
N = 29  # a ring shard's length: not a power of two, not a multiple of 8 or 32
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
BLOCKS = [  # (q rows, kv rows, causal) as the ring slices them from one shard
    (slice(None), slice(None), True),              # diagonal block
    (slice(1, None), slice(0, N - 1), True),       # striped strict block: (n-1) x (n-1)
    (slice(None), slice(0, N // 2), False),        # dense half (zigzag)
    (slice(None), slice(None), False),             # dense full
]
VARIANTS = {"flash": (torch.bfloat16, torch.float16), "efficient": (torch.bfloat16, torch.float16, torch.float32),
            "cudnn": (torch.bfloat16, torch.float16)}


def _inputs(h, kvh, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(2, N, n, d, generator=gen).to(dtype) for n in (h, kvh, kvh, h))
    return q, k, v, do


def reference_attention(q, k, v, causal, scale):
    """float64 attention of ``[b, sq, h, d]`` against ``[b, sk, kv_h, d]`` (causal: square)."""
    g = q.size(2) // k.size(2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(g, 2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double().repeat_interleave(g, 2))


def _reference(q, k, v, do, causal):
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    out = reference_attention(qr, kr, vr, causal, SCALE)
    (out * do.double()).sum().backward()
    kx = kr.detach().repeat_interleave(q.size(2) // k.size(2), 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qr.detach(), kx) * SCALE
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return out.detach(), torch.logsumexp(s, -1), qr.grad, kr.grad, vr.grad


@pytest.fixture
def cuda_branch(monkeypatch):
    """Run TorchKernel's CUDA branch on CPU tensors through an AtenShim of the given level."""

    def install(level="values", gqa=None):
        shim = AtenShim(level, SCALE, gqa)
        monkeypatch.setattr(kernels_torch, "torch", TorchProxy(shim))
        monkeypatch.setattr(kernels_torch, "_uses_cpu_op", lambda t: False)
        monkeypatch.setattr(kernels_torch, "_GQA_NATIVE", {})  # each stand-in is probed afresh
        return shim

    return install


def _run_blocks(kernel, q, k, v, do, dtype):
    for q_rows, kv_rows, causal in BLOCKS:
        qb, kb, vb, dob = q[:, q_rows], k[:, kv_rows], v[:, kv_rows], do[:, q_rows]
        out, lse = kernel.forward(qb, kb, vb, causal, SCALE)
        ref_out, ref_lse, dq_ref, dk_ref, dv_ref = _reference(qb, kb, vb, dob, causal)
        assert out.dtype == dtype and out.shape == qb.shape
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape and lse.is_contiguous()
        assert isclose_rel(out, ref_out) < TOL[dtype]
        assert isclose_rel(lse, ref_lse) < 1e-6
        dq, dk, dv = kernel.backward(dob, qb, kb, vb, out, lse, causal, SCALE)
        assert dq.shape == qb.shape and dk.shape == kb.shape and dv.shape == vb.shape  # kv heads, not expanded
        for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
            assert isclose_rel(got, want) < TOL[dtype]


CASES = [(var, dt, heads, d) for var, dts in VARIANTS.items() for dt in dts
         for heads, d in (((8, 2), 64), ((4, 4), 128), ((8, 2), 256))]


@pytest.mark.parametrize("variant, dtype, heads, d", CASES, ids=lambda p: str(p).replace("torch.", ""))
def test_torch_cuda_ops_contracts_and_values(cuda_branch, variant, dtype, heads, d):
    shim = cuda_branch("values")
    kernel = TorchKernel(variant)
    q, k, v, do = _inputs(heads[0], heads[1], d, dtype, seed=d + heads[1])
    _run_blocks(kernel, q, k, v, do, dtype)
    op = {"flash": "_scaled_dot_product_flash_attention", "efficient": "_scaled_dot_product_efficient_attention",
          "cudnn": "_scaled_dot_product_cudnn_attention"}[variant]
    probe = 2 if heads[0] != heads[1] else 0  # GQA: the probe's expanded call, then the refused one
    assert shim.calls == [op, op] * (probe // 2) + [op, op + "_backward"] * len(BLOCKS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masked_calls_on_the_efficient_op(cuda_branch, dtype):
    """forward_masked / backward_masked (batched packed documents) on the memory-efficient op."""
    shim = cuda_branch("values")
    gen = torch.Generator().manual_seed(7)
    q, do = (torch.randn(3, 21, 8, 64, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(3, 19, 2, 64, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(3, 1, 21, 19, generator=gen) < 0.6
    mask[..., 0] = True  # every row sees a key
    kernel = TorchKernel()
    out, lse = kernel.forward_masked(q, k, v, mask, SCALE)
    want_out, want_lse = kernels.MathKernel().forward_masked(q.double(), k.double(), v.double(), mask, SCALE)
    assert isclose_rel(out, want_out) < TOL[dtype] and isclose_rel(lse, want_lse) < 1e-6
    g = kernel.backward_masked(do, q, k, v, out, lse, mask, SCALE)
    want = kernels.MathKernel().backward_masked(do.double(), q.double(), k.double(), v.double(), want_out,
                                                want_lse, mask, SCALE)
    for got, w in zip(g, want):
        assert got.shape == w.shape and isclose_rel(got, w) < TOL[dtype]
    assert shim.calls == ["_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"]


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_flash_varlen_op_contracts_and_values(cuda_branch, monkeypatch, heads):
    """PyTorch's CUDA flash varlen op (packed documents, windows) against the float64 math kernel."""
    from striped_sp.kernels.segments import Segments

    shim = cuda_branch("values")
    monkeypatch.setattr(TorchKernel, "native_varlen", lambda self, device, dtype, head_dim=None: True)
    # documents: two causal pieces and a windowed band
    segs = Segments(torch.tensor([0, 7, 19, 33]), torch.tensor([0, 7, 19, 33]), torch.tensor([-1, -1, 5]),
                    torch.tensor([0, 0, 0]))
    gen = torch.Generator().manual_seed(3)
    q, do = (torch.randn(2, 33, heads[0], 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 33, heads[1], 64, generator=gen).to(torch.bfloat16) for _ in range(2))

    def run(kernel, tq, tk, tv, tdo):
        acc = torch.zeros(2, 33, heads[0], 64, dtype=torch.float32)
        lse = torch.full((2, heads[0], 33), float("-inf"), dtype=acc.dtype)
        kernel.forward_varlen(tq, tk, tv, segs, SCALE, acc, lse)
        grads = [torch.zeros(t.shape, dtype=acc.dtype) for t in (tq, tk, tv)]
        kernel.backward_varlen(tdo, tq, tk, tv, acc.to(tq.dtype), lse, segs, SCALE, *grads)
        return acc, lse, grads

    acc, lse, grads = run(TorchKernel(), q, k, v, do)
    assert set(shim.calls) == {"_flash_attention_forward", "_flash_attention_backward"}
    monkeypatch.undo()
    want_acc, want_lse, want_grads = run(kernels.MathKernel(), *(t.double() for t in (q, k, v, do)))
    assert isclose_rel(acc, want_acc) < 2e-2
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen) and isclose_rel(lse[seen], want_lse[seen]) < 1e-6
    for got, want in zip(grads, want_grads):
        assert isclose_rel(got, want) < 3e-2


def test_cuda_op_choice(monkeypatch):
    """TorchKernel on CUDA: flash for fp16/bf16 on sm80+ with head_dim <= 256, else efficient."""
    kernel = TorchKernel()
    for cap, dtype, d, want in (((8, 0), torch.bfloat16, 256, "flash"), ((9, 0), torch.float16, 64, "flash"),
                                ((8, 0), torch.float32, 64, "efficient"), ((7, 5), torch.float16, 64, "efficient")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert kernel._cuda_op(torch.empty(1, 2, 2, d, dtype=dtype)) == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_aligned_strict_block_on_the_flash_op(cuda_branch, dtype):
    """A 3-rank striped ring (tests/support/ring_emulation.py) through the flash op's CUDA branch in
    ``[b, h, s, d]``, with the strict block as all queries x ``k[:-1]`` (bottom-right causal); the
    shim admits that non-square causal call on the flash op only and answers an empty row with
    lse +inf, as flash-attn does."""
    shim = cuda_branch("values")
    kernel = TorchKernel("flash")
    assert kernel.causal_alignment(torch.device("cuda"), dtype, 64) == "bottom_right"
    assert TorchKernel("efficient").causal_alignment(torch.device("cuda"), dtype, 64) == "top_left"
    check_emulated(kernel, "striped", 3, (8, 2), True, seed=3, local=N, dtype=dtype, tol=TOL[dtype] * 2,
                   head_dim=64)
    assert "_scaled_dot_product_flash_attention_backward" in shim.calls


def test_aligned_call_refused_on_the_efficient_op(cuda_branch):
    """The efficient op aligns a causal mask top-left: the contract refuses an n x n-1 causal call."""
    cuda_branch("contract")
    q, k, v, _ = _inputs(8, 2, 64, torch.bfloat16, seed=5)
    with pytest.raises(ContractError, match="n x n-1 on the flash op only"):
        TorchKernel("efficient").forward(q, k[:, :-1], v[:, :-1], True, SCALE)


GQA_CASES = [(None, False), ("wrong", False), ("native", True)] + [
    (f"wrong_if_{case}", False) for case in ("backward", "batched", "noncausal", "rectangular", "strided")]


@pytest.mark.parametrize("variant", ["flash", "efficient", "cudnn"])
@pytest.mark.parametrize("gqa, native", GQA_CASES, ids=[str(c[0]) for c in GQA_CASES])
def test_gqa_kv_heads_unexpanded_only_where_the_op_takes_them(cuda_branch, variant, gqa, native):
    """The one-time probe per op: ops that refuse fewer kv heads (the releases that need equal
    heads), that read the wrong head, or that read the wrong head only in one kind of call the ring
    makes (backward, batch > 1, dense, rectangular, strided views) get expanded kv heads; an op
    that takes them correctly gets them as they are.  Values against float64 in every case."""
    dtype = torch.bfloat16
    q, k, v, do = _inputs(8, 2, 64, dtype, seed=8)
    shim = cuda_branch("values", gqa)
    kernel = TorchKernel(variant)
    assert kernel._gqa_native(variant, q.transpose(1, 2), k.transpose(1, 2)) == native
    assert kernels_torch._GQA_NATIVE == {(variant, "cpu", dtype, 64, 8, 2): native}
    shim.kv_heads.clear()
    _run_blocks(kernel, q, k, v, do, dtype)
    assert len(shim.kv_heads) == 2 * len(BLOCKS) and set(shim.kv_heads) == {2 if native else 8}


def test_gqa_probe_can_be_turned_off(cuda_branch, monkeypatch):
    monkeypatch.setenv(kernels_torch.GQA_NATIVE_ENV, "0")
    shim = cuda_branch("values", "native")
    q, k, v, do = _inputs(8, 2, 64, torch.bfloat16, seed=9)
    _run_blocks(TorchKernel("flash"), q, k, v, do, torch.bfloat16)
    assert kernels_torch._GQA_NATIVE == {} and set(shim.kv_heads) == {8}


def test_gqa_probe_skipped_while_tracing(cuda_branch, monkeypatch):
    """Under torch.compile tracing nothing is probed or cached (the kv heads are expanded)."""
    cuda_branch("values", "native")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16)
    assert not TorchKernel("flash")._gqa_native("flash", q, k) and kernels_torch._GQA_NATIVE == {}


# -- the checks can fail: one argument order broken on purpose --------------------------------

def _mutant(source_fn, old: str, new: str):
    """``TorchKernel`` with one method's source edited (``old`` -> ``new``)."""
    src = textwrap.dedent(inspect.getsource(source_fn))
    assert src.count(old) == 1, f"mutation site {old!r} not found once in {source_fn.__qualname__}"
    ns = {}
    exec(compile(src.replace(old, new), "<mutant>", "exec"), vars(kernels_torch), ns)
    return type("MutantTorchKernel", (TorchKernel,), {source_fn.__name__: ns[source_fn.__name__]})


def _caught_at(cuda_branch, kernel_cls, variant="flash"):
    """The first check level that rejects the kernel (None: none does)."""
    for level in ("meta", "schema", "contract", "values"):
        cuda_branch(level)
        kernel = kernel_cls(variant)
        try:
            if level in ("meta", "schema", "contract"):  # a plain meta run, as the issue describes
                m = dict(device="meta", dtype=torch.bfloat16)
                q, k, v = torch.empty(2, N, 8, 64, **m), torch.empty(2, N, 2, 64, **m), torch.empty(2, N, 2, 64, **m)
                out, lse = kernel.forward(q, k, v, True, SCALE)
                assert out.shape == q.shape and lse.shape == (2, 8, N)
                g = kernel.backward(q, q, k, v, out, lse, True, SCALE)
                assert [t.shape for t in g] == [q.shape, k.shape, v.shape]
            else:
                q, k, v, do = _inputs(8, 2, 64, torch.bfloat16, seed=1)
                _run_blocks(kernel, q, k, v, do, torch.bfloat16)
        except (ContractError, RuntimeError, AssertionError):
            return level
    return None


def test_swapped_out_and_lse_is_caught(cuda_branch):
    """Swap ``out`` and ``lse`` in the flash backward call: torch's parser and meta kernel accept
    it (the meta run the issue describes), the schema binding too (both parameters are Tensor);
    the per-argument contract rejects it (``out`` has the lse's shape [b, h, s], dtype float32)."""
    assert _caught_at(cuda_branch, TorchKernel) is None  # the real kernel passes every level
    broken = _mutant(TorchKernel._cuda_backward, "dout, q, kt, vt, out, lse, None, None", "dout, q, kt, vt, lse, out, None, None")
    assert _caught_at(cuda_branch, broken) == "contract"


def test_swapped_key_and_value_is_caught_by_values_only(cuda_branch):
    """Same shapes and dtypes: only the float64 values see that ``key`` and ``value`` traded places."""
    broken = _mutant(TorchKernel._cuda_forward, "(q, kt, vt, 0.0, causal, False", "(q, vt, kt, 0.0, causal, False")
    assert _caught_at(cuda_branch, broken) == "values"


def test_unpadded_efficient_lse_is_caught(cuda_branch):
    """The memory-efficient backward reads lse padded to a multiple of 32 rows (torch's meta
    forward says so); handing it the unpadded lse is a contract error."""
    broken = _mutant(TorchKernel._cuda_backward, "vt, None, out, lse_p, rng", "vt, None, out, lse, rng")
    assert _caught_at(cuda_branch, broken, "efficient") == "contract"


def test_positional_scale_is_caught(cuda_branch):
    """``scale`` is keyword-only in every schema: passing it by position is an arity error that
    torch's parser already reports (level meta)."""
    broken = _mutant(TorchKernel._cuda_forward, "(q, kt, vt, 0.0, causal, False, scale=scale)",
                     "(q, kt, vt, 0.0, causal, False, scale)")
    assert _caught_at(cuda_branch, broken) == "meta"


# -- flash-attn: documented private signatures of 2.5, 2.6 and 2.7+ -------------------------

def _check_fa_args(b: dict, varlen: bool, version: str, softcap: float = 0.0):
    """Per-argument contract of flash-attn's private functions (GQA native: kv heads divide q heads);
    ``softcap``: the value every call must carry (2.6+)."""
    q, k, v = b["q"], b["k"], b["v"]
    hdim = 1 if varlen else 2
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype == v.dtype, "half inputs"
    for name in ("q", "k", "v", "out", "dout"):
        if name in b:
            assert b[name].stride(-1) == 1, f"{name}: contiguous last dim"
    assert k.shape == v.shape and k.size(-1) == q.size(-1) and q.size(hdim) % k.size(hdim) == 0, "kv shape"
    assert b["dropout_p"] == 0.0 and b["softmax_scale"] == SCALE and b["alibi_slopes"] is None
    if "softcap" in b:
        assert isinstance(b["softcap"], float) and b["softcap"] == softcap, (b["softcap"], softcap)
    if version == "2.5" or version == "2.6":
        assert isinstance(b["window_size"], tuple) and len(b["window_size"]) == 2
        wl, wr = b["window_size"]
    else:
        wl, wr = b["window_size_left"], b["window_size_right"]
    assert isinstance(wl, int) and isinstance(wr, int)
    if not varlen:
        assert (wl, wr) == (-1, -1)
        # square causal calls, or the aligned strict block (n queries x n - 1 keys, bottom-right)
        assert not b["causal"] or q.size(1) in (k.size(1), k.size(1) + 1), "square causal calls"
    else:
        assert b["causal"] == (wl < 0 and wr == 0)
        assert b["cu_seqlens_q"].dtype == torch.int32 and b["cu_seqlens_k"].dtype == torch.int32
    if "dout" in b:
        assert b["out"].shape == q.shape and b["out"].dtype == q.dtype, "out is [.., h, d] like q"
        assert b["dout"].shape == q.shape
        lse_shape = (q.size(1), q.size(0)) if varlen else (q.size(0), q.size(2), q.size(1))
        assert b["softmax_lse"].shape == lse_shape and b["softmax_lse"].dtype == torch.float32, "lse"
        assert b["softmax_lse"].is_contiguous()
        for g, t in (("dq", q), ("dk", k), ("dv", v)):
            assert b[g].shape == t.shape and b[g].dtype == t.dtype, f"{g} buffer"
        assert isinstance(b["deterministic"], bool)
        # flash-attn's backward kernel builds its dropout state from params.rng_state whether or not
        # it drops out (csrc flash_bwd_kernel.h): a null pointer is not safe; [2] int64 as the forward returns it
        rng = b["rng_state"]
        assert isinstance(rng, torch.Tensor) and rng.shape == (2,) and rng.dtype == torch.int64, "rng_state"
    return wl, wr


def _fa_compute_forward(b, varlen, wl, wr):
    math = kernels.MathKernel()
    q, k, v = b["q"], b["k"], b["v"]
    if not varlen:
        if b["causal"] and q.size(1) != k.size(1):  # bottom-right (flash-attn >= 2.1); empty rows: lse +inf
            vis = torch.ones(q.size(1), k.size(1), dtype=torch.bool).tril(k.size(1) - q.size(1))
            out, lse = math.forward_masked(q, k, v, vis[None, None], b["softmax_scale"])
            return out.nan_to_num(0.0), lse.masked_fill(torch.isneginf(lse), float("inf"))
        out, lse = math.forward(q, k, v, b["causal"], b["softmax_scale"])
        return out, lse
    outs, lses = [], []
    cq, ck = b["cu_seqlens_q"].tolist(), b["cu_seqlens_k"].tolist()
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        qi, kj = torch.arange(lq).unsqueeze(1) + lk - lq, torch.arange(lk).unsqueeze(0)
        wl_, wr_ = (wl, 0) if b["causal"] else (wl, wr)
        vis = torch.ones(lq, lk, dtype=torch.bool)
        if wl_ >= 0:
            vis &= kj >= qi - wl_
        if wr_ >= 0:
            vis &= kj <= qi + wr_
        o, l = math.forward_masked(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]], v[None, ck[i]:ck[i + 1]],
                                   vis[None, None], b["softmax_scale"])
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, 1)


def _fa_module(version: str, calls: list, softcap: float = 0.0):
    """flash_attn.flash_attn_interface of ``version`` ("2.5", "2.6", "2.7"): functions with the
    documented parameter lists, bound by name, arguments checked (``softcap``: the cap every call
    must pass; the values stay uncapped: a plumbing check), values from the math kernel."""
    win = ["window_size"] if version in ("2.5", "2.6") else ["window_size_left", "window_size_right"]
    soft = [] if version == "2.5" else ["softcap"]
    fwd_p = ["q", "k", "v", "dropout_p", "softmax_scale", "causal", *win, *soft, "alibi_slopes", "return_softmax"]
    vfwd_p = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
              "softmax_scale", "causal", *win, *soft, "alibi_slopes", "return_softmax", "block_table"]
    bwd_p = ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p", "softmax_scale", "causal",
             *win, *soft, "alibi_slopes", "deterministic", "rng_state"]
    vbwd_p = ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
              "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal", *win, *soft, "alibi_slopes",
              "deterministic", "rng_state"]

    def make(name, params, varlen, backward, optional_from):
        sig = inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                   default=None if i >= optional_from else inspect.Parameter.empty)
                                 for i, p in enumerate(params)])

        def fn(*args, **kwargs):
            b = sig.bind(*args, **kwargs)
            b.apply_defaults()
            b = dict(b.arguments)
            calls.append((name, b))
            wl, wr = _check_fa_args(b, varlen, version, softcap)
            if not backward:
                out, lse = _fa_compute_forward(b, varlen, wl, wr)
                out = out.to(b["q"].dtype)
                rng_state = torch.zeros(2, dtype=torch.int64)  # (seed, offset), unused without dropout
                if version == "2.7":
                    return out, lse, None, rng_state
                return out, b["q"], b["k"], b["v"], out, lse, None, rng_state
            fb = dict(b)
            fb["q"], fb["k"], fb["v"] = (t.double() for t in (b["q"], b["k"], b["v"]))
            with torch.enable_grad():
                qq, kk, vv = (fb[n].requires_grad_() for n in ("q", "k", "v"))
                if varlen:
                    o, _ = _fa_compute_forward({**fb, "q": qq, "k": kk, "v": vv}, True, wl, wr)
                else:
                    o = reference_attention(qq, kk, vv, b["causal"], b["softmax_scale"])
                (o * b["dout"].double()).sum().backward()
            for buf, t in zip((b["dq"], b["dk"], b["dv"]), (qq, kk, vv)):
                buf.copy_(t.grad)
            return None

        fn.__signature__ = sig
        fn.__name__ = name
        return fn

    mod = types.ModuleType("flash_attn.flash_attn_interface")
    mod._flash_attn_forward = make("_flash_attn_forward", fwd_p, False, False, len(fwd_p))
    mod._flash_attn_backward = make("_flash_attn_backward", bwd_p, False, True, len(bwd_p) - 1)
    mod._flash_attn_varlen_forward = make("_flash_attn_varlen_forward", vfwd_p, True, False,
                                          len(vfwd_p) - 1 if version == "2.5" else 10)
    mod._flash_attn_varlen_backward = make("_flash_attn_varlen_backward", vbwd_p, True, True, len(vbwd_p) - 1)
    if version == "2.7":  # custom ops: __call__(*args, **kwargs), the parameters on _init_fn
        for name in ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
                     "_flash_attn_varlen_backward"):
            inner = getattr(mod, name)
            wrapper = type("CustomOpDef", (), {"__call__": lambda self, *a, _f=inner, **kw: _f(*a, **kw)})()
            wrapper._init_fn = inner
            setattr(mod, name, wrapper)
    return mod


@pytest.fixture
def flash_attn(monkeypatch):
    def install(version, softcap=0.0):
        calls = []
        pkg = types.ModuleType("flash_attn")
        pkg.__version__ = {"2.5": "2.5.9.post1", "2.6": "2.6.3", "2.7": "2.7.4.post1"}[version]
        monkeypatch.setitem(sys.modules, "flash_attn", pkg)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", _fa_module(version, calls, softcap))
        return calls

    return install


@pytest.mark.parametrize("version", ["2.5", "2.6", "2.7"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_flash_attn_dense_contracts(flash_attn, version, heads):
    calls = flash_attn(version)
    kernel = FlashAttnKernel()
    for d in (64, 256):
        q, k, v, do = _inputs(heads[0], heads[1], d, torch.bfloat16, seed=d)
        _run_blocks(kernel, q.contiguous(), k.contiguous(), v.contiguous(), do, torch.bfloat16)
    assert [c[0] for c in calls] == ["_flash_attn_forward", "_flash_attn_backward"] * (2 * len(BLOCKS))
    kv = [c[1]["k"].size(2) for c in calls]
    assert set(kv) == {heads[1]}  # GQA native: kv heads reach flash-attn unexpanded


@pytest.mark.parametrize("version", ["2.6", "2.7"])
def test_flash_attn_varlen_contracts(flash_attn, version):
    from striped_sp.kernels.segments import Segments

    calls = flash_attn(version)
    segs = Segments(torch.tensor([0, 7, 19, 33]), torch.tensor([0, 7, 19, 33]), torch.tensor([-1, -1, 5]),
                    torch.tensor([0, 0, 0]))
    gen = torch.Generator().manual_seed(4)
    q, do = (torch.randn(1, 33, 8, 64, generator=gen).to(torch.float16) for _ in range(2))
    k, v = (torch.randn(1, 33, 2, 64, generator=gen).to(torch.float16) for _ in range(2))

    def run(kernel, tq, tk, tv, tdo):
        dt = torch.float32
        acc, lse = torch.zeros(1, 33, 8, 64, dtype=dt), torch.full((1, 8, 33), float("-inf"), dtype=dt)
        kernel.forward_varlen(tq, tk, tv, segs, SCALE, acc, lse)
        grads = [torch.zeros(t.shape, dtype=dt) for t in (tq, tk, tv)]
        kernel.backward_varlen(tdo, tq, tk, tv, acc.to(tq.dtype), lse, segs, SCALE, *grads)
        return acc, lse, grads

    acc, lse, grads = run(FlashAttnKernel(), q, k, v, do)
    assert {c[0] for c in calls} == {"_flash_attn_varlen_forward", "_flash_attn_varlen_backward"}
    want_acc, want_lse, want_grads = run(kernels.MathKernel(), *(t.double() for t in (q, k, v, do)))
    assert isclose_rel(acc, want_acc) < 4e-3 and isclose_rel(lse, want_lse) < 1e-6
    for got, want in zip(grads, want_grads):
        assert isclose_rel(got, want) < 4e-3


@pytest.mark.parametrize("version", ["2.6", "2.7"])
def test_flash_attn_softcap_reaches_every_call(flash_attn, version):
    """A soft-capped flash-attn 2 kernel passes ``softcap`` (a float) to its dense and varlen
    forward and backward calls, by the documented names; flash-attn 2.5 has none: refused by name."""
    from striped_sp.kernels.segments import Segments

    calls = flash_attn(version, softcap=2.5)
    kernel = FlashAttnKernel().with_softcap(2.5)
    q, k, v, do = _inputs(8, 2, 64, torch.bfloat16, seed=3)
    _run_blocks(kernel, q.contiguous(), k.contiguous(), v.contiguous(), do, torch.bfloat16)
    segs = Segments(torch.tensor([0, 7, 19]), torch.tensor([0, 7, 19]), torch.tensor([-1, 5]), torch.tensor([0, 0]))
    qv, kv = q[:1, :19].contiguous(), k[:1, :19].contiguous()
    acc, lse = torch.zeros(1, 19, 8, 64), torch.full((1, 8, 19), float("-inf"))
    kernel.forward_varlen(qv, kv, kv, segs, SCALE, acc, lse)
    grads = [torch.zeros(t.shape) for t in (qv, kv, kv)]
    kernel.backward_varlen(do[:1, :19].contiguous(), qv, kv, kv, acc.to(qv.dtype), lse, segs, SCALE, *grads)
    names = {c[0] for c in calls}
    assert names == {"_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
                     "_flash_attn_varlen_backward"}, names
    assert all(c[1]["softcap"] == 2.5 for c in calls)


def test_flash_attn_2_5_cannot_softcap(flash_attn):
    flash_attn("2.5")
    why = FlashAttnKernel().softcap_unavailable_reason()
    assert why is not None and "2.5" in why and ">= 2.6" in why
    with pytest.raises(ValueError, match=r"backend 'flash_attn' cannot apply softcap=2.5"):
        FlashAttnKernel().with_softcap(2.5)


def test_flash_attn_aligned_strict_call(flash_attn):
    """The aligned strict block on flash-attn: all n queries x k[:-1] with its bottom-right causal
    mask gives the sliced call's rows 1.. and an empty row 0 (lse +inf, which the ring drops)."""
    flash_attn("2.7")
    q, k, v, _ = _inputs(8, 2, 64, torch.bfloat16, seed=6)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kernel = FlashAttnKernel()
    out, lse = kernel.forward(q, k[:, :-1], v[:, :-1], True, SCALE)
    ref_out, ref_lse = kernel.forward(q[:, 1:], k[:, :-1], v[:, :-1], True, SCALE)
    assert torch.isposinf(lse[:, :, 0]).all()
    assert torch.equal(lse[:, :, 1:], ref_lse) and torch.equal(out[:, 1:], ref_out)


def test_flash_attn_out_lse_swap_is_caught(flash_attn, monkeypatch):
    """The same mutation on the flash-attn adapter: the stand-in binds by name and rejects it."""
    flash_attn("2.7")
    src = textwrap.dedent(inspect.getsource(FlashAttnKernel.backward))
    old = "out=out, softmax_lse=lse.contiguous()"
    assert src.count(old) == 1
    ns = {}
    import striped_sp.kernels.flash_attn_kernel as fa_mod

    exec(compile(src.replace(old, "out=lse.contiguous(), softmax_lse=out"), "<mutant>", "exec"), vars(fa_mod), ns)
    monkeypatch.setattr(FlashAttnKernel, "backward", ns["backward"])
    q, k, v, do = _inputs(8, 2, 64, torch.bfloat16, seed=2)
    with pytest.raises(AssertionError, match="out is"):
        _run_blocks(FlashAttnKernel(), q.contiguous(), k.contiguous(), v.contiguous(), do, torch.bfloat16)


# -- on a GPU (skipped here): do the private ops take fewer kv heads natively? ----------------

_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@_GPU
@pytest.mark.parametrize("op", ["flash", "efficient", "cudnn"])
def test_gqa_native_probe_on_gpu(op):
    """Evidence for TorchKernel's docstring: run the op with 2 kv heads for 8 query heads and
    compare with the expanded call.  Reports (does not fail) when the op refuses."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    call = {"flash": lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=SCALE),
            "efficient": lambda q, k, v: torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True, scale=SCALE),
            "cudnn": lambda q, k, v: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=SCALE)}[op]
    want = call(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))[0]
    try:
        got = call(q, k, v)[0]
    except RuntimeError as e:
        pytest.skip(f"{op} refuses fewer kv heads: {str(e)[:200]}")
    print(f"{op}: GQA native, max diff {float((got.float() - want.float()).abs().max())}")
