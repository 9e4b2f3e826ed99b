"""``bench train``: where a step's time goes (``--profile``), and the tables and the plot.

:func:`paper_table` is the paper's shape (one line per row and length, one column per layout or
peer: the training step's speedup over contiguous); :func:`print_report` prints it and the detailed
records; :func:`profiled_step` times one more step under ``torch.profiler`` by kind of op.
"""

from __future__ import annotations

import time

import torch

from .common import sync
from .report import format_table

__all__ = ["profiled_step", "paper_table", "print_report", "plot"]

#: op-name fragments of each kind, for --profile (self CPU/CUDA time of the ops)
_KINDS = (("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "cudnn_attention")),
          # the ring's autograd Function itself: its Python (slicing, merging calls) and its waits on transfers
          ("ring", ("RingAttention",)),
          ("communication", ("c10d::", "gloo", "nccl", "record_param_comms", "all_to_all", "alltoall")),
          ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm", "aten::linear",
                      "aten::matmul")))


def profiled_step(runner, i: int, device) -> dict:
    """Milliseconds of one more step by kind of op (self time; on CUDA the kernels' device time):
    ``attention`` (the kernels), ``ring`` (the ring's autograd Function outside its child ops: its
    host work and its waits for the peer's blocks), ``matmul``, ``communication``, ``other`` (every
    other op: elementwise, norms, copies, the optimizer), ``idle`` (the step's wall time that no op
    covers: waits outside an op, Python)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with torch_profile(activities=acts) as prof:
        t0 = time.perf_counter()
        runner.step(i)
        sync(device)
        wall = time.perf_counter() - t0
    out = {k: 0.0 for k, _ in _KINDS}
    out["other"] = 0.0
    for ev in prof.key_averages():
        self_ms = (ev.self_device_time_total if cuda else ev.self_cpu_time_total) / 1e3
        kind = next((k for k, frags in _KINDS if any(f in ev.key for f in frags)), "other")
        out[kind] += self_ms
    out["total"] = wall * 1e3
    out["idle"] = out["total"] - sum(out[k] for k in (*(k for k, _ in _KINDS), "other"))
    return out


def paper_table(records: list[dict]) -> tuple[list[dict], list[tuple[str, str]]]:
    """The paper's shape: one line per (model, row, length), one column per layout / peer holding
    its speedup over contiguous (the rows and the columns of :func:`.report.format_table`)."""
    impls = list(dict.fromkeys(r["impl"] for r in records))
    lines = {}
    for r in records:
        line = lines.setdefault((r["model"], r["row"], r["seq_len"]),
                                {"model": r["model"], "row": r["row"], "seq_len": r["seq_len"]})
        line[r["impl"]] = r["speedup_vs_contiguous"]
        if r["impl"] == "contiguous":
            line["contiguous_ms"] = r["median_ms"]
    cols = [("model", "model"), ("row", "row"), ("seq_len", "tokens"), ("contiguous_ms", "contiguous ms")]
    return list(lines.values()), cols + [(i, i) for i in impls]


def plot(path: str, records: list[dict]) -> None:
    """PNG of the dense rows' speedup over contiguous against the sequence length, per model."""
    from .report import plot_speedup

    dense = [{**r, "series": f"{r['model']} {r['impl']}"} for r in records
             if r["kind"] == "dense" and not r.get("same_as")]  # a column that ran as another is drawn once
    plot_speedup(path, dense, "series", f"bench train (N={records[0]['world_size']}): training step "
                 "speedup over contiguous (Ring Attention)", theory=False)


def print_report(cfg, recs: list[dict], notes: dict, profile: list[dict], when: str) -> None:
    """The header (model, clock, ``when``: duration and load), the paper's table, the records, the profile."""
    print(f"train: N={cfg.world_size} ranks, torch {torch.__version__}, {cfg.dtype} "
          "(auto: fp32 on CPU, bf16 on CUDA); "
          f"model: {cfg.layers} layers, width {cfg.hidden}, MLP {cfg.ffn_hidden}, {cfg.heads} heads / "
          f"{cfg.kv_heads} kv heads x {cfg.head_dim}, vocab {cfg.vocab}, RoPE; batch {cfg.batch}; AdamW;\n"
          f"median of {cfg.rounds} interleaved rounds after {cfg.warmup} warm-up (a step: forward, backward, "
          f"gradient reduction, optimizer step; the slowest rank); cpu ms: the busiest rank's process CPU time\n"
          f"per step (time descheduled by other jobs does not count, a spinning wait does); {when}\n")
    for (m, _, _, impl), why in notes.items():
        if impl == "-":
            print(f"model {m} {why}\n")
    rows, cols = paper_table(recs)
    print("speedup of the training step over contiguous (Ring Attention), the paper's table:\n")
    print(format_table(rows, cols))
    detail = [{**r, "note": notes.get((r["model"], r["row"], r["seq_len"], r["impl"]), ""),
               "loss_rel_diff": None if r["loss_rel_diff"] is None else f"{r['loss_rel_diff']:.1e}"} for r in recs]
    print()
    print(format_table(detail, [("model", "model"), ("row", "row"), ("seq_len", "tokens"), ("impl", "column"),
                                ("layout", "layout"), ("median_ms", "step ms"), ("tokens_per_s", "tokens/s"),
                                ("speedup_vs_contiguous", "vs contiguous"), ("speedup_vs_zigzag", "vs zigzag"),
                                ("cpu_ms", "cpu ms"), ("cpu_speedup_vs_contiguous", "cpu vs contiguous"),
                                ("peak_mib", "peak MiB/rank"), ("padding_tokens", "padding"),
                                ("loss_rel_diff", "loss rel diff"), ("note", "note")]))
    if profile:
        print("\nwhere a step goes (ms; one more step per column under torch.profiler, which slows small "
              "ops; self time by kind of op,\nring = the ring's autograd Function outside its ops (host work, "
              "waits), other = every other op, idle = the step's time no op covers):\n")
        print(format_table(profile, [("model", "model"), ("row", "row"), ("seq_len", "tokens"), ("impl", "column"),
                                     ("rank", "rank"), ("total", "step"), ("attention", "attention"),
                                     ("ring", "ring host+wait"), ("matmul", "matmul"), ("communication", "comm"),
                                     ("other", "other ops"), ("idle", "idle")]))
