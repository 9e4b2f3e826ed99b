"""Mixed local/global models (Gemma / Mistral style): every ``K``-th layer global causal, the
others a sliding window of ``W`` keys.

The data layout is chosen once for the row and shared by every layer, so a layout is judged on
the whole layer mix.  One *model block* is ``K`` layers: ``K - 1`` window layers and one global
layer.  Each layout is timed on one window layer and one global layer (two layer timings, however
many values of ``K`` are asked for), and the block time is combined from them:
``block = (K - 1) * window_layer + global_layer``.

The global layer runs what :func:`striped_sp.ring_attention` runs for it: the dense per-block
plans (:mod:`.sim`) for a plain causal row of one document when the layout has them, else the
masked varlen plans (:mod:`.sim_masked`).
"""

from __future__ import annotations

import dataclasses

from ..plan.layouts import get_layout

__all__ = ["check_global_every", "combine_layers", "simulate_mixed", "MIXED_COLUMNS"]

#: the table columns of a mixed record (key, header)
MIXED_COLUMNS = [("global_every", "K"), ("window_layer_ms", "window layer ms"),
                 ("global_layer_ms", "global layer ms"), ("block_ms", "block ms"),
                 ("window_share", "window share")]


def check_global_every(global_every, window: int | None) -> list[int]:
    """The values of ``K`` (``--global-every``), each an int >= 1 (1: every layer global), given
    with a window ``W > 0``; else ``ValueError`` naming the value and the rule."""
    ks = [global_every] if isinstance(global_every, int) else list(global_every or [])
    if not ks:
        raise ValueError("--global-every: expected at least one K >= 1")
    for k in ks:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"--global-every {k!r}: expected an int K >= 1 (every K-th layer global causal, "
                             "the others windowed)")
    if not window:
        raise ValueError(f"--global-every {','.join(map(str, ks))} needs --window W > 0: the other layers "
                         "of each block use that window")
    return ks


def combine_layers(window_recs: list[dict], global_recs: list[dict], ks: list[int], time_key: str,
                   who: str = "layout") -> list[dict]:
    """Records of model blocks from the per-layer records of the same layouts (matched on ``who``,
    ``world_size``, ``seq_len`` and ``pass`` when present).  Each keeps the window record's fields
    (docs, window, padding, plan, ...), with ``time_key`` set to the block time, and adds
    ``global_every`` (K), ``window_layer_ms``, ``global_layer_ms``, ``block_ms`` (the same as
    ``time_key``), ``window_share`` (the window layers' share of the block time) and the speedups
    ``speedup_vs_contiguous`` / ``speedup_vs_zigzag`` of the block time (``None`` without those
    layouts).  The global record's predicted and measured forward time, when it has them, are kept as
    ``global_predicted_forward_ms`` / ``global_measured_forward_ms`` / ``global_plan_balance``."""
    def key(r):
        return (r[who], r["world_size"], r["seq_len"], r.get("pass"))

    glob = {key(r): r for r in global_recs}
    out = []
    for k in ks:
        block = []
        for w in window_recs:
            g = glob.get(key(w))
            if g is None:
                raise ValueError(f"no global-layer record for {key(w)}")
            tw, tg = w[time_key], g[time_key]
            total = None if tw is None or tg is None else (k - 1) * tw + tg
            rec = {**w, time_key: total, "global_every": k, "window_layer_ms": tw, "global_layer_ms": tg,
                   "block_ms": total, "window_share": None if not total else (k - 1) * tw / total}
            for field in ("predicted_forward_ms", "measured_forward_ms", "plan_balance"):
                if g.get(field) is not None:
                    rec["global_" + field] = g[field]
            rec.pop("efficiency", None)
            rec.pop("measured_forward_ms", None)
            block.append(rec)
        for rec in block:
            for base, field in (("contiguous", "speedup_vs_contiguous"), ("zigzag", "speedup_vs_zigzag")):
                ref = next((b for b in block if b[who] == base and key(b)[1:] == key(rec)[1:]), None)
                ok = ref is not None and ref["block_ms"] and rec["block_ms"]
                rec[field] = ref["block_ms"] / rec["block_ms"] if ok else None
        out += block
    return out


def simulate_mixed(cfg, tokens_per_rank: list[int], docs: str | None, window: int, ks: list[int],
                   seed: int = 0) -> list[dict]:
    """``bench sim --window W --global-every K``: per layout and ``K``, the simulated model block
    (records of :func:`combine_layers` over :func:`.sim_masked.simulate_masked` records; no
    single-device reference).  ``cfg``: a :class:`.sim.SimConfig`."""
    from .sim import simulate
    from .sim_masked import simulate_masked

    ks = check_global_every(ks, window)
    cfg = dataclasses.replace(cfg, reference=False)
    window_recs = simulate_masked(cfg, tokens_per_rank, docs, window, seed)
    # the global layer: dense plans where the engine runs them (one document, a layout that has them)
    # (a window hint's layout: where every row resolves to stripes of 1)
    dense = [lay for lay in cfg.layouts if docs is None and all(
        get_layout(lay).dense_row(n * t, n) for n in cfg.world_sizes for t in tokens_per_rank)]
    masked = [lay for lay in cfg.layouts if lay not in dense]
    global_recs = []
    if masked:
        global_recs += simulate_masked(dataclasses.replace(cfg, layouts=tuple(masked)), tokens_per_rank, docs,
                                       None, seed)
    if dense:
        points = tuple((n, n * t) for n in cfg.world_sizes for t in tokens_per_rank)
        global_recs += simulate(dataclasses.replace(cfg, layouts=tuple(dense), points=points))
    return combine_layers(window_recs, global_recs, ks, "critical_path_ms")
