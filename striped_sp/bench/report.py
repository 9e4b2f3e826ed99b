"""Plain tables on stdout, JSON files and PNG plots of the benchmark records."""

from __future__ import annotations

import json
import math
from typing import Sequence

__all__ = ["format_table", "write_json", "check_plotting", "plot_speedup", "plot_balance", "plot_masked_sim",
           "plan_report", "plan_lines"]


def plan_report(layout: str, bounds, world_size: int, windowed: bool, heads: int) -> dict:
    """For a striped layout (the default's per-batch search included), the fields every bench mode
    adds to its records: ``plan`` (the placement chosen, :func:`striped_sp.plan.search.describe`, in
    words; ``plan_stripe_size``, ``plan_whole_max`` and ``plan_whole_documents`` as data),
    ``plan_balance`` (the plan's critical path over ideal in score entries, counted as ``bench
    balance`` counts its table; ``None`` for a windowed row, whose window the count leaves out),
    ``predicted_forward_ms`` (the cost model this process places rows by, ``plan_cost_model``:
    ``"cpu"`` without CUDA; forward critical path of all ``heads``;
    ``None`` for a windowed row, since the model knows documents, not windows) and ``predicted_ms``
    (forward+backward, the ring included: what ``stripe_size="auto"`` ranks plans by).  ``{}`` for a
    layout without stripes (contiguous, zigzag)."""
    from ..plan.layouts import get_layout
    from ..plan.search import describe

    lay = get_layout(layout)
    if getattr(lay, "stripe_size", None) is None:  # no stripes, no placement: no plan to describe
        return {}
    stripe, place = lay.stripe_size, lay.doc_placement
    if getattr(lay, "auto", False):  # what the row runs: one document's stripes, a window hint's, or the search
        stripe, place = lay.row_plan(int(bounds[-1]), world_size, tuple(bounds))
    d = describe(tuple(bounds), world_size, stripe, place)
    chosen = f"; stripe_size {d['stripe_size']}, {d['steps']} ring steps" if stripe == "auto" else ""
    if stripe != lay.stripe_size:
        words = "zigzag's order (2N stripes mirrored)" if stripe == "doc" else f"stripes of {stripe}"
        chosen = (f"; {'one document' if len(bounds) <= 2 else 'packed'}: {words}"
                  + (" (the window hint)" if lay.window is not None else ""))
    return {"plan": f"whole documents <= {d['whole_max']} tokens: {d['whole_documents']} of {d['documents']}{chosen}",
            "plan_stripe_size": d["stripe_size"], "plan_whole_max": d["whole_max"], "plan_order": d["order"],
            "plan_whole_documents": d["whole_documents"], "plan_cost_model": d["cost_model"],
            "plan_balance": None if windowed else d["balance"],
            "predicted_forward_ms": None if windowed else d["predicted_forward_ms"] * heads,
            "predicted_ms": None if windowed else d["predicted_ms"] * heads}


def plan_lines(recs: Sequence[dict], measured_key: str | None, measured_what: str) -> list[str]:
    """One line per record with a ``plan`` (see :func:`plan_report`): the plan, the predicted forward
    time and the measured ``recs[measured_key]`` (``measured_what`` names it: "forward", "fwd+bwd")."""
    lines = []
    for r in recs:
        if "plan" not in r:
            continue
        pred = r.get("predicted_forward_ms")
        pred = ("not predicted (the cost model knows no windows)" if pred is None
                else f"predicted {pred:.1f} ms, fwd+bwd {r.get('predicted_ms') or 0:.1f} ms (cost model "
                     f"{r.get('plan_cost_model', 'cpu')!r}"
                     + ("" if r.get("plan_balance") is None else f", balance {r['plan_balance']:.4f}") + ")")
        who = r.get("layout", r.get("impl"))
        meas = "" if measured_key is None or r.get(measured_key) is None else \
            f"; measured {measured_what} {r[measured_key]:.1f} ms"
        lines.append(f"plan {who} N={r['world_size']}: {r['plan']}; forward {pred}{meas}")
    return lines


def check_plotting() -> None:
    """``ImportError`` naming the extra to install when matplotlib is missing; the CLI calls it for
    ``--plot`` before any work starts."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError("--plot needs matplotlib: pip install 'striped_sp[bench]' "
                          f"(or matplotlib itself), or leave out --plot ({err})") from None


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """``columns``: (key, header) pairs; values formatted plainly, right-aligned."""
    cells = [[_cell(r.get(k)) for k, _ in columns] for r in rows]
    heads = [h for _, h in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)]
    left = {0}  # first column left-aligned

    def line(vals):
        return "  ".join(v.ljust(w) if i in left else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))

    out = [line(heads), "  ".join("-" * w for w in widths)]
    out += [line(c) for c in cells]
    return "\n".join(out)


def write_json(path: str, records: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


def plot_speedup(path: str, records: list[dict], series_key: str, title: str, pass_name: str | None = None,
                 theory: bool = True) -> None:
    """PNG of ``speedup_vs_contiguous`` against ``seq_len``: one line per (series, world_size), and
    with ``theory`` a dotted line at the work model's balanced-layout speedup ``(2N-1)/N``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if (pass_name is None or r.get("pass") == pass_name)
            and r.get("speedup_vs_contiguous") is not None]
    sizes = sorted({r["world_size"] for r in recs})
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=90)
    for i, n in enumerate(sizes):
        for name in sorted({r[series_key] for r in recs if r["world_size"] == n}):
            pts = sorted((r["seq_len"], r["speedup_vs_contiguous"]) for r in recs
                         if r["world_size"] == n and r[series_key] == name)
            label = f"{name} (N={n})" if len(sizes) > 1 else name
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[i % len(styles)], marker="o", label=label)
    if theory:
        for n in sizes:
            ax.axhline((2 * n - 1) / n, color="black", linestyle=":", linewidth=0.8)
            ax.annotate(f"work model, N={n}: {(2 * n - 1) / n:.3f}", xy=(0.01, (2 * n - 1) / n), fontsize=7,
                        xycoords=("axes fraction", "data"), va="bottom")
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, max(hi, max((2 * n - 1) / n for n in sizes) + 0.08)) if sizes else None
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("speedup over contiguous")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_balance(path: str, recs: list[dict], masked: bool = False) -> None:
    """``bench balance``: critical path over ideal against N, per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=90)
    style = {"striped": ("--", "x"), "zigzag": ("-", "o"), "contiguous": ("-", "s")}
    for lay in sorted({r["layout"] for r in recs}):
        pts = sorted((r["world_size"], r["critical_path_over_ideal"]) for r in recs if r["layout"] == lay)
        ls, mk = style.get(lay, ("-", "o"))
        label = "striped (default: per-batch search)" if masked and lay == "striped" else lay
        ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=ls, marker=mk, label=label)
    ns = sorted({r["world_size"] for r in recs})
    if masked:
        r0 = recs[0]
        ax.set_title(f"work model: critical path / ideal, docs {r0['docs'] or 'one per row'}, "
                     f"window {r0['window'] or 'none'}", fontsize=9)
    else:
        ax.plot(ns, [(2 * n - 1) / n for n in ns], ":", color="black", linewidth=0.8, label="(2N-1)/N")
        ax.set_title("work model: critical path over ideal (striped and zigzag overlap at 1.00)", fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ring size N")
    ax.set_ylabel("critical path / ideal")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_masked_sim(path: str, recs: list[dict], pass_name: str) -> None:
    """``bench sim --docs/--window``: speedup over contiguous per layout and N, as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in recs if r["pass"] == pass_name]
    labels = [f"{r['layout']}\nN={r['world_size']}, {r['tokens_per_rank']}/rank"
              + (f"\nK={r['global_every']}" if "global_every" in r else "") for r in rows]
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(rows)), 3.6), dpi=90)
    ax.bar(range(len(rows)), [r["speedup_vs_contiguous"] or 0 for r in rows],
           color=[{"striped": "C0", "zigzag": "C1", "contiguous": "C2"}.get(r["layout"], "C3") for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_ylabel("speedup over contiguous")
    r0 = rows[0]
    mixed = ", blocks of K layers, 1 global" if "global_every" in r0 else ""
    ax.set_title(f"sim ({pass_name}): docs {r0['docs'] or 'one per row'}, window {r0['window'] or 'none'}{mixed}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
