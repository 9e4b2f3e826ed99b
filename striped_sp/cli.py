"""Command line: ``striped-sp bench MODE [options]`` and ``striped-sp patch``.

bench modes (``striped-sp bench MODE --help`` for each one's options and defaults):
  balance    the work model: each layout's critical path over the ideal, per ring size N
  sim        N ranks simulated on one device with the real kernels (CPU now, CUDA when present)
  run        a real multi-process run (gloo on CPU, NCCL on CUDA) with the peers torch_ring, ulysses
  hier       a model of hierarchical CP: the predicted time of every Ulysses x ring split
  precision  bf16 gradient error against N for each dtype dK/dV travel the ring in

patch: the Megatron-LM patch files shipped with the package
  striped-sp patch --list                              the tags and the paths
  striped-sp patch --print core_v0.19.0 | git apply    (in a Megatron-LM checkout)

Progress bars go to stderr (tqdm, the bench extra); the tables go to stdout.
"""

from __future__ import annotations

import argparse
import sys

LAYOUT_NAMES = ("striped", "zigzag", "contiguous")


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers separated by commas") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return vals


def _names(choices):
    def parse(text: str) -> list[str]:
        vals = [x for x in text.replace(",", " ").split() if x]
        bad = [v for v in vals if v not in choices]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"{text!r}: expected some of {', '.join(choices)}")
        return vals
    return parse


def _layout_names(text: str) -> list[str]:
    """Layout names, parameters included (``striped:stripe=128,place=auto``), separated by spaces
    or ``;`` (a comma also separates plain names)."""
    from .layouts import get_layout

    vals = [x for x in text.replace(";", " ").split() if x]
    if len(vals) == 1 and ":" not in vals[0]:
        vals = [x for x in vals[0].split(",") if x]
    if not vals:
        raise argparse.ArgumentTypeError(f"{text!r}: expected some of {', '.join(LAYOUT_NAMES)}")
    try:
        return [get_layout(v).key for v in vals]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _docs_spec(text: str) -> str:
    from .bench.docs import parse_docs

    try:
        parse_docs(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _window(text: str) -> int:
    try:
        val = int(text)
    except ValueError:
        val = -1
    if val < 0:
        raise argparse.ArgumentTypeError(f"--window {text!r}: expected a left window >= 0 (0: none)")
    return val


def _masks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--docs", type=_docs_spec, default=None, metavar="SPEC",
                   help="packed documents: lognormal:median=1024,sigma=1.2 | long | fixed:L (seeded); "
                        "zigzag pads every document to a multiple of 2N")
    p.add_argument("--window", type=_window, default=0, metavar="W",
                   help="sliding window: a query sees the W keys before it (window_size=(W, 0)); 0: none")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and appends ``(default: X)`` to every option whose help
    does not state its default already (lists shown comma-separated; None / False not shown)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if (not action.option_strings or d is None or d is False or d is argparse.SUPPRESS or d == []
                or "default" in text.lower()):
            return text
        shown = ",".join(map(str, d)) if isinstance(d, (list, tuple)) else str(d)
        return f"{text} (default: {shown.replace('%', '%%')})"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.add_argument("--plot", metavar="PATH",
                   help="write a PNG plot (needs matplotlib, the bench extra: checked before the work starts)")
    p.add_argument("--layouts", type=_layout_names, default=list(LAYOUT_NAMES),
                   help="layouts separated by spaces or ';', some of " + ", ".join(LAYOUT_NAMES)
                   + "; striped takes parameters: 'striped:stripe=128', 'striped:place=auto', "
                   "'striped:stripe=64,place=512'")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _shape(p: argparse.ArgumentParser, heads: int) -> None:
    p.add_argument("--batch", type=int, default=1, help="sequences per batch")
    p.add_argument("--heads", type=int, default=heads, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA/MQA); default: --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16; auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--backend", default="auto", help="kernel backend of ring_attention (auto: the best available)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="striped-sp", description=__doc__, formatter_class=_Formatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{bench,patch}")
    bench = sub.add_parser("bench", help="benchmarks: balance, sim, run, hier, precision",
                           description="Benchmarks and models; `striped-sp bench MODE --help` for a mode's options.")
    modes = bench.add_subparsers(dest="mode", required=True, metavar="{balance,sim,run,hier,precision}")

    b = modes.add_parser("balance", help="work model: critical path over ideal per layout and N",
                         description="The work model (no kernels run): attention score entries per ring step;\n"
                                     "each layout's critical path over the ideal, per ring size N.")
    _common(b)
    b.add_argument("--world-sizes", type=_ints, default=[2, 4, 8, 16, 32, 64], help="ring sizes N to sweep")
    b.add_argument("--tokens-per-rank", type=int, default=4096, help="tokens per rank")
    _masks(b)

    s = modes.add_parser("sim", help="N ranks simulated on one device with the real kernels",
                         description="N ranks simulated on one device with the real kernels: every distinct\n"
                                     "(rank, step) block plan timed, the critical path summed over the ring steps.")
    _common(s)
    _shape(s, heads=4)
    s.add_argument("--world-sizes", type=_ints, default=[8], help="ring sizes N to sweep")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--seq-lens", type=_ints, help="global sequence lengths to sweep")
    g.add_argument("--tokens-per-rank", type=_ints,
                   help="tokens per rank to sweep (seq = tokens * N); default 4096 when --seq-lens is not given")
    s.add_argument("--device", default="auto", help="cpu or cuda (auto: cuda when available)")
    s.add_argument("--reps", type=int, default=3, help="timed repetitions per distinct block plan (median)")
    s.add_argument("--link-gbps", type=float, default=None,
                   help="ring link bandwidth in GB/s: a step lasts max(compute, transfer)")
    s.add_argument("--every-block", action="store_true",
                   help="time every (rank, step) block separately instead of once per distinct plan")
    s.add_argument("--no-reference", action="store_true",
                   help="skip the single-device full causal run (efficiency left empty)")
    s.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: one simulated rank = one core)")
    s.add_argument("--plot-pass", default="fwd+bwd", choices=["forward", "backward", "fwd+bwd"],
                   help="the pass the --plot shows")
    s.add_argument("--strict-block", choices=["sliced", "aligned"], default=None,
                   help="the striped strict block's form (default: the kernel's; aligned needs a bottom-right causal kernel)")
    s.add_argument("--tensor-format", choices=["native", "bshd"], default="native",
                   help="native: the kernel's own memory format (as the ring); bshd: through its [b, s, h, d] API")
    _masks(s)

    r = modes.add_parser("run", help="real multi-process run with the peers",
                         description="A real multi-process run (gloo on CPU, NCCL on CUDA): fwd+bwd of each\n"
                                     "layout and peer, median over iterations of the slowest rank.")
    _common(r)
    _shape(r, heads=4)
    r.add_argument("--world-size", type=int, default=2, help="ranks N (processes)")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--seq-lens", type=_ints, help="global sequence lengths to sweep")
    g.add_argument("--tokens-per-rank", type=_ints, help="tokens per rank to sweep (default 4096)")
    r.add_argument("--peers", default="torch_ring,ulysses",
                   help="comma-separated peers (torch_ring, ulysses) or 'none'")
    r.add_argument("--device", default="auto", help="cpu or cuda (auto: cuda when there are N GPUs)")
    r.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    r.add_argument("--iters", type=int, default=7, help="timed fwd+bwd iterations (median)")
    r.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default cores // N)")
    r.add_argument("--no-pin", action="store_true", help="CPU: do not pin each rank to its own core(s)")
    r.add_argument("--profile", action="store_true",
                   help="also time kernel, merge and ring waits inside our layouts, per rank")
    r.add_argument("--ulysses-sizes", type=_ints, default=[],
                   help="also run each layout as hierarchical CP with these ulysses_size values (e.g. 2)")
    r.add_argument("--force-peers", action="store_true",
                   help="run torch_ring even on a torch version it is not pinned to")
    _masks(r)
    from .bench import hier, precision

    hier.register(modes)
    precision.register(modes)
    _patch_parser(sub)
    for parser in (p, bench, *modes.choices.values(), *sub.choices.values()):
        parser.formatter_class = _Formatter
    return p


def _patch_parser(sub) -> None:
    p = sub.add_parser("patch", help="the Megatron-LM patch files shipped with the package",
                       description="The Megatron-LM patches (one per release line) that add --context-parallel-algo\n"
                                   "to pretrain_gpt.py (docs/megatron.md).  TAG: a Megatron-LM tag (core_v0.19.0)\n"
                                   "or a megatron-core version (0.19.2: the patch of its release line).\n"
                                   "In a Megatron-LM checkout: striped-sp patch --print core_v0.19.0 | git apply")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--list", action="store_true", help="print every shipped patch: tag and path")
    g.add_argument("--print", metavar="TAG", dest="print_tag", help="print the patch for TAG (pipe it to git apply)")
    g.add_argument("--path", metavar="TAG", dest="path_tag", help="print the path of the patch file for TAG")


def _patch(args) -> int:
    from .patch_files import available, patch_path, read_patch

    if args.list:
        for tag, path in available().items():
            print(f"{tag}\t{path}")
    elif args.path_tag:
        print(patch_path(args.path_tag))
    else:
        sys.stdout.write(read_patch(args.print_tag))
    return 0


def _seq_lens(args, world_sizes, default_tpr):
    if args.seq_lens:
        return [(n, s) for n in world_sizes for s in args.seq_lens]
    return [(n, t * n) for n in world_sizes for t in (args.tokens_per_rank or [default_tpr])]


def _masked_balance(args) -> int:
    from .bench.report import format_table, plot_balance, write_json
    from .bench.work import masked_balance_records

    from .bench.sim import Bar

    # a bar weighted by the N^2 block plans of each (N, layout): the large N take most of the time
    bar = Bar(sum(n * n for n in args.world_sizes) * len(args.layouts), "balance (block plans)", not args.no_progress)
    recs = []
    for n in args.world_sizes:
        for lay in args.layouts:
            recs += masked_balance_records([lay], [n], args.tokens_per_rank, args.docs, args.window)
            bar.tick(n * n)
    bar.close()
    print(f"work model: attention score entries per ring step, {args.tokens_per_rank} tokens per rank, "
          f"documents {args.docs or 'one per row'}, window {args.window or 'none'};\n"
          "critical path = sum over steps of the busiest rank; ideal = visible score entries of the "
          "unpadded row / N\n(zigzag: every document padded to a multiple of 2N, Transformer Engine's rule)\n")
    print(format_table(recs, [("layout", "layout"), ("world_size", "N"), ("documents", "documents"),
                              ("padding_tokens", "padding"), ("critical_path_over_ideal", "critical/ideal")]))
    if args.json:
        write_json(args.json, recs)
    if args.plot:
        plot_balance(args.plot, recs, masked=True)
    return 0


def _balance(args) -> int:
    from .bench.report import format_table, plot_balance, write_json
    from .bench.work import balance_records

    if args.docs or args.window:
        return _masked_balance(args)

    recs = balance_records(args.layouts, args.world_sizes, args.tokens_per_rank)
    rows = []
    for r in recs:
        n = r["world_size"]
        theory = {"contiguous": (2 * n - 1) / n, "zigzag": 1.0, "striped": 1.0}[r["layout"]]
        rows.append({**r, "theory": theory})
    print(f"work model: attention score entries per ring step, {args.tokens_per_rank} tokens per rank;\n"
          "critical path = sum over steps of the busiest rank; ideal = S(S+1)/2 / N\n")
    print(format_table(rows, [("layout", "layout"), ("world_size", "N"),
                              ("critical_path_over_ideal", "critical/ideal"), ("theory", "n->inf")]))
    if args.json:
        write_json(args.json, recs)
    if args.plot:
        plot_balance(args.plot, recs)
    return 0


def _sim(args) -> int:
    from .bench.common import pick_device, pick_dtype
    from .bench.report import format_table, plot_speedup, write_json
    from .bench.sim import SimConfig, simulate, work_speedup

    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    if args.docs or args.window:
        return _masked_sim(args, device, dtype)
    points = _seq_lens(args, args.world_sizes, 4096)
    cfg = SimConfig(layouts=tuple(args.layouts), points=tuple(points), batch=args.batch, heads=args.heads,
                    kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype, device=device,
                    backend=args.backend, reps=args.reps, link_gbps=args.link_gbps,
                    every_block=args.every_block, reference=not args.no_reference,
                    progress=not args.no_progress, threads=args.threads, strict_block=args.strict_block,
                    tensor_format=args.tensor_format)
    load0 = _load()
    recs = simulate(cfg)
    kvh = args.kv_heads or args.heads
    print(f"sim: {device.type} ({_device_name(device)}), {dtype}, batch {args.batch}, {args.heads} heads / "
          f"{kvh} kv heads x {args.head_dim}, strict block {args.strict_block or 'default'}, tensor format "
          f"{args.tensor_format}, link "
          f"{args.link_gbps or 'inf'} GB/s; load average before/after "
          f"{load0} / {_load()}\n"
          + ("clock: CPU time of the one compute thread (other load on the machine does not count)\n"
             if device.type == "cpu" and args.threads == 1 else "clock: wall time, device synchronised\n") +
          "critical path = sum over ring steps of the slowest rank (kernels + merge/accumulate);\n"
          "efficiency = (one device, full causal over S) / N / critical path; "
          "work model = the speedup the score-entry count predicts\n")
    rows = [{**r, "tpr": r["seq_len"] // r["world_size"],
             "theory": work_speedup(r["layout"], r["world_size"], r["seq_len"] // r["world_size"])
             if "contiguous" in args.layouts else None} for r in recs]
    print(format_table(rows, [("layout", "layout"), ("world_size", "N"), ("seq_len", "seq_len"),
                              ("tpr", "tokens/rank"), ("pass", "pass"), ("critical_path_ms", "critical ms"),
                              ("speedup_vs_contiguous", "vs contiguous"), ("theory", "work model"),
                              ("efficiency", "efficiency")]))
    if args.json:
        write_json(args.json, recs)
    if args.plot:
        plot_speedup(args.plot, recs, "layout", f"sim ({device.type}, {args.plot_pass}): speedup over contiguous",
                     pass_name=args.plot_pass)
    return 0


def _masked_sim(args, device, dtype) -> int:
    from .bench.report import format_table, plot_masked_sim, write_json
    from .bench.sim import SimConfig
    from .bench.sim_masked import simulate_masked

    if args.seq_lens:
        raise SystemExit("striped-sp bench sim: with --docs/--window give --tokens-per-rank, not --seq-lens")
    if args.batch != 1:
        raise SystemExit(f"striped-sp bench sim: --batch {args.batch} with --docs/--window: the masked "
                         "simulation runs one packed row (batch 1)")
    if args.every_block:
        raise SystemExit("striped-sp bench sim: --every-block with --docs/--window: every (rank, step) "
                         "is timed separately already")
    tprs = args.tokens_per_rank or [4096]
    cfg = SimConfig(layouts=tuple(args.layouts), world_sizes=tuple(args.world_sizes), heads=args.heads,
                    kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype, device=device,
                    backend=args.backend, reps=args.reps, link_gbps=args.link_gbps, reference=not args.no_reference,
                    progress=not args.no_progress, threads=args.threads)
    load0 = _load()
    recs = simulate_masked(cfg, tprs, args.docs, args.window)
    kvh = args.kv_heads or args.heads
    print(f"sim: {device.type} ({_device_name(device)}), {dtype}, batch 1, {args.heads} heads / {kvh} kv heads x "
          f"{args.head_dim}, documents {args.docs or 'one per row'}, window {args.window or 'none'}, "
          f"link {args.link_gbps or 'inf'} GB/s; load average before/after {load0} / {_load()}\n"
          + ("clock: CPU time of the one compute thread\n" if device.type == "cpu" and args.threads == 1
             else "clock: wall time, device synchronised\n") +
          "every (rank, step) timed (median of --reps); critical path = sum over steps of the slowest rank;\n"
          "zigzag pads every document to a multiple of 2N; efficiency = (one device, whole row) / N / critical\n")
    print(format_table(recs, [("layout", "layout"), ("world_size", "N"), ("tokens_per_rank", "tokens/rank"),
                              ("documents", "docs"), ("padding_tokens", "padding"), ("pass", "pass"),
                              ("critical_path_ms", "critical ms"), ("speedup_vs_contiguous", "vs contiguous"),
                              ("speedup_vs_zigzag", "vs zigzag"), ("efficiency", "efficiency")]))
    for r in recs:
        if "plan" in r and r["pass"] == "forward":
            pred = r["predicted_forward_ms"]
            pred = "not predicted (the cost model knows no windows)" if pred is None else \
                f"predicted {pred:.1f} ms (cost model 'cpu')"
            print(f"plan {r['layout']} N={r['world_size']}: {r['plan']}; forward {pred}, "
                  f"measured {r['measured_forward_ms']:.1f} ms")
    if args.json:
        write_json(args.json, recs)
    if args.plot:
        plot_masked_sim(args.plot, recs, args.plot_pass)
    return 0


def _load() -> str:
    import os

    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def _cores() -> int:
    import os

    return os.cpu_count() or 1


def _device_name(device) -> str:
    import os
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{os.cpu_count()} cores, torch {torch.__version__}"


def _run(args) -> int:
    from .bench.report import format_table, plot_speedup, write_json
    from .bench.run import RunConfig, run

    peers = () if args.peers.strip() in ("", "none") else tuple(_names(("torch_ring", "ulysses"))(args.peers))
    if "contiguous" not in args.layouts:
        args.layouts.append("contiguous")
    seqs = tuple(s for _, s in _seq_lens(args, [args.world_size], 4096))
    cfg = RunConfig(world_size=args.world_size, seq_lens=seqs, layouts=tuple(args.layouts), peers=peers,
                    batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                    dtype=args.dtype, device=args.device, backend=args.backend, warmup=args.warmup,
                    iters=args.iters, threads=args.threads, profile=args.profile, pin=not args.no_pin,
                    progress=not args.no_progress, force_peers=args.force_peers, docs=args.docs,
                    window=args.window, ulysses_sizes=tuple(u for u in args.ulysses_sizes if u > 1))
    load0 = _load()
    recs, notes, profile = run(cfg)
    import torch

    print(f"run: {args.world_size} ranks, torch {torch.__version__}, batch {args.batch}, {args.heads} heads / "
          f"{args.kv_heads or args.heads} kv heads x {args.head_dim}, dtype {args.dtype} (auto: float32 on CPU, "
          f"bfloat16 on CUDA); median of {args.iters} "
          f"fwd+bwd iterations after {args.warmup} warm-up (slowest rank per iteration);\n"
          f"load average before/after: {load0} / {_load()} on {_cores()} cores\n")
    rows = [{**r, "tpr": r["seq_len"] // r["world_size"], "note": notes.get((r["seq_len"], r["impl"]), "")}
            for r in recs]
    print(format_table(rows, [("impl", "impl"), ("world_size", "N"), ("seq_len", "seq_len"), ("tpr", "tokens/rank"),
                              ("median_ms", "median ms"), ("speedup_vs_contiguous", "vs contiguous"),
                              ("peak_mib", "peak MiB/rank"), ("note", "note")]))
    if profile:
        print("\nwhere the time goes (ms per iteration, median; 'other' = total - kernel - merge - wait):")
        prow = []
        for p in profile:
            f_other = p.get("fwd_total", 0) - sum(p.get(f"fwd_{k}", 0) for k in ("kernel", "merge", "wait"))
            b_other = p.get("bwd_total", 0) - sum(p.get(f"bwd_{k}", 0) for k in ("kernel", "wait"))
            prow.append({**p, "fwd_other": f_other, "bwd_other": b_other})
        print(format_table(prow, [("impl", "impl"), ("seq_len", "seq_len"), ("rank", "rank"),
                                  ("fwd_total", "fwd"), ("fwd_kernel", "kernel"), ("fwd_merge", "merge"),
                                  ("fwd_wait", "wait"), ("fwd_other", "other"), ("bwd_total", "bwd"),
                                  ("bwd_kernel", "kernel"), ("bwd_wait", "wait"), ("bwd_other", "other")]))
    if args.json:
        write_json(args.json, recs)
    if args.plot:
        plot_speedup(args.plot, recs, "impl", f"run ({args.world_size} ranks): fwd+bwd speedup over contiguous")
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "patch":
        name, handler = "striped-sp patch", _patch
    else:
        name = f"striped-sp bench {args.mode}"
        handler = args.run if args.mode in ("hier", "precision") else {"balance": _balance, "sim": _sim, "run": _run}[args.mode]
    if getattr(args, "plot", None):  # before the work, not after it
        from .bench.report import check_plotting

        try:
            check_plotting()
        except ImportError as e:
            parser.exit(2, f"{name}: {e}\n")
    try:
        return handler(args)
    except ValueError as e:  # a bad setting: its message, not a traceback
        parser.exit(2, f"{name}: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
