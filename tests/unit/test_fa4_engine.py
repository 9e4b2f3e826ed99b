"""The engine on ``backend="fa4"`` under the FA4 double, against float64, without a GPU.

Every call of the ring (dense blocks, the striped strict block in both forms, packed documents
with some shorter than N, windows, GQA, MLA's (192, 128) head dims) runs on
:class:`~striped_sp.kernels.FA4Kernel` over :class:`fa4_double.FA4Double` (written from FA4's
upstream semantics), on the engine's own executor with all N ranks in one process
(:func:`striped_sp.engine.local.simulate`, and the same executor with an aligned strict block
plan).  References: float64 attention over the whole sequence (tests/support/reference.py).
fp32 stand-in inputs (the double answers in float64) at 2e-6, bf16 at 3e-2.

The double catches a kernel that got FA4 wrong: a top-left aligned mask, a lse shifted by a row,
a window left out (each seen failing here).
"""

from __future__ import annotations

import pytest
import torch

import striped_sp.kernels.fa4_kernel as fa4_mod
from fa4_double import install_fa4
from reference import reference_attention
from striped_sp.engine import local
from striped_sp.engine.autograd import backward_steps, forward_steps
from striped_sp.engine.request import RingRequest
from striped_sp.engine.transport import LocalRing, run_local
from striped_sp.kernels import FA4Kernel
from striped_sp.plan.layouts import shard, unshard
from striped_sp.plan.ring_plan import build_ring_plan


def _docs(seq_len: int, n: int, gen) -> list[int]:
    """Random document bounds with some documents shorter than the ring (n ranks), one long."""
    cuts = sorted(set(torch.randint(1, seq_len, (5,), generator=gen).tolist()) | {2, 3, 3 + n // 2})
    return [0, *cuts, seq_len]


CASES = [  # (N, tokens per rank, request arguments; docs: random documents, "padded": multiples of 2N)
    (2, 10, dict(layout="striped")),
    (3, 8, dict(layout="zigzag")),
    (4, 6, dict(layout="contiguous")),
    (8, 4, dict(layout="striped:stripe=2")),
    (5, 6, dict(layout="striped", docs=True)),
    (4, 8, dict(layout="striped:stripe=doc", docs=True)),
    (6, 6, dict(layout="contiguous", docs=True)),
    (4, 8, dict(layout="zigzag", docs="padded")),
    (7, 4, dict(layout="striped:place=auto", docs=True)),
    (4, 6, dict(layout="striped", window_size=(7, 0))),
    (3, 8, dict(layout="zigzag", window_size=(5, 0))),
    (8, 4, dict(layout="striped", docs=True, window_size=(6, 0))),
    (2, 12, dict(layout="contiguous", docs=True, window_size=(4, 0))),
    (4, 6, dict(layout="striped", causal=False)),
    (4, 8, dict(layout="striped", docs=True, ulysses_size=2)),
]


def _ids(c):
    return str(c) if not isinstance(c, dict) else ",".join(f"{k}={v}" for k, v in c.items())


@pytest.fixture
def fa4(monkeypatch):
    def install(**kwargs):
        monkeypatch.setattr(fa4_mod, "_capability", lambda device: (10, 0))
        return install_fa4(monkeypatch, **kwargs)

    return install


def _case_inputs(n, per_rank, args, dtype, seed, heads=(4, 2), dims=(16, 16)):
    gen = torch.Generator().manual_seed(seed)
    seq = n * per_rank
    args = dict(args)
    docs = args.pop("docs", False)
    if docs == "padded":
        unit = 2 * n
        args["cu_seqlens"] = [0, *sorted(set((torch.randint(1, seq // unit, (2,), generator=gen) * unit).tolist())), seq]
    elif docs:
        args["cu_seqlens"] = _docs(seq, n, gen)
    h, kvh = heads
    q, do = torch.randn(1, seq, h, dims[0], generator=gen), torch.randn(1, seq, h, dims[1], generator=gen)
    k, v = torch.randn(1, seq, kvh, dims[0], generator=gen), torch.randn(1, seq, kvh, dims[1], generator=gen)
    return [t.to(dtype) for t in (q, k, v, do)], args


def _reference(q, k, v, do, args):
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, args.get("causal", True), q.size(-1) ** -0.5, args.get("cu_seqlens"),
                              args.get("window_size"))
    (ref * do.double()).sum().backward()
    return ref.detach(), qr.grad, kr.grad, vr.grad


def _errors(got, want):
    return {name: float((g.double() - w).abs().max() / max(1.0, float(w.abs().max())))
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}


def _simulate(q, k, v, do, n, args, kernel=None):
    sim = local.simulate(q, k, v, n, do, kernel=kernel or FA4Kernel(), **args)
    return sim.out, sim.dq, sim.dk, sim.dv


@pytest.mark.parametrize("n,per_rank,args", CASES, ids=_ids)
def test_engine_on_fa4_matches_float64(fa4, n, per_rank, args):
    double = fa4(fp32=True)
    (q, k, v, do), args = _case_inputs(n, per_rank, args, torch.float32, seed=n * 100 + per_rank)
    errs = _errors(_simulate(q, k, v, do, n, args), _reference(q, k, v, do, args))
    assert max(errs.values()) < 2e-6, errs
    # kv heads never expanded (the backward may split the heads in halves: the group stays 2)
    assert double.calls and all(c[1]["q"].size(-2) == 2 * c[1]["k"].size(-2) for c in double.calls)
    if "cu_seqlens" in args or "window_size" in args:  # packed documents and windows: FA4's varlen call
        assert any(c[1]["cu_seqlens_q"] is not None for c in double.calls)


@pytest.mark.parametrize("n,per_rank,args", [CASES[0], CASES[5], CASES[11]], ids=_ids)
def test_engine_on_fa4_bf16(fa4, n, per_rank, args):
    fa4()
    (q, k, v, do), args = _case_inputs(n, per_rank, args, torch.bfloat16, seed=n)
    errs = _errors(_simulate(q, k, v, do, n, args), _reference(q, k, v, do, args))
    assert max(errs.values()) < 3e-2, errs


def _ring(q, k, v, do, n, kernel, strict_block="sliced", **request_args):
    """The engine's executor on a LocalRing, every rank's plan built with ``strict_block``, and
    v's head dim kept (FA4 takes MLA natively): what ``simulate`` runs, for the forms it does not plan."""
    request = RingRequest(None, **request_args)
    layout, scale = request.layout, q.size(-1) ** -0.5
    parts = [[shard(t, n, r, layout=layout) for r in range(n)] for t in (q, k, v, do)]
    plans = [build_ring_plan(layout, None, True, n, r, q.size(1) // n, kernel=kernel, scale=scale,
                             strict_block=strict_block, dtype=q.dtype, head_dim=q.size(-1), heads=q.size(2))
             for r in range(n)]
    ring = LocalRing(n)
    fwd = run_local([forward_steps(parts[0][r], parts[1][r], parts[2][r], plans[r], ring.transports[r])
                     for r in range(n)])
    bwd = run_local([backward_steps(parts[3][r], parts[0][r], parts[1][r], parts[2][r], fwd[r][0], fwd[r][1], plans[r],
                                    ring.transports[r]) for r in range(n)])
    return tuple(unshard(list(x), layout=layout) for x in
                 ([f[0] for f in fwd], [b[0] for b in bwd], [b[1] for b in bwd], [b[2] for b in bwd]))


@pytest.mark.parametrize("n", [2, 5, 8])
@pytest.mark.parametrize("dims", [(16, 16), (192, 128)], ids=["mha", "mla"])
def test_aligned_strict_block_and_mla(fa4, n, dims):
    """The striped strict block in its aligned form (all n queries x k[:-1], bottom-right causal, row
    0 empty: lse -inf) and MLA's (192, 128) on FA4 natively (no padding of v)."""
    double = fa4(fp32=True)
    (q, k, v, do), args = _case_inputs(n, 4, dict(layout="striped:stripe=1"), torch.float32, seed=n, heads=(4, 1),
                                       dims=dims)
    got = _ring(q, k, v, do, n, FA4Kernel(), strict_block="aligned", layout="striped:stripe=1")
    errs = _errors(got, _reference(q, k, v, do, args))
    assert max(errs.values()) < 2e-6, errs
    shapes = {(c[1]["q"].size(1), c[1]["k"].size(1), c[1]["causal"]) for c in double.calls if c[0] == "_flash_attn_fwd"}
    assert (4, 3, True) in shapes  # the aligned call ran
    assert all(c[1]["v"].size(-1) == dims[1] for c in double.calls)  # v never padded


# -- the double catches a kernel that gets FA4 wrong ------------------------------------------------

class _ShiftedLse(FA4Kernel):
    def forward(self, q, k, v, causal, scale):
        out, lse = super().forward(q, k, v, causal, scale)
        return out, lse.roll(1, -1)


class _NoWindow(FA4Kernel):
    def varlen_forward_op(self, q, k, v, cu_q, cu_k, max_q, max_k, wl, wr, scale):
        return super().varlen_forward_op(q, k, v, cu_q, cu_k, max_q, max_k, None if wr == 0 else wl, wr, scale)


@pytest.mark.parametrize("mutant, double_args, n, args, strict", [
    (FA4Kernel, dict(alignment="top_left"), 4, dict(layout="striped:stripe=1"), "aligned"),
    (_ShiftedLse, {}, 4, dict(layout="zigzag"), "sliced"),
    (_NoWindow, {}, 4, dict(layout="striped:stripe=1", window_size=(5, 0)), None),
], ids=["top-left-alignment", "shifted-lse", "ignored-window"])
def test_the_double_catches(fa4, mutant, double_args, n, args, strict):
    fa4(fp32=True, **double_args)
    (q, k, v, do), args = _case_inputs(n, 6, args, torch.float32, seed=7)
    if strict is None:
        got = _simulate(q, k, v, do, n, args, kernel=mutant())
    else:
        got = _ring(q, k, v, do, n, mutant(), strict_block=strict, **args)
    errs = _errors(got, _reference(q, k, v, do, args))
    assert max(errs.values()) > 1e-3, errs


def _capped_reference(q, k, v, do, cap, cu=None, window=None):
    """float64 attention over the whole row with every scaled score ``x`` capped to ``cap * tanh(x / cap)``
    (written here, not from the engine), -> (out, dq, dk, dv)."""
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    h, s = q.size(2), q.size(1)
    kx, vx = (t.repeat_interleave(h // t.size(2), dim=2) for t in (kr, vr))
    sc = torch.einsum("bqhd,bkhd->bhqk", qr, kx) * q.size(-1) ** -0.5
    sc = cap * torch.tanh(sc / cap)
    pos = torch.arange(s)
    seen = pos[None, :] <= pos[:, None]
    if window is not None:
        seen &= pos[None, :] >= pos[:, None] - window[0]
    if cu is not None:
        doc = torch.searchsorted(torch.tensor(cu[1:]), pos, right=True)
        seen &= doc[:, None] == doc[None, :]
    out = torch.einsum("bhqk,bkhd->bqhd", sc.masked_fill(~seen, float("-inf")).softmax(-1), vx)
    (out * do.double()).sum().backward()
    return out.detach(), qr.grad, kr.grad, vr.grad


@pytest.mark.parametrize("n,per_rank,args", [CASES[0], CASES[11]], ids=_ids)
def test_engine_on_fa4_softcap(fa4, n, per_rank, args):
    """softcap reaches every FA4 call (forward and backward, dense and varlen) and the result is the
    capped attention's, to float32 precision of float64."""
    double = fa4(fp32=True)
    (q, k, v, do), args = _case_inputs(n, per_rank, args, torch.float32, seed=n * 7 + per_rank)
    q, k = 3 * q, 3 * k  # scores past the cap
    errs = _errors(_simulate(q, k, v, do, n, {**args, "softcap": 2.5}),
                   _capped_reference(q, k, v, do, 2.5, args.get("cu_seqlens"), args.get("window_size")))
    assert max(errs.values()) < 2e-5, errs
    assert {c[0] for c in double.calls} == {"_flash_attn_fwd", "_flash_attn_bwd"}
    assert all(c[1]["softcap"] == 2.5 for c in double.calls), [c[1]["softcap"] for c in double.calls]
