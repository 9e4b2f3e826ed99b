"""The search's fast predictions (no run tables, dense calls summed as matrix products) give the
predictions of the full placement: the same pieces, the same step costs up to float64 rounding,
the same chosen plan."""

from __future__ import annotations

import random

import pytest
import torch

from striped_sp.plan import doc_stripes, placement, search
from striped_sp.plan.cost import COST_MODELS, GPU_ARCHS, gpu_model


def _models():
    out = list(COST_MODELS.values())
    out += [gpu_model(cls, arch) for cls in ("fa2", "fa4", "cudnn") for arch in GPU_ARCHS]
    return out


def _row(rng: random.Random, n: int, per_rank: int) -> tuple:
    seq, bounds = n * per_rank, [0]
    while bounds[-1] < seq:
        length = rng.choice([0, 1, 3, rng.randrange(1, 64), int(rng.lognormvariate(6, 1.2)) + 1])
        bounds.append(min(seq, bounds[-1] + length))
    return tuple(bounds)


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.name)
def test_rect_factors_sum_to_the_dense_call(model):
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 3000, (64, 1), generator=gen).double()
    keys = torch.randint(0, 3000, (1, 64), generator=gen).double()
    rows[:4], keys[:, :4] = 0.0, 0.0  # empty sides cost nothing
    total = sum(f * g for f, g in model.rect_factors(rows, keys))
    torch.testing.assert_close(total, model.call_tensor(rows, keys, False), rtol=1e-12, atol=0)


def test_step_cost_by_products_equals_the_loop():
    rng = random.Random(7)
    models = _models()
    for i in range(40):
        n = rng.choice([1, 2, 3, 4, 8, 16, 64])
        bounds = _row(rng, n, rng.choice([64, 256, 2048] if n < 64 else [64, 256]))
        local = bounds[-1] // n
        model = models[i % len(models)]
        for whole_max in (0, local // 4, local):
            _, kept, split, counts = doc_stripes.place(bounds, n, whole_max)
            fast = doc_stripes.place(bounds, n, whole_max, tables=False)
            assert fast[:3] == (None, kept, split) and fast[3].dtype == torch.int64 and fast[3].tolist() == counts
            causal = lambda m: model.call_tensor(m, m, True)  # noqa: E731
            rect = lambda q, k: model.call_tensor(q, k, False)  # noqa: E731
            slow = doc_stripes.step_cost(bounds, n, kept, counts, causal, rect)
            fast = doc_stripes.step_cost(bounds, n, kept, counts, causal, rect, model.rect_factors)
            torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-6)


def test_placed_pieces_equal_the_tables_pieces():
    rng = random.Random(8)
    checked = 0
    for _ in range(120):
        n = rng.choice([1, 2, 3, 4, 8, 16, 64])
        bounds = _row(rng, n, rng.choice([64, 256, 2048]))
        local = bounds[-1] // n
        for stripe in (1, 8, 64):
            whole_max = rng.choice([0, 16, local // 4, local])
            try:
                tables, whole, striped, _ = placement._place(bounds, n, stripe, whole_max)
            except ValueError:
                with pytest.raises(ValueError):
                    placement._placed_pieces(bounds, n, stripe, whole_max)
                continue
            pieces, fast_striped = placement._placed_pieces(bounds, n, stripe, whole_max)
            assert fast_striped == striped
            assert pieces == [[(d, c) for d, c in rows if c] for rows in placement._whole_pieces(bounds, tables, whole)]
            checked += 1
    assert checked > 100


def _slow_prediction(bounds, n, stripe, whole_max, model):
    """predict_ring's compute per step from the full placement (run tables, the step loop)."""
    lengths = search._lengths(bounds)
    if stripe == "doc":
        _, kept, split, counts = doc_stripes.place(bounds, n, whole_max)
        cost = doc_stripes.step_cost(bounds, n, kept, counts, lambda m: model.call_tensor(m, m, True),
                                     lambda q, k: model.call_tensor(q, k, False))
        compute = cost.max(1).values.tolist()
        return compute if split else compute[:1]
    tables, whole, striped, _ = placement._place(bounds, n, stripe, whole_max)
    pieces = placement._whole_pieces(bounds, tables, whole)
    whole_ns = [sum(model.call(c, c, True) for _, c in rows) for rows in pieces]
    per_step = sum(placement._striped_doc_ns(model, lengths[d], n, stripe) for d in striped)
    ring = bool(striped) or any(c != lengths[d] for rows in pieces for d, c in rows)
    compute = [max(whole_ns) + per_step]
    if ring and n > 1:
        compute += [per_step] * (n - 1)
        compute[1] += placement._cross_entries(pieces) * model.ns_per_entry
    return compute


def test_every_candidate_of_the_search_is_predicted_as_from_the_full_placement():
    from striped_sp.bench.docs import packed_row, parse_docs

    model = search.model_named(None)
    for n, seq in ((8, 1 << 15), (64, 1 << 18)):
        bounds = tuple(packed_row(parse_docs("lognormal:median=600,sigma=1.2"), seq))
        search._search.cache_clear()
        chosen, tried = search.search(bounds, n, model)
        assert len(tried) > 10
        for p in (p for p in tried if not p.coarse):
            compute = _slow_prediction(bounds, n, p.stripe_size, p.whole_max, model)
            assert len(compute) == p.steps
            torch.testing.assert_close(torch.tensor(p.compute_ms, dtype=torch.float64),
                                       torch.tensor(compute, dtype=torch.float64) / 1e6, rtol=1e-12, atol=0)
        exact = [p for p in tried if not p.coarse]
        assert chosen == min(exact, key=lambda p: (p.ms > min(q.ms for q in exact) / (1 - search.MIN_GAIN),
                                                     search.preference(p)))


def _full_search(bounds, n, model, stripe_size="auto"):
    """The search with every candidate predicted exactly (no coarse step): the reference choice."""
    local = bounds[-1] // n
    lengths = search._lengths(bounds)
    maxes = search._whole_maxes(local, lengths)
    families = (1, "doc") if stripe_size == "auto" else (stripe_size,)
    tried = [p for stripe in families for w in maxes if (p := search._try(bounds, n, stripe, w, model))]
    s = search.MIN_STRIPE
    while s <= local // 2 and stripe_size == "auto":
        for w in maxes:
            if not any(w < x < s * n for x in lengths):
                tried += [p for o in ("round", "mirror") if (p := search._try(bounds, n, s, w, model, True, order=o))]
        s *= 2
    fastest = min(p.ms for p in tried)
    return min((p for p in tried if p.ms <= fastest / (1 - search.MIN_GAIN)), key=search.preference)


def _short_documents_row(rng: random.Random, n: int, per_rank: int) -> tuple:
    """Rows of documents shorter than 2N tokens (where coarse predictions are far off), some mixed
    with longer ones."""
    kind, bounds = rng.randrange(4), [0]
    while bounds[-1] < n * per_rank:
        if kind == 0:
            length = rng.choice([1, 2, 3])
        elif kind == 1:
            length = rng.choice([1, 2, 3, rng.randrange(1, 2 * n), int(rng.lognormvariate(6, 1.2)) + 1])
        elif kind == 2:
            length = rng.randrange(1, 3 * n) if rng.random() < 0.7 else rng.randrange(n, 8 * n)
        else:
            length = rng.choice([1, 2, int(rng.lognormvariate(7, 1)) + 1])
        bounds.append(min(n * per_rank, bounds[-1] + length))
    return tuple(bounds)


def test_the_search_keeps_the_full_searchs_choice_on_rows_of_short_documents():
    rng = random.Random(11)
    models = _models()
    for i in range(60):
        n = rng.choice([2, 4, 8, 16])
        bounds = _short_documents_row(rng, n, rng.choice([64, 256]))
        model = models[i % len(models)]
        for stripe in ("auto", "doc"):
            search._search.cache_clear()
            try:
                chosen = search.search(bounds, n, model, stripe, "auto")[0]
            except ValueError:
                continue
            full = _full_search(bounds, n, model, stripe)
            assert chosen.layout_params == full.layout_params, (n, model.name, stripe)


@pytest.mark.parametrize("mix", ["lognormal:median=128,sigma=1.0", "lognormal:median=600,sigma=1.2",
                                 "lognormal:median=2500,sigma=1.0", "lognormal:median=8192,sigma=1.5"])
def test_the_coarse_step_keeps_the_full_searchs_choice(mix):
    from striped_sp.bench.docs import packed_row, parse_docs

    models = [search.model_named("cpu"), gpu_model("fa2", "H100"), gpu_model("fa4", "B200")]
    for n, seq in ((2, 1 << 13), (8, 1 << 15), (16, 1 << 15), (64, 1 << 18)):
        bounds = tuple(packed_row(parse_docs(mix), seq))
        for model in models:
            search._search.cache_clear()
            chosen, tried = search.search(bounds, n, model)
            full = _full_search(bounds, n, model)
            assert chosen.layout_params == full.layout_params, (n, model.name)
            assert chosen.ms == pytest.approx(full.ms, rel=1e-12) and not chosen.coarse


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.name)
def test_vectorised_call_costs_equal_the_models_calls(model):
    rng = random.Random(9)
    lengths = [rng.choice([0, 1, 5, 63, 64, 65, rng.randrange(1, 100000)]) for _ in range(200)]
    as_tensor = torch.tensor(lengths, dtype=torch.float64)
    expected = torch.tensor([model.call(x, x, True) for x in lengths], dtype=torch.float64)
    torch.testing.assert_close(search._call_ns(model, as_tensor, as_tensor), expected, rtol=1e-12, atol=0)
    for stripe in (1, 8, 64, 512):
        for n in (1, 2, 8, 64):
            expected = torch.tensor([placement._striped_doc_ns(model, x, n, stripe) for x in lengths],
                                    dtype=torch.float64)
            torch.testing.assert_close(search._striped_docs_ns(model, as_tensor, n, stripe), expected,
                                       rtol=1e-12, atol=0)


def test_the_coarse_step_rules_out_only_plans_beyond_its_margin():
    """A row where the margin decides (lognormal median 300, sigma 2.0, N = 8, 4096 tokens per rank,
    the CPU model): per-document stripes with documents <= 64 whole are within 1% of the fastest and
    preferred; a coarse step that ruled out plans inside its margin (``x (1 - COARSE_MARGIN)``)
    dropped them and took documents <= 256 whole."""
    from striped_sp.bench.docs import packed_row, parse_docs

    model = search.model_named("cpu")
    bounds = tuple(packed_row(parse_docs("lognormal:median=300,sigma=2.0"), 8 * 4096))
    search._search.cache_clear()
    chosen, tried = search.search(bounds, 8, model)
    assert (chosen.stripe_size, chosen.whole_max) == ("doc", 64)
    full = _full_search(bounds, 8, model)
    assert (chosen.stripe_size, chosen.whole_max) == (full.stripe_size, full.whole_max)
    best = min(p.ms for p in tried if not p.coarse)
    rough = [p for p in tried if p.coarse]
    assert all(p.ms > best * (1 + search.COARSE_MARGIN) for p in rough), [(p.whole_max, p.ms, best) for p in rough]
