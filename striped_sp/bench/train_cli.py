"""``striped-sp bench train`` on the command line: its arguments and presets' help (:func:`register`),
the :class:`~striped_sp.bench.train_run.TrainConfig` they make (:func:`config_of`) and the run that
prints the report (and writes the JSON records and the plot).
"""

from __future__ import annotations

import time

import torch

from .common import load_average
from .train_run import AUTO, PEERS, PRESETS, TrainConfig, train

__all__ = ["register", "config_of"]


def register(modes) -> None:
    """Add ``striped-sp bench train`` to the bench sub-commands."""
    from .cli_args import _ints, names

    p = modes.add_parser("train", help="end-to-end training steps (Megatron GPT, HF Llama/Mistral) per layout",
                         description="End-to-end training steps (forward, backward, gradient reduction, optimizer step)\n"
                         "of a megatron-core GPTModel and a Hugging Face Llama / Mistral (through DeepSpeed), per layout,\n"
                         "on N spawned ranks (gloo on CPU, NCCL on CUDA): interleaved rounds, median step time, tokens/s,\n"
                         "speedup over contiguous (Ring Attention: the paper's table), peak memory per rank, and the\n"
                         "losses of every layout compared (same weights, same data).\n\n"
                         + _presets_help())
    p.add_argument("--preset", choices=["auto", *PRESETS], default="auto",
                   help="model and row defaults (auto: paper on CUDA, cpu otherwise)")
    p.add_argument("--models", type=names(tuple(PEERS)), default=["megatron", "hf"], help="megatron, hf")
    p.add_argument("--hf-model", choices=["llama", "lfm2", "qwen3_next"], default="llama",
                   help="the hf path's model: llama (Mistral for the window row), or a hybrid (dense rows only, no "
                        "ulysses peer): lfm2 (layers alternating short convolution / attention), qwen3_next (three "
                        "gated delta net layers per attention layer, heads as --heads / --kv-heads); its mixers split "
                        "over the group ($STRIPED_SP_SPLIT_MIXERS=0: gathered)")
    p.add_argument("--rows", type=names(("dense", "packed", "window")), default=["dense", "packed", "window"],
                   help="row kinds: dense, packed, window")
    p.add_argument("--world-size", type=int, default=None, help="ranks N (default: 2 on CPU, the GPUs on CUDA)")
    p.add_argument("--seq-lens", type=_ints, default=None, help="dense rows' lengths (tokens per sample)")
    p.add_argument("--packed-lens", type=_ints, default=None, help="packed rows' lengths")
    p.add_argument("--window-lens", type=_ints, default=None, help="window model rows' lengths")
    p.add_argument("--docs", default=TrainConfig.docs, help="the packed rows' document mix (bench sim --docs)")
    p.add_argument("--window", type=int, default=None, help="the window model's window (keys before a query)")
    p.add_argument("--layouts", type=_columns, default=list(TrainConfig.layouts),
                   help=f"columns: layout keys ('striped:stripe=doc', ...) and {AUTO} (the auto configuration)")
    p.add_argument("--peers", default="native,ulysses", help="native (Megatron, needs TE), ulysses (HF), or none")
    for name, help_text in (("layers", "transformer layers"), ("hidden", "model width"),
                            ("ffn-hidden", "MLP width"), ("heads", "query heads"), ("kv-heads", "key/value heads"),
                            ("head-dim", "head dimension"), ("vocab", "vocabulary"), ("rounds", "timed rounds")):
        key = name.replace("-", "_")
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"{help_text} (default: the preset's, cpu {PRESETS['cpu'][key]}, "
                            f"paper {PRESETS['paper'][key]})")
    p.add_argument("--batch", type=int, default=1, help="dense rows per step")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (the first measures memory, see --memory)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16; auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default="auto", help="cpu or cuda (auto: cuda when there are N GPUs)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default cores // N)")
    p.add_argument("--seed", type=int, default=TrainConfig.seed, help="weights and data")
    p.add_argument("--init-std", type=float, default=TrainConfig.init_std, help="weight init std")
    p.add_argument("--profile", action="store_true", help="one more step per column under torch.profiler")
    p.add_argument("--memory", action="store_true",
                   help="peak memory per rank on the first step (on CUDA always; on the CPU it runs torch.profiler, "
                        "whose C++ side prints lines and a warning to stderr)")
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.add_argument("--plot", metavar="PATH", help="PNG: dense rows' speedup over contiguous against length "
                   "(needs matplotlib, the bench extra: checked before the work starts)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=_main)


def _presets_help() -> str:
    """The presets' values and the expected run time, for ``bench train --help``."""
    lines = ["", "", "Presets (--preset; explicit options override them):"]
    for name, where in (("cpu", "2 gloo ranks, fp32"), ("paper", "the paper's lengths, a ~1B model, N GPUs, bf16")):
        p = PRESETS[name]
        lines.append(f"  {name} ({where}): {p['layers']} layers, width {p['hidden']}, MLP {p['ffn_hidden']}, "
                     f"{p['heads']} heads / {p['kv_heads']} kv heads x {p['head_dim']}, vocab {p['vocab']};")
        lines.append(f"    dense rows {', '.join(map(str, p['seq_lens']))}, packed {', '.join(map(str, p['packed_lens']))}, "
                     f"window {', '.join(map(str, p['window_lens']))} tokens (window {p['window']}); "
                     f"{p['rounds']} rounds")
    lines += ["", "Run time: each row runs (--warmup + --rounds) steps of every column. With the cpu preset,",
              "both models and every row: about 15-20 minutes on a 2-core CPU (estimated from the step",
              "times in docs/results.md: 1.3 / 3.9 / 13.6 s per step at 4k / 8k / 16k dense tokens,",
              "3.5 s packed, 4.0 s window, megatron); --models megatron --rows dense --seq-lens 4096:",
              "about a minute (52 s measured). The paper preset has not been timed here (no GPUs)."]
    return "\n".join(lines)


def _columns(text: str) -> list[str]:
    """``--layouts``: names separated by commas, or by spaces / ';' when a key has parameters."""
    sep = ";" if ";" in text else (" " if " " in text.strip() else ",")
    vals = [x.strip() for x in text.split(sep) if x.strip()]
    if not vals:
        raise ValueError(f"--layouts {text!r}: expected layout names")
    return vals


def config_of(args) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``bench train`` arguments (preset defaults filled in)."""
    cuda = args.device != "cpu" and torch.cuda.is_available()
    preset = PRESETS[("paper" if cuda else "cpu") if args.preset == "auto" else args.preset]
    world = args.world_size or (torch.cuda.device_count() if cuda and args.device != "cpu" else 2)

    def pick(name):
        val = getattr(args, name)
        return preset[name] if val is None else val

    peers = () if args.peers.strip() in ("", "none") else tuple(x for x in args.peers.split(",") if x)
    return TrainConfig(models=tuple(args.models), kinds=tuple(args.rows), world_size=world,
                       seq_lens=tuple(pick("seq_lens")), packed_lens=tuple(pick("packed_lens")),
                       window_lens=tuple(pick("window_lens")), docs=args.docs, window=pick("window"),
                       layouts=tuple(args.layouts), peers=peers, layers=pick("layers"), hidden=pick("hidden"),
                       ffn_hidden=pick("ffn_hidden"), heads=pick("heads"), kv_heads=pick("kv_heads"),
                       head_dim=pick("head_dim"), vocab=pick("vocab"), batch=args.batch, dtype=args.dtype,
                       device=args.device, warmup=args.warmup, rounds=pick("rounds"), seed=args.seed,
                       init_std=args.init_std,
                       threads=args.threads, profile=args.profile, progress=not args.no_progress,
                       memory=True if args.memory else None, hf_model=args.hf_model)


def _main(args) -> int:
    from .report import write_json
    from .train_report import plot, print_report

    cfg = config_of(args)
    load0 = load_average()
    t0 = time.time()
    recs, notes, profile = train(cfg)
    if "hf" in cfg.models and cfg.hf_model != "llama":
        from ..deepspeed.hybrid import split_mixers_enabled

        print(f"hf model: {cfg.hf_model} (a hybrid; its mixers "
              f"{'split over the group' if split_mixers_enabled() else 'gathered into natural order'})")
    when = f"{time.time() - t0:.0f} s; load average before/after {load0} / {load_average()}"
    print_report(cfg, recs, notes, profile, when)
    if args.json:
        write_json(args.json, recs)
    if args.plot:
        plot(args.plot, recs)
    return 0
