"""Which form a hybrid's recurrent mixer runs in over ``N`` ranks: the head all-to-all (``split``),
state passing (``state``) or the gather (``gathered``), by a cost model fitted to ``bench state_split``.

Per mixer kind and form, the busiest rank's forward + backward time of one layer is modelled from
what the rank scans: ``T`` tokens of a share ``h`` of the heads (``split``: all ``S`` tokens of
``1/N`` of the heads; ``state``: its ``S/N`` tokens of every head; ``gathered``: all of both) as

    ms = a * h * T + b * h * T**2

(``a``: the per-token work, the re-layout's or all-to-all's bytes with it; ``b``: a kernel whose cost
per token grows with the row, as the PyTorch fallback's chunk loop does).  :data:`FITTED` holds ``(a,
b)`` per kind and form, fitted (least squares on the relative error, both coefficients kept >= 0) by
``python -m striped_sp.bench.state_split --fit FILE.json ...``, which prints the dict to put here.

The choice is a pure function of shapes (kind, ``N``, tokens per row, which forms can run), so every
rank of the group makes the same one without a message.  The gather competes only where the split
could run: past the heads (heads that do not divide by ``N``, more ranks than heads) state passing
runs, never the gather.  A kind without fitted figures keeps the rule: split where it can, else state
passing, else the gather.
"""

from __future__ import annotations

__all__ = ["FITTED", "FORMS", "features", "predict_ms", "choose", "switches"]

#: the forms, in the order a tie goes
FORMS = ("split", "state", "gathered")

#: ``kind -> form -> (a, b)``: ms per token and per token squared of one layer (width 256, fp32,
#: fwd + bwd, one thread per rank, gloo), refitted by ``bench state_split --fit``; fitted on the
#: N = 2, 4 and S = 4096, 16384 rows of docs/results.md's state-passing tables (2-core CPU)
FITTED: dict[str, dict[str, tuple[float, float]]] = {
    "gated delta net": {"split": (0.1755, 3.682e-05), "state": (0.319, 3.041e-05), "gathered": (0.1497, 4.212e-05)},
    "Mamba2": {"split": (0.318, 3.926e-06), "state": (0.3435, 5.092e-06), "gathered": (0.2277, 2.034e-05)},
    "short convolution": {"split": (0.05411, 0), "state": (0.06686, 0), "gathered": (0.0537, 7.378e-07)},
}


def features(form: str, n: int, seq_len: int) -> tuple[float, float]:
    """``(h T, h T**2)`` of ``form`` over ``n`` ranks on a row of ``seq_len`` tokens."""
    if form == "split":
        tokens, share = seq_len, 1.0 / n
    elif form == "state":
        tokens, share = seq_len / n, 1.0
    elif form == "gathered":
        tokens, share = seq_len, 1.0
    else:
        raise ValueError(f"mixer form {form!r}: expected one of {', '.join(FORMS)}")
    return share * tokens, share * tokens * tokens


def predict_ms(kind: str, form: str, n: int, seq_len: int, fitted: dict | None = None) -> float | None:
    """The model's ms for one layer, or ``None`` where ``kind`` / ``form`` has no fitted figures."""
    coef = (FITTED if fitted is None else fitted).get(kind, {}).get(form)
    if coef is None:
        return None
    x1, x2 = features(form, n, seq_len)
    return coef[0] * x1 + coef[1] * x2


def choose(kind: str, n: int, seq_len: int, can_split: bool, can_pass: bool,
           fitted: dict | None = None) -> tuple[str, dict]:
    """``(form, predicted)``: the form to run and the model's ms of every candidate (``{}`` where the
    kind has no figures: then the rule, split, else state, else gathered)."""
    candidates = [f for f, ok in (("split", can_split), ("state", can_pass), ("gathered", can_split or not can_pass))
                  if ok]
    predicted = {f: predict_ms(kind, f, n, seq_len, fitted) for f in candidates}
    if len(candidates) == 1 or any(ms is None for ms in predicted.values()):
        return candidates[0], {}
    return min(candidates, key=lambda f: (predicted[f], FORMS.index(f))), predicted


def switches(kind: str, n: int, can_split: bool, can_pass: bool, lengths=None,
             fitted: dict | None = None) -> list[tuple[int, str, dict]]:
    """Where the choice changes along row lengths (powers of 2 from 1024 to 2**20 tokens, or
    ``lengths``): ``[(first length, form, predicted at it), ...]``, the first entry at the first length."""
    lengths = lengths or [2 ** p for p in range(10, 21)]
    runs = []
    for seq_len in lengths:
        form, predicted = choose(kind, n, seq_len, can_split, can_pass, fitted)
        if not runs or runs[-1][1] != form:
            runs.append((seq_len, form, predicted))
    return runs
