"""``auto``: the fastest plan the engine can run for a packed row, by the kernel's cost model.

A striped layout on a packed row has two knobs, both plan data: the stripe size (``1``: token by
token; ``s``: stripes of ``s`` tokens; ``"doc"``: ``2N`` stripes per document) and the longest
document kept whole on one rank (``whole_max``; ``0``: none; the tokens per rank: every document
that fits, which for a row of short documents means no ring traffic at all).  :func:`search`
predicts the forward+backward time of each candidate with :meth:`CostModel.ring_ns
<striped_sp.plan.cost.CostModel.ring_ns>` (compute on the slowest rank per step, the transfer of the
rows the ring carries, a fixed cost per step, the steps a row of whole documents skips) and returns
the fastest, preferring the simpler plan on a near tie (:data:`MIN_GAIN`, :func:`preference`).

Candidates: ``whole_max`` in 0 and the powers of two from :data:`MIN_WHOLE` up to the tokens per
rank, for stripes of 1 and ``"doc"``; the powers of two from
:data:`~striped_sp.plan.stripe_choice.MIN_STRIPE` up to half the tokens per rank as stripe sizes,
each with ``whole_max`` 0 and the best one of stripes of 1.  Infeasible ones (stripes that cannot
fill the ranks evenly) are skipped, and so are stripe sizes under which a striped document spans
fewer than ``N`` stripes (it then falls on a few ranks, unevenly: the model assumes every striped
document spread over all ranks).  The model knows no windows: under a window the choice is the one
of the global layers (Megatron's ``--striped-stripe-size auto`` keeps its window rule,
:mod:`striped_sp.plan.stripe_choice`).  A pure function of the boundaries, ``N`` and the model: every
rank, the data loader and the ring reach the same choice, kept in a small cache keyed by the model
(:func:`search`, :func:`placed_runs`).
"""

from __future__ import annotations

import dataclasses
import functools

import logging

import torch

from . import doc_stripes, placement
from .cost import CostModel, default_model, model_named
from .stripe_choice import MIN_STRIPE

__all__ = ["MIN_GAIN", "MIN_WHOLE", "Prediction", "predict_ring", "predict_zigzag", "search", "preference",
           "choose_whole_max", "describe", "decision", "placed_runs", "placements_made"]

_log = logging.getLogger("striped_sp.plan.search")

#: a candidate must beat a simpler one by this share of its time to be chosen (the model is crude:
#: at N=2 a 0.6% predicted gain once cut a document and measured 7-12% slower)
MIN_GAIN = 0.01
#: the shortest ``whole_max`` tried after 0 (shorter documents are too few entries to matter)
MIN_WHOLE = 64
#: in the joint search (``stripe_size="auto"``), per-document stripes are first predicted coarsely
#: (:func:`~striped_sp.plan.doc_stripes._floor_table` counts, no fix-up: a few ms less each at 1M
#: tokens); the coarsely fastest is then predicted exactly, and so is every other within this share
#: of the best exact prediction.  Coarse predictions were within 4.1% of the exact ones on lognormal
#: mixes, but rows of documents shorter than 2N tokens can be off several times over; a pinned
#: ``stripe_size="doc"`` predicts every candidate exactly (tests/unit/test_search_speed.py checks the
#: choice against the full search on both kinds of rows)
COARSE_MARGIN = 0.10


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One candidate plan: ``stripe_size`` and ``whole_max``; ``ms``: predicted forward+backward time
    per head; ``steps``: ring steps (1: no ring traffic); ``compute_ms`` and ``carried_rows``: per
    step, the slowest rank's forward compute and the key/value rows then passed on."""

    stripe_size: int | str
    whole_max: int
    ms: float
    steps: int
    compute_ms: tuple
    carried_rows: tuple
    #: predicted from counts before the placement's fix-up (per-document stripes only, not the exact
    #: prediction): ruled out by :data:`COARSE_MARGIN`, never chosen
    coarse: bool = False
    #: how an int stripe size's stripes are dealt (:mod:`striped_sp.plan.mirror`): "round" or "mirror"
    order: str = "round"

    @property
    def layout_params(self) -> dict:
        params = {"stripe_size": self.stripe_size, "doc_placement": self.whole_max or "split"}
        return params if self.order == "round" else {**params, "order": self.order}


def _lengths(bounds: tuple) -> list[int]:
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _striped_steps(bounds, world_size, stripe, whole_max, model, even_only=False, order="round"):
    """Per-step forward compute (ns) on the slowest rank and the tokens each rank keeps private."""
    pieces, striped = placement._placed_pieces(bounds, world_size, stripe, whole_max, order)
    lengths = _lengths(bounds)
    if even_only and stripe > 1 and any(lengths[d] < stripe * world_size for d in striped):
        # a document on fewer ranks than N falls unevenly: outside what the model describes
        raise ValueError(f"stripe_size={stripe}: a striped document is shorter than {stripe * world_size} tokens")
    sizes = torch.tensor([len(rows) for rows in pieces], dtype=torch.int64)
    counts = torch.tensor([c for rows in pieces for _, c in rows], dtype=torch.float64)
    whole_ns = torch.zeros(world_size, dtype=torch.float64).index_add_(
        0, torch.repeat_interleave(torch.arange(world_size), sizes), _call_ns(model, counts, counts)).tolist()
    striped_lengths = torch.tensor([lengths[d] for d in striped], dtype=torch.float64)
    per_step = float(_striped_docs_ns(model, striped_lengths, world_size, stripe).sum())
    later = per_step if order == "round" else float(_mirrored_later_ns(model, striped_lengths, world_size, stripe).sum())
    cross = placement._cross_entries(pieces)  # cut documents: their cross-rank blocks, dense
    private = [sum(c for d, c in rows if c == lengths[d]) for rows in pieces]
    ring = bool(striped) or any(c != lengths[d] for rows in pieces for d, c in rows)  # striped or cut
    compute = [max(whole_ns) + per_step]
    if ring and world_size > 1:
        compute += [later] * (world_size - 1)
        compute[1] += cross * model.ns_per_entry
    return compute, private


def _call_ns(model: CostModel, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """:meth:`CostModel.call` of causal calls, element by element (float64; 0 where a side is 0).
    Not :meth:`CostModel.call_tensor`, which prices calls of under one row (a short document's
    ``L / N`` on each rank) at 0 where ``call`` does not: the search's predictions stay what they were."""
    safe = torch.where(rows > 0, rows, torch.ones_like(rows))
    ns = (model.ns_per_entry * safe * torch.minimum(keys, safe / 2 + model.causal_waste) * model.causal_factor
          * (1 + model.small_rows / safe))
    return torch.where((rows > 0) & (keys > 0), ns + model.call_ns, torch.zeros_like(ns))


def _striped_docs_ns(model: CostModel, lengths: torch.Tensor, world_size: int, stripe: int) -> torch.Tensor:
    """:func:`~striped_sp.plan.placement._striped_doc_ns` of every document of ``lengths`` (float64)."""
    rows = lengths / world_size
    one = _call_ns(model, rows, rows)
    if stripe == 1:
        return one
    k = rows / stripe
    square = _call_ns(model, *(torch.tensor([float(stripe)], dtype=torch.float64),) * 2)
    dense = model.ns_per_entry * (k * (k - 1) / 2 * stripe * stripe) * (1 + model.small_rows / stripe)
    return torch.where(k <= 1, one, k * square + dense + (k - 1) * model.call_ns)


def _mirrored_later_ns(model: CostModel, lengths: torch.Tensor, world_size: int, stripe: int) -> torch.Tensor:
    """A ring step after the first of mirrored stripes (:mod:`striped_sp.plan.mirror`), per document
    (float64): every rank's ``k`` query stripes meet ``k^2 / 2`` of the source's key stripes' dense
    squares (a prefix call per query stripe, no diagonal); a document of at most ``N`` stripes as
    round-robin's (one piece per rank)."""
    k = lengths / world_size / stripe
    dense = model.ns_per_entry * (k * k / 2 * stripe * stripe) * (1 + model.small_rows / stripe) + k * model.call_ns
    return torch.where(k <= 1, _striped_docs_ns(model, lengths, world_size, stripe), dense)


def _doc_steps(bounds, world_size, whole_max, model, coarse=False):
    _, kept, split, counts = doc_stripes.place(bounds, world_size, whole_max, tables=False, coarse=coarse)
    lengths = _lengths(bounds)
    cost = doc_stripes.step_cost(bounds, world_size, kept, counts, lambda m: model.call_tensor(m, m, True),
                                 lambda q, k: model.call_tensor(q, k, False), model.rect_factors)
    private = [sum(lengths[d] for d in docs) for docs in kept]
    compute = cost.max(1).values.tolist()
    return (compute if split else compute[:1]), private


def predict_ring(bounds, world_size: int, stripe_size, whole_max: int, model: CostModel | str | None = None,
                 even_only: bool = False, coarse: bool = False, order: str = "round") -> Prediction:
    """The model's forward+backward time per head of one candidate (``ValueError`` if infeasible;
    ``even_only``: also for a stripe size under which a striped document spans fewer than N stripes;
    ``coarse``: per-document stripes predicted from their counts before the fix-up; ``order``: how an
    int stripe size's stripes are dealt, :mod:`striped_sp.plan.mirror`)."""
    model = model_named(model)
    bounds = tuple(bounds)
    if stripe_size == "doc":
        compute, private = _doc_steps(bounds, world_size, whole_max, model, coarse)
    else:
        compute, private = _striped_steps(bounds, world_size, stripe_size, whole_max, model, even_only, order)
    local = bounds[-1] // world_size
    carried = [local - min(private)] * (len(compute) - 1) + [0]
    ns = model.ring_ns(compute, carried)
    return Prediction(stripe_size, whole_max, ns / 1e6, len(compute), tuple(c / 1e6 for c in compute), tuple(carried),
                      coarse=coarse and stripe_size == "doc", order="round" if stripe_size == "doc" else order)


def predict_zigzag(bounds, world_size: int, model: CostModel | str | None = None) -> Prediction:
    """The model's forward+backward time per head of ``zigzag`` on the same packed row: every document
    padded to a multiple of ``2N`` and cut into ``2N`` chunks, chunks ``r`` and ``2N-1-r`` on rank
    ``r``, which is per-document stripes (``"doc"``) on the padded row, every row carried.  For the
    log and the docs only: the striped default never switches layouts."""
    model = model_named(model)
    unit = 2 * world_size
    lengths = [-(-n // unit) * unit for n in _lengths(tuple(bounds))]
    padded = [0]
    for n in lengths:
        padded.append(padded[-1] + n)
    compute, _ = _doc_steps(tuple(padded), world_size, 0, model)
    carried = [padded[-1] // world_size] * (len(compute) - 1) + [0]
    ns = model.ring_ns(compute, carried)
    return Prediction("zigzag", 0, ns / 1e6, len(compute), tuple(c / 1e6 for c in compute), tuple(carried))


def _whole_maxes(local: int, lengths: list[int]) -> list[int]:
    """0 and the powers of two from :data:`MIN_WHOLE` up to ``local`` (and ``local``), keeping one
    length per distinct set of documents it allows whole (the same set: the same plan)."""
    out, c = [0], MIN_WHOLE
    while c < local:
        out.append(c)
        c *= 2
    out.append(local)
    kept, seen = [], set()
    for w in out:
        allowed = sum(1 for n in lengths if n <= w)
        if allowed not in seen:
            seen.add(allowed)
            kept.append(w)
    return kept


def _try(bounds, world_size, stripe, whole_max, model, even_only=False, coarse=False, order="round"):
    try:
        return predict_ring(bounds, world_size, stripe, whole_max, model, even_only, coarse, order)
    except ValueError:
        return None


def search(bounds, world_size: int, model: CostModel | str | None = None, stripe_size="auto",
           doc_placement="auto", order: str = "round") -> tuple[Prediction, list[Prediction]]:
    """``(chosen, every candidate predicted)`` for a packed row with boundaries ``bounds``; a
    candidate with ``coarse`` set was ruled out on a coarse prediction (:data:`COARSE_MARGIN`), its
    ``ms`` not the exact one.

    ``stripe_size``: ``"auto"`` (every stripe size) or a fixed one; ``doc_placement``: ``"auto"``
    (every ``whole_max``), ``"split"`` or an int (fixed); ``order`` (a fixed int stripe size): how its
    stripes are dealt (``"auto"`` stripe sizes try both orders).  ``ValueError`` when no candidate fits."""
    model = model_named(model)
    return _search(tuple(int(b) for b in bounds), world_size, model, stripe_size, doc_placement, order)


# a cache beside the plan cache: a pure function of (row, N, model, knobs), the model resolved and in
# the key; asked for one row by every rank's plan, the loader and describe(); 16 rows of candidates
@functools.lru_cache(maxsize=16)
def _search(bounds: tuple, world_size: int, model: CostModel, stripe_size, doc_placement, order="round"):
    local = bounds[-1] // world_size
    lengths = _lengths(bounds)
    if doc_placement == "auto":
        maxes = _whole_maxes(local, lengths)
    else:
        maxes = [0 if doc_placement == "split" else int(doc_placement)]
    if stripe_size == "auto":
        families, sizes = [1, "doc"], []
        s = MIN_STRIPE
        while s <= local // 2:
            sizes.append(s)
            s *= 2
    else:
        families, sizes = [stripe_size], []
    tried = [p for stripe in families if stripe != "doc" for w in maxes
             if (p := _try(bounds, world_size, stripe, w, model, order=order))]
    for s in sizes:  # one joint search: every stripe size with every whole_max, dealt both ways
        for w in maxes:
            if any(w < n < s * world_size for n in lengths):
                continue  # a striped document on fewer than N stripes (predict_ring's even_only)
            tried += [p for o in ("round", "mirror") if (p := _try(bounds, world_size, s, w, model, True, order=o))]
    if "doc" in families and stripe_size == "auto":  # coarsely first; exactly where it may be the fastest
        rough = sorted((p for w in maxes if (p := _try(bounds, world_size, "doc", w, model, coarse=True))),
                       key=lambda p: p.ms)
        exact = [q for p in rough[:1] if (q := _try(bounds, world_size, "doc", p.whole_max, model))]
        bar = min(p.ms for p in tried + exact) * (1 + COARSE_MARGIN) if tried + exact else float("inf")
        tried += exact + [(_try(bounds, world_size, "doc", p.whole_max, model) if p.ms <= bar else p)
                          for p in rough[1:]]
        tried = [p for p in tried if p is not None]
    elif "doc" in families:
        tried += [p for w in maxes if (p := _try(bounds, world_size, "doc", w, model))]
    if not any(not p.coarse for p in tried):
        raise ValueError(f"no striped plan fills {world_size} ranks of {local} tokens evenly for this row "
                         f"(stripe_size={stripe_size!r}, doc_placement={doc_placement!r})")
    fastest = min(p.ms for p in tried if not p.coarse)
    near = [p for p in tried if not p.coarse and p.ms <= fastest / (1 - MIN_GAIN)]
    return min(near, key=preference), tried


def preference(p: Prediction) -> tuple:
    """Among near-equal predictions, the plan to take: the fewest whole documents (no cut ones),
    then per-document stripes, stripes of 1, stripe sizes (smallest first): per-document stripes
    measured at least as fast as stripes of 1 on every packed mix (docs/tuning.md, "Choosing a plan")."""
    family = {"doc": 0, 1: 1}.get(p.stripe_size, 2)
    return p.whole_max, family, 0 if isinstance(p.stripe_size, str) else p.stripe_size, p.order != "round"


def choose_whole_max(bounds, world_size: int, stripe=1, model: CostModel | str | None = None) -> int:
    """``doc_placement="auto"`` for a fixed stripe size: the ``whole_max`` :func:`search` picks."""
    return search(bounds, world_size, model, stripe, "auto")[0].whole_max


def _resolve(bounds: tuple, world_size: int, stripe, doc_placement, model: CostModel, order="round"):
    """``(stripe_size, whole_max, order)`` that a striped layout with these parameters runs on a packed row."""
    if stripe == "auto" or doc_placement == "auto":
        chosen = search(bounds, world_size, model, stripe, doc_placement, order)[0]
        return chosen.stripe_size, chosen.whole_max, chosen.order
    return stripe, 0 if doc_placement == "split" else doc_placement, order


def placed_runs(bounds: tuple, world_size: int, stripe, doc_placement, model: CostModel | None = None,
                order: str = "round") -> list:
    """Per rank, the int64 run table ``[runs, 4]`` (local start, first position, count, step) of a
    packed row with boundaries ``bounds`` under a striped layout (``auto`` parameters resolved by
    :func:`search` with ``model``, default :func:`~striped_sp.plan.cost.default_model`; cached;
    ``order``: how a fixed int stripe size's stripes are dealt, :mod:`striped_sp.plan.mirror`).
    ``ValueError`` when the stripes cannot fill the ranks evenly."""
    return _placed_runs(tuple(bounds), world_size, stripe, doc_placement, model_named(model), order)


def _plan_words(stripe, whole_max: int, order: str = "round") -> str:
    kind = {"doc": "per-document stripes", 1: "stripes of 1"}.get(stripe, f"stripes of {stripe}")
    kind += " mirrored" if order == "mirror" else ""
    return kind + (f", documents <= {whole_max} tokens whole" if whole_max else "")


def decision(bounds, world_size: int, stripe="auto", doc_placement="auto",
             model: CostModel | str | None = None, order: str = "round") -> str:
    """What a striped layout with these parameters runs on the packed row ``bounds``, and why, in one
    line (for the log at DEBUG and :attr:`RingPlan.decision <striped_sp.plan.ring_plan.RingPlan>`): the
    plan chosen with its predicted forward+backward time per head and ring steps, how many candidates
    were ranked, the runner-up, and zigzag's predicted time where it is faster than every striped plan
    (the layout named is never changed).  A fixed stripe size and placement: "pinned"."""
    bounds = tuple(int(b) for b in bounds)
    model = model_named(model)
    if stripe != "auto" and doc_placement != "auto":
        whole = 0 if doc_placement == "split" else doc_placement
        return (f"pinned: {_plan_words(stripe, whole, order)} (stripe_size={stripe!r}, doc_placement={doc_placement!r}"
                + (f", order={order!r})" if order != "round" else ")"))
    chosen, tried = search(bounds, world_size, model, stripe, doc_placement, order)
    rough = sum(p.coarse for p in tried)
    tried = [p for p in tried if not p.coarse]
    others = sorted((p for p in tried if p.layout_params != chosen.layout_params), key=lambda p: p.ms)
    order_word = f", order={chosen.order!r}" if chosen.order != "round" else ""
    line = (f"searched {len(tried)} striped plans for {len(bounds) - 1} documents on {world_size} ranks by the "
            f"cost model {model.label!r}: {_plan_words(chosen.stripe_size, chosen.whole_max, chosen.order)} "
            f"(stripe_size={chosen.stripe_size!r}, whole_max={chosen.whole_max}{order_word}), predicted "
            f"{chosen.ms:.2f} ms fwd+bwd per head, {chosen.steps} ring step{'s' if chosen.steps > 1 else ''}")
    if others:
        best = others[0]
        line += (f"; next {_plan_words(best.stripe_size, best.whole_max, best.order)} {best.ms:.2f} ms "
                 f"({best.ms / chosen.ms - 1:+.1%})")
    zig = predict_zigzag(bounds, world_size, model)
    line += (f"; zigzag (its mirrored order on documents padded to 2N) {zig.ms:.2f} ms "
             f"({zig.ms / chosen.ms - 1:+.1%}; per-document stripes are its order unpadded)")
    if rough:
        line += f"; {rough} more per-document plans ruled out on a coarse prediction"
    return line


# a cache beside the plan cache: the run tables of all N ranks of one row (model resolved, in the
# key), asked for by each rank's plan and by shard / unshard / positions; 64 rows' tables.  Its size
# is also placements_made(), which calibrate_cost_model refuses after
@functools.lru_cache(maxsize=64)
def _placed_runs(bounds: tuple, world_size: int, stripe, doc_placement, model: CostModel, order="round") -> list:
    if _log.isEnabledFor(logging.DEBUG) and (stripe == "auto" or doc_placement == "auto"):
        _log.debug("striped layout (stripe_size=%r, doc_placement=%r) on a packed row: %s", stripe, doc_placement,
                   decision(bounds, world_size, stripe, doc_placement, model))
    stripe, whole_max, order = _resolve(bounds, world_size, stripe, doc_placement, model, order)
    if stripe == "doc":
        return doc_stripes.place(bounds, world_size, whole_max)[0]
    return placement._place(bounds, world_size, stripe, whole_max, order=order)[0]


def placements_made() -> bool:
    """Whether any packed row was placed in this process yet (by :func:`placed_runs`)."""
    return _placed_runs.cache_info().currsize > 0


def describe(bounds, world_size: int, stripe, doc_placement, model: CostModel | str | None = None) -> dict:
    """What a striped layout does with a packed row, for reports: ``stripe_size`` and ``whole_max``
    (the longest whole document allowed; 0: none) as resolved, ``whole_documents`` / ``documents``,
    the model's ``balance``, ``predicted_forward_ms`` per head (:func:`~striped_sp.plan.placement.predict`)
    and ``predicted_ms`` forward+backward per head with its ring ``steps`` (:func:`predict_ring`)."""
    bounds = tuple(int(b) for b in bounds)
    model = model_named(model)
    stripe, whole_max, order = _resolve(bounds, world_size, stripe, doc_placement, model)
    if stripe == "doc":
        kept = sum(len(docs) for docs in doc_stripes.place(bounds, world_size, whole_max)[1])
    else:
        tables, whole, _, _ = placement._place(bounds, world_size, stripe, whole_max, order=order)
        lengths = _lengths(bounds)
        kept = sum(1 for rows in placement._whole_pieces(bounds, tables, whole) for d, c in rows if c == lengths[d])
    pred = placement.predict(bounds, world_size, stripe, whole_max, model, order)
    ring = predict_ring(bounds, world_size, stripe, whole_max, model, order=order)
    return {"stripe_size": stripe, "whole_max": whole_max, "order": order, "whole_documents": kept,
            "documents": len(bounds) - 1,
            "balance": pred["balance"], "predicted_forward_ms": pred["ms"], "predicted_ms": ring.ms,
            "steps": ring.steps, "cost_model": model.label}
