"""Command line: ``striped-sp bench MODE [options]`` and ``striped-sp patch``.

bench modes (``striped-sp bench MODE --help`` for each one's options and defaults):
  balance    the work model: each layout's critical path over the ideal, per ring size N
  sim        N ranks simulated on one device with the real kernels (CPU now, CUDA when present)
  run        a real multi-process run (gloo on CPU, NCCL on CUDA) with the peers torch_ring, ulysses
  hier       a model of hierarchical CP: the predicted time of every Ulysses x ring split
  precision  bf16 gradient error against N for each dtype dK/dV travel the ring in
  train      end-to-end training steps (Megatron GPT, HF Llama/Mistral) per layout, the paper's table
  overhead   host work: per-batch plan time, per-layer aten ops, copies, syncs and host time, rank 0 of N
  hybrid     a hybrid's mixer layer (short conv, gated delta net): the whole-sequence gather vs the attention ring

patch: the Megatron-LM patch files shipped with the package
  striped-sp patch --list                              the tags and the paths
  striped-sp patch --print core_v0.19.0 | git apply    (in a Megatron-LM checkout)
  striped-sp patch --apply core_v0.19.0 -C megatron-lm  (the same; a no-op where already applied)
  striped-sp patch --status core_v0.19.0 -C megatron-lm applied, applies, or neither

Progress bars go to stderr (tqdm, the bench extra); the tables go to stdout.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from .bench import fit, hier, hybrid_cost, hybrid_split, overhead, precision, train
    from .bench.cli_args import Formatter, add_balance, add_run, add_sim

    p = argparse.ArgumentParser(prog="striped-sp", description=__doc__, formatter_class=Formatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{bench,patch}")
    bench = sub.add_parser("bench", help="benchmarks: balance, sim, run, hier, precision, train, overhead, hybrid, hybrid-split, fit",
                           description="Benchmarks and models; `striped-sp bench MODE --help` for a mode's options.")
    modes = bench.add_subparsers(dest="mode", required=True, metavar="{balance,sim,run,hier,precision,train,overhead,hybrid,hybrid-split,fit}")
    add_balance(modes)
    add_sim(modes)
    add_run(modes)
    hier.register(modes)
    precision.register(modes)
    train.register(modes)
    overhead.register(modes)
    hybrid_cost.register(modes)
    hybrid_split.register(modes)
    fit.register(modes)
    _patch_parser(sub)
    for parser in (p, bench, *modes.choices.values(), *sub.choices.values()):
        parser.formatter_class = Formatter
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
    g.add_argument("--status", metavar="TAG", dest="status_tag",
                   help="in the checkout: is the patch for TAG applied, does it apply, or neither (exit 0, 1, 2)")
    g.add_argument("--apply", metavar="TAG", dest="apply_tag",
                   help="apply the patch for TAG in the checkout, unless it is already applied")
    p.add_argument("-C", dest="directory", default=".", metavar="DIR",
                   help="the Megatron-LM checkout for --status / --apply (default: the current folder)")


def _patch(args) -> int:
    from .patch_apply import apply_patch, describe, patch_status
    from .patch_files import available, patch_path, read_patch

    if args.list:
        for tag, path in available().items():
            print(f"{tag}\t{path}")
    elif args.path_tag:
        print(patch_path(args.path_tag))
    elif args.status_tag:
        state, detail = patch_status(args.status_tag, args.directory)
        print(describe(args.status_tag, args.directory, state, detail))
        return {"applied": 0, "applies": 1}.get(state, 2)
    elif args.apply_tag:
        print(apply_patch(args.apply_tag, args.directory))
    else:
        sys.stdout.write(read_patch(args.print_tag))
    return 0


def _seq_lens(args, world_sizes, default_tpr):
    if args.seq_lens:
        return [(n, s) for n in world_sizes for s in args.seq_lens]
    return [(n, t * n) for n in world_sizes for t in (args.tokens_per_rank or [default_tpr])]


def _masked_balance(args) -> int:
    from .bench.report import format_table, plan_lines, plot_balance, write_json
    from .bench.work import masked_balance_records

    from .bench.sim import Bar

    if getattr(args, "global_every", None):
        return _mixed_balance(args)

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
    lines = plan_lines(recs, None, "")
    if lines:
        print("\n(cost model forward per head; balance: the plan's critical path over ideal, the table's count)\n"
              + "\n".join(lines))
    if args.json:
        write_json(args.json, recs)
    if args.plot:
        plot_balance(args.plot, recs, masked=True)
    return 0


def _mixed_balance(args) -> int:
    from .bench.mixed import check_global_every
    from .bench.report import format_table, plan_lines, write_json
    from .bench.work import mixed_balance_records

    ks = check_global_every(args.global_every, args.window)
    if args.plot:
        raise ValueError("--plot with --global-every: no plot of mixed blocks; leave out --plot")
    recs = mixed_balance_records(args.layouts, args.world_sizes, args.tokens_per_rank, args.docs, args.window, ks)
    print(f"work model: attention score entries per ring step, {args.tokens_per_rank} tokens per rank, "
          f"documents {args.docs or 'one per row'}; blocks of K layers: K-1 with window {args.window}, 1 global "
          "causal, one layout for all;\ncritical path = sum over steps of the busiest rank; ideal = visible score "
          "entries of the unpadded row / N; block = the layers' critical paths over their ideals, summed\n")
    print(format_table(recs, [("layout", "layout"), ("world_size", "N"), ("global_every", "K"),
                              ("documents", "documents"), ("padding_tokens", "padding"),
                              ("window_layer_balance", "window layer"), ("global_layer_balance", "global layer"),
                              ("critical_path_over_ideal", "block critical/ideal")]))
    lines = plan_lines([r for r in recs if r["global_every"] == ks[0]], None, "")
    if lines:
        print("\n(the window layer's plan; cost model forward per head)\n" + "\n".join(lines))
    if args.json:
        write_json(args.json, recs)
    return 0


def _balance(args) -> int:
    from .bench.report import format_table, plot_balance, write_json
    from .bench.work import balance_records

    from .plan.layouts import get_layout

    if args.docs or args.window or not all(get_layout(lay).dense_plans for lay in args.layouts):
        return _masked_balance(args)  # stripes of s > 1 have the engine's masked plans only

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
    from .plan.layouts import get_layout

    if args.predict:  # nothing runs: the GPU cost model prices the plans
        from .bench.predict import run_cli

        return run_cli(args)
    if args.global_every:  # before any work
        from .bench.mixed import check_global_every

        check_global_every(args.global_every, args.window)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    if args.docs or args.window or not all(get_layout(lay).dense_plans for lay in args.layouts):
        return _masked_sim(args, device, dtype)  # stripes of s > 1 have the engine's masked plans only
    points = _seq_lens(args, args.world_sizes, 4096)
    cfg = SimConfig(layouts=tuple(args.layouts), points=tuple(points), batch=args.batch, heads=args.heads,
                    kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype, device=device,
                    backend=args.backend, reps=args.reps, link_gbps=args.link_gbps,
                    reference=not args.no_reference,
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
          + "the engine's executor on a LocalRing; clock: each rank's part of each round (CPU time with one "
          "compute thread on a CPU, else wall time), device "
          "synchronised (median of --reps)\n"
          "critical path = sum over ring rounds of the slowest rank (kernels + merge/accumulate);\n"
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
    from .bench.report import format_table, plan_lines, plot_masked_sim, write_json
    from .bench.sim import SimConfig
    from .bench.sim_masked import simulate_masked

    if args.seq_lens:
        raise SystemExit("striped-sp bench sim: with --docs/--window give --tokens-per-rank, not --seq-lens")
    if args.batch != 1:
        raise SystemExit(f"striped-sp bench sim: --batch {args.batch} with --docs/--window: the masked "
                         "simulation runs one packed row (batch 1)")
    tprs = args.tokens_per_rank or [4096]
    cfg = SimConfig(layouts=tuple(args.layouts), world_sizes=tuple(args.world_sizes), heads=args.heads,
                    kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype, device=device,
                    backend=args.backend, reps=args.reps, link_gbps=args.link_gbps, reference=not args.no_reference,
                    progress=not args.no_progress, threads=args.threads)
    load0 = _load()
    if args.global_every:
        from .bench.mixed import simulate_mixed

        recs = simulate_mixed(cfg, tprs, args.docs, args.window, args.global_every)
    else:
        recs = simulate_masked(cfg, tprs, args.docs, args.window)
    kvh = args.kv_heads or args.heads
    print(f"sim: {device.type} ({_device_name(device)}), {dtype}, batch 1, {args.heads} heads / {kvh} kv heads x "
          f"{args.head_dim}, documents {args.docs or 'one per row'}, window {args.window or 'none'}, "
          f"link {args.link_gbps or 'inf'} GB/s; load average before/after {load0} / {_load()}\n"
          + "the engine's executor on a LocalRing; clock: each rank's part of each round (CPU time with one "
          "compute thread on a CPU, else wall time), device "
          "synchronised\n(median of --reps); critical path = sum over rounds of the slowest rank;\n"
          "zigzag pads every document to a multiple of 2N; efficiency = (one device, whole row) / N / critical\n")
    cols = [("layout", "layout"), ("world_size", "N"), ("tokens_per_rank", "tokens/rank"), ("documents", "docs"),
            ("padding_tokens", "padding"), ("pass", "pass"), ("critical_path_ms", "critical ms"),
            ("speedup_vs_contiguous", "vs contiguous"), ("speedup_vs_zigzag", "vs zigzag"), ("efficiency", "efficiency")]
    if args.global_every:
        from .bench.mixed import MIXED_COLUMNS

        print(f"mixed model: blocks of K layers = (K-1) layers with window {args.window} + 1 global causal layer; "
              "block ms = (K-1) x window layer + global layer (critical paths); speedups of the block time\n")
        cols = cols[:5] + MIXED_COLUMNS[:1] + cols[5:6] + MIXED_COLUMNS[1:] + cols[7:9]
    print(format_table(recs, cols))
    first = [r for r in recs if r["pass"] == "forward" and r.get("global_every", 0) == (args.global_every or [0])[0]]
    if args.global_every:  # the cost model predicts the global layer (it knows no windows)
        first = [{**r, "predicted_forward_ms": r.get("global_predicted_forward_ms"),
                  "measured_forward_ms": r.get("global_measured_forward_ms"),
                  "plan_balance": r.get("global_plan_balance")} for r in first]
    print("\n".join(plan_lines(first, "measured_forward_ms",
                               "global layer forward" if args.global_every else "forward")))
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


def _run_blocks(args, recs) -> list[dict]:
    """``bench run --global-every``: the model-block records (:func:`.bench.mixed.combine_layers`), printed."""
    from .bench.mixed import MIXED_COLUMNS, combine_layers
    from .bench.report import format_table
    from .bench.run import GLOBAL_SUFFIX

    window = [r for r in recs if r["impl"] in args.layouts]
    glob = [{**r, "impl": r["impl"][:-len(GLOBAL_SUFFIX)]} for r in recs if r["impl"].endswith(GLOBAL_SUFFIX)]
    blocks = combine_layers(window, glob, args.global_every, "median_ms", who="impl")
    print(f"\nmixed model: blocks of K layers = (K-1) layers with window {args.window} + 1 global causal layer "
          f"(the '{GLOBAL_SUFFIX}' lines); block ms = (K-1) x window layer + global layer (medians)\n")
    print(format_table(blocks, [("impl", "impl"), ("world_size", "N"), ("seq_len", "seq_len"), *MIXED_COLUMNS,
                                ("speedup_vs_contiguous", "vs contiguous"), ("speedup_vs_zigzag", "vs zigzag")]))
    return blocks


def _run(args) -> int:
    from .bench.report import format_table, plan_lines, plot_speedup, write_json
    from .bench.cli_args import names
    from .bench.run import RunConfig, run

    peers = () if args.peers.strip() in ("", "none") else tuple(names(("torch_ring", "ulysses"))(args.peers))
    if args.global_every:  # before any work
        from .bench.mixed import check_global_every

        check_global_every(args.global_every, args.window)
    if "contiguous" not in args.layouts:
        args.layouts.append("contiguous")
    seqs = tuple(s for _, s in _seq_lens(args, [args.world_size], 4096))
    cfg = RunConfig(world_size=args.world_size, seq_lens=seqs, layouts=tuple(args.layouts), peers=peers,
                    batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                    dtype=args.dtype, device=args.device, backend=args.backend, warmup=args.warmup,
                    iters=args.iters, threads=args.threads, profile=args.profile, pin=not args.no_pin,
                    progress=not args.no_progress, force_peers=args.force_peers, docs=args.docs,
                    window=args.window, ulysses_sizes=tuple(u for u in args.ulysses_sizes if u > 1),
                    global_every=tuple(args.global_every or ()), memory=True if args.memory else None)
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
    print("\n".join(plan_lines(recs, "median_ms", "fwd+bwd")))
    if args.global_every:
        recs = recs + _run_blocks(args, recs)
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
        handler = args.run if args.mode in ("hier", "precision", "train", "overhead", "hybrid", "hybrid-split", "fit") else {"balance": _balance, "sim": _sim, "run": _run}[args.mode]
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
