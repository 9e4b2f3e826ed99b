"""Varlen calls (many band segments) on every CPU-runnable kernel path, against a float64
reference written from flash-attn's documented varlen semantics; the flash-attn varlen adapter's
plumbing through a stand-in module; PyTorch's CUDA varlen op on meta tensors (arity and shapes)."""

import random
import sys
import types

import pytest
import torch

from striped_sp.kernels import varlen
from striped_sp.kernels import FlashAttnKernel, KERNELS, MathKernel
from striped_sp.kernels.segments import Segments

SCALE = 0.3


def _fa_visible(lq, lk, wl, wr, causal):
    """flash-attn varlen: windows are bottom-right aligned; causal means a right window of 0."""
    x = torch.arange(lq).unsqueeze(1)
    y = torch.arange(lk).unsqueeze(0)
    sh = lk - lq
    vis = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        wr = 0
    if wl >= 0:
        vis &= y >= x + sh - wl
    if wr >= 0:
        vis &= y <= x + sh + wr
    return vis


def _random_segments(rng, count, long=False):
    lq, lk, wl, wr = [], [], [], []
    for _ in range(count):
        kind = rng.choice(["causal", "full", "band", "rect", "tall"])
        a = rng.randint(1, 300 if long else 12)
        if kind == "causal":
            lq.append(a), lk.append(a), wl.append(-1), wr.append(0)
        elif kind == "full":
            lq.append(a), lk.append(rng.randint(1, 300 if long else 12)), wl.append(-1), wr.append(-1)
        elif kind == "band":  # a causal band whose every row sees a key
            w = rng.randint(0, a)
            lq.append(a), lk.append(a), wl.append(w), wr.append(0)
        elif kind == "rect":  # rows that see a window of keys ending at their own column
            b = rng.randint(a, a + 20)
            lq.append(a), lk.append(b), wl.append(rng.randint(0, b)), wr.append(rng.choice([0, -1]))
        else:  # more queries than keys, a lower bound only (contiguous blocks under a window)
            a = max(a, 2)
            lq.append(a), lk.append(rng.randint(1, a - 1)), wl.append(rng.randint(0, 3)), wr.append(-1)
    cu = lambda xs: torch.tensor([0] + list(torch.tensor(xs).cumsum(0)))  # noqa: E731
    # segments sit in the local tensors with gaps between them (rows no segment owns)
    gaps = lambda: torch.tensor([rng.randint(0, 3) for _ in lq]).cumsum(0)  # noqa: E731
    return Segments(cu(lq), cu(lk), torch.tensor(wl), torch.tensor(wr), cu(lq)[:-1] + gaps(), cu(lk)[:-1] + gaps())


def _sizes(segs):
    return int((segs.q_start + segs.lq).max()) + 2, int((segs.k_start + segs.lk).max()) + 1


def _run(kernel, q, k, v, dout, segs):
    """Forward into fresh accumulators, then backward with the resulting out / lse."""
    acc = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full((q.size(0), q.size(2), q.size(1)), float("-inf"))
    kernel.forward_varlen(q, k, v, segs, SCALE, acc, lse)
    out = acc.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32)
    dk, dv = torch.zeros(k.shape, dtype=torch.float32), torch.zeros(v.shape, dtype=torch.float32)
    kernel.backward_varlen(dout, q, k, v, out, lse, segs, SCALE, dq, dk, dv)
    return out, lse, dq, dk, dv


def _reference(q, k, v, segs):
    """float64 out ``[b, Lq, h, d]`` and lse of each segment on its own (flash-attn semantics), at
    the segments' rows; rows of no segment: out 0, lse -inf."""
    g = q.size(2) // k.size(2)
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.size(0), q.size(2), q.size(1)), float("-inf"), dtype=torch.float64)
    for t in range(len(segs)):
        a, b = int(segs.q_start[t]), int(segs.q_start[t] + segs.lq[t])
        c, d = int(segs.k_start[t]), int(segs.k_start[t] + segs.lk[t])
        qs = q[:, a:b].double()
        ks = k[:, c:d].double().repeat_interleave(g, 2)
        vs = v[:, c:d].double().repeat_interleave(g, 2)
        wl, wr = int(segs.wl[t]), int(segs.wr[t])
        vis = _fa_visible(b - a, d - c, wl, wr, wl < 0 and wr == 0)
        s = torch.einsum("bqhd,bkhd->bhqk", qs, ks) * SCALE
        s = s.masked_fill(~vis, float("-inf"))
        lse = lse.index_copy(2, torch.arange(a, b), torch.logsumexp(s, -1))
        out = out.index_copy(1, torch.arange(a, b), torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vs))
    return out, lse


def _check_against_reference(q, k, v, dout, segs, got, tol=1e-5):
    """``got`` = (out, lse, dq, dk, dv) against the float64 per-segment reference."""
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _reference(qr, kr, vr, segs)
    (ref * dout.double()).sum().backward()
    for x, want in zip(got, (ref, ref_lse, qr.grad, kr.grad, vr.grad)):
        assert _err(x, want) < tol


def _err(x, ref):
    x, ref = x.double(), ref.double()
    both_inf = torch.isinf(ref) & (x == ref)  # rows of no segment: lse stays -inf
    diff = torch.where(both_inf, torch.zeros_like(x), x - ref)
    return (diff.abs().max() / max(1.0, ref[~torch.isinf(ref)].abs().max().item())).item()


@pytest.mark.parametrize("backend", ["torch", "math"])
@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_varlen_forward_backward(backend, long, heads, seed):
    rng = random.Random(seed)  # conftest: fixed per test id, printed on failure
    segs = _random_segments(rng, 12 if long else 60, long)
    nq, nk = _sizes(segs)
    gen = torch.Generator().manual_seed(rng.randint(0, 10**6))
    q = torch.randn(2, nq, heads[0], 16, generator=gen)
    k = torch.randn(2, nk, heads[1], 16, generator=gen)
    v = torch.randn(2, nk, heads[1], 16, generator=gen)
    dout = torch.randn(2, nq, heads[0], 16, generator=gen)
    _check_against_reference(q, k, v, dout, segs, _run(KERNELS[backend], q, k, v, dout, segs))
    if long:  # the long segments went through direct calls and tiles, the short ones through packs
        plan = varlen.schedule(segs)
        assert plan.direct and plan.batches


def _flash_window(wl, wr, causal, max_seqlen_k):
    """flash-attn's own rewriting of the window (mha_varlen_fwd / set_params_fprop): a side at or
    beyond max_seqlen_k is unbounded, and then an unbounded side of a one-sided window becomes
    max_seqlen_k."""
    if causal:
        wr = 0
    wl = -1 if wl >= max_seqlen_k else wl
    wr = -1 if wr >= max_seqlen_k else wr
    if wl < 0 and wr >= 0:
        wl = max_seqlen_k
    if wl >= 0 and wr < 0:
        wr = max_seqlen_k
    return wl, wr


def _install_fake_varlen_flash_attn(monkeypatch, calls, caps=None):
    """flash_attn.flash_attn_interface with the documented varlen signatures (2.6+), computed
    per segment from the documented semantics, including flash-attn's window rewriting and
    ``softcap`` (recorded in ``caps``, forward and backward): checks our plumbing, not flash-attn."""
    caps = [] if caps is None else caps

    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                   alibi_slopes=None, return_softmax=False, block_table=None):
        assert cu_seqlens_q.dtype == torch.int32 and q.dim() == 3
        calls.append((window_size_left, window_size_right, causal))
        caps.append(("fwd", softcap))
        math = MathKernel().with_softcap(softcap)
        outs, lses = [], []
        for t in range(cu_seqlens_q.numel() - 1):
            a, b = int(cu_seqlens_q[t]), int(cu_seqlens_q[t + 1])
            c, d = int(cu_seqlens_k[t]), int(cu_seqlens_k[t + 1])
            assert b - a <= max_seqlen_q and d - c <= max_seqlen_k
            wl, wr = _flash_window(window_size_left, window_size_right, causal, max_seqlen_k)
            vis = _fa_visible(b - a, d - c, wl, wr, False)
            o, l = math.forward_masked(q[None, a:b], k[None, c:d], v[None, c:d], vis[None, None], softmax_scale)
            outs.append(o[0])
            lses.append(l[0])
        return torch.cat(outs), torch.cat(lses, 1), None, None

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                    window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                    rng_state=None):
        caps.append(("bwd", softcap))
        math = MathKernel().with_softcap(softcap)
        for t in range(cu_seqlens_q.numel() - 1):
            a, b = int(cu_seqlens_q[t]), int(cu_seqlens_q[t + 1])
            c, d = int(cu_seqlens_k[t]), int(cu_seqlens_k[t + 1])
            wl, wr = _flash_window(window_size_left, window_size_right, causal, max_seqlen_k)
            vis = _fa_visible(b - a, d - c, wl, wr, False)
            g = math.backward_masked(dout[None, a:b], q[None, a:b], k[None, c:d], v[None, c:d], out[None, a:b],
                                     softmax_lse[None, :, a:b], vis[None, None], softmax_scale)
            dq[a:b], dk[c:d], dv[c:d] = g[0][0], g[1][0], g[2][0]

    mod = types.ModuleType("flash_attn.flash_attn_interface")
    mod._flash_attn_varlen_forward = _flash_attn_varlen_forward
    mod._flash_attn_varlen_backward = _flash_attn_varlen_backward
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", mod)


def test_flash_attn_varlen_adapter_plumbing(monkeypatch):
    calls = []
    _install_fake_varlen_flash_attn(monkeypatch, calls)
    rng = random.Random(5)
    segs = _random_segments(rng, 40)
    nq, nk = _sizes(segs)
    q, dout = torch.randn(2, nq, 4, 8), torch.randn(2, nq, 4, 8)
    k, v = torch.randn(2, nk, 2, 8), torch.randn(2, nk, 2, 8)
    got = _run(FlashAttnKernel(), q, k, v, dout, segs)
    windows = {(int(a), int(b)) for a, b in zip(segs.wl, segs.wr)}
    # one native call per window class; more than two classes are folded into the full and causal
    # ones (kernels/native.py): two launches
    assert len(windows) > 2 and len(calls) <= 2, (calls, windows)
    assert all(wl < 0 for wl, _, _ in calls)
    assert all(causal == (wl < 0 and wr == 0) for wl, wr, causal in calls)
    _check_against_reference(q, k, v, dout, segs, got)


def test_flash_attn_varlen_softcap_reaches_the_kernel(monkeypatch):
    """A soft-capped flash-attn 2 kernel passes ``softcap`` to every varlen call, forward and
    backward, and equals the capped math kernel's schedule on the same segments."""
    calls, caps = [], []
    _install_fake_varlen_flash_attn(monkeypatch, calls, caps)
    segs = _random_segments(random.Random(7), 30)
    nq, nk = _sizes(segs)
    q, dout = 3 * torch.randn(1, nq, 4, 8), torch.randn(1, nq, 4, 8)
    k, v = 3 * torch.randn(1, nk, 2, 8), torch.randn(1, nk, 2, 8)
    got = _run(FlashAttnKernel().with_softcap(2.5), q, k, v, dout, segs)
    assert caps and {c for _, c in caps} == {2.5} and {w for w, _ in caps} == {"fwd", "bwd"}, caps
    want = _run(MathKernel().with_softcap(2.5), q, k, v, dout, segs)
    assert max(_err(a, b) for a, b in zip(got, want)) < 1e-5


def test_flash_attn_varlen_spans(monkeypatch):
    """Documents back to back (a striped row): each window class's rows are one range, so the
    native call takes slices and merges into slices, no gather; still exact, forward and backward."""
    calls = []
    _install_fake_varlen_flash_attn(monkeypatch, calls)
    lens = torch.tensor([7, 30, 12, 25])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])
    segs = Segments(cu, cu, torch.tensor([-1, -1, 5, 5]), torch.tensor([0, 0, 0, 0]))
    program = varlen.as_program(FlashAttnKernel(), segs, torch.zeros(1, 74, 1, 8), torch.zeros(1, 74, 1, 8))
    assert [g.q_span for g in program.groups] == [(0, 37), (37, 37)] and all(g.q_rows is None for g in program.groups)
    gen = torch.Generator().manual_seed(4)
    q, dout = torch.randn(1, 74, 4, 8, generator=gen), torch.randn(1, 74, 4, 8, generator=gen)
    k, v = torch.randn(1, 74, 2, 8, generator=gen), torch.randn(1, 74, 2, 8, generator=gen)
    _check_against_reference(q, k, v, dout, segs, _run(FlashAttnKernel(), q, k, v, dout, segs))


def test_torch_cuda_varlen_path_on_meta(monkeypatch):
    """PyTorch's CUDA flash varlen op (and the memory-efficient op with a mask) on meta tensors:
    argument arity and output shapes of the path a GPU takes (values need a GPU)."""
    kernel = KERNELS["torch"]
    monkeypatch.setattr(type(kernel), "native_varlen", lambda self, device, dtype, head_dim=None: True)
    segs = _random_segments(random.Random(2), 10)
    nq, nk = _sizes(segs)
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, dout = torch.empty(2, nq, 8, 64, **meta), torch.empty(2, nq, 8, 64, **meta)
    k, v = torch.empty(2, nk, 2, 64, **meta), torch.empty(2, nk, 2, 64, **meta)
    acc = torch.empty(2, nq, 8, 64, device="meta")
    lse = torch.empty(2, 8, nq, device="meta")
    kernel.forward_varlen(q, k, v, segs, SCALE, acc, lse)
    dq = torch.empty(q.shape, device="meta")
    dk, dv = torch.empty(k.shape, device="meta"), torch.empty(v.shape, device="meta")
    kernel.backward_varlen(dout, q, k, v, q, lse, segs, SCALE, dq, dk, dv)
    mask = torch.ones(3, 1, 20, 24, dtype=torch.bool, device="meta")
    qm, km = torch.empty(3, 20, 8, 64, **meta), torch.empty(3, 24, 2, 64, **meta)
    o, l = kernel.forward_masked(qm, km, km, mask, SCALE)
    assert o.shape == qm.shape and l.shape == (3, 8, 20)
    g = kernel.backward_masked(qm, qm, km, km, o, l, mask, SCALE)
    assert g[0].shape == qm.shape and g[1].shape == km.shape


@pytest.mark.parametrize("backend", ["torch", "math"])
def test_long_bands_share_one_mask(backend):
    """A long windowed segment is cut into tiles of one shape and band: they run as one batched
    call with a single broadcast mask, and the result is still exact."""
    segs = Segments(torch.tensor([0, 1000, 1600]), torch.tensor([0, 1000, 1600]), torch.tensor([100, 37]),
                    torch.tensor([0, 0]))
    plan = varlen.schedule(segs)
    assert any(p.mask is not None and p.mask.size(0) == 1 and p.packs >= 4 for p in plan.batches)
    assert any(p.strided is not None for p in plan.batches)  # consecutive tiles: strided views
    gen = torch.Generator().manual_seed(11)
    q, dout = torch.randn(1, 1600, 2, 8, generator=gen), torch.randn(1, 1600, 2, 8, generator=gen)
    k, v = torch.randn(1, 1600, 1, 8, generator=gen), torch.randn(1, 1600, 1, 8, generator=gen)
    _check_against_reference(q, k, v, dout, segs, _run(KERNELS[backend], q, k, v, dout, segs))


def test_flash_attn_before_2_6_refuses_varlen(monkeypatch):
    """flash-attn < 2.6 returns a padded varlen lse: masks must not reach it."""
    _install_fake_varlen_flash_attn(monkeypatch, [])
    sys.modules["flash_attn"].__version__ = "2.5.9"
    assert "flash-attn >= 2.6" in FlashAttnKernel().varlen_unavailable_reason()
    sys.modules["flash_attn"].__version__ = "2.7.4.post1"
    assert FlashAttnKernel().varlen_unavailable_reason() is None


@pytest.mark.parametrize("backend", ["torch", "math"])
def test_padding_rows_stay_finite_with_large_scores(backend):
    """Short documents packed with padding rows, and scores far above exp's float32 range: the
    padding rows must add nothing (no inf * 0) to any key's gradient."""
    lens = [3, 5, 2, 9, 7, 4]  # two packs: 19 and 11 rows, so the second has padding rows
    cu = torch.tensor([0, 3, 8, 10, 19, 26, 30])
    segs = Segments(cu, cu, torch.full((6,), -1), torch.zeros(6, dtype=torch.int64))
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 30, 2, 16, generator=gen) * 6
    k = torch.randn(1, 30, 2, 16, generator=gen) * 6
    k[:, 19] = q[:, 0]  # the first key of the padded pack scores ~ |q0|^2 * 0.3 against row 0
    v, dout = torch.randn(1, 30, 2, 16, generator=gen), torch.randn(1, 30, 2, 16, generator=gen)
    assert sum(lens) == 30 and any(p.q_real is not None for p in varlen.schedule(segs).batches)
    got = _run(KERNELS[backend], q, k, v, dout, segs)
    for t in got:
        assert torch.isfinite(t).all()
    _check_against_reference(q, k, v, dout, segs, got, tol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "math"])
def test_equal_short_documents_run_on_strided_packs(backend):
    """Documents of one length fill every pack exactly: the packs are strided views, no gathers."""
    cu = torch.arange(0, 161, 4)
    segs = Segments(cu, cu, torch.full((40,), -1), torch.zeros(40, dtype=torch.int64))
    plan = varlen.schedule(segs)
    assert plan.batches and all(p.strided is not None and p.mask.size(0) == p.packs for p in plan.batches)
    gen = torch.Generator().manual_seed(5)
    q, dout = torch.randn(1, 160, 4, 8, generator=gen), torch.randn(1, 160, 4, 8, generator=gen)
    k, v = torch.randn(1, 160, 2, 8, generator=gen), torch.randn(1, 160, 2, 8, generator=gen)
    _check_against_reference(q, k, v, dout, segs, _run(KERNELS[backend], q, k, v, dout, segs))


def _staircase_segments():
    """Two documents' stripes against blocks of them (each query stripe sees the whole key
    prefix up to its own stripe), the second with a short last stripe and a key prefix longer
    than its first stripe, a one-row stripe, and segments of other kinds between them."""
    items = []  # (q0, lq, k0, lk, wl, wr)
    q = 0
    for stripe, keys in [(8, 8 * j) for j in range(1, 11)]:  # a dense row's stripes
        items.append((q, stripe, 0, keys, -1, -1))
        q += stripe
    items.append((q, 6, 90, 6, -1, 0))  # a causal document
    q += 6
    for stripe, keys in ((7, 12), (7, 19), (1, 20), (5, 25)):  # prefix of 12 before 7 rows
        items.append((q, stripe, 100, keys, -1, -1))
        q += stripe
    items.append((q, 4, 130, 9, 3, 0))  # a band
    q += 4
    items.append((q, 5, 0, 5, -1, -1))  # full, keys start at 0 but not a next stripe
    q += 5
    items += [(q, 6, 140, 3, -1, -1), (q + 6, 4, 140, 7, -1, -1)]  # a prefix shorter than its stripe: no run
    q += 10
    items += [(q, 6, 150, 6, -1, -1), (q + 6, 4, 150, 12, -1, -1)]  # keys grow by more than the rows: no run
    q += 10
    items += [(q, 6, 170, 6, -1, -1), (q + 8, 4, 170, 10, -1, -1)]  # rows not back to back: no run
    q += 12
    items += [(q, 6, 180, 6, -1, -1), (q + 6, 4, 181, 10, -1, -1)]  # keys from another row: no run
    q += 10
    items += [(q, 6, 195, 6, -1, 0), (q + 6, 4, 195, 10, -1, -1)]  # a causal first stripe: no run
    cu = lambda xs: torch.tensor([0] + list(torch.tensor(xs).cumsum(0)))  # noqa: E731
    col = list(zip(*items))
    return Segments(cu(col[1]), cu(col[3]), torch.tensor(col[4]), torch.tensor(col[5]), torch.tensor(col[0]),
                    torch.tensor(col[2]))


def test_staircase_stripes_gather_no_key_twice(monkeypatch):
    """Stripes that see a growing key prefix run as one causal call and one call of triangles
    (window (0, -1)): the keys gathered are about the block's, not once per stripe; exact,
    forward and backward."""
    calls = []
    _install_fake_varlen_flash_attn(monkeypatch, calls)
    segs = _staircase_segments()
    nq, nk = _sizes(segs)
    program = varlen.as_program(FlashAttnKernel(), segs, torch.zeros(1, nq, 1, 8), torch.zeros(1, nk, 1, 8))
    windows = sorted((g.wl, g.wr) for g in program.groups)
    # four classes once unfolded (full, causal, the triangles' (0, -1), a (3, 0) band): the
    # triangles and the band run folded, in the full and causal launches (kernels/native.py)
    assert windows == [(-1, -1), (-1, 0)]
    # each run: its last stripe's keys once (causal) and about l per stripe (the folded triangles:
    # 287 keys with the triangles as (0, -1) calls), not each stripe's whole prefix (612)
    gathered = sum(int(g.cu_k.t[-1]) for g in program.groups)
    assert 287 <= gathered < 0.6 * int(segs.lk.sum()) == 0.6 * 612
    gen = torch.Generator().manual_seed(9)
    q, dout = torch.randn(2, nq, 4, 8, generator=gen), torch.randn(2, nq, 4, 8, generator=gen)
    k, v = torch.randn(2, nk, 2, 8, generator=gen) * 2, torch.randn(2, nk, 2, 8, generator=gen)
    _check_against_reference(q, k, v, dout, segs, _run(FlashAttnKernel(), q, k, v, dout, segs))


def test_staircase_runs_stay_inside_their_call():
    """A run never joins the last stripe of one call to the first of the next, and segments
    that are no run come back as they were."""
    from striped_sp.kernels.native import unfold_staircases

    segs = _staircase_segments()
    fields = [segs.wl, segs.wr, segs.q_start, segs.k_start, segs.lq, segs.lk]
    # stripe 2 of the first document as the first segment of a second call: two runs of 2
    split = torch.tensor([0, 0] + [1] * 25)
    every = -(10 ** 9)  # every run unfolds, whatever it saves
    got = unfold_staircases(split, *fields, min_saving=every)
    whole = unfold_staircases(torch.zeros_like(split), *fields, min_saving=every)
    call0 = [tuple(int(f[i]) for f in got[1:]) for i in range(len(got[0])) if int(got[0][i]) == 0]
    # (wl, wr, q0, k0, lq, lk): its 2 stripes as one causal run and 2 triangles
    assert call0 == [(-1, 0, 0, 0, 16, 16), (0, -1, 0, 1, 7, 7), (0, -1, 8, 9, 7, 7)]
    assert len(got[0]) == len(whole[0]) + 1  # one more causal run, the same triangles
    # a call unfolds only when it gathers at least min_saving fewer keys so (here both runs or none)
    saving = (8 * 55 - 80 - 70) + (76 - 25 - 16)
    assert len(unfold_staircases(torch.zeros_like(split), *fields, min_saving=saving)[0]) == len(whole[0])
    assert all(torch.equal(a, b) for a, b in zip(unfold_staircases(torch.zeros_like(split), *fields,
                                                                   min_saving=saving + 1)[1:], fields))
    assert bool((whole[5] > 0).all())  # a one-row stripe has no triangle (no empty segment)
    random_segs = _random_segments(random.Random(11), 30)
    plain = [random_segs.wl, random_segs.wr, random_segs.q_start, random_segs.k_start, random_segs.lq,
             random_segs.lk]
    same = unfold_staircases(torch.zeros(30, dtype=torch.int64), *plain)
    assert all(torch.equal(a, b) for a, b in zip(same[1:], plain))


@pytest.mark.parametrize("layout,docs,b", [("striped:stripe=4", None, 1), ("striped:stripe=4", None, 2),
                                           ("striped:stripe=4", [0, 100, 110, 128], 1),
                                           ("striped:stripe=2", [0, 90, 128], 1)])
def test_stripes_on_the_native_path_are_exact_with_staircases_unfolded(monkeypatch, layout, docs, b):
    """A whole ring (4 ranks, in process) of stripes on the flash-attn path, where every step's
    query stripes see growing key prefixes and are unfolded: against float64 attention."""
    from reference import reference_attention
    from striped_sp.engine import local
    from striped_sp.kernels import native

    calls, unfolded = [], []
    _install_fake_varlen_flash_attn(monkeypatch, calls)
    real = native.unfold_staircases

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        unfolded.append(len(out[0]) != len(args[0]))
        return out

    monkeypatch.setattr(native, "unfold_staircases", spy)
    gen = torch.Generator().manual_seed(21)
    q, do = (torch.randn(b, 128, 4, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, 128, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True, 8 ** -0.5, docs, None)
    (ref * do).sum().backward()
    args = dict(layout=layout) if docs is None else dict(layout=layout, cu_seqlens=docs)
    sim = local.simulate(q, k, v, 4, do, kernel=FlashAttnKernel(), **args)
    assert any(unfolded)  # the path under test ran
    for got, want in ((sim.out, ref), (sim.dq, qr.grad), (sim.dk, kr.grad), (sim.dv, vr.grad)):
        assert (got - want.detach()).abs().max().item() < 1e-10


def test_calls_of_a_step_share_their_launches(monkeypatch):
    """The calls of one ring step (compile_steps): query rows repeat across them (zigzag's second
    key piece of a document), yet they run in at most 2 launches (full, causal) once their windows
    are folded, and merge call by call: exact against float64 attention over each row's union of
    keys, forward (out, lse) and backward."""
    from striped_sp.kernels.arena import Arena

    calls = []
    _install_fake_varlen_flash_attn(monkeypatch, calls)
    rng = random.Random(17)
    first = _random_segments(rng, 30)
    nq, nk = _sizes(first)
    # the second call: the same query rows against as many other keys (square: every row sees one),
    # windows of every kind
    second = Segments(first.cu_q, first.cu_q, torch.tensor([rng.choice([-1, 0, 2, 7]) for _ in range(len(first))]),
                      torch.tensor([rng.choice([-1, 0]) for _ in range(len(first))]), first.q_start,
                      torch.tensor([rng.randint(0, nk - int(n)) for n in first.lq]))
    kernel = FlashAttnKernel()
    arena = Arena()
    (program,), = varlen.compile_steps(kernel, [[first, second]], 2, nq, nk, "cpu", torch.float32, 16, arena)
    arena.place("cpu")
    assert program.launches() <= 2 and any(len(g.parts) > 1 for g in program.groups), [(g.wl, g.wr) for g in program.groups]
    gen = torch.Generator().manual_seed(5)
    q, dout = torch.randn(2, nq, 4, 16, generator=gen), torch.randn(2, nq, 4, 16, generator=gen)
    k, v = torch.randn(2, nk, 2, 16, generator=gen), torch.randn(2, nk, 2, 16, generator=gen)
    out, lse, dq, dk, dv = _run(kernel, q, k, v, dout, program)
    # float64: each row's visible keys are the union of both calls'
    vis = torch.zeros(nq, nk, dtype=torch.bool)
    for segs in (first, second):
        for t in range(len(segs)):
            a, c = int(segs.q_start[t]), int(segs.k_start[t])
            lq, lk = int(segs.lq[t]), int(segs.lk[t])
            vis[a:a + lq, c:c + lk] |= _fa_visible(lq, lk, int(segs.wl[t]), int(segs.wr[t]), False)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qr, kr.repeat_interleave(2, 2)) * SCALE
    seen = vis.any(1)
    s = s.masked_fill(~(vis | ~seen[:, None]), float("-inf"))  # a row that sees nothing: finite, then dropped
    p = s.softmax(-1) * seen[None, None, :, None]
    ref = torch.einsum("bhqk,bkhd->bqhd", p, vr.repeat_interleave(2, 2))
    ref_lse = s.logsumexp(-1).masked_fill(~seen[None, None], float("-inf"))
    (ref * dout.double()).sum().backward()
    for name, x, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv),
                             (ref, ref_lse, qr.grad, kr.grad, vr.grad)):
        assert not x.isnan().any() and not want.isnan().any(), name
        assert _err(x, want) < 1e-5, name
