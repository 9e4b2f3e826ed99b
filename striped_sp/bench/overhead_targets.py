"""The issue's targets for ``striped-sp bench overhead``: per-layer ops and host time on the CPU path,
no copy and no synchronisation per later layer and at most 2 launches per ring step on the CUDA path,
the per-batch plan time; :func:`targets` says of the records which are met.
"""

from __future__ import annotations

__all__ = ["targets", "CPU_TARGETS", "GPU_OP_TARGETS", "PLAN_TARGET"]

#: (N, tokens): the CPU path's most non-kernel ops and host ms per layer (fwd+bwd, after the first)
CPU_TARGETS = {(8, 131072): (12_000, 30.0), (64, 1048576): (42_000, 150.0)}
#: issue 35's: non-kernel aten ops per later layer on the CUDA path
GPU_OP_TARGETS = {(8, 131072): 1_000, (64, 1048576): 8_000}
PLAN_TARGET = ((64, 1048576), 100.0, ("striped", "striped:stripe=doc", "striped:place=auto"))


def _target(what: str, recs: list[dict], key: str, limit: float) -> str:
    """``what: met`` when every record's ``key`` is within ``limit``, else ``MISSED``, with how many
    configurations meet it and the worst one."""
    worst = max(recs, key=lambda r: r[key])
    ok = sum(r[key] <= limit for r in recs)
    value = f"{worst[key]:.1f}" if isinstance(worst[key], float) else str(worst[key])
    return (f"{what}: {'met' if ok == len(recs) else 'MISSED'} ({ok} of {len(recs)} configurations; most: {value}, "
            f"{worst['layout']} {worst['row']}, {worst['path']} path)")


def targets(recs: list[dict]) -> list[str]:
    """One line per target of the issue that the records cover: met (by every configuration) or
    missed, how many configurations meet it, the worst one."""
    lines = []
    for (n, tokens), (max_ops, max_ms) in CPU_TARGETS.items():
        cpu = [r for r in recs if r["path"] == "cpu" and r["world_size"] == n and r["tokens"] == tokens]
        if cpu:
            lines.append(_target(f"cpu path, {_tok(tokens)}/N={n}: non-kernel ops per layer <= {max_ops}", cpu,
                                 "other_ops", max_ops))
            lines.append(_target(f"cpu path, {_tok(tokens)}/N={n}: host ms per layer <= {max_ms:g}", cpu, "host_ms",
                                 max_ms))
    gpu = [r for r in recs if r["path"].startswith("cuda")]
    if gpu:
        lines.append(_target("cuda path: 0 host-to-device copies per layer after the first", gpu, "h2d_copies", 0))
        lines.append(_target("cuda path: 0 synchronisations per layer after the first", gpu, "syncs", 0))
        lines.append(_target("cuda path: <= 2 attention kernel launches per forward ring step (every row)", gpu,
                             "launches_per_step", 2))
        for (n, tokens), max_ops in GPU_OP_TARGETS.items():
            at = [r for r in gpu if r["world_size"] == n and r["tokens"] == tokens]
            if at:
                lines.append(_target(f"cuda path, {_tok(tokens)}/N={n}: non-kernel ops per layer <= {max_ops}", at,
                                     "other_ops", max_ops))
    (n, tokens), max_ms, layouts = PLAN_TARGET
    plans = [r for r in recs if r["world_size"] == n and r["tokens"] == tokens and r["layout"] in layouts]
    if plans:
        lines.append(_target(f"per-batch plan, {_tok(tokens)}/N={n}, {', '.join(layouts)}: <= {max_ms:g} ms", plans,
                             "plan_ms", max_ms))
    return lines


def _tok(tokens: int) -> str:
    if tokens % (1 << 20) == 0:
        return f"{tokens >> 20}M"
    if tokens % 1024 == 0:
        return f"{tokens >> 10}k"
    return str(tokens)
