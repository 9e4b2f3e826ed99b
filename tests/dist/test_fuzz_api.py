"""A fuzz of the public API from outside (issue 40): generated cases, a fixed seed, 1 and 2 ranks.

Every valid case (layouts and stripe forms, packed documents, windows up to beyond the row, GQA,
a value head dim of its own, every kind of strided view) must match a float64 reference that
runs none of our code, forward and all three gradients; every invalid case must be refused with a
``ValueError`` / ``TypeError`` that names the argument, on every rank, before any rank waits for a
peer; nothing may hang (the ranks' ring timeout is the harness's 30 s, and a refusal must come
within a few seconds).

In one process the cases run on ``simulate`` (every rank of a ring of 1, 2 or 4 on the engine's
own executor) and on ``ring_attention`` over a group of one; on 2 gloo ranks ``ring_attention``
runs the valid cases, and the invalid ones with the bad value on rank 1 only.
"""

from __future__ import annotations

import math
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

import striped_sp
from striped_sp.engine.local import simulate
from striped_sp.plan.layouts import get_layout
from dist_helper import check_case, run_cases
from reference import reference_attention

SEED = 4040
LAYOUTS = ["striped", "zigzag", "contiguous", "striped:stripe=2", "striped:stripe=doc", "striped:place=auto"]
VIEWS = ["contiguous", "sbhd", "bhsd", "strided_d", "bsdh", "strided_s", "offset", "expanded_kv", "fused"]


# -- valid cases ---------------------------------------------------------------------------------

def valid_case(rng: random.Random, n: int) -> dict:
    """One valid configuration on a ring of ``n``: shapes, layout, mask, scale, view kind."""
    layout = rng.choice(LAYOUTS)
    multiple = get_layout(layout).seq_multiple * n
    seq = multiple * (rng.randint(1, 5) if n > 1 else rng.randint(2, 11))
    kvh = rng.choice([1, 2])
    case = {"n": n, "b": rng.choice([1, 2]), "seq": seq, "h": kvh * rng.choice([1, 2]), "kvh": kvh,
            "d": rng.choice([4, 8]), "layout": layout, "causal": rng.random() < 0.85,
            "scale": rng.choice([None, 0.3]), "view": rng.choice(VIEWS), "cu": None, "window": None}
    case["dv"] = case["d"] if rng.random() < 0.8 else rng.choice([3, 12])
    if case["view"] == "fused" and case["dv"] != case["d"]:
        case["view"] = "contiguous"
    if case["causal"] and rng.random() < 0.4:  # packed documents (zigzag: multiples of 2N)
        case["b"] = 1
        unit = 2 * n if layout == "zigzag" else 1
        cuts = sorted(rng.sample(range(1, seq // unit), min(rng.randint(1, 3), seq // unit - 1))) if seq // unit > 1 else []
        case["cu"] = [0, *(c * unit for c in cuts), seq]
    if rng.random() < 0.35:  # a window: short, or beyond the row (no bound), up to int64's limit
        left = rng.choice([0, 1, 3, seq - 1, seq, 10 ** 6, 2 ** 63 - 1])
        case["window"] = (left, 0) if case["causal"] else (left, rng.choice([-1, 2, 2 ** 63 - 1]))
    return case


def as_view(x: torch.Tensor, kind: str, role: str) -> torch.Tensor:
    """``x`` ``[b, s, h, d]`` with the same values, stored as ``kind`` (a leaf that requires grad)."""
    b, s, h, d = x.shape
    x = x.detach()
    if kind == "sbhd":
        y = x.transpose(0, 1).contiguous().transpose(0, 1)
    elif kind == "bhsd":
        y = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif kind == "strided_d":
        y = x.new_zeros(b, s, h, 2 * d)[..., ::2]
        y.copy_(x)
    elif kind == "bsdh":
        y = x.transpose(2, 3).contiguous().transpose(2, 3)
    elif kind == "strided_s":
        y = x.new_zeros(b, 2 * s, h, d)[:, ::2]
        y.copy_(x)
    elif kind == "offset":
        y = x.new_zeros(x.numel() + 3)[3:].view(b, s, h, d)
        y.copy_(x)
    elif kind == "expanded_kv" and role != "q":
        return x  # made by the caller (one head expanded)
    elif kind == "fused":
        y = x.new_zeros(b, s, 3, h, d)[:, :, ("q", "k", "v").index(role)]
        y.copy_(x)
    else:
        y = x.clone()
    return y.requires_grad_()


def make_inputs(case: dict, gen: torch.Generator, dtype=torch.float32):
    """Full-sequence q ``[b, S, h, d]``, k ``[b, S, kvh, d]``, v ``[b, S, kvh, dv]``, dout."""
    b, s = case["b"], case["seq"]
    q = torch.randn(b, s, case["h"], case["d"], generator=gen, dtype=dtype)
    if case["view"] == "expanded_kv":
        k = torch.randn(b, s, 1, case["d"], generator=gen, dtype=dtype).expand(b, s, case["kvh"], case["d"])
        v = torch.randn(b, s, 1, case["dv"], generator=gen, dtype=dtype).expand(b, s, case["kvh"], case["dv"])
    else:
        k = torch.randn(b, s, case["kvh"], case["d"], generator=gen, dtype=dtype)
        v = torch.randn(b, s, case["kvh"], case["dv"], generator=gen, dtype=dtype)
    dout = torch.randn(b, s, case["h"], case["dv"], generator=gen, dtype=dtype)
    return q, k, v, dout


def reference(case, q, k, v, dout):
    """Float64 output and gradients over the full sequence, by :func:`reference_attention`."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    scale = case["scale"] or case["d"] ** -0.5
    out = reference_attention(q, k, v, case["causal"], scale, case["cu"], case["window"])
    grads = torch.autograd.grad(out, (q, k, v), dout.double())
    return out, *grads


def request_args(case: dict) -> dict:
    return {"layout": case["layout"], "causal": case["causal"], "softmax_scale": case["scale"],
            "cu_seqlens": None if case["cu"] is None else torch.tensor(case["cu"]), "window_size": case["window"]}


def errors(got, want) -> list[float]:
    """Max abs error of each tensor over the reference's max abs value (``got`` may hold ``None``)."""
    return [float("inf") if g is None else ((g.double() - w).abs().max() / w.abs().max().clamp_min(0.1)).item()
            for g, w in zip(got, want)]


TOL = 2e-5  # float32 inputs against float64


def _simulate_case(case, gen):
    q, k, v, dout = make_inputs(case, gen)
    views = [as_view(t, case["view"], role) if not (case["view"] == "expanded_kv" and role != "q") else t
             for t, role in zip((q, k, v), ("q", "k", "v"))]
    sim = simulate(*views, case["n"], dout, **request_args(case))
    return errors((sim.out, sim.dq, sim.dk, sim.dv), reference(case, q, k, v, dout))


VALID = [valid_case(random.Random(SEED + i), n) for i, n in enumerate([1, 2, 4] * 20)]


def test_valid_cases_on_the_in_process_executor_match_float64():
    """60 valid cases on ``simulate`` (rings of 1, 2 and 4), forward and every gradient."""
    gen = torch.Generator().manual_seed(SEED)
    bad = []
    for i, case in enumerate(VALID):
        errs = _simulate_case(case, gen)
        if not max(errs) < TOL:
            bad.append((i, case, errs))
    assert not bad, f"{len(bad)} of {len(VALID)} valid cases wrong: {bad[:3]}"


def test_every_view_kind_is_exact_on_a_group_of_one(world_of_one):
    """``ring_attention`` on one rank with each view kind (the dense and the masked path)."""
    gen = torch.Generator().manual_seed(SEED)
    for view in VIEWS:
        for masked in (False, True):
            case = {"n": 1, "b": 2, "seq": 12, "h": 4, "kvh": 2, "d": 8, "dv": 8, "layout": "striped",
                    "causal": True, "scale": None, "view": view, "cu": None, "window": (5, 0) if masked else None}
            q, k, v, dout = make_inputs(case, gen)
            ins = [as_view(t, view, role) if not (view == "expanded_kv" and role != "q") else t.requires_grad_()
                   for t, role in zip((q, k, v), ("q", "k", "v"))]
            out = striped_sp.ring_attention(*ins, **request_args(case))
            grads = torch.autograd.grad(out, ins, dout)
            errs = errors((out, *grads), reference(case, q, k, v, dout))
            assert max(errs) < TOL, (view, masked, errs)


# -- invalid cases -------------------------------------------------------------------------------

def _qkv(b=1, s=8, h=2, kvh=2, d=8, dv=None, dtype=torch.float32):
    return (torch.randn(b, s, h, d, dtype=dtype), torch.randn(b, s, kvh, d, dtype=dtype),
            torch.randn(b, s, kvh, dv or d, dtype=dtype))


def _bad_call(rng: random.Random):
    """``(name, inputs, kwargs, env, exception types, the argument's name in the message)``: one
    ``ring_attention`` call (4 local tokens per rank of 2, a global row of 8) with one bad value."""
    q, k, v = _qkv()
    kinds = [
        ("scale-str", {"softmax_scale": "abc"}, TypeError, "softmax_scale"),
        ("scale-complex", {"softmax_scale": 1 + 2j}, TypeError, "softmax_scale"),
        ("scale-list", {"softmax_scale": [0.3]}, TypeError, "softmax_scale"),
        ("scale-tensor", {"softmax_scale": torch.tensor(0.3)}, TypeError, "softmax_scale"),
        ("scale-inf", {"softmax_scale": rng.choice([math.inf, -math.inf, math.nan])}, ValueError, "softmax_scale"),
        ("scale-nonpositive", {"softmax_scale": rng.choice([0.0, -0.5, -3])}, ValueError, "softmax_scale"),
        ("causal-str", {"causal": rng.choice(["False", "no", 2, None])}, TypeError, "causal"),
        ("deterministic-str", {"deterministic": rng.choice(["yes", 3])}, TypeError, "deterministic"),
        ("window-huge", {"window_size": (rng.choice([2 ** 63, 10 ** 30]), 0)}, ValueError, "window_size"),
        ("window-negative", {"window_size": (rng.randint(-9, -2), 0)}, ValueError, "window_size"),
        ("window-right", {"window_size": (3, rng.randint(1, 5))}, ValueError, "window_size"),
        ("window-type", {"window_size": rng.choice([(1.5, 0), ("a", 0), (3,), 4])}, ValueError, "window_size"),
        ("layout-unicode", {"layout": rng.choice(["striped:stripe=\u00b2", "striped:stripe=x", "spiral"])},
         ValueError, "layout|stripe"),
        ("stripe-size", {"stripe_size": rng.choice([0, -3])}, ValueError, "stripe"),
        ("cu-meta", {"cu_seqlens": torch.tensor([0, 4, 8], device="meta")}, ValueError, "cu_seqlens"),
        ("cu-float", {"cu_seqlens": torch.tensor([0.0, 8.0])}, ValueError, "cu_seqlens"),
        ("cu-end", {"cu_seqlens": [0, 3, rng.choice([7, 9])]}, ValueError, "cu_seqlens"),
        ("group-type", {"group": rng.choice([3, "world"])}, TypeError, "group"),
        ("timeout", {"timeout": rng.choice([0, -1, "x", math.inf])}, ValueError, "timeout"),
        ("ulysses", {"ulysses_size": rng.choice([0, -1, 1.5])}, ValueError, "ulysses_size"),
        ("backend", {"backend": rng.choice(["cutlass", "", None])}, ValueError, "backend"),
        ("comm-dtype", {"grad_comm_dtype": rng.choice([torch.int32, torch.float64])}, ValueError, "grad_comm_dtype"),
    ]
    inputs = [
        ("head-dim-0", _qkv(d=0), TypeError, "head"),
        ("heads", _qkv(h=3, kvh=2), ValueError, "heads"),
        ("lengths", (q, k[:, :6], v[:, :6]), ValueError, "sequence length"),
        ("batch", (q.expand(2, -1, -1, -1), k, v), ValueError, "batch"),
        ("dtypes", (q, k.double(), v), ValueError, "dtype"),
        ("ndim", (q[0], k, v), ValueError, "q has shape"),
        ("not-tensor", (q.tolist(), k, v), ValueError, "q must be a torch.Tensor"),
    ]
    env = [
        ("env-timeout", {"STRIPED_SP_RING_TIMEOUT_S": rng.choice(["abc", "0", "-5"])}, ValueError, "STRIPED_SP_RING_TIMEOUT_S"),
        ("env-check", {"STRIPED_SP_CHECK_RANKS": rng.choice(["yes", "2"])}, ValueError, "STRIPED_SP_CHECK_RANKS"),
    ]
    pick = rng.random()
    if pick < 0.65:
        name, kwargs, exc, word = rng.choice(kinds)
        return name, (q, k, v), kwargs, {}, exc, word
    if pick < 0.88:
        name, ins, exc, word = rng.choice(inputs)
        return name, ins, {}, {}, (ValueError, TypeError) if exc is TypeError else exc, word
    name, variables, exc, word = rng.choice(env)
    return name, (q, k, v), {}, variables, exc, word


def _call(inputs, kwargs, env, world, request: bool = False):
    """``ring_attention`` (or a ``RingRequest`` built beforehand, ``request=True``) under ``env``."""
    saved = {key: os.environ.get(key) for key in env}
    if request:
        built = striped_sp.RingRequest(**({"group": world} | kwargs))
    os.environ.update(env)
    try:
        if request:
            return built(*inputs)
        return striped_sp.ring_attention(*inputs, **({"group": world} | kwargs))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


INVALID = [_bad_call(random.Random(SEED * 7 + i)) for i in range(120)]


def test_invalid_calls_are_refused_by_name_on_one_rank(world_of_one):
    """On a group of one (the same checks as on many ranks): each bad value raises the named error."""
    import re
    for name, inputs, kwargs, env, exc, word in INVALID:
        if name == "lengths":  # a ring of one: 8 vs 6 tokens
            pass
        with pytest.raises(exc, match=re.compile(word, re.I)) as info:
            _call(inputs, kwargs, env, None if kwargs.get("group") is not None else world_of_one)
        assert info.type in ((exc,) if isinstance(exc, type) else exc), (name, info.value)


SIM_BAD = [
    ("world-0", dict(world_size=0), ValueError, "world_size"),
    ("world-negative", dict(world_size=-2), ValueError, "world_size"),
    ("world-float", dict(world_size=2.0), TypeError, "world_size"),
    ("world-bool", dict(world_size=True), TypeError, "world_size"),
    ("q-3d", dict(q=lambda q: q[0]), ValueError, "q has shape"),
    ("mixed-dtypes", dict(k=lambda k: k.double()), ValueError, "dtype"),
    ("heads", dict(q=lambda q: torch.randn(1, 8, 3, 8)), ValueError, "heads"),
    ("lengths", dict(k=lambda k: k[:, :6], v=lambda v: v[:, :6]), ValueError, "sequence length"),
    ("batch", dict(q=lambda q: q.expand(2, -1, -1, -1)), ValueError, "batch"),
    ("dout-head-dim", dict(dout=lambda d: d[..., :4]), ValueError, "dout"),
    ("dout-dtype", dict(dout=lambda d: d.double()), ValueError, "dout"),
    ("dout-seq", dict(dout=lambda d: d[:, :4]), ValueError, "dout"),
    ("not-multiple", dict(world_size=3), ValueError, "sequence length"),
    ("scale", dict(softmax_scale=math.inf), ValueError, "softmax_scale"),
]


@pytest.mark.parametrize("name, change, exc, word", SIM_BAD, ids=[c[0] for c in SIM_BAD])
def test_simulate_applies_the_checks_of_ring_attention(name, change, exc, word):
    q, k, v = _qkv()
    dout = torch.randn(1, 8, 2, 8)
    args = {"q": q, "k": k, "v": v, "dout": dout, "world_size": 2}
    kwargs = {}
    for key, value in change.items():
        if key in args and callable(value):
            args[key] = value(args[key])
        elif key in args:
            args[key] = value
        else:
            kwargs[key] = value
    with pytest.raises(exc, match=word):
        simulate(args["q"], args["k"], args["v"], args["world_size"], args["dout"], **kwargs)


def test_simulate_takes_v_head_dim_as_ring_attention_does():
    """``dv != d`` under the math kernel (a value head dim of its own): dout keeps v's head dim
    (it was padded or cut to q's: an einsum error, or at dv = 1 silently wrong dq/dv)."""
    gen = torch.Generator().manual_seed(SEED)
    for dv in (1, 3, 12):
        case = {"n": 2, "b": 1, "seq": 8, "h": 2, "kvh": 1, "d": 4, "dv": dv, "layout": "striped", "causal": True,
                "scale": None, "view": "contiguous", "cu": None, "window": None}
        q, k, v, dout = make_inputs(case, gen, torch.float64)
        sim = simulate(q, k, v, 2, dout, backend="math")
        errs = errors((sim.out, sim.dq, sim.dk, sim.dv), reference(case, q, k, v, dout))
        assert max(errs) < 1e-10, (dv, errs)


@pytest.mark.parametrize("call, word", [
    (lambda: striped_sp.shard([1, 2], 2, 0), "x must be a torch.Tensor"),
    (lambda: striped_sp.shard(torch.zeros(1, 8), 2, 0, dim=3), "dim=3"),
    (lambda: striped_sp.shard(torch.zeros(1, 8), 0, 0), "world_size"),
    (lambda: striped_sp.shard(torch.zeros(1, 8), 2.0, 0), "world_size"),
    (lambda: striped_sp.shard(torch.zeros(1, 8), 2, -1), "rank"),
    (lambda: striped_sp.shard(torch.zeros(1, 8), 2, 2), "rank"),
    (lambda: striped_sp.unshard(torch.zeros(2, 4)), "list of every rank's shard"),
    (lambda: striped_sp.unshard([torch.zeros(1, 4), "x"]), "shard 1 must be a torch.Tensor"),
    (lambda: striped_sp.unshard([torch.zeros(1, 4, 2), torch.zeros(1, 4, 3)]), "shard 1 is"),
    (lambda: striped_sp.unshard([torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.float64)]), "shard 1 is"),
    (lambda: striped_sp.unshard([torch.zeros(1, 4)], dim=-3), "dim=-3"),
    (lambda: striped_sp.prepare_plans(16, world_size=4, rank=-1), "rank=-1"),
    (lambda: striped_sp.prepare_plans(16, world_size=4, rank=4), "rank=4"),
    (lambda: striped_sp.prepare_plans(16, world_size=0, rank=0), "world_size=0"),
    (lambda: striped_sp.prepare_plans(16, world_size=4), "world_size=4 and rank=None"),
    (lambda: striped_sp.prepare_plans(16), "no process group"),
])
def test_layout_helpers_refuse_by_name(call, word):
    with pytest.raises((ValueError, TypeError), match=word):
        call()


# -- two gloo ranks ------------------------------------------------------------------------------

def check_valid_on_two_ranks(first: int, count: int):
    """Valid cases of a ring of 2 through ``ring_attention`` (this rank's shard, as a view)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(SEED + first)
    for i in range(first, first + count):
        case = valid_case(random.Random(SEED * 3 + i), n)
        q, k, v, dout = make_inputs(case, gen)
        cu = case["cu"]
        shard = lambda t: striped_sp.shard(t, n, rank, layout=case["layout"], cu_seqlens=cu)  # noqa: E731
        ins = [as_view(shard(t), case["view"] if case["view"] != "expanded_kv" else "contiguous", role)
               for t, role in zip((q, k, v), ("q", "k", "v"))]
        out = striped_sp.ring_attention(*ins, **request_args(case))
        grads = torch.autograd.grad(out, ins, shard(dout))
        ref = reference(case, q, k, v, dout)
        errs = errors((out, *grads), [shard(t) for t in ref])
        assert max(errs) < TOL, (i, case, errs)


def check_invalid_on_one_rank(first: int, count: int):
    """Rank 1 alone passes a bad value: it raises its own error, rank 0 a ``ValueError`` naming rank
    1 and the cause, both at once (well inside the 30 s ring timeout); then a good call runs.

    Rank 0's call is a signature new to the group each time (its own scale), as a batch's first
    call is: a signature the group agreed on before skips the exchange (module docstring of
    :mod:`striped_sp.engine.agreement`), and then only the failing rank's exit, or the ring timeout,
    stops its peers."""
    import re
    rank = dist.get_rank()
    good = _qkv()
    for i in range(first, first + count):
        name, inputs, kwargs, env, exc, word = INVALID[i]
        if kwargs.get("group") is not None:
            continue  # a bad group is refused before any group exists to tell
        start = time.perf_counter()
        if rank == 1:  # a bad setting: also through a request built before it was set (the adapters' way)
            with pytest.raises(exc, match=re.compile(word, re.I)):
                _call(inputs, kwargs, env, None, request=bool(env) and i % 2 == 1)
        else:
            with pytest.raises(ValueError, match=re.compile(r"rank 1 of the group refused: \w+: .*(" + word + ")",
                                                            re.I)):
                _call(good, {"softmax_scale": 0.25 + i / 1024}, {}, None)
        assert time.perf_counter() - start < 10, (name, "took", time.perf_counter() - start)
    out = striped_sp.ring_attention(*good)
    assert torch.isfinite(out).all()


CASES = [(f"valid_{i}", check_valid_on_two_ranks, (i, 10)) for i in range(0, 40, 10)]
CASES += [(f"invalid_{i}", check_invalid_on_one_rank, (i, 30)) for i in range(0, 120, 30)]


@pytest.fixture(scope="module")
def two_ranks():
    return run_cases(2, CASES, timeout_s=300)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_two_ranks(two_ranks, name):
    check_case(two_ranks, name)
