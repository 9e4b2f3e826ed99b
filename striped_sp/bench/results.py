"""``make results``: regenerate the tables of docs/results.md and the plots of docs/ in one command.

    python -m striped_sp.bench.results                       # every section below but ``run`` (~6 min on 2 CPU cores)
    python -m striped_sp.bench.results --only balance,memory # some sections
    python -m striped_sp.bench.results --only run            # wall-clock timings: one idle core per rank

Each section runs ``striped-sp bench ...`` command lines (the ones it prints into the page, so a
reader can rerun any figure alone), reads their JSON records and rewrites its region of
``results.md`` (between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``) with the
tables, the figures, the commands, the machine and the date.  Text outside the regions is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import re
import shlex
import sys
import tempfile
from pathlib import Path

__all__ = ["SECTIONS", "DEFAULT_SECTIONS", "main"]

WEB = "lognormal:median=1024,sigma=1.2"


class _Context:
    def __init__(self, out: Path, tmp: Path):
        self.out, self.tmp = out, tmp
        self.commands: list[str] = []

    def bench(self, args: list[str], plot: str | None = None, quiet_flag: bool = True) -> list[dict]:
        """Run ``striped-sp ARGS`` (with ``--plot`` into the output folder), record its command line
        as shown in the docs, and return its JSON records."""
        from ..cli import main as cli_main

        shown = ["striped-sp", *args] + (["--plot", f"docs/{plot}"] if plot else [])
        self.commands.append(" ".join(shlex.quote(a) for a in shown))
        path = self.tmp / f"{len(self.commands)}.json"
        argv = [*args, "--json", str(path)] + (["--plot", str(self.out / plot)] if plot else [])
        if quiet_flag:
            argv.append("--no-progress")
        print(f"$ {self.commands[-1]}", flush=True)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli_main(argv)
        print(buf.getvalue(), flush=True)
        if rc:
            raise SystemExit(f"{self.commands[-1]} failed ({rc})")
        return json.loads(path.read_text())

    def block(self, *extra: str) -> str:
        """The commands run since the last block (and ``extra`` lines), as a bash block."""
        lines = [*self.commands, *extra]
        self.commands = []
        return "```bash\n" + "\n".join(lines) + "\n```\n"


def machine() -> str:
    """One line: the processor (or GPU), cores, torch, Python."""
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f"{torch.cuda.get_device_name(0)}, " if torch.cuda.is_available() else ""
    return (f"{gpu}{cpu or 'CPU'} ({os.cpu_count()} cores), torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------- sections

def balance(ctx: _Context) -> str:
    """The work model on one causal sequence: critical path over ideal per N; the per-(rank, step)
    picture at N = 8."""
    recs = ctx.bench(["bench", "balance"], plot="bench_balance.png")
    sizes = sorted({r["world_size"] for r in recs})
    value = {(r["layout"], r["world_size"]): r["critical_path_over_ideal"] for r in recs}
    rows = [[f"`{lay}`", *(_fmt(value[lay, n], 4) for n in sizes)] for lay in ("striped", "zigzag", "contiguous")]
    plot_steps(ctx.out / "balance_steps.png", 8, 4096)
    return ("Critical path over ideal work (1.0 = perfectly balanced), one causal sequence of 4096 tokens "
            "per rank: the sum over ring steps of the busiest rank's attention score entries, over "
            "`S(S+1)/2 / N`. Contiguous tends to `(2N-1)/N`.\n\n"
            + _table(["layout", *(f"N={n}" for n in sizes)], rows)
            + "\n![work per rank and ring step, N = 8](balance_steps.png)\n\n"
            "![critical path over ideal against N](bench_balance.png)\n\n"
            + ctx.block("python -m striped_sp.bench.results --only balance   # also docs/balance_steps.png"))


def plot_steps(path: Path, world_size: int, local_len: int) -> None:
    """Score entries per rank (x) and ring step (y), as a share of a full block, for contiguous,
    zigzag and striped; each panel names its critical path over ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .work import critical_path_over_ideal, step_entries

    layouts = ("contiguous", "zigzag", "striped")
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.8), dpi=90, sharey=True)
    for ax, lay in zip(axes, layouts):
        e = step_entries(lay, world_size, local_len)
        share = [[x / local_len ** 2 for x in row] for row in e]
        im = ax.imshow(share, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="upper")
        crit = critical_path_over_ideal(lay, world_size, local_len)
        ax.set_title(f"{lay}\ncritical path {crit:.3f} x ideal", fontsize=9)
        ax.set_xlabel("rank")
        ax.set_xticks(range(world_size))
    axes[0].set_ylabel("ring step")
    axes[0].set_yticks(range(world_size))
    fig.colorbar(im, ax=list(axes), shrink=0.85, label="work (share of a full block)")
    fig.suptitle(f"causal attention work per rank and ring step, N = {world_size} "
                 "(a step lasts as long as its busiest rank)", fontsize=10, y=1.02)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


#: the layouts of the packed-balance table: the default (its per-batch search) and the paper's stripes of 1
PACKED_LAYOUTS = ("striped", "striped:stripe=1", "zigzag", "contiguous")


def _plan_words(r: dict) -> str:
    """The plan a ``bench`` record's striped layout ran, in words."""
    stripe = {"doc": "per-document stripes", 1: "stripes of 1"}.get(r["plan_stripe_size"],
                                                                    f"stripes of {r['plan_stripe_size']}")
    whole = r["plan_whole_documents"]
    if whole == r["documents"]:
        return "every document whole on one rank"
    return stripe + (f", documents <= {r['plan_whole_max']} tokens whole ({whole} of {r['documents']})" if whole else "")


def packed_balance(ctx: _Context) -> str:
    """The work model on packed rows and windows (zigzag pads every document to a multiple of 2N):
    the default ``striped`` (each packed row placed by its cost model's search) beside stripes of 1."""
    lays = list(PACKED_LAYOUTS)
    base = ["bench", "balance", "--world-sizes", "8,32", "--tokens-per-rank", "8192", "--layouts", ";".join(lays)]
    mixes = [
        ("web mix (lognormal, median 1024, sigma 1.2)", ctx.bench(base + ["--docs", WEB], plot="bench_packed_balance.png")),
        ("one document, window 4096", ctx.bench(base + ["--window", "4096"])),
        ("web mix + window 4096", ctx.bench(base + ["--docs", WEB, "--window", "4096"],
                                            plot="bench_packed_window_balance.png")),
    ]
    more = ctx.bench(["bench", "balance", "--world-sizes", "16,64", "--tokens-per-rank", "8192", "--docs", WEB,
                      "--layouts", "striped;striped:stripe=1"])
    doc = ctx.bench(["bench", "balance", "--world-sizes", "8", "--tokens-per-rank", "8192", "--docs", WEB,
                     "--layouts", "striped:stripe=doc"])[0]
    short = ctx.bench(["bench", "balance", "--world-sizes", "32", "--tokens-per-rank", "32", "--docs", "fixed:32",
                       "--layouts", "striped;striped:stripe=1;striped:place=auto;zigzag;contiguous"])
    rows = []
    for name, recs in mixes:
        for n in sorted({r["world_size"] for r in recs}):
            by = {r["layout"]: r for r in recs if r["world_size"] == n}
            rows.append([name, n, *(_fmt(by[lay]["critical_path_over_ideal"], 4) for lay in lays),
                         by["zigzag"]["padding_tokens"]])
    web = [r for r in mixes[0][1] + more if r["layout"] in ("striped", "striped:stripe=1")]
    plans = []
    for n in sorted({r["world_size"] for r in web}):
        by = {r["layout"]: r for r in web if r["world_size"] == n}
        d, one = by["striped"], by["striped:stripe=1"]
        plans.append([n, _plan_words(d), _fmt(d["critical_path_over_ideal"], 4), _fmt(one["critical_path_over_ideal"], 4),
                      f"{d['predicted_ms']:.0f} / {one['predicted_ms']:.0f}"])
    model = web[0]["plan_cost_model"]
    by = {r["layout"]: r for r in short}
    tail = (f"\nPer-document stripes (`striped:stripe=doc`) on the web mix at N = 8: "
            f"{doc['critical_path_over_ideal']:.4f}, no padding. 32 documents of 32 tokens at N = 32 (`fixed:32`): "
            f"the default `striped` {by['striped']['critical_path_over_ideal']:.4f} "
            f"({_plan_words(by['striped'])}), `striped:stripe=1` {by['striped:stripe=1']['critical_path_over_ideal']:.4f}"
            f" (every document starts on rank 0), `striped:place=auto` "
            f"{by['striped:place=auto']['critical_path_over_ideal']:.4f}, zigzag "
            f"{by['zigzag']['critical_path_over_ideal']:.4f} (pads {by['zigzag']['padding_tokens']:,} tokens), contiguous "
            f"{by['contiguous']['critical_path_over_ideal']:.4f}.\n\n")
    return ("Critical path over ideal (ideal: the visible score entries of the unpadded row over N), "
            "8192 tokens per rank. `striped` is the default: on each packed row the plan its cost model predicts "
            f"fastest (here the model {model!r}, the one a process without CUDA places rows by), so its figures "
            "follow that model; `striped:stripe=1` is the paper's layout on every row, whose figures depend on "
            "nothing but the row. Under a window the default plans as for global layers (the model knows no "
            "windows; the window hint `striped:window=W` is another layout).\n\n"
            + _table(["row", "N", *(f"`{lay}`" + (" (default, per-batch search)" if lay == "striped" else "")
                                    for lay in lays), "zigzag padding (tokens)"], rows)
            + "\nWhat the default chose on the web mix, against stripes of 1: the model prices larger pieces "
              "cheaper per score entry and charges the rows the ring carries, so it keeps short documents whole "
              "(no pieces, no transfer) and gives up compute balance for it; its predicted forward+backward time "
              "per head is the lower one. These are the model's predictions, not measurements: the default timed against "
              "stripes of 1 and zigzag at N = 4 and 8 is in [the next section]"
              "(#the-default-against-stripes-of-1-and-zigzag-timed).\n\n"
            + _table(["N", "the default's plan", "default balance", "`striped:stripe=1` balance",
                      f"predicted fwd+bwd ms per head, default / stripes of 1 (model {model!r})"], plans)
            + tail
            + "![balance, web mix](bench_packed_balance.png) "
              "![balance, web mix and window 4096](bench_packed_window_balance.png)\n\n" + ctx.block())


def sim(ctx: _Context) -> str:
    """Speed against sequence length: N = 8 ranks simulated on one device with the real kernels."""
    recs = ctx.bench(["bench", "sim", "--world-sizes", "8", "--tokens-per-rank", "512,1024,2048", "--reps", "3",
                      "--no-reference"], plot="bench_sim_cpu.png")
    recs = [r for r in recs if r["pass"] == "fwd+bwd"]
    rows = []
    for s in sorted({r["seq_len"] for r in recs}):
        by = {r["layout"]: r for r in recs if r["seq_len"] == s}
        rows.append([s // 8, s, *(_fmt(by[lay]["critical_path_ms"], 0) for lay in ("striped", "zigzag", "contiguous")),
                     f"{by['striped']['speedup_vs_contiguous']:.2f}x", f"{by['zigzag']['speedup_vs_contiguous']:.2f}x",
                     f"{by['striped']['critical_path_ms'] / by['zigzag']['critical_path_ms']:.2f}"])
    return ("Forward + backward critical path (the sum over ring steps of the slowest rank's time in the engine's "
            "executor: kernel calls, merges, gradient accumulation), N = 8, 4 heads x 64, float32, batch 1. On a "
            "CPU the clock is the CPU time of the one compute thread. The work model predicts 1.875x for a "
            "balanced layout over contiguous.\n\n"
            + _table(["tokens/rank", "sequence", "striped ms", "zigzag ms", "contiguous ms", "striped vs contiguous",
                      "zigzag vs contiguous", "striped / zigzag time"], rows)
            + "\n![speedup over contiguous against sequence length](bench_sim_cpu.png)\n\n" + ctx.block())


def packed_sim(ctx: _Context) -> str:
    """Packed rows and windows, N = 8 simulated, every (rank, step) timed."""
    base = ["bench", "sim", "--world-sizes", "8", "--tokens-per-rank", "2048", "--reps", "3", "--no-reference"]
    runs = [
        ("web mix", ctx.bench(base + ["--docs", WEB, "--layouts",
                                      "striped:stripe=1;striped:stripe=doc;striped:stripe=512;zigzag;contiguous"])),
        ("one document, window 1024", ctx.bench(base + ["--window", "1024", "--layouts",
                                                        "striped;striped:stripe=128;striped:stripe=512;zigzag;contiguous"])),
        ("web mix + window 1024", ctx.bench(base + ["--docs", WEB, "--window", "1024", "--layouts",
                                                    "striped:stripe=1;striped:stripe=doc;striped:stripe=128;zigzag;contiguous"])),
    ]
    rows = []
    plot_packed(ctx.out / "bench_packed_sim.png", [(name, [r for r in recs if r["pass"] == "fwd+bwd"])
                                                     for name, recs in runs])
    for name, recs in runs:
        recs = [r for r in recs if r["pass"] == "fwd+bwd"]
        best = min(recs, key=lambda r: r["critical_path_ms"])
        for r in recs:
            ms = f"{r['critical_path_ms']:.0f}"
            rows.append([name, f"`{r['layout']}`", f"**{ms}**" if r is best else ms,
                         f"{r['speedup_vs_zigzag']:.2f}x" if r.get("speedup_vs_zigzag") else "-",
                         f"{r['speedup_vs_contiguous']:.2f}x", r.get("padding_tokens", 0)])
    return ("Forward + backward critical path, N = 8, 2048 tokens per rank (a row of 16,384 tokens), 4 heads x 64, "
            "float32; every (rank, step) of the engine's executor timed (CPU time of the compute thread); fastest "
            "per row in bold. Timings of blocks this small vary from run to run (the ratios of two runs of these "
            "commands have differed by up to a third): compare the order of the layouts, and rerun on your own "
            "machine before relying on a figure.\n\n"
            + _table(["row", "layout", "fwd+bwd ms", "vs zigzag", "vs contiguous", "padding"], rows)
            + "\n![speed over zigzag on packed rows and windows](bench_packed_sim.png)\n\n"
            + ctx.block("python -m striped_sp.bench.results --only packed-sim   # docs/bench_packed_sim.png"))


def plot_packed(path: Path, runs: list) -> None:
    """Horizontal bars: each layout's fwd+bwd speed over zigzag, one group per row kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, colors = [], [], []
    palette = {"striped": "C0", "zigzag": "C1", "contiguous": "C2"}
    for name, recs in runs:
        zig = next(r["critical_path_ms"] for r in recs if r["layout"] == "zigzag")
        for r in recs:
            labels.append(f"{name}: {r['layout']}")
            values.append(zig / r["critical_path_ms"])
            colors.append(palette.get(r["layout"], "C3"))
    fig, ax = plt.subplots(figsize=(7, 0.32 * len(labels) + 1.0), dpi=90)
    ax.barh(range(len(labels)), values, color=colors)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("fwd+bwd speed over zigzag (higher is faster)")
    ax.set_title("N = 8 simulated, 2048 tokens per rank; red: striped with stripes", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def memory(ctx: _Context) -> str:
    """Peak memory per rank of one forward + backward, against one process on the whole sequence."""
    runs = []
    for n in (2, 4):
        runs.append((n, ctx.bench(["bench", "run", "--world-size", str(n), "--seq-lens", "8192", "--heads", "8",
                                   "--warmup", "0", "--iters", "1", "--peers", "torch_ring,ulysses",
                                   "--layouts", "striped"])))
    rows, points = [], {}
    for n, recs in runs:
        by = {r["impl"]: r.get("peak_mib") for r in recs}
        one = by.get("sdpa_1proc")
        rows.append([n, 8192 // n, *(_fmt(by.get(k), 1) for k in ("striped", "torch_ring", "ulysses", "sdpa_1proc")),
                     _fmt(by["striped"] / one if one else None, 2)])
        points[n] = by
    plot_memory(ctx.out / "bench_memory.png", points)
    block = ctx.block("python -m striped_sp.bench.results --only memory   # docs/bench_memory.png")
    return ("Peak memory per rank of one forward + backward (the local q, k, v, output gradient and everything "
            "the pass allocates, gradients included; the allocator's own events), 8,192 tokens in all, 8 heads x 64, "
            "float32. `sdpa_1proc`: one process running PyTorch's fused causal attention on the whole sequence. "
            "`torch_ring` is PyTorch's ring context parallel, `ulysses` DeepSpeed's all-to-all.\n\n"
            + _table(["N", "tokens/rank", "striped MiB", "torch_ring MiB", "ulysses MiB", "one process MiB",
                      "striped / one process"], rows)
            + "\n![peak memory per rank](bench_memory.png)\n\n"
            + block)


def plot_memory(path: Path, points: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = [k for k in ("striped", "torch_ring", "ulysses") if any(p.get(k) for p in points.values())]
    sizes = sorted(points)
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=90)
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(sizes))]
        ax.bar(xs, [points[n].get(impl) or 0 for n in sizes], width, label=impl)
    one = [p.get("sdpa_1proc") for p in points.values() if p.get("sdpa_1proc")]
    if one:
        ax.axhline(one[0], color="black", linestyle=":", linewidth=1, label="one process, whole sequence")
    ax.set_xticks(range(len(sizes)), [f"N = {n}" for n in sizes])
    ax.set_ylabel("peak MiB per rank")
    ax.set_title("one forward + backward, 8192 tokens in all, 8 heads x 64, fp32", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def hier(ctx: _Context) -> str:
    """The hierarchical-CP model: the best Ulysses x ring split per N (a prediction, nothing runs)."""
    base = ["bench", "hier", "--world-sizes", "8,16,64,256"]
    long_recs = ctx.bench(base, quiet_flag=False)
    short_recs = ctx.bench(base + ["--tokens-per-rank", "4096"], plot="bench_hier_4k.png", quiet_flag=False)
    rows = []
    for n in sorted({r["world_size"] for r in long_recs}):
        cells = [n]
        for recs in (long_recs, short_recs):
            best = next(r for r in recs if r["world_size"] == n and r["best"])
            ring = next(r for r in recs if r["world_size"] == n and r["ulysses"] == 1)
            cells += [f"{best['ulysses']} x {best['ring']}", f"{best['ms']:.1f} ({ring['ms']:.1f})"]
        rows.append(cells)
    return ("Predicted forward + backward time of one attention layer (Llama-3-8B heads: 32 query / 8 kv heads "
            "x 128, bf16, 350 TFLOP/s achieved, nodes of 8 GPUs with 450 GB/s inside and 50 GB/s across); "
            "`u x r` = Ulysses groups of u ranks, a ring of r groups. A model of FLOPs and bytes, not a "
            "measurement.\n\n"
            + _table(["N", "32k tokens/GPU: best split", "ms (pure ring)", "4k tokens/GPU: best split",
                      "ms (pure ring)"], rows)
            + "\n![predicted time of each split over the pure ring, 4k tokens per GPU](bench_hier_4k.png)\n\n"
            + ctx.block())


def run(ctx: _Context) -> str:
    """Wall-clock timings of real processes (gloo on CPU, NCCL on GPUs) with the peers."""
    recs = ctx.bench(["bench", "run", "--world-size", "2", "--tokens-per-rank", "4096", "--heads", "8", "--head-dim",
                      "64", "--iters", "9"])
    rows = [[f"`{r['impl']}`", _fmt(r["median_ms"], 1), f"{r['speedup_vs_contiguous']:.2f}x", _fmt(r.get("peak_mib"), 1)]
            for r in recs if r["impl"] != "sdpa_1proc"]
    return ("N = 2 processes, 4096 tokens per rank, 8 heads x 64, float32 on CPU (bfloat16 on GPUs); median "
            "wall time of 9 forward + backward iterations after 2 warm-up, slowest rank; one idle core per rank.\n\n"
            + _table(["implementation", "median ms", "vs contiguous", "peak MiB/rank"], rows) + "\n" + ctx.block())


SECTIONS = {"balance": balance, "packed-balance": packed_balance, "sim": sim, "packed-sim": packed_sim,
            "memory": memory, "hier": hier, "run": run}
DEFAULT_SECTIONS = ("balance", "packed-balance", "sim", "packed-sim", "memory", "hier")


def replace_region(text: str, name: str, body: str) -> str:
    """``text`` with the region ``name`` (its markers kept) holding ``body``; appended when absent."""
    begin, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
    region = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: region, text, count=1)
    return text.rstrip() + f"\n\n{region}\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m striped_sp.bench.results", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(DEFAULT_SECTIONS),
                   help=f"comma-separated sections, of {', '.join(SECTIONS)} (default: all but run)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "docs"),
                   help="the folder of results.md and the plots (default: the repository's docs/)")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in names if s not in SECTIONS]
    if bad:
        p.error(f"--only: unknown section(s) {bad}: choose from {', '.join(SECTIONS)}")
    from .report import check_plotting

    try:
        check_plotting()
    except ImportError as e:
        p.exit(2, f"{p.prog}: {e}\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    page = out / "results.md"
    text = page.read_text() if page.exists() else "# Results\n"
    stamp = f"Machine: {machine()}. Date: {datetime.date.today().isoformat()}."
    with tempfile.TemporaryDirectory() as tmp:
        ctx = _Context(out, Path(tmp))
        for name in names:
            body = SECTIONS[name](ctx)
            text = replace_region(text, name, body + "\n" + stamp + "\n")
            page.write_text(text)  # after every section: a long run keeps what it finished
    print(f"wrote {page} ({', '.join(names)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
