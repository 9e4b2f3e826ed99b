"""``striped-sp bench overhead`` on the command line: its arguments (:func:`register`) and the run
that prints the table and the targets (and writes the JSON records).
"""

from __future__ import annotations

import torch

from .overhead_measure import DEFAULT_LAYOUTS, ROWS, WEB_MIX, OverheadConfig, measure
from .overhead_targets import _tok, targets

__all__ = ["register", "DESCRIPTION", "COLUMNS"]


DESCRIPTION = (
    "Host work beside the attention kernels, rank 0 of N on PyTorch's fake process group, 1 head x 8,\n"
    "one CPU thread: the per-batch plan (prepare + compile) and, per layer after the batch's first\n"
    "(forward + backward), the aten ops, attention kernel calls, host-to-device copies,\n"
    "synchronisations and host time; on the CPU path and the CUDA path (on the GPU, or a dry run:\n"
    "counts on meta tensors).  Defaults: 128k tokens at N = 8 (about half a minute); the sizes of\n"
    "docs/results.md: --world-sizes 8,32,64 --tokens-per-rank 16k.")


def register(modes) -> None:
    """Add ``striped-sp bench overhead`` to the bench sub-commands."""
    from .cli_args import _ints, _layout_names, _sizes, _window, names

    p = modes.add_parser("overhead", help="host work: per-batch plan time, per-layer ops, copies, syncs, host ms",
                         description=DESCRIPTION)
    p.add_argument("--world-sizes", type=_ints, default=[8], help="ring sizes N")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tokens", type=_sizes, default=None,
                   help="row lengths (every N with every length; 128k, 1M accepted)")
    g.add_argument("--tokens-per-rank", type=_sizes, default=None,
                   help="tokens per rank (row = N x this; default 16k: 128k at N=8, 512k at N=32, 1M at N=64)")
    p.add_argument("--rows", type=names(ROWS), default=list(ROWS),
                   help="row kinds: dense, packed, window, packed-window (the packed mix with the window)")
    p.add_argument("--layouts", type=_layout_names, default=list(DEFAULT_LAYOUTS),
                   help="layouts separated by spaces or ';' (parameters as bench sim: 'striped:stripe=512'; "
                        "default: " + "; ".join(DEFAULT_LAYOUTS) + ")")
    p.add_argument("--paths", type=names(("cpu", "cuda")), default=["cpu", "cuda"], help="cpu, cuda")
    p.add_argument("--device", choices=["auto", "meta", "cuda"], default="auto",
                   help="the cuda path's tensors: cuda (the GPU), meta (a dry run), auto: cuda when present")
    p.add_argument("--docs", default=WEB_MIX, help="the packed rows' document mix (bench sim --docs)")
    p.add_argument("--window", type=_window, default=4096, help="the window rows' window (W, 0)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median) of plans and layers")
    p.add_argument("--profile", action="store_true",
                   help="print the package's functions with the most time in one layer of each configuration")
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=_main)


COLUMNS = [("layout", "layout"), ("world_size", "N"), ("tokens_label", "tokens"), ("row", "row"), ("path", "path"),
           ("steps", "steps"), ("plan_ms", "plan ms"), ("ops", "ops"), ("kernel_calls", "kernels"),
           ("other_ops", "other ops"), ("h2d_copies", "h2d"), ("syncs", "syncs"), ("host_ms", "host ms"),
           ("launches_per_step", "launch/step"), ("launches_per_step_group", "launch/step-class"), ("gathered_keys_per_step", "keys gathered")]


def _main(args) -> int:
    from .common import load_average
    from .docs import parse_docs
    from .report import format_table, write_json

    parse_docs(args.docs)  # ValueError before any work
    if args.tokens:
        points = tuple((n, t) for n in args.world_sizes for t in args.tokens)
    else:
        points = tuple((n, n * t) for n in args.world_sizes for t in (args.tokens_per_rank or [16384]))
    cfg = OverheadConfig(layouts=tuple(args.layouts), points=points, rows=tuple(args.rows), paths=tuple(args.paths),
                         device=args.device, docs=args.docs, window=args.window, reps=args.reps,
                         progress=not args.no_progress)
    load0 = load_average()
    recs = measure(cfg, profile=args.profile)
    cuda = next((r["count_device"] for r in recs if r["path"].startswith("cuda")), None)
    if cuda == "cuda":
        cuda_note = "cuda: on the GPU, host ms = wall time up to the return, before the device is synchronised"
    elif cuda:
        cuda_note = ("cuda (dry run): counts on meta tensors; host ms of the same branch on CPU tensors, attention "
                     "ops shape-only\n(an upper bound: the other ops compute on 1 x 8 heads, where a GPU only launches "
                     "them)")
    else:
        cuda_note = ""
    print(f"overhead: rank 0 of N on PyTorch's fake process group, {cfg.heads} head x {cfg.head_dim}, one CPU thread, "
          f"torch {torch.__version__}; load average before/after {load0} / {load_average()}\n"
          f"plan ms: per batch, RingRequest.prepare + compile_plan of rank 0, planner caches emptied (median of "
          f"{cfg.reps});\nper layer after the batch's first, forward + backward: aten ops, attention kernel calls, "
          "other ops, host-to-device\ncopies, synchronisations; host ms: the layer's CPU time (one thread; median of "
          f"{cfg.reps}); cpu: attention ops shape-only,\nso everything but their compute; {cuda_note}\n"
          f"rows: dense (one document), packed ({cfg.docs}; zigzag pads documents to 2N), window ({cfg.window}, 0),\n"
          "packed-window (both); launch/step: the most attention launches of a forward ring step;\n"
          "launch/step-class: the most attention calls of a forward step per window class of its calls;\n"
          "keys gathered: key rows gathered by index per forward step (the values' the same), in local blocks\n")
    rows = [{**r, "tokens_label": _tok(r["tokens"]), "syncs": r["syncs"] if r["path"] != "cpu" else None}
            for r in recs]
    print(format_table(rows, COLUMNS))
    lines = targets(recs)
    if lines:
        print("\nthe issue's targets:\n" + "\n".join("  " + line for line in lines))
    if args.profile:
        for r in recs:
            print(f"\n{r['layout']} N={r['world_size']} {_tok(r['tokens'])} {r['row']} {r['path']}: "
                  "cumulative ms in one layer (the package's functions)")
            for where, ms, calls in r.get("profile", []):
                print(f"  {ms:9.1f}  {calls:7d}  {where}")
    if args.json:
        write_json(args.json, [{k: v for k, v in r.items() if k != "profile"} for r in recs])
    return 0
