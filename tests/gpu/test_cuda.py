"""CUDA kernels and the ring on a GPU, against a float64 reference (skipped without CUDA).

On a machine with a GPU: ``.venv/bin/python -m pytest -q tests/gpu/test_cuda.py`` (CI has none).
Every backend that claims the device (PyTorch's flash / memory-efficient / cuDNN ops, flash-attn
when installed) is checked, forward and backward, with the shapes the ring produces: square
causal blocks, the striped strict blocks (``q[1:]`` against ``k[:-1]``, and the aligned form), dense
rectangles, GQA.
"""

import itertools

import pytest
import torch

from dist_helper import run_cases
from reference import reference_attention, rel_err
from ring_emulation import check_emulated
from striped_sp.kernels import KERNELS, TorchKernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}  # TF32 matmuls on fp32
SCALE = 64 ** -0.5


def _backends(dtype, head_dim=64):
    dev = torch.device("cuda")
    names = [n for n, k in KERNELS.items() if n != "math" and k.unavailable_reason(dev, dtype, head_dim) is None]
    kernels = {n: KERNELS[n] for n in names}
    if "torch" in kernels and dtype != torch.float32:  # both fused ops PyTorch may choose
        kernels["torch-efficient"] = TorchKernel("efficient")
    return kernels


def _grads(q, k, v, dout, causal, q_rows, kv_rows):
    qr, kr, vr = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    out = reference_attention(qr[:, q_rows], kr[:, kv_rows], vr[:, kv_rows], causal, SCALE)
    (out * dout.double().cpu()).sum().backward()
    return out, qr.grad[:, q_rows], kr.grad[:, kv_rows], vr.grad[:, kv_rows]


CASES = list(itertools.product(
    [torch.bfloat16, torch.float16, torch.float32],
    [(8, 8), (8, 2)],
    [  # (q rows, kv rows, causal) as the ring slices them from a 261-token shard
        (slice(None), slice(None), True),            # diagonal block
        (slice(1, None), slice(0, 260), True),       # striped strict block
        (slice(None), slice(0, 130), False),         # zigzag dense half
    ],
))


@pytest.mark.parametrize("dtype, heads, block", CASES, ids=lambda p: str(p))
def test_cuda_kernels_against_float64(dtype, heads, block):
    q_rows, kv_rows, causal = block
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = lambda h: (2, 261, h, 64)  # noqa: E731
    q = torch.randn(shape(heads[0]), device="cuda", generator=gen).to(dtype)
    k = torch.randn(shape(heads[1]), device="cuda", generator=gen).to(dtype)
    v = torch.randn(shape(heads[1]), device="cuda", generator=gen).to(dtype)
    n_q = len(range(*q_rows.indices(261)))
    dout = torch.randn((2, n_q, heads[0], 64), device="cuda", generator=gen).to(dtype)
    ref_out, dq_ref, dk_ref, dv_ref = _grads(q, k, v, dout, causal, q_rows, kv_rows)
    backends = _backends(dtype)
    assert backends, f"no CUDA backend for {dtype}"
    for name, kernel in backends.items():
        out, lse = kernel.forward(q[:, q_rows], k[:, kv_rows], v[:, kv_rows], causal, SCALE)
        assert lse.dtype == torch.float32 and lse.shape == (2, heads[0], n_q), name
        assert rel_err(out.cpu(), ref_out) < TOL[dtype], name
        dq, dk, dv = kernel.backward(dout, q[:, q_rows], k[:, kv_rows], v[:, kv_rows], out, lse, causal, SCALE)
        assert dk.shape == k[:, kv_rows].shape, name
        for what, got, want in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
            assert rel_err(got.cpu(), want) < TOL[dtype], f"{name} {what}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("aligned", [False, True], ids=["sliced", "aligned"])
def test_emulated_striped_ring_on_gpu(dtype, aligned):
    """A 4-rank striped ring through the ring's own step functions, in each kernel's tensor format
    (``[b, h, s, d]`` for PyTorch's ops), GQA, 261-token shards; ``aligned``: the strict block as
    all queries x ``k[:-1]`` with the kernel's bottom-right causal mask, on every kernel that
    declares one (flash-attn, PyTorch's CUDA flash op)."""
    dev = torch.device("cuda")
    ran = []
    for name, kernel in _backends(dtype, 128).items():
        if aligned and kernel.causal_alignment(dev, dtype, 128) != "bottom_right":
            continue
        check_emulated(kernel, "striped", 4, (32, 8), aligned, seed=7, local=261, dtype=dtype, tol=TOL[dtype],
                       head_dim=128, device="cuda")
        ran.append(name)
    assert ran, f"no CUDA backend ran for {dtype} (aligned={aligned})"


def check_ring_on_one_gpu(layout, dtype_name):
    """A CP group of size 1 on the GPU runs the whole engine path (plans, merge, autograd)."""
    import torch.distributed as dist

    import striped_sp

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    q = torch.randn(1, 96, 8, 64, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(1, 96, 2, 64, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(1, 96, 2, 64, device="cuda", dtype=dtype, requires_grad=True)
    group = dist.new_group([0])
    out = striped_sp.ring_attention(q, k, v, group, layout=layout)
    out.sum().backward()
    ref = reference_attention(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), True, SCALE)
    assert rel_err(out.detach().cpu(), ref) < TOL[dtype]
    assert torch.isfinite(q.grad).all() and k.grad.shape == k.shape


def test_ring_on_one_gpu():
    cases = [(f"{lay}-{dt}", check_ring_on_one_gpu, (lay, dt))
             for lay in ("striped", "zigzag", "contiguous") for dt in ("bfloat16", "float32")]
    results = run_cases(1, cases)
    failed = {name: err for name, err in results.items() if err}
    assert not failed, failed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("docs", [None, [0, 300, 340, 512]], ids=["dense", "packed"])
def test_unfolded_staircases_on_the_cuda_varlen_op(dtype, docs, monkeypatch):
    """Stripes on the CUDA path: every step's growing key prefixes run as a causal call and a
    call of window (0, -1) triangles on the device's own varlen op (4 ranks in process), against
    float64; the rewrite must have run."""
    from striped_sp.engine import local
    from striped_sp.kernels import native

    kernel = KERNELS["torch"]
    if not kernel.native_varlen(torch.device("cuda"), dtype, 64):
        pytest.skip("no native varlen op for this dtype on this device")
    unfolded, real = [], native.unfold_staircases

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        unfolded.append(len(out[0]) != len(args[0]))
        return out

    monkeypatch.setattr(native, "unfold_staircases", spy)
    torch.manual_seed(1)
    q, dout = (torch.randn(1, 512, 8, 64, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, 512, 2, 64, device="cuda", dtype=dtype) for _ in range(2))
    qr, kr, vr = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True, SCALE, docs, None)
    (ref * dout.double().cpu()).sum().backward()
    args = {"layout": "striped:stripe=16"} if docs is None else {"layout": "striped:stripe=8", "cu_seqlens": docs}
    sim = local.simulate(q, k, v, 4, dout, kernel=kernel, **args)
    assert any(unfolded)
    for got, want in ((sim.out, ref), (sim.dq, qr.grad), (sim.dk, kr.grad), (sim.dv, vr.grad)):
        assert rel_err(got.detach().float().cpu(), want.float()) < TOL[dtype]
