"""Stripe sizes and whole-document placement (striped_sp.plan.placement): the placement itself (every
token exactly once, S/N per rank, documents whole where asked, balance), and ring_attention with
every stripe size and placement on 1 to 4 gloo ranks against an independent float64 reference
(forward and every gradient), with short documents, windows, GQA and Ulysses."""

import random

import pytest
import torch

import striped_sp
from dist_helper import CaseTable, cp_group
from reference import reference_attention, sharded_errors
from striped_sp.plan.layouts import get_layout
from striped_sp.plan.search import choose_whole_max, placed_runs

SEED = 1812
SCALE = 0.37  # not head_dim ** -0.5: a dropped scale fails


def _bounds(lengths):
    out = [0]
    for x in lengths:
        out.append(out[-1] + x)
    return out


def _random_lengths(rng, total, short):
    lengths = []
    while sum(lengths) < total:
        pick = rng.randint(1, 3) if short and rng.random() < 0.5 else rng.randint(1, max(1, total // 3))
        lengths.append(min(pick, total - sum(lengths)))
    return lengths


# -- the placement, on one process ---------------------------------------------------------------

@pytest.mark.parametrize("spec", ["striped:stripe=3", "striped:place=auto", "striped:place=20",
                                  "striped:stripe=4,place=auto", "striped:place=1", "striped:stripe=doc",
                                  "striped:stripe=doc,place=auto", "striped:stripe=doc,place=9"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_positions_are_a_permutation(spec, n):
    rng = random.Random(SEED + n)
    seq = 24 * n * (3 if "stripe=3" in spec else 4 if "stripe=4" in spec else 1)
    bounds = _bounds(_random_lengths(rng, seq, short=True))
    lay = get_layout(spec)
    parts = [lay.positions(seq, n, r, bounds) for r in range(n)]
    assert all(p.numel() == seq // n for p in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq))
    x = torch.randn(2, seq, 3)
    shards = [striped_sp.shard(x, n, r, layout=spec, cu_seqlens=bounds) for r in range(n)]
    assert torch.equal(striped_sp.unshard(shards, layout=spec, cu_seqlens=bounds), x)


def test_whole_documents_stay_on_one_rank():
    """Documents placed whole sit on one rank in one run; only short ones (at most
    max(64, tokens per rank / 64)) are ever cut; every rank holds S/N tokens."""
    rng = random.Random(SEED)
    n, seq = 8, 8 * 2048
    lengths = [max(1, int(rng.lognormvariate(5.5, 1.0))) for _ in range(400)]
    bounds = [b for b in _bounds(lengths) if b < seq] + [seq]
    tables = placed_runs(tuple(bounds), n, 1, 300)
    pieces = {}
    for r, t in enumerate(tables):
        assert int(t[:, 2].sum()) == seq // n
        for _, first, count, step in t.tolist():
            if step == 1:
                pieces.setdefault(first, []).append((r, count))
    starts = {a: b - a for a, b in zip(bounds[:-1], bounds[1:])}
    cut_docs = 0
    for first, parts in pieces.items():
        if first in starts and parts == [(parts[0][0], starts[first])]:
            assert starts[first] <= 300
            continue
        cut_docs += 1
    whole = [a for a, length in starts.items() if a in pieces and pieces[a][0][1] == length]
    assert len(whole) >= 10 and all(starts[a] <= 300 for a in whole)
    assert all(c <= 64 for parts in pieces.values() if len(parts) > 1 for _, c in parts)
    assert cut_docs <= 3 * n


LIMIT = 7  # doc_placement: documents of at most this many tokens stay whole
AT_THE_LIMIT = (LIMIT, LIMIT + 1, 3, 20, LIMIT, 5)  # then the rest of a row of 40 tokens per rank


def _at_the_limit(n, local=40):
    return AT_THE_LIMIT + (local * n - sum(AT_THE_LIMIT),)


def _owners(parts, start, stop):
    """The ranks holding positions ``start .. stop - 1``, in position order, repeats collapsed."""
    owner = {int(p): r for r, part in enumerate(parts) for p in part if start <= p < stop}
    runs = [owner[p] for p in range(start, stop)]
    return [r for i, r in enumerate(runs) if i == 0 or runs[i - 1] != r]


def _is_subsequence(small, big):
    it = iter(big)
    return all(x in it for x in small)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_document_of_exactly_the_limit_stays_whole(n):
    """docs/tuning.md, "Whole-document placement": ``doc_placement=L`` keeps every document of *at
    most* L tokens whole on one rank.  Under ``stripe=doc`` those of exactly L sit on one rank in one
    run, one of L + 1 is cut into its 2N stripes dealt round trip (ranks 0..N-1, then N-1..0; a
    stripe may be empty).  The plain placement (``stripe=1``) keeps the ones of L unstriped (whole,
    or cut into contiguous pieces where no rank has room: the module notes) and deals the one of
    L + 1 token by token."""
    lengths = _at_the_limit(n)
    bounds = _bounds(lengths)
    seq = bounds[-1]
    round_trip = list(range(n)) + list(range(n - 1, -1, -1))
    for spec in (f"striped:stripe=doc,place={LIMIT}", f"striped:place={LIMIT}"):
        lay = get_layout(spec)
        parts = [lay.positions(seq, n, r, bounds) for r in range(n)]
        for d, length in enumerate(lengths[:-1]):
            owners = _owners(parts, bounds[d], bounds[d + 1])
            held = [p[(p >= bounds[d]) & (p < bounds[d + 1])].tolist() for p in parts]
            contiguous = all(h == list(range(h[0], h[0] + len(h))) for h in held if h)
            if "stripe=doc" in spec and length <= LIMIT:
                assert len(owners) == 1, f"{spec}: document {d} of {length} tokens cut: {owners}"
            elif "stripe=doc" in spec:
                assert len(set(owners)) > 1 and _is_subsequence(owners, round_trip), (spec, d, owners)
            elif length <= LIMIT:
                assert contiguous, f"{spec}: document {d} of {length} tokens striped: {held}"
            else:
                assert not contiguous, f"{spec}: document {d} of {length} > {LIMIT} tokens not striped: {held}"


def test_auto_keeps_short_documents_whole_and_splits_a_dense_row():
    n, seq = 8, 8 * 4096
    short = _bounds([256] * (seq // 256))
    assert choose_whole_max(short, n) >= 256
    assert choose_whole_max([0, seq], n) < seq // n  # one long document: striped


def test_bad_parameters_are_value_errors():
    with pytest.raises(ValueError, match="stripe_size=0"):
        get_layout("striped", stripe_size=0)
    with pytest.raises(ValueError, match="doc_placement='whole'"):
        get_layout("striped", doc_placement="whole")
    with pytest.raises(ValueError, match="only 'striped'"):
        get_layout("zigzag:stripe=4")
    with pytest.raises(ValueError, match="apply to layout 'striped' only"):
        get_layout("contiguous", stripe_size=4)
    with pytest.raises(ValueError, match="layout parameter"):
        get_layout("striped:tile=4")
    with pytest.raises(ValueError, match="stripe_size=10"):  # one 30-token document in stripes of 10: 20 / 10
        striped_sp.positions(30, 2, 0, layout="striped:stripe=10,place=1", cu_seqlens=[0, 30])
    with pytest.raises(ValueError, match="multiple of"):
        striped_sp.positions(36, 2, 0, layout="striped:stripe=4")


# -- ring_attention on gloo ranks -----------------------------------------------------------------

HEADS = {"mha": (4, 4), "gqa": (4, 2)}


def check_placed(n, layout, heads, seed, local_len, docs, window, ulysses=1, backend="auto"):
    group, rank = cp_group(n)
    rng = random.Random(seed)
    seq = local_len * n
    if isinstance(docs, tuple):  # the documents' lengths themselves
        assert sum(docs) == seq, (docs, seq)
        bounds = _bounds(docs)
    else:
        bounds = None if docs is None else _bounds(_random_lengths(rng, seq, docs == "short"))
    h, kvh = HEADS[heads]
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(1, seq, h, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, seq, kvh, 16, generator=gen) for _ in range(2))
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True, SCALE, bounds, window)
    (ref * dout.double()).sum().backward()

    def sh(t):
        return striped_sp.shard(t, n, rank, layout=layout, cu_seqlens=bounds)

    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    out = striped_sp.ring_attention(ql, kl, vl, group, layout=layout, softmax_scale=SCALE, backend=backend,
                                    cu_seqlens=cu, window_size=window, ulysses_size=ulysses)
    (out * sh(dout)).sum().backward()
    errs = sharded_errors(out, (ql, kl, vl), ref, (qr, kr, vr), sh)
    bad = {name: e for name, e in errs.items() if not e < 1e-5}
    assert not bad, f"{layout} seed={seed} bounds={bounds} window={window}: errors above 1e-5: {bad}"


def check_keyword_parameters(n, seed):
    """stripe_size= / doc_placement= keywords equal the parameters in the name."""
    group, rank = cp_group(n)
    bounds = [0, 5, 6, 30, 31, 40 * n]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 40 * n, 2, 8, generator=gen) for _ in range(3))
    kw = dict(cu_seqlens=bounds, stripe_size=2, doc_placement=8)
    ql, kl, vl = (striped_sp.shard(t, n, rank, **kw) for t in (q, k, v))
    a = striped_sp.ring_attention(ql, kl, vl, group, **kw)
    b = striped_sp.ring_attention(ql, kl, vl, group, layout="striped:stripe=2,place=8", cu_seqlens=bounds)
    assert torch.equal(a, b)


def check_ring_sends_shared_rows_only(n, seed):
    """Whole documents at the end of a rank stay home: every K/V and dK/dV transfer carries the
    owner's shared rows, fewer than its local rows (and the result stays exact: check_placed)."""
    from striped_sp.plan.masks import make_mask, shared_rows
    from striped_sp.engine.transport import TorchTransport as Ring

    group, rank = cp_group(n)
    layout, local = "striped:stripe=doc,place=8", 40
    bounds = [0, 3, 20, 25, 27, 34, 38, local * n]
    lay = get_layout(layout)
    shared = [shared_rows(lay, make_mask(local * n, n, lay, bounds, None, True), n, r) for r in range(n)]
    assert min(shared) < local
    sizes, real = [], Ring.shift

    def spy(self, tensors, what="a ring step", hops=1, recv_rows=None):
        sizes.append((what, tensors[0].size(1)))
        return real(self, tensors, what, hops, recv_rows)

    Ring.shift = spy
    try:
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, local * n, 2, 8, generator=gen) for _ in range(3))
        ql, kl, vl = (striped_sp.shard(t, n, rank, layout=layout, cu_seqlens=bounds).requires_grad_() for t in (q, k, v))
        striped_sp.ring_attention(ql, kl, vl, group, layout=layout, cu_seqlens=bounds).sum().backward()
    finally:
        Ring.shift = real
    fwd = [rows for what, rows in sizes if what.startswith("forward")]
    assert fwd == [shared[(rank - t) % n] for t in range(len(fwd))], (fwd, shared)
    dkv = [rows for what, rows in sizes if "dK/dV" in what]
    assert dkv == [shared[(rank - t) % n] for t in range(len(dkv))], (dkv, shared)
    check_placed(n, layout, "gqa", seed, local, "short", None)


def _cases(world):
    sizes = {4: [4, 2, 1], 3: [3]}[world]
    cases = []
    for n in sizes:
        for i, layout in enumerate(["striped:stripe=2", "striped:stripe=4", "striped:place=auto",
                                    "striped:place=6", "striped:stripe=2,place=auto", "striped:stripe=3,place=10",
                                    "striped:stripe=doc", "striped:stripe=doc,place=7"]):
            s = SEED + 100 * n + 10 * i
            stripe = layout.split("stripe=")[1].split(",")[0] if "stripe=" in layout else "1"
            stripe = int(stripe) if stripe.isdigit() else 1
            ll = 12 * stripe
            specs = [
                ("docs-short", "gqa", ll, "short", None),
                ("docs-mixed", "mha", 2 * ll, "mixed", None),
                ("docs-window", "gqa", 2 * ll, "short", (3, 0)),
                ("docs-window-wide", "mha", 2 * ll, "mixed", (17, 0)),
                ("dense", "gqa", ll, None, None),
                ("dense-window", "mha", ll, None, (5, 0)),
                ("long-docs", "gqa", 150, "mixed", None) if 150 % stripe == 0 else ("long-docs", "gqa", 144, "mixed", None),
            ]
            for j, (name, heads, local_len, docs, window) in enumerate(specs):
                cases.append((f"N{n}-{layout}-{name}", check_placed, (n, layout, heads, s + j, local_len, docs, window)))
            cases.append((f"N{n}-{layout}-math", check_placed, (n, layout, "gqa", s + 9, ll, "short", (4, 0), 1, "math")))
            if n == 4:
                cases.append((f"N{n}-{layout}-ulysses2", check_placed,
                              (n, layout, "gqa", s + 8, 2 * ll, "mixed", None, 2)))
        cases.append((f"N{n}-keywords", check_keyword_parameters, (n, SEED + n)))
        if n > 1:  # documents of exactly the whole-placement limit (test_a_document_of_exactly_the_limit...)
            for j, spec in enumerate([f"striped:stripe=doc,place={LIMIT}", f"striped:place={LIMIT}"]):
                cases.append((f"N{n}-{spec}-at-the-limit", check_placed,
                              (n, spec, "gqa", SEED + 3 * n + j, 40, _at_the_limit(n), None)))
                cases.append((f"N{n}-{spec}-at-the-limit-window", check_placed,
                              (n, spec, "mha", SEED + 5 * n + j, 40, _at_the_limit(n), (4, 0))))
        if n > 1:
            cases.append((f"N{n}-sends-shared-rows", check_ring_sends_shared_rows_only, (n, SEED + 7 * n)))
    return cases


#: left to make test-release: the wide-window, dense-window and math-kernel rows of every layout (make test
#: keeps each layout's short, mixed, windowed and long documents, dense rows, Ulysses and the limits)
_RELEASE_ROWS = ("-docs-window-wide", "-dense-window", "-math")

CASES = CaseTable({world: _cases(world) for world in (4, 3)},
                  release=lambda world, name: name.endswith(_RELEASE_ROWS))


@pytest.mark.parametrize("world, name", CASES.params())
def test_placed_against_float64_reference(world, name):
    err = CASES.result(world, name)
    assert err is None, err


@pytest.mark.parametrize("n", [8, 32])
def test_auto_keeps_short_documents_whole_and_the_model_counts_the_plans_balance(n):
    """On short documents auto keeps some whole, predicted faster than none; the model's balance
    (critical path over ideal, in score entries) is the one of the real plans' blocks."""
    from striped_sp.bench.docs import packed_row, parse_docs
    from striped_sp.plan.placement import predict
    from striped_sp.plan.search import predict_ring

    bounds = packed_row(parse_docs("lognormal:median=256,sigma=1.2"), n * 2048, seed=3)
    chosen = choose_whole_max(bounds, n)
    assert chosen > 0
    assert predict_ring(bounds, n, 1, chosen, "cpu").ms < predict_ring(bounds, n, 1, 0, "cpu").ms
    balance = predict(bounds, n, 1, chosen)["balance"]
    if n == 8:  # the plans' own count: every (rank, step) block of the real ring
        from striped_sp.bench.docs import Workload
        from striped_sp.bench.work import masked_step_entries
        from striped_sp.plan.masks import make_mask

        lay = get_layout("striped", doc_placement=chosen)
        mask = make_mask(bounds[-1], n, lay, bounds, None, True)
        ideal = sum((b - a) * (b - a + 1) // 2 for a, b in zip(bounds[:-1], bounds[1:])) / n
        entries = masked_step_entries(Workload(lay.key, n, mask, 0, ideal))
        assert sum(max(row) for row in entries) / ideal == pytest.approx(balance, rel=0.02)


@pytest.mark.parametrize("spec, n, local, left, steps", [
    ("contiguous", 8, 64, 64, 2), ("contiguous", 8, 64, 65, 3), ("contiguous", 8, 64, 0, 1),
    ("striped:stripe=16", 8, 64, 40, 4), ("striped:stripe=1", 8, 64, 5, 6), ("striped:stripe=1", 4, 64, 5, 4),
    ("striped", 8, 64, 5, 8), ("striped:stripe=16,order=mirror", 8, 64, 40, 8),
    ("zigzag", 8, 64, 3, 8), ("striped:place=auto", 8, 64, 3, 8), ("contiguous", 8, 64, -1, 8),
])
def test_ring_steps_cover_every_visible_block(spec, n, local, left, steps):
    """No step after ring_steps has visible keys on any rank (the block plans' own count), and for
    layouts dealt in blocks the bound is tight: its last step has some."""
    from striped_sp.plan.masks import block_plan, make_mask

    lay = get_layout(spec)
    mask = make_mask(n * local, n, lay, None, (left, 0) if left >= 0 else None, True)
    assert lay.ring_steps(n, local, mask) == steps
    busy = [any(block_plan(lay, mask, n, r, (r - t) % n) for r in range(n)) for t in range(n)]
    assert not any(busy[steps:])
    if lay.window_block(n, local, mask) is not None:
        assert busy[steps - 1]


# -- per-document stripes (stripe_size="doc") -----------------------------------------------------

def _web_row(n, tokens_per_rank=2048, median=256, seed=3):
    from striped_sp.bench.docs import packed_row, parse_docs

    return tuple(packed_row(parse_docs(f"lognormal:median={median},sigma=1.2"), n * tokens_per_rank, seed=seed))


def _plan_entries(spec, bounds, n):
    """entries[t][r] of the real block plans (the work model's count, independent of doc_stripes)."""
    from striped_sp.bench.docs import Workload
    from striped_sp.bench.work import masked_step_entries
    from striped_sp.plan.masks import make_mask

    lay = get_layout(spec)
    mask = make_mask(bounds[-1], n, lay, list(bounds), None, True)
    return masked_step_entries(Workload(lay.key, n, mask, 0, 1.0))


@pytest.mark.parametrize("n, whole_max", [(4, 0), (8, 0), (8, 512), (8, 4096)])
def test_doc_stripes_step_entries_match_the_plans(n, whole_max):
    """doc_stripes' analytic count of every (step, rank) block equals the block plans' own."""
    from striped_sp.plan import doc_stripes

    bounds = _web_row(n)
    _, kept, _, counts = doc_stripes.place(bounds, n, whole_max)
    model = doc_stripes.step_entries(bounds, n, kept, counts)
    plans = _plan_entries(f"striped:stripe=doc,place={whole_max}" if whole_max else "striped:stripe=doc", bounds, n)
    assert model.tolist() == [[float(x) for x in row] for row in plans]


@pytest.mark.parametrize("n", [2, 8, 32])
def test_doc_stripes_are_balanced_round_trips(n):
    """Every split document: two runs per rank (one from either half, in a round trip), S/N tokens
    per rank; the real plans' critical path within 1% of ideal, dense row and web mix."""
    for bounds in [(0, n * 1024), _web_row(n, 1024)]:
        tables = placed_runs(bounds, n, "doc", "split")
        assert all(int(t[:, 2].sum()) == bounds[-1] // n for t in tables)
        runs = sorted((int(p), int(c), r) for r, t in enumerate(tables) for _, p, c, _ in t.tolist())
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b - a < 2 * n:
                continue
            mine = [r for p, c, r in runs if a <= p < b]
            assert mine == list(range(n)) + list(reversed(range(n))), (a, b, mine)
        entries = _plan_entries("striped:stripe=doc", bounds, n) if n <= 8 else None
        if entries is not None:
            ideal = sum((y - x) * (y - x + 1) // 2 for x, y in zip(bounds[:-1], bounds[1:])) / n
            assert sum(max(row) for row in entries) / ideal <= 1.01


def test_doc_stripes_keep_short_documents_whole_and_fill_ranks_exactly():
    from striped_sp.plan import doc_stripes

    n = 8
    bounds = _web_row(n)
    tables, kept, split, counts = doc_stripes.place(bounds, n, 512)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    whole = [d for docs in kept for d in docs]
    assert len(whole) >= 5 and all(lengths[d] <= 512 for d in whole)
    assert sorted(whole + split) == [d for d in range(len(lengths)) if lengths[d]]
    for r, t in enumerate(tables):
        assert int(t[:, 2].sum()) == bounds[-1] // n
        for d in kept[r]:
            assert [bounds[d], lengths[d]] in t[:, 1:3].tolist()
    assert [sum(row) for row in counts] == [lengths[d] for d in split]


def test_diagonal_block_is_one_causal_square_per_document():
    """A rank's own block under a plain causal mask: one call, one causal segment per document
    (its pieces back to back in local order); with a window the pieces stay separate."""
    from striped_sp.plan.masks import block_plan, make_mask

    n = 4
    bounds = [0, 40, 41, 200, 320]
    lay = get_layout("striped:stripe=doc")
    plan = block_plan(lay, make_mask(320, n, lay, bounds, None, True), n, 1, 1)
    assert len(plan) == 1
    segs = plan[0].segments
    assert segs.lq.tolist() == segs.lk.tolist() and (segs.wl == -1).all() and (segs.wr == 0).all()
    assert int(segs.lq.sum()) == 80 and len(segs) == 3  # the 1-token document sits on another rank
    windowed = block_plan(lay, make_mask(320, n, lay, bounds, (5, 0), True), n, 1, 1)
    assert sum(len(c.segments) for c in windowed) > 3


def test_auto_takes_the_simplest_of_the_near_fastest_plans():
    """The search's choice is within MIN_GAIN of the fastest prediction, and no candidate as close
    is preferred (fewer whole documents, then "doc" before stripes of 1 before sizes); on the web mix
    at N=2 it is per-document stripes (that family measured fastest there: 642 ms against 652-709 ms
    for stripes of 1 with any placement, 700 ms zigzag; docs/tuning.md, "Choosing a plan")."""
    from striped_sp.bench.docs import workload
    from striped_sp.plan.search import MIN_GAIN, Prediction, preference, search

    bounds = tuple(workload("striped", 2, 4096, "lognormal:median=1024,sigma=1.2", None, 0).mask.bounds)
    chosen, tried = search(bounds, 2, "cpu")
    fastest = min(p.ms for p in tried)
    assert chosen.ms <= fastest / (1 - MIN_GAIN)
    assert not [p for p in tried if p.ms <= fastest / (1 - MIN_GAIN) and preference(p) < preference(chosen)]
    assert preference(Prediction("doc", 0, 1.0, 2, (), ())) < preference(Prediction(1, 0, 1.0, 2, (), ()))
    assert chosen.stripe_size == "doc"
    assert len({(p.stripe_size, p.whole_max, p.order) for p in tried}) == len(tried) > 10


@pytest.mark.parametrize("spec", ["striped:stripe=doc,place=512", "striped:place=512", "striped", "zigzag",
                                  "striped:stripe=doc", "contiguous"])
def test_shared_rows_hold_every_key_other_ranks_see(spec):
    """No rank's plan against another rank's keys reaches past that rank's shared rows (the rows
    the ring sends on); with whole documents the ring sends less."""
    from striped_sp.bench.docs import workload
    from striped_sp.plan.masks import block_plan, shared_rows

    n = 8
    lay = get_layout(spec)
    mask = workload(spec, n, 2048, "lognormal:median=256,sigma=1.2", None, 3).mask  # zigzag: padded
    shared = [shared_rows(lay, mask, n, r) for r in range(n)]
    for s in range(n):
        for r in range(n):
            if r != s:
                for call in block_plan(lay, mask, n, r, s):
                    assert int((call.segments.k_start + call.segments.lk).max()) <= shared[s], (spec, r, s)
    if "place" in spec:
        assert sum(shared) < 0.9 * mask.seq_len


def test_shared_rows_count_only_the_closing_whole_documents():
    """A one-token document in the middle of a rank's rows is wholly on that rank but not at the
    end: the rows after it are still shared."""
    from striped_sp.plan.masks import make_mask, shared_rows

    n, bounds = 4, [0, 100, 101, 256]
    lay = get_layout("striped:stripe=doc")
    mask = make_mask(256, n, lay, bounds, None, True)
    assert [shared_rows(lay, mask, n, r) for r in range(n)] == [64] * n
    placed = get_layout("striped:stripe=doc,place=1")  # the one-token document kept whole, at the end
    mask = make_mask(256, n, placed, bounds, None, True)
    assert sorted(shared_rows(placed, mask, n, r) for r in range(n)) == [63, 64, 64, 64]
