"""Attention sinks (gpt-oss' ``sinks``, Megatron's learnable softmax offset): ``ring_attention(...,
sinks=)`` and ``RingRequest(...)(q, k, v, sinks=)`` are exact, forward and every gradient (dq, dk,
dv and d sinks), against a float64 reference written here (plain softmax attention over the whole
row with one extra sink column per head, no engine code): every layout (striped, its stripe and
placement forms, zigzag, contiguous), dense, packed and windowed rows, GQA / MQA, Ulysses and
hierarchical CP, on 2 and 4 gloo ranks and on the in-process executor at N = 8; a gpt-oss-shaped
stack (window 128 alternating with global layers, sinks, a packed web-like mix) at N = 8 to 1e-9.

Each rank's d sinks is its own rows' part; the tests sum it over the ranks (the framework's
gradient reduction does, as for every replicated weight) before comparing."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import check_case, run_cases
from reference import reference_mask
from seeds import seed_for
from striped_sp.engine import local
from striped_sp.kernels.merge import fold_sinks, sink_grad

pytestmark = pytest.mark.dist

SEED = seed_for(__name__)
TOL = 1e-10  # float64 end to end: ~1e-15; a sink folded per step or a dropped d sinks: > 1e-2


def sink_reference(q, k, v, sinks, scale, causal=True, cu_seqlens=None, window_size=None):
    """Softmax attention over the whole row in float64 with one sink logit per head: the scores
    ``[b, h, S, S]`` (masked to -inf outside the document, window and causal triangle) get one
    more column ``sinks[h]``, softmaxed with them and dropped before the values."""
    q, k, v, sinks = q.double(), k.double(), v.double(), sinks.double()
    b, s, h, _ = q.shape
    rep = h // k.size(2)
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    seen = reference_mask(s, causal, cu_seqlens, window_size)
    scores = scores.masked_fill(~seen, float("-inf"))
    with_sink = torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)
    probs = with_sink.softmax(-1)[..., :s]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def _rel(got, want) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-300)).item()


def _docs(kind, s, n, gen):
    """Document bounds of a row of ``s`` tokens: ``None`` (dense), random (``"packed"``: short ones
    and a long one), or every document a multiple of ``2n`` (``"padded"``: zigzag's rule)."""
    if kind is None:
        return None
    if kind == "padded":
        unit = 2 * n
        cuts = sorted(set((torch.randint(1, s // unit, (3,), generator=gen) * unit).tolist()))
    else:
        # short documents and a long one (over a third of the row): no layout keeps every document on
        # one rank, so the ring has steps to fold a sink into (or not)
        cuts = sorted(set(torch.randint(1, 2 * s // 3, (5,), generator=gen).tolist()) | {3})
    return [0, *cuts, s]


def _reference_grads(q, k, v, sinks, dout, scale, **mask):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = sink_reference(*leaves, scale, **mask)
    ref.backward(dout)
    return ref.detach(), [t.grad for t in leaves]


# -- gloo ranks -------------------------------------------------------------------------------------

def check_ring(layout, docs, window, ulysses, kv_heads, backend, how):
    """``ring_attention`` (or a ``RingRequest``) with sinks on this group, against float64."""
    n, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(SEED + 7 * n)
    s, h, d, scale = 2 * n * 12, 4, 16, 0.37
    q, dout = (torch.randn(1, s, h, d, dtype=torch.float64, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, s, kv_heads, d, dtype=torch.float64, generator=gen) for _ in range(2))
    sinks = 2 * torch.randn(h, dtype=torch.float64, generator=gen)  # non-zero: a dropped sink shows
    cu = _docs(docs, s, n, gen)
    cu_t = None if cu is None else torch.tensor(cu)
    shard = (lambda t: striped_sp.shard(t, n, rank, layout=layout, cu_seqlens=cu_t))
    mine = [shard(t).requires_grad_() for t in (q, k, v)]
    my_sinks = sinks.clone().requires_grad_()
    args = dict(layout=layout, backend=backend, softmax_scale=scale, cu_seqlens=cu_t, window_size=window,
                ulysses_size=ulysses)
    if how == "request":
        out = striped_sp.RingRequest(**args)(*mine, sinks=my_sinks)
    else:
        out = striped_sp.ring_attention(*mine, **args, sinks=my_sinks)
    assert out.dtype == torch.float64
    out.backward(shard(dout))
    assert my_sinks.grad is not None, "no gradient reached sinks"
    dsinks = my_sinks.grad.clone()
    dist.all_reduce(dsinks)  # each rank's rows' part: the framework's reduction sums them
    ref, grads = _reference_grads(q, k, v, sinks, dout, scale, cu_seqlens=cu, window_size=window)
    errs = {"out": _rel(out, shard(ref)), "dq": _rel(mine[0].grad, shard(grads[0])),
            "dk": _rel(mine[1].grad, shard(grads[1])), "dv": _rel(mine[2].grad, shard(grads[2])),
            "dsinks": _rel(dsinks, grads[3])}
    assert all(e < TOL for e in errs.values()), f"seed={SEED}: errors {errs} above {TOL}"


def check_model_dtypes():
    """float32 q/k/v with bfloat16 sinks (a model that keeps them in bf16): out in float32, d sinks
    in bfloat16, both at their precision of the float64 result of the bf16 sinks' values."""
    n, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(SEED + 3)
    s, h, d = 2 * n * 12, 4, 16
    q, dout = (torch.randn(1, s, h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, s, 2, d, generator=gen) for _ in range(2))
    sinks = (2 * torch.randn(h, generator=gen)).to(torch.bfloat16).requires_grad_()
    shard = (lambda t: striped_sp.shard(t, n, rank))
    mine = [shard(t).requires_grad_() for t in (q, k, v)]
    out = striped_sp.ring_attention(*mine, sinks=sinks)
    out.backward(shard(dout))
    assert sinks.grad is not None, "no gradient reached sinks"
    assert out.dtype == torch.float32 and sinks.grad.dtype == torch.bfloat16
    dsinks = sinks.grad.float()
    dist.all_reduce(dsinks)
    ref, grads = _reference_grads(q, k, v, sinks.detach(), dout, d ** -0.5)
    assert _rel(out, shard(ref)) < 1e-5 and _rel(mine[0].grad, shard(grads[0])) < 1e-4
    assert _rel(dsinks, grads[3]) < 2e-2  # n bf16 roundings summed


def check_refused(what):
    """A bad ``sinks`` is a ``ValueError`` naming its shape and the rule, on every rank, before the
    ring; ranks that disagree on having sinks all raise naming the field."""
    n, rank = dist.get_world_size(), dist.get_rank()
    q, k, v = (torch.randn(1, 8, 4, 8) for _ in range(3))
    if what == "shape":
        with pytest.raises(ValueError, match=r"sinks has shape \(3,\): expected \[4\], 1-D with one sink logit "
                                             r"per query head"):
            striped_sp.ring_attention(q, k, v, sinks=torch.zeros(3))
    elif what == "2d":
        with pytest.raises(ValueError, match=r"sinks has shape \(1, 4\): expected \[4\]"):
            striped_sp.RingRequest()(q, k, v, sinks=torch.zeros(1, 4))
    elif what == "dtype":
        with pytest.raises(ValueError, match="sinks has dtype torch.int64: expected a floating-point dtype"):
            striped_sp.ring_attention(q, k, v, sinks=torch.zeros(4, dtype=torch.long))
    elif what == "one rank":  # rank 1 passes a bad one: rank 0 hears of it and raises too
        match = r"sinks has shape \(2,\)" if rank == 1 else "rank 1"
        with pytest.raises(ValueError, match=match):
            striped_sp.ring_attention(q, k, v, sinks=torch.zeros(2) if rank == 1 else torch.zeros(4))
    elif what == "disagree":  # rank 0 with sinks, the others without
        with pytest.raises(ValueError, match="sinks"):
            striped_sp.ring_attention(q, k, v, sinks=torch.zeros(4) if rank == 0 else None)
    assert n > 1


LAYOUTS = ["striped", "striped:stripe=1", "striped:stripe=2", "striped:place=auto", "zigzag", "contiguous"]
ROWS = {"dense": (None, None), "packed": ("packed", None), "window": (None, (9, 0)),
        "packed-window": ("packed", (9, 0))}


def _docs_for(layout, docs):
    return "padded" if docs and layout == "zigzag" else docs


CASES_2 = [(f"{lay}-{row}", check_ring, (lay, _docs_for(lay, ROWS[row][0]), ROWS[row][1], 1, 2, "torch", "call"))
           for lay in LAYOUTS for row in ROWS]
CASES_2 += [
    ("math-striped-packed-window", check_ring, ("striped", "packed", (9, 0), 1, 2, "math", "call")),
    ("math-zigzag-dense", check_ring, ("zigzag", None, None, 1, 2, "math", "call")),
    ("request-striped-packed", check_ring, ("striped", "packed", None, 1, 2, "torch", "request")),
    ("mqa-striped-window", check_ring, ("striped", None, (9, 0), 1, 1, "torch", "call")),
    ("ulysses2-striped-dense", check_ring, ("striped", None, None, 2, 2, "torch", "call")),
    ("ulysses2-striped-packed", check_ring, ("striped", "packed", None, 2, 2, "torch", "call")),
    ("ulysses2-zigzag-window-mqa", check_ring, ("zigzag", None, (9, 0), 2, 1, "torch", "request")),
    ("model-dtypes", check_model_dtypes, ()),
    *[(f"refused-{w}", check_refused, (w,)) for w in ("shape", "2d", "dtype", "one rank", "disagree")],
]
CASES_4 = [
    ("striped-dense", check_ring, ("striped", None, None, 1, 2, "torch", "call")),
    ("striped-packed-window", check_ring, ("striped", "packed", (9, 0), 1, 2, "torch", "call")),
    ("stripe2-window", check_ring, ("striped:stripe=2", None, (13, 0), 1, 2, "torch", "call")),
    ("place-auto-packed", check_ring, ("striped:place=auto", "packed", None, 1, 2, "torch", "call")),
    ("zigzag-packed", check_ring, ("zigzag", "padded", None, 1, 2, "torch", "call")),
    ("contiguous-window", check_ring, ("contiguous", None, (9, 0), 1, 2, "torch", "request")),
    ("hier-2x2-striped-packed", check_ring, ("striped", "packed", None, 2, 2, "torch", "call")),
    ("hier-2x2-zigzag-mqa", check_ring, ("zigzag", None, None, 2, 1, "torch", "call")),
    ("ulysses4-striped-packed-window", check_ring, ("striped", "packed", (9, 0), 4, 2, "math", "call")),
]
_results: dict = {}


@pytest.mark.parametrize("name", [name for name, _, _ in CASES_2])
def test_sinks_exact_on_2_ranks(name):
    if 2 not in _results:
        _results[2] = run_cases(2, CASES_2)
    check_case(_results[2], name)


@pytest.mark.parametrize("name", [name for name, _, _ in CASES_4])
def test_sinks_exact_on_4_ranks(name):
    if 4 not in _results:
        _results[4] = run_cases(4, CASES_4)
    check_case(_results[4], name)


# -- the in-process executor ------------------------------------------------------------------------

SIM_CASES = [  # (layout, docs, window, ulysses, kv heads)
    ("striped", None, None, 1, 2), ("striped", "packed", None, 1, 2), ("striped", None, (13, 0), 1, 2),
    ("striped", "packed", (9, 0), 1, 2), ("striped:stripe=1", "packed", None, 1, 2),
    ("striped:stripe=2", None, (11, 0), 1, 1), ("striped:stripe=doc", "packed", None, 1, 2),
    ("striped:place=auto", "packed", (9, 0), 1, 2), ("striped:stripe=doc,place=7", "packed", None, 1, 2),
    ("zigzag", None, None, 1, 2), ("zigzag", "padded", (40, 0), 1, 2), ("contiguous", None, None, 1, 1),
    ("contiguous", "packed", (9, 0), 1, 2), ("striped", "packed", None, 4, 2), ("zigzag", None, None, 2, 1),
    ("striped", "packed", (9, 0), 8, 2),
]


@pytest.mark.parametrize("layout,docs,window,ulysses,kv_heads", SIM_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-u{c[3]}-kv{c[4]}" for c in SIM_CASES])
def test_sinks_exact_on_the_local_ring(layout, docs, window, ulysses, kv_heads):
    n, per_rank, h, d, scale = 8, 16, 8, 8, 0.41
    gen = torch.Generator().manual_seed(seed_for(f"{layout}-{docs}-{window}-{ulysses}-{kv_heads}"))
    s = n * per_rank
    q, dout = (torch.randn(1, s, h, d, dtype=torch.float64, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, s, kv_heads, d, dtype=torch.float64, generator=gen) for _ in range(2))
    sinks = 2 * torch.randn(h, dtype=torch.float64, generator=gen)
    cu = _docs(docs, s, n, gen)
    sim = local.simulate(q, k, v, n, dout, layout=layout, cu_seqlens=cu, window_size=window, ulysses_size=ulysses,
                         softmax_scale=scale, sinks=sinks)
    ref, grads = _reference_grads(q, k, v, sinks, dout, scale, cu_seqlens=cu, window_size=window)
    errs = {what: _rel(got, want) for what, got, want in (
        ("out", sim.out, ref), ("dq", sim.dq, grads[0]), ("dk", sim.dk, grads[1]), ("dv", sim.dv, grads[2]),
        ("dsinks", sim.dsinks, grads[3]))}
    assert all(e < TOL for e in errs.values()), errs


def test_sinks_refused_on_the_local_ring():
    q = torch.randn(1, 16, 4, 8)
    with pytest.raises(ValueError, match=r"sinks has shape \(8,\): expected \[4\]"):
        local.simulate(q, q, q, 2, sinks=torch.zeros(8))


def _web_row(seq_len: int, median: float, sigma: float, seed: int) -> list[int]:
    """A packed row of web-like documents (lengths lognormal: many short, a long tail), the last one
    cut at the row's end."""
    rng, bounds = random.Random(seed), [0]
    while bounds[-1] < seq_len:
        bounds.append(min(seq_len, bounds[-1] + max(1, round(math.exp(rng.gauss(math.log(median), sigma))))))
    return bounds


def test_gpt_oss_shaped_stack_is_exact_at_n8():
    """gpt-oss' attention at N = 8 on the in-process executor: layers alternating a window of 128
    (transformers' sliding_window=128: window_size=(127, 0)) with global attention, each with its own
    sinks, GQA 8:1, on one packed row of web-like documents under the default striped layout; two
    layers chained (the second's queries are the first's output), forward and backward through both:
    every gradient, both layers' d sinks included, to 1e-9 of float64."""
    n, s, h, kvh, d = 8, 1024, 8, 1, 16
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(SEED + 11)
    cu = _web_row(s, 96, 1.2, SEED)
    assert len(cu) > 6 and max(b - a for a, b in zip(cu, cu[1:])) > 128  # a window that cuts documents
    q1, dout = (torch.randn(1, s, h, d, dtype=torch.float64, generator=gen) for _ in range(2))
    k1, v1, k2, v2 = (torch.randn(1, s, kvh, d, dtype=torch.float64, generator=gen) for _ in range(4))
    sinks1, sinks2 = (2 * torch.randn(h, dtype=torch.float64, generator=gen) for _ in range(2))
    layers = [dict(window_size=(127, 0)), dict()]
    # the engine: layer 1 forward, layer 2 forward and backward, layer 1 backward with layer 2's dq
    first = local.simulate(q1, k1, v1, n, cu_seqlens=cu, sinks=sinks1, **layers[0])
    second = local.simulate(first.out, k2, v2, n, dout, cu_seqlens=cu, sinks=sinks2, **layers[1])
    first = local.simulate(q1, k1, v1, n, second.dq, cu_seqlens=cu, sinks=sinks1, plans=first.plans, **layers[0])
    # the reference, end to end
    leaves = [t.clone().requires_grad_() for t in (q1, k1, v1, sinks1, k2, v2, sinks2)]
    mid = sink_reference(*leaves[:4], scale, cu_seqlens=cu, window_size=(127, 0))
    ref = sink_reference(mid, *leaves[4:], scale, cu_seqlens=cu)
    ref.backward(dout)
    errs = {what: _rel(got, want.grad if isinstance(want, torch.Tensor) and want.grad is not None else want)
            for what, got, want in (
                ("out", second.out, ref.detach()), ("dq1", first.dq, leaves[0]), ("dk1", first.dk, leaves[1]),
                ("dv1", first.dv, leaves[2]), ("dsinks1", first.dsinks, leaves[3]), ("dk2", second.dk, leaves[4]),
                ("dv2", second.dv, leaves[5]), ("dsinks2", second.dsinks, leaves[6]))}
    assert all(e < 1e-9 for e in errs.values()), errs


# -- the fold itself --------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["bshd", "bhsd"])
def test_fold_sinks_on_rows_that_saw_no_key(fmt):
    """A row with lse = -inf (no key seen) comes out 0 with lse = its sink, never NaN; its d sink is 0;
    a -inf sink leaves a row as it was."""
    out = torch.randn(1, 3, 2, 4)  # bshd
    lse = torch.tensor([[[0.5, float("-inf"), 1.0], [float("-inf"), 2.0, float("-inf")]]])
    sinks = torch.tensor([0.3, float("-inf")])
    before = out.clone()
    acc = out if fmt == "bshd" else out.transpose(1, 2).contiguous()
    fold_sinks(acc, lse, sinks, fmt)
    got = acc if fmt == "bshd" else acc.transpose(1, 2)
    assert not got.isnan().any()
    assert (got[:, 1, 0] == 0).all() and (got[:, 0, 1] == 0).all() and (got[:, 2, 1] == 0).all()
    assert torch.allclose(got[:, 1, 1], before[:, 1, 1])  # -inf sink: unchanged
    want0 = before[:, 0, 0] * torch.exp(torch.tensor(0.5) - torch.logaddexp(torch.tensor(0.5), torch.tensor(0.3)))
    assert torch.allclose(got[:, 0, 0], want0)
    assert lse[0, 0, 1] == 0.3 and lse[0, 1, 0] == float("-inf")
    dsinks = sink_grad(torch.randn(1, 3, 2, 4), got, lse, sinks)
    assert not dsinks.isnan().any()
