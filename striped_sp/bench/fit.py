"""``striped-sp bench fit``: the cost model's error on packed mixes it was not fitted on.

The per-batch search (:mod:`striped_sp.plan.search`) ranks plans by a cost model fitted on a few
rows; whether it ranks well on other rows is a question of its error there.  This mode measures
that error: ``bench sim`` (the engine's executor, N ranks on one core, the critical path in CPU
time of the compute thread; no transfers) times every layout on every mix, the model's compute
terms are refitted on the ``--fit-mixes`` rows only, and the refitted model predicts the
``--test-mixes`` rows, which it never saw.

What is fitted (:func:`fit_scales`, least squares without intercept): the measured forward+backward
critical path ``y`` (ms, all heads) as ``a * x_kernel + b * x_steps``, where ``x_kernel`` is the
model's kernel time of the plan without transfers (``heads * (1 + backward_factor) * sum over steps
of the slowest rank's forward compute``, :func:`~striped_sp.plan.search.predict_ring`'s
``compute_ms``) and ``x_steps`` is ``heads * steps``: ``a`` rescales the kernel terms
(``ns_per_entry`` and ``call_ns`` together), ``b`` is the fixed cost of a ring step in ms per head
(the model's ``step_ns``).  The table's model is ``a = 1``, ``b = step_ns``; both are reported.
Transfers are out of scope here (``bench sim`` runs none); windows too (the model knows none).

The per-call efficiency of diagonal-masked calls (:attr:`~striped_sp.plan.cost.CostModel.causal_factor`,
why zigzag's full half blocks beat the strided causal blocks of stripes of 1 on long documents) is a
third term (:func:`fit_terms`): ``x_kernel`` split into the causal calls' part ``x_causal`` (the model's
kernel time less that of the same model with causal entries free) and the rest, each with its own
scale; the fitted factor is the causal scale over the full one, and its error on the test mixes is
reported beside the two-scale fit's.
"""

from __future__ import annotations

import dataclasses
import statistics

__all__ = ["Sample", "fit_scales", "fit_terms", "predict", "predict_terms", "errors", "samples_from_records",
           "register"]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One (mix, layout, N, tokens per rank) point: the model's features and the measured time.
    ``x_kernel``: the model's kernel time without transfers (ms, all heads, forward+backward);
    ``x_steps``: heads times ring steps; ``measured_ms``: the fwd+bwd critical path (ms)."""

    mix: str
    layout: str
    world_size: int
    tokens_per_rank: int
    x_kernel: float
    x_steps: float
    measured_ms: float
    #: the part of ``x_kernel`` spent on the entries of causal (diagonal-masked) calls
    x_causal: float = 0.0


def fit_scales(samples) -> tuple[float, float]:
    """``(a, b)`` minimising ``sum (a * x_kernel + b * x_steps - measured_ms)^2`` over ``samples``
    (floats; least squares without intercept, 2 x 2 normal equations).  ``ValueError`` with fewer
    than 2 samples or features that do not separate (every sample's ``x_steps / x_kernel`` equal)."""
    samples = list(samples)
    if len(samples) < 2:
        raise ValueError(f"fit_scales needs at least 2 samples to fit 2 scales, got {len(samples)}")
    skk = sum(s.x_kernel * s.x_kernel for s in samples)
    sks = sum(s.x_kernel * s.x_steps for s in samples)
    sss = sum(s.x_steps * s.x_steps for s in samples)
    sky = sum(s.x_kernel * s.measured_ms for s in samples)
    ssy = sum(s.x_steps * s.measured_ms for s in samples)
    det = skk * sss - sks * sks
    if abs(det) <= 1e-12 * max(skk * sss, 1e-300):
        raise ValueError(f"fit_scales: the {len(samples)} samples' kernel and step features are proportional "
                         "(the same ring steps per unit of kernel time): the two scales cannot be told apart; "
                         "add layouts or mixes with other step counts")
    return (sky * sss - ssy * sks) / det, (skk * ssy - sks * sky) / det


def fit_terms(samples) -> tuple[float, float, float]:
    """``(a_full, a_causal, b)`` minimising ``sum (a_full * (x_kernel - x_causal) + a_causal * x_causal
    + b * x_steps - measured_ms)^2`` (least squares without intercept): the causal calls' entries priced
    apart; ``a_causal / a_full`` is the fitted :attr:`~striped_sp.plan.cost.CostModel.causal_factor` of the
    model the features were priced with.  ``ValueError`` with fewer than 3 samples or features that do
    not separate."""
    import torch

    samples = list(samples)
    if len(samples) < 3:
        raise ValueError(f"fit_terms needs at least 3 samples to fit 3 scales, got {len(samples)}")
    x = torch.tensor([[s.x_kernel - s.x_causal, s.x_causal, s.x_steps] for s in samples], dtype=torch.float64)
    y = torch.tensor([[s.measured_ms] for s in samples], dtype=torch.float64)
    if int(torch.linalg.matrix_rank(x)) < 3:
        raise ValueError(f"fit_terms: the {len(samples)} samples' full, causal and step features are linearly "
                         "dependent: add layouts (stripes of 1 against zigzag) or mixes")
    a_full, a_causal, b = torch.linalg.lstsq(x, y).solution.flatten().tolist()
    return a_full, a_causal, b


def predict_terms(sample: Sample, terms) -> float:
    """The predicted fwd+bwd ms of ``sample`` with :func:`fit_terms`'s scales."""
    a_full, a_causal, b = terms
    return a_full * (sample.x_kernel - sample.x_causal) + a_causal * sample.x_causal + b * sample.x_steps


def predict(sample: Sample, a: float, b: float) -> float:
    """The predicted fwd+bwd ms of ``sample`` with scales ``(a, b)`` (:func:`fit_scales`)."""
    return a * sample.x_kernel + b * sample.x_steps


def errors(samples, a: float, b: float) -> list[float]:
    """Relative error ``predicted / measured - 1`` of every sample (a list of floats)."""
    return [predict(s, a, b) / s.measured_ms - 1 for s in samples]


def samples_from_records(records, mix: str, heads: int, model) -> list[Sample]:
    """The :class:`Sample` of every fwd+bwd record of ``bench sim``'s masked path
    (:func:`.sim_masked.simulate_masked`) for mix ``mix``: striped layouts priced as the row ran them
    (the default's search resolved, :func:`.report.plan_report`), zigzag on its padded documents
    (:func:`~striped_sp.plan.search.predict_zigzag`); other layouts are left out (no model)."""
    from ..plan.search import predict_ring, predict_zigzag
    from .docs import workload

    import dataclasses as dc

    free = dc.replace(model, causal_factor=0.0)  # the same model with the causal calls' entries free
    out = []
    for r in records:
        if r["pass"] != "fwd+bwd":
            continue
        n, tpr, lay = r["world_size"], r["tokens_per_rank"], r["layout"]
        bounds = tuple(workload("striped", n, tpr, mix, None).mask.bounds)
        if lay == "zigzag":
            pred, rest = predict_zigzag(bounds, n, model), predict_zigzag(bounds, n, free)
        elif "plan_stripe_size" in r:
            args = (bounds, n, r["plan_stripe_size"], r["plan_whole_max"])
            order = r.get("plan_order", "round")
            pred, rest = predict_ring(*args, model, order=order), predict_ring(*args, free, order=order)
        else:
            continue
        kernel = heads * (1 + model.backward_factor) * sum(pred.compute_ms)
        causal = kernel - heads * (1 + model.backward_factor) * sum(rest.compute_ms)
        out.append(Sample(mix, lay, n, tpr, kernel, float(heads * pred.steps), r["critical_path_ms"], causal))
    return out


def _measure(args, mixes) -> list[Sample]:
    """Every mix of ``mixes`` through ``bench sim`` ``args.rounds`` times; per sample the median
    measured time over the rounds (rounds run every mix in turn: interleaved)."""
    import torch

    from ..plan.cost import default_model
    from .sim import SimConfig
    from .sim_masked import simulate_masked

    cfg = SimConfig(layouts=tuple(args.layouts), world_sizes=tuple(args.world_sizes), heads=args.heads,
                    head_dim=args.head_dim, dtype=torch.float32, device=torch.device("cpu"), reps=args.reps,
                    reference=False, progress=not args.no_progress, threads=1)
    model = default_model()
    runs: dict = {}
    for _ in range(args.rounds):
        for mix in mixes:
            for s in samples_from_records(simulate_masked(cfg, list(args.tokens_per_rank), mix, None), mix,
                                          args.heads, model):
                runs.setdefault((s.mix, s.layout, s.world_size, s.tokens_per_rank), []).append(s)
    return [dataclasses.replace(ss[0], measured_ms=statistics.median(s.measured_ms for s in ss))
            for ss in runs.values()]


def _main(args) -> int:
    from ..plan.cost import default_model
    from .report import format_table, write_json

    model = default_model()
    both = list(dict.fromkeys([*args.fit_mixes, *args.test_mixes]))
    measured = _measure(args, both)
    fit = [s for s in measured if s.mix in args.fit_mixes]
    test = [s for s in measured if s.mix in args.test_mixes and s.mix not in args.fit_mixes]
    a, b = fit_scales(fit)
    try:
        terms, why = fit_terms(fit), ""
    except ValueError as e:  # too few samples, or no causal part apart: the two scales only
        terms, why = None, str(e)
    table_b = model.step_ns / 1e6
    rows = []
    for s in fit + test:
        pred, plain = predict(s, a, b), predict(s, 1.0, table_b)
        three = None if terms is None else predict_terms(s, terms)
        rows.append({"set": "fit" if s in fit else "test", "mix": s.mix, "layout": s.layout, "N": s.world_size,
                     "tokens/rank": s.tokens_per_rank, "measured_ms": s.measured_ms, "predicted_ms": pred,
                     "error": pred / s.measured_ms - 1, "causal_term_ms": three,
                     "causal_term_error": None if three is None else three / s.measured_ms - 1, "table_model_ms": plain,
                     "table_model_error": plain / s.measured_ms - 1})
    print(f"fit: bench sim (CPU time of the compute thread, {args.heads} heads x {args.head_dim}, float32, median "
          f"of {args.rounds} interleaved rounds of --reps {args.reps}); cost model {model.label!r}")
    print(f"fitted on {len(fit)} samples: kernel scale a = {a:.4f}, step cost b = {b * 1e3:.1f} us per head "
          f"(the table's model: a = 1, b = {table_b * 1e3:.1f} us)")
    print(f"the causal term not fitted: {why}\n" if terms is None else
          f"with the causal term: full-call scale {terms[0]:.4f}, causal-call scale {terms[1]:.4f}, step cost "
          f"{terms[2] * 1e3:.1f} us per head: causal_factor = {terms[1] / terms[0] * model.causal_factor:.3f} "
          f"(the table's {model.causal_factor:.3f})\n")
    print(format_table(rows, [("set", "set"), ("mix", "mix"), ("layout", "layout"), ("N", "N"),
                              ("tokens/rank", "tokens/rank"), ("predicted_ms", "predicted ms"),
                              ("measured_ms", "measured ms"), ("error", "error"),
                              ("causal_term_error", "causal term error"), ("table_model_error", "table model error")]))
    for name, group in (("fit", fit), ("test", test)):
        if group:
            errs = [abs(e) for e in errors(group, a, b)]
            plain = [abs(e) for e in errors(group, 1.0, table_b)]
            three = [abs(predict_terms(s, terms) / s.measured_ms - 1) for s in group] if terms else []
            causal = (f"; with the causal term median {statistics.median(three):.1%}, max {max(three):.1%}"
                      if three else "")
            print(f"{name} mixes: |error| median {statistics.median(errs):.1%}, max {max(errs):.1%}{causal} (the "
                  f"table's model: median {statistics.median(plain):.1%}, max {max(plain):.1%})")
    if args.json:
        write_json(args.json, rows)
    return 0


def _mixes(text: str) -> list[str]:
    import argparse

    from .cli_args import _docs_spec

    mixes = [m.strip() for m in text.split(";") if m.strip()]
    if not mixes:
        raise argparse.ArgumentTypeError(f"{text!r}: expected mixes separated by ';' "
                                         "(lognormal:median=M,sigma=S | long | fixed:L)")
    return [_docs_spec(m) for m in mixes]


def register(modes) -> None:
    """The ``fit`` mode's parser."""
    from .cli_args import _ints, _layout_names

    p = modes.add_parser("fit", help="the cost model's error on packed mixes it was not fitted on",
                         description=__doc__.split("\n\n")[1])
    p.add_argument("--fit-mixes", type=_mixes, required=True, help="mixes to fit on, separated by ';'")
    p.add_argument("--test-mixes", type=_mixes, required=True, help="mixes to report on, separated by ';'")
    p.add_argument("--layouts", type=_layout_names, default=_layout_names(
        "striped;striped:stripe=1;striped:stripe=doc;zigzag"), help="layouts (striped forms and zigzag)")
    p.add_argument("--world-sizes", type=_ints, default=[4], help="ring sizes N")
    p.add_argument("--tokens-per-rank", type=_ints, default=[2048], help="tokens per rank")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions of each ring (median per rank and round)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over every mix (median per sample)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the table's rows as a JSON list")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=_main)
