"""``python -m striped_sp.bench.state_split --fit A.json B.json``: refit the mixer forms' cost model
(:mod:`striped_sp.plan.mixer_cost`) from ``state_split --json`` records, and its error on the rows it
was not fitted on.

Per kind and form, ``ms = a * h T + b * h T**2`` (:func:`~striped_sp.plan.mixer_cost.features`) by
least squares on the relative error (each row divided by its measured ms), both coefficients >= 0 (a
negative one drops its feature).  ``--fit-lens`` picks the fitted rows by tokens per row; every other
row (and with ``--fit-world-sizes``, every row of another N) is a test row: its measured and predicted ms, the error, and whether the model's choice is the
measured fastest form's (or within 5 % of it)."""

from __future__ import annotations

import json

from ..plan.mixer_cost import FORMS, choose, features, predict_ms

__all__ = ["KIND_NAMES", "load", "fit", "test_rows", "fitted_source"]

#: the bench's kinds -> the forms' ``kind``
KIND_NAMES = {"gated_delta": "gated delta net", "mamba2": "Mamba2", "short_conv": "short convolution"}


def load(paths) -> list[dict]:
    """The records of every ``state_split --json`` file in ``paths``, in order."""
    records = []
    for path in paths:
        with open(path) as f:
            records += json.load(f)
    return records


def _measured(rec: dict, form: str) -> float | None:
    ms = rec.get(f"{form}_cpu_ms")
    return ms if ms else None


def _solve(rows) -> tuple[float, float]:
    """Least squares of ``1 = a x1/y + b x2/y`` over ``rows`` ``(x1, x2, y)``, both >= 0."""
    def one(i):  # one feature alone
        num = sum(r[i] / r[2] for r in rows)
        den = sum((r[i] / r[2]) ** 2 for r in rows)
        c = num / den
        return c, sum((1 - c * r[i] / r[2]) ** 2 for r in rows)

    s11 = sum((r[0] / r[2]) ** 2 for r in rows)
    s22 = sum((r[1] / r[2]) ** 2 for r in rows)
    s12 = sum(r[0] * r[1] / r[2] ** 2 for r in rows)
    t1, t2 = sum(r[0] / r[2] for r in rows), sum(r[1] / r[2] for r in rows)
    det = s11 * s22 - s12 * s12
    if det > 0:
        a, b = (t1 * s22 - t2 * s12) / det, (t2 * s11 - t1 * s12) / det
        if a >= 0 and b >= 0:
            return a, b
    (a, ea), (b, eb) = one(0), one(1)
    return (a, 0.0) if ea <= eb else (0.0, b)


def _fitted_on(rec: dict, lengths, sizes) -> bool:
    return rec["S"] in lengths and (not sizes or rec["N"] in sizes)


def fit(records, lengths, sizes=None) -> dict:
    """``{kind: {form: (a, b)}}`` from the records whose ``S`` is in ``lengths`` (and ``N`` in ``sizes``)."""
    fitted: dict = {}
    for bench_kind, kind in KIND_NAMES.items():
        for form in FORMS:
            rows = [(*features(form, r["N"], r["S"]), _measured(r, form)) for r in records
                    if r["kind"] == bench_kind and _fitted_on(r, lengths, sizes) and _measured(r, form)]
            if rows:
                fitted.setdefault(kind, {})[form] = _solve(rows)
    return fitted


def test_rows(records, lengths, fitted: dict, sizes=None) -> list[dict]:
    """One row per record and form not fitted on: measured and predicted ms, the relative error, and the
    choice: the model's, the measured fastest, and the measured cost of the model's over the fastest."""
    out = []
    for r in records:
        kind = KIND_NAMES[r["kind"]]
        if _fitted_on(r, lengths, sizes) or kind not in fitted:
            continue
        measured = {f: _measured(r, f) for f in FORMS if _measured(r, f)}
        form, _ = choose(kind, r["N"], r["S"], "split" in measured, "state" in measured, fitted)
        best = min(measured, key=measured.get)
        for f, ms in measured.items():
            pred = predict_ms(kind, f, r["N"], r["S"], fitted)
            out.append({"kind": kind, "N": r["N"], "S": r["S"], "form": f, "measured_ms": ms,
                        "predicted_ms": pred, "error": pred / ms - 1, "chosen": form, "fastest": best,
                        "chosen_over_fastest": measured.get(form, float("nan")) / measured[best]})
    return out


def fitted_source(fitted: dict) -> str:
    """``fitted`` as the literal for :data:`striped_sp.plan.mixer_cost.FITTED`."""
    lines = ["FITTED: dict[str, dict[str, tuple[float, float]]] = {"]
    for kind, forms in fitted.items():
        body = ", ".join(f'"{f}": ({a:.4g}, {b:.4g})' for f, (a, b) in forms.items())
        lines.append(f'    "{kind}": {{{body}}},')
    return "\n".join(lines + ["}"])


def main(paths, lengths, sizes=None) -> int:
    from .report import format_table

    records = load(paths)
    fitted = fit(records, lengths, sizes)
    print(fitted_source(fitted))
    rows = test_rows(records, lengths, fitted, sizes)
    if rows:
        print(f"\nrows not fitted on (fitted: S in {sorted(lengths)}, N in {sorted(sizes) if sizes else 'any'}):\n")
        print(format_table(rows, [(k, k) for k in rows[0]]))
        errs = [abs(r["error"]) for r in rows]
        print(f"\n|error|: median {sorted(errs)[len(errs) // 2]:.2f}, max {max(errs):.2f}; the model's choice "
              f"costs at most {max(r['chosen_over_fastest'] for r in rows):.2f}x the measured fastest")
    return 0
