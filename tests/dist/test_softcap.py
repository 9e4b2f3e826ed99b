"""Logit soft-capping (Gemma 2's ``attn_logit_softcapping``): ``ring_attention(..., softcap=c)`` and
``RingRequest(softcap=c)`` are exact, forward and every gradient (dq, dk, dv; d sinks with sinks
on), against a float64 reference written here (softmax attention over the whole unsharded row with
every score ``s`` replaced by ``c * tanh(s / c)``, no engine code): layouts striped (plain,
``stripe=``, ``place=auto``), zigzag and contiguous; dense, packed and windowed rows; GQA / MQA;
MLA head dims ``(d, dv) = (24, 16)``; Ulysses; on the in-process executor at N = 1-4 and on 2 gloo
ranks.  Refusals: a bad value (before any message), a kernel that cannot soft-cap.

The cap is small against the scores (inputs scaled up): most scores saturate, so a cap applied
after the merge, or dropped in backward, misses by far more than the tolerance."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import CaseTable
from reference import reference_mask
from seeds import seed_for
from striped_sp.engine import local

pytestmark = pytest.mark.dist

SEED = seed_for(__name__)
TOL = 1e-10  # float64 end to end: ~1e-15; a cap after the merge or none in backward: > 1e-2
CAP = 2.5


def softcap_reference(q, k, v, scale, cap, sinks=None, causal=True, cu_seqlens=None, window_size=None):
    """Softmax attention over the whole row in float64: scores ``[b, h, S, S]`` capped to
    ``cap * tanh(s / cap)``, then masked to -inf outside the document, window and causal triangle;
    with ``sinks`` ``[h]`` one more (uncapped) column per head, dropped before the values.
    ``q`` ``[b, S, h, d]``, ``k`` ``[b, S, kvh, d]``, ``v`` ``[b, S, kvh, dv]`` -> ``[b, S, h, dv]``."""
    q, k, v = q.double(), k.double(), v.double()
    b, s, h, _ = q.shape
    rep = h // k.size(2)
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = cap * torch.tanh(scores / cap)
    seen = reference_mask(s, causal, cu_seqlens, window_size)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)
    probs = scores.softmax(-1)[..., :s]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def _rel(got, want) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-300)).item()


def _docs(kind, s, n, gen):
    if kind is None:
        return None
    if kind == "padded":  # zigzag: every document a multiple of 2n
        unit = 2 * n
        cuts = sorted(set((torch.randint(1, s // unit, (3,), generator=gen) * unit).tolist()))
    else:
        cuts = sorted(set(torch.randint(1, 2 * s // 3, (5,), generator=gen).tolist()) | {3})
    return [0, *cuts, s]


def _inputs(gen, s, h, kv_heads, d, dv, with_sinks=False):
    q = 3 * torch.randn(1, s, h, d, dtype=torch.float64, generator=gen)  # scores well past the cap
    k = 3 * torch.randn(1, s, kv_heads, d, dtype=torch.float64, generator=gen)
    v = torch.randn(1, s, kv_heads, dv, dtype=torch.float64, generator=gen)
    dout = torch.randn(1, s, h, dv, dtype=torch.float64, generator=gen)
    sinks = 2 * torch.randn(h, dtype=torch.float64, generator=gen) if with_sinks else None
    return q, k, v, dout, sinks


def _reference_grads(q, k, v, sinks, dout, scale, cap, **mask):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.clone().requires_grad_())
    ref = softcap_reference(*leaves[:3], scale, cap, sinks=leaves[3] if sinks is not None else None, **mask)
    ref.backward(dout)
    return ref.detach(), [t.grad for t in leaves]


# -- the in-process executor ------------------------------------------------------------------------

SIM_CASES = [  # (n, layout, docs, window, ulysses, kv heads, (d, dv), sinks)
    (1, "striped", None, None, 1, 2, (16, 16), False),
    (2, "striped", None, None, 1, 2, (16, 16), False),
    (3, "striped", "packed", None, 1, 2, (16, 16), False),
    (4, "striped", None, None, 1, 2, (16, 16), False),
    (4, "striped", "packed", (9, 0), 1, 2, (16, 16), False),
    (4, "striped:stripe=2", None, (11, 0), 1, 1, (16, 16), False),
    (4, "striped:place=auto", "packed", None, 1, 2, (16, 16), False),
    (4, "zigzag", None, None, 1, 2, (16, 16), False),
    (4, "zigzag", "padded", (13, 0), 1, 2, (16, 16), False),
    (4, "contiguous", None, None, 1, 1, (16, 16), False),
    (4, "contiguous", "packed", (9, 0), 1, 2, (16, 16), False),
    (4, "striped", None, None, 1, 2, (24, 16), False),
    (4, "zigzag", "padded", None, 1, 2, (24, 16), False),
    (4, "striped", "packed", (9, 0), 1, 2, (16, 16), True),
    (4, "zigzag", None, None, 1, 2, (24, 16), True),
    (4, "striped", None, None, 2, 2, (16, 16), False),
    (4, "striped", "packed", (9, 0), 2, 2, (16, 16), True),
]


@pytest.mark.parametrize("n,layout,docs,window,ulysses,kv_heads,dims,sinks", SIM_CASES,
                         ids=["-".join(map(str, c)) for c in SIM_CASES])
def test_softcap_exact_on_the_local_ring(n, layout, docs, window, ulysses, kv_heads, dims, sinks):
    per_rank, h, scale = 2 * 12, 4, 0.3
    gen = torch.Generator().manual_seed(seed_for(f"{n}-{layout}-{docs}-{window}-{ulysses}-{kv_heads}-{dims}-{sinks}"))
    s = n * per_rank
    q, k, v, dout, sink_t = _inputs(gen, s, h, kv_heads, *dims, with_sinks=sinks)
    cu = _docs(docs, s, n, gen)
    sim = local.simulate(q, k, v, n, dout, layout=layout, cu_seqlens=cu, window_size=window, ulysses_size=ulysses,
                         softmax_scale=scale, softcap=CAP, sinks=sink_t)
    ref, grads = _reference_grads(q, k, v, sink_t, dout, scale, CAP, cu_seqlens=cu, window_size=window)
    got = [("out", sim.out, ref), ("dq", sim.dq, grads[0]), ("dk", sim.dk, grads[1]), ("dv", sim.dv, grads[2])]
    if sinks:
        got.append(("dsinks", sim.dsinks, grads[3]))
    errs = {what: _rel(a, b) for what, a, b in got}
    assert all(e < TOL for e in errs.values()), f"seed {SEED}: {errs}"


def test_softcap_changes_the_result():
    """The inputs are in the capped regime: without the cap the result is far away (so the cases
    above could not pass with a cap that does nothing)."""
    gen = torch.Generator().manual_seed(SEED)
    q, k, v, _, _ = _inputs(gen, 48, 4, 2, 16, 16)
    sim = local.simulate(q, k, v, 2, softmax_scale=0.3, softcap=CAP)
    plain = softcap_reference(q, k, v, 0.3, 1e9)
    assert _rel(sim.out, plain) > 1e-2


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), "50", True, -3])
def test_bad_softcap_refused(bad):
    with pytest.raises(ValueError, match=r"softcap=.* must be None, 0 \(off\) or a positive finite float"):
        striped_sp.RingRequest(None, softcap=bad)


@pytest.mark.parametrize("off", [None, 0, 0.0])
def test_softcap_off_is_the_plain_kernel(off):
    from striped_sp.kernels import resolve_kernel

    assert striped_sp.RingRequest(None, softcap=off).softcap == 0.0
    kernel = resolve_kernel("auto", torch.device("cpu"), torch.float32, 16, softcap=0.0)
    assert kernel.softcap == 0.0


def test_auto_picks_a_capping_kernel_and_a_named_one_that_cannot_is_refused():
    from striped_sp.kernels import resolve_kernel

    kernel = resolve_kernel("auto", torch.device("cpu"), torch.float32, 16, softcap=CAP)
    assert kernel.name == "math" and kernel.softcap == CAP
    assert resolve_kernel("auto", torch.device("cpu"), torch.float32, 16, softcap=CAP) is kernel  # one instance
    with pytest.raises(ValueError, match=r"softcap=2.5: backend 'torch' cannot soft-cap logits .*kernels that can: "
                                         r"\['flash_attn', 'fa4', 'math'\]"):
        resolve_kernel("torch", torch.device("cpu"), torch.float32, 16, softcap=CAP)
    q = torch.randn(1, 16, 4, 8)
    with pytest.raises(ValueError, match=r"backend 'torch' cannot soft-cap"):
        local.simulate(q, q, q, 2, backend="torch", softcap=CAP)


# -- gloo ranks -------------------------------------------------------------------------------------

def check_ring(layout, docs, window, kv_heads, dims, sinks, how):
    n, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(SEED + 11 * n)
    s, h, scale = 2 * n * 12, 4, 0.3
    q, k, v, dout, sink_t = _inputs(gen, s, h, kv_heads, *dims, with_sinks=sinks)
    cu = _docs(docs, s, n, gen)
    cu_t = None if cu is None else torch.tensor(cu)
    shard = (lambda t: striped_sp.shard(t, n, rank, layout=layout, cu_seqlens=cu_t))
    mine = [shard(t).requires_grad_() for t in (q, k, v)]
    my_sinks = None if sink_t is None else sink_t.clone().requires_grad_()
    args = dict(layout=layout, softmax_scale=scale, cu_seqlens=cu_t, window_size=window, softcap=CAP)
    if how == "request":
        out = striped_sp.RingRequest(**args)(*mine, sinks=my_sinks)
    elif how == "compiled":  # torch.compile around the call (issue 47: sinks and the cap under it)
        call = torch.compile(lambda *t: striped_sp.ring_attention(*t, **args, sinks=my_sinks), backend="aot_eager")
        out = call(*mine)
    else:
        out = striped_sp.ring_attention(*mine, **args, sinks=my_sinks)
    out.backward(shard(dout))
    ref, grads = _reference_grads(q, k, v, sink_t, dout, scale, CAP, cu_seqlens=cu, window_size=window)
    errs = {"out": _rel(out, shard(ref)), "dq": _rel(mine[0].grad, shard(grads[0])),
            "dk": _rel(mine[1].grad, shard(grads[1])), "dv": _rel(mine[2].grad, shard(grads[2]))}
    if sinks:
        dsinks = my_sinks.grad.clone()
        dist.all_reduce(dsinks)
        errs["dsinks"] = _rel(dsinks, grads[3])
    assert all(e < TOL for e in errs.values()), f"seed={SEED}: errors {errs} above {TOL}"


def check_refused(what):
    """A bad value or a kernel that cannot is a ``ValueError`` on every rank before the ring; ranks
    that disagree on the cap all raise naming the field."""
    rank = dist.get_rank()
    q = torch.randn(1, 8, 4, 8)
    if what == "value":
        with pytest.raises(ValueError, match=r"softcap=-1.0 must be None, 0 \(off\) or a positive finite float"):
            striped_sp.ring_attention(q, q, q, softcap=-1.0)
    elif what == "kernel":
        with pytest.raises(ValueError, match=r"backend 'torch' cannot soft-cap"):
            striped_sp.ring_attention(q, q, q, backend="torch", softcap=CAP)
    elif what == "disagree":
        with pytest.raises(ValueError, match="softcap"):
            striped_sp.ring_attention(q, q, q, softcap=CAP if rank == 0 else 3.0)


CASES_2 = [
    ("striped-dense", check_ring, ("striped", None, None, 2, (16, 16), False, "call")),
    ("striped-packed-window", check_ring, ("striped", "packed", (9, 0), 2, (16, 16), False, "request")),
    ("zigzag-mla", check_ring, ("zigzag", None, None, 2, (24, 16), False, "call")),
    ("contiguous-mqa-window", check_ring, ("contiguous", None, (9, 0), 1, (16, 16), False, "call")),
    ("striped-sinks-packed", check_ring, ("striped", "packed", None, 2, (16, 16), True, "call")),
    ("compiled-sinks-packed-window", check_ring, ("striped", "packed", (9, 0), 2, (16, 16), True, "compiled")),
    *[(f"refused-{w}", check_refused, (w,)) for w in ("value", "kernel", "disagree")],
]
#: torch.compile's tracing of the ring is ~95% of the 2-rank cases' time: make test-release runs it
_RELEASE = {"compiled-sinks-packed-window"}
CASES = CaseTable({2: CASES_2}, release=lambda world, name: name in _RELEASE)


@pytest.mark.parametrize("world, name", CASES.params())
def test_softcap_exact_on_2_ranks(world, name):
    assert CASES.result(world, name) is None, CASES.result(world, name)
