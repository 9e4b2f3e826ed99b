"""State passing (engine/state_passing.py, engine/state_fold.py) on 2 and 4 gloo ranks (8 under ``-m
release``) against the plain recurrences run in float64 on the whole row: Mamba2's scalar-decay scan,
the gated delta rule and a short convolution's halo; forward and backward; dense and packed rows (a
document starting inside a chunk, one starting exactly at a chunk's start, a chunk crossed whole);
striped, zigzag and contiguous; more ranks than heads.

The references below are the recurrences as the papers write them, one token at a time, on the full
row (documents reset the state).  Each rank's chunk kernel is the same loop on its chunk from a zero
state: the module under test is what joins the chunks."""

import pytest
import torch
import torch.distributed as dist

from dist_helper import check_case, run_cases

S, B = 48, 2
PACKED = (0, 5, 6, 19, 24, 30, 48)  # on 4 ranks: a start inside chunk 1, one at chunk 2's start, chunk 3 crossed whole


def _starts(bounds):
    starts = torch.zeros(S, dtype=torch.bool)
    starts[0] = True
    for b in bounds or ():
        if 0 < b < S:
            starts[b] = True
    return starts


def ssd_scan(x, dt, A, Bm, Cm, starts):
    """``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t``; zero state at every start.
    Returns ``y`` and the last state."""
    b, t, heads, p = x.shape
    h = x.new_zeros(b, heads, p, Bm.size(-1))
    ys = []
    for i in range(t):
        if starts[i]:
            h = torch.zeros_like(h)
        h = torch.exp(dt[:, i] * A)[..., None, None] * h + (dt[:, i, :, None] * x[:, i])[..., None] * Bm[:, i, :, None]
        ys.append((h * Cm[:, i, :, None]).sum(-1))
    return torch.stack(ys, 1), h


def delta_scan(q, k, v, g, beta, starts):
    """``S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``, ``o_t = S_t^T q_t``; zero at every start."""
    b, t, heads, dk = k.shape
    st = k.new_zeros(b, heads, dk, v.size(-1))
    eye = torch.eye(dk, dtype=k.dtype)
    outs = []
    for i in range(t):
        if starts[i]:
            st = torch.zeros_like(st)
        kk = k[:, i, :, :, None] * k[:, i, :, None, :]
        a = torch.exp(g[:, i])[..., None, None] * (eye - beta[:, i, :, None, None] * kk)
        st = a @ st + beta[:, i, :, None, None] * k[:, i, :, :, None] * v[:, i, :, None, :]
        outs.append((st * q[:, i, :, :, None]).sum(-2))
    return torch.stack(outs, 1), st


def conv(x, w, seq):
    """Depthwise causal conv of width ``K`` over ``x`` ``[b, t, c]``; a token sees only its own document."""
    kw = w.size(-1)
    out = torch.zeros_like(x)
    for t in range(x.size(1)):
        for i in range(kw):
            s = t - kw + 1 + i
            if s >= 0 and seq[s] == seq[t]:
                out[:, t] = out[:, t] + w[:, i] * x[:, s]
    return out


def _inputs(seed, heads, dk=3, dv=4):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    k = torch.nn.functional.normalize(r(B, S, heads, dk), dim=-1)
    return dict(x=r(B, S, heads, dv), dt=torch.rand(B, S, heads, generator=g, dtype=torch.float64) * 0.5,
                Bm=r(B, S, heads, dk), Cm=r(B, S, heads, dk), q=r(B, S, heads, dk) * dk ** -0.5, k=k,
                g=-torch.rand(B, S, heads, generator=g, dtype=torch.float64) * 0.3,
                beta=torch.rand(B, S, heads, generator=g, dtype=torch.float64), w=r(B, S, heads, dv),
                A=-torch.rand(heads, generator=g, dtype=torch.float64) - 0.1)


def _local(layout, bounds):
    from striped_sp import positions
    from striped_sp.engine.state_passing import contiguous_chunks

    n, rank = dist.get_world_size(), dist.get_rank()
    mine = positions(S, n, rank, layout, list(bounds) if bounds else None)
    return mine, contiguous_chunks(S, n, rank, layout, bounds)


def _check_grads(local, full, mine, what):
    for name, (got, want) in local.items():
        want = want.index_select(1, mine) if want.dim() > 1 and want.size(1) == S else want
        err = (got - want).abs().max().item()
        assert err < 1e-10, (what, name, err)


def _case_ssd(layout, bounds, heads):
    from striped_sp.engine.state_fold import scalar_decay_pass
    from striped_sp.engine.state_passing import from_chunks, to_chunks

    full, starts = _inputs(1, heads), _starts(bounds)
    names = ("x", "dt", "Bm", "Cm")
    ref_in = {k: full[k].clone().requires_grad_(True) for k in (*names, "A")}
    ref, _ = ssd_scan(*(ref_in[k] for k in ("x", "dt", "A", "Bm", "Cm")), starts)
    (ref * full["w"]).sum().backward()
    mine, plan = _local(layout, bounds)
    loc = {k: full[k].index_select(1, mine).requires_grad_(True) for k in names}
    A = full["A"].clone().requires_grad_(True)
    ch = {k: to_chunks(loc[k], None, plan) for k in names}
    y, h = ssd_scan(ch["x"], ch["dt"], A, ch["Bm"], ch["Cm"], plan.seq_idx != torch.roll(plan.seq_idx, 1))
    y = scalar_decay_pass(y, h, ch["dt"] * A, ch["Cm"], None, plan)
    out = from_chunks(y, None, plan)
    (out * full["w"].index_select(1, mine)).sum().backward()
    dist.all_reduce(A.grad)
    # values checked after the backward, so that a wrong value leaves no rank waiting in a collective
    assert (out - ref.detach().index_select(1, mine)).abs().max() < 1e-10
    _check_grads({**{k: (loc[k].grad, ref_in[k].grad) for k in names}, "A": (A.grad, ref_in["A"].grad)},
                 full, mine, "ssd")


def _case_delta(layout, bounds, heads, sub=5):
    from striped_sp.engine.state_fold import delta_rule_pass
    from striped_sp.engine.state_passing import from_chunks, to_chunks

    full, starts = _inputs(2, heads), _starts(bounds)
    names = ("q", "k", "x", "g", "beta")
    ref_in = {k: full[k].clone().requires_grad_(True) for k in names}
    ref, _ = delta_scan(*(ref_in[k] for k in names), starts)
    (ref * full["w"]).sum().backward()
    mine, plan = _local(layout, bounds)
    loc = {k: full[k].index_select(1, mine).requires_grad_(True) for k in names}
    ch = {k: to_chunks(loc[k], None, plan) for k in names}
    o, st = delta_scan(*(ch[k] for k in names), plan.seq_idx != torch.roll(plan.seq_idx, 1))
    o = delta_rule_pass(o, st, ch["q"], ch["k"], ch["g"], ch["beta"], None, plan, chunk=sub)
    out = from_chunks(o, None, plan)
    (out * full["w"].index_select(1, mine)).sum().backward()
    # values checked after the backward, so that a wrong value leaves no rank waiting in a collective
    assert (out - ref.detach().index_select(1, mine)).abs().max() < 1e-10
    _check_grads({k: (loc[k].grad, ref_in[k].grad) for k in names}, full, mine, "delta")


def _case_halo(layout, bounds, width=3):
    from striped_sp.engine.state_passing import from_chunks, halo, to_chunks

    full = _inputs(3, 2)
    seq = torch.cumsum(_starts(bounds).long(), 0)
    x = full["x"].reshape(B, S, -1)
    w = torch.randn(x.size(-1), width + 1, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ref_x = x.clone().requires_grad_(True)
    ref = conv(ref_x, w, seq)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (ref * weight).sum().backward()
    mine, plan = _local(layout, bounds)
    loc = x.index_select(1, mine).requires_grad_(True)
    ch = to_chunks(loc, None, plan)
    ext = torch.cat((halo(ch, width, None, plan), ch), dim=1)
    local_seq = torch.cat((torch.zeros(width, dtype=torch.int32), plan.seq_idx))
    out = from_chunks(conv(ext, w, local_seq)[:, width:], None, plan)
    (out * weight.index_select(1, mine)).sum().backward()
    # values checked after the backward, so that a wrong value leaves no rank waiting in a collective
    assert (out - ref.detach().index_select(1, mine)).abs().max() < 1e-10
    _check_grads({"x": (loc.grad, ref_x.grad)}, None, mine, "halo")


def _case_refusals():
    from striped_sp.engine.state_passing import contiguous_chunks, halo, to_chunks

    n, rank = dist.get_world_size(), dist.get_rank()
    with pytest.raises(ValueError, match=r"49 tokens do not split into \d equal chunks"):
        contiguous_chunks(S + 1, n, rank, "contiguous", None)
    plan = contiguous_chunks(S, n, rank, "striped", None)
    with pytest.raises(ValueError, match=r"to_chunks: .* must be \[batch, \d+ tokens"):
        to_chunks(torch.zeros(B, S // n + 1, 3), None, plan)
    with pytest.raises(ValueError, match="needs chunks of at least"):
        halo(torch.zeros(B, S // n, 3), S, None, plan)


LAYOUTS = ("striped", "zigzag", "contiguous")
CASES = [(f"ssd_{lay}_dense", _case_ssd, (lay, None, 2)) for lay in LAYOUTS]
CASES += [(f"delta_{lay}_dense", _case_delta, (lay, None, 2)) for lay in LAYOUTS]
CASES += [(f"halo_{lay}_dense", _case_halo, (lay, None)) for lay in LAYOUTS]
CASES += [(f"{kind}_{lay}_packed", fn, (lay, PACKED, 1) if kind != "halo" else (lay, PACKED))
          for lay in ("striped", "contiguous") for kind, fn in (("ssd", _case_ssd), ("delta", _case_delta),
                                                               ("halo", _case_halo))]
CASES += [("refusals", _case_refusals, ())]


@pytest.fixture(scope="module", params=[2, 4, pytest.param(8, marks=pytest.mark.release)])
def results(request):
    return request.param, run_cases(request.param, CASES, timeout_s=300)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_state_passing(results, name):
    check_case(results[1], name)
