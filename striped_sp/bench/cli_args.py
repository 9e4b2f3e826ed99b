"""The argument definitions of the ``bench balance``, ``bench sim`` and ``bench run`` sub-commands
(:mod:`striped_sp.cli` builds the parser and runs the modes), with their value parsers."""

from __future__ import annotations

import argparse

__all__ = ["LAYOUT_NAMES", "Formatter", "add_balance", "add_sim", "add_run", "names"]

LAYOUT_NAMES = ("striped", "zigzag", "contiguous")


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers separated by commas") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return vals


def _sizes(text: str) -> list[int]:
    """``128k,1M`` (k = 1024, M = 1024^2) or plain integers."""
    vals = []
    for part in text.replace(",", " ").split():
        scale = {"k": 1 << 10, "m": 1 << 20}.get(part[-1].lower(), 1)
        try:
            val = int(part[:-1] if scale > 1 else part) * scale
        except ValueError:
            val = 0
        if val <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected positive sizes like 131072, 128k or 1M")
        vals.append(val)
    if not vals:
        raise argparse.ArgumentTypeError(f"{text!r}: expected sizes like 128k,1M")
    return vals


def names(choices):
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
    from ..plan.layouts import get_layout

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
    from .docs import parse_docs

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


class Formatter(argparse.RawDescriptionHelpFormatter):
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
                   "'striped:stripe=64,place=512', 'striped:stripe=doc' (per-document stripes)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _shape(p: argparse.ArgumentParser, heads: int) -> None:
    p.add_argument("--batch", type=int, default=1, help="sequences per batch")
    p.add_argument("--heads", type=int, default=heads, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA/MQA); default: --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16; auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--backend", default="auto", help="kernel backend of ring_attention (auto: the best available)")



def _global_every(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-every", type=_ints, default=None, metavar="K",
                   help="mixed local/global model (needs --window): every K-th layer global causal, the "
                        "others windowed; reports per layout one block of K layers = (K-1) window layers + "
                        "1 global layer, from one timing of each (several K: comma-separated)")


def _timed_mode(modes, name: str, help_text: str, description: str) -> argparse.ArgumentParser:
    """A mode that runs kernels: its parser with the common and the shape options."""
    p = modes.add_parser(name, help=help_text, description=description)
    _common(p)
    _shape(p, heads=4)
    return p


def _lengths(p: argparse.ArgumentParser, tokens_help: str) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--seq-lens", type=_ints, help="global sequence lengths to sweep")
    g.add_argument("--tokens-per-rank", type=_ints, help=tokens_help)


def add_balance(modes) -> None:
    """``bench balance``."""
    b = modes.add_parser("balance", help="work model: critical path over ideal per layout and N",
                         description="The work model (no kernels run): attention score entries per ring step;\n"
                                     "each layout's critical path over the ideal, per ring size N.")
    _common(b)
    b.add_argument("--world-sizes", type=_ints, default=[2, 4, 8, 16, 32, 64], help="ring sizes N to sweep")
    b.add_argument("--tokens-per-rank", type=int, default=4096, help="tokens per rank")
    _masks(b)
    b.add_argument("--global-every", type=_ints, default=None, metavar="K",
                   help="mixed local/global model (needs --window): every K-th layer global causal, the "
                        "others windowed; per layout the window layer's, the global layer's and one block's "
                        "((K-1) window layers + 1 global layer) critical path over ideal (several K: comma-separated)")


def add_sim(modes) -> None:
    """``bench sim``."""
    s = _timed_mode(modes, "sim", "N ranks simulated on one device with the real kernels",
                    "N ranks simulated on one device: the engine's executor on a LocalRing, every\n"
                    "(rank, round) timed, the critical path summed over the ring's rounds.")
    s.add_argument("--world-sizes", type=_ints, default=[8], help="ring sizes N to sweep")
    _lengths(s, "tokens per rank to sweep (seq = tokens * N); default 4096 when --seq-lens is not given")
    s.add_argument("--device", default="auto", help="cpu or cuda (auto: cuda when available)")
    s.add_argument("--reps", type=int, default=3, help="timed repetitions of each ring (median per rank and round)")
    s.add_argument("--link-gbps", type=float, default=None,
                   help="ring link bandwidth in GB/s: a step lasts max(compute, transfer)")
    s.add_argument("--every-block", action="store_true",
                   help="no effect, kept for old command lines: every (rank, step) is always run and timed "
                   "(the engine's executor)")
    s.add_argument("--predict", default=None, metavar="ARCH", choices=["A100", "H100", "H800", "H200", "B200"],
                   help="run nothing: price every rank's plan (the row of --docs / --window, chosen as on ARCH) "
                        "with the GPU cost model of --backend's kernel class on ARCH (a prediction), and hold it "
                        "against ring-flash-attention's published figures")
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
    _global_every(s)


def add_run(modes) -> None:
    """``bench run``."""
    r = _timed_mode(modes, "run", "real multi-process run with the peers",
                    "A real multi-process run (gloo on CPU, NCCL on CUDA): fwd+bwd of each\n"
                    "layout and peer, median over iterations of the slowest rank.")
    r.add_argument("--world-size", type=int, default=2, help="ranks N (processes)")
    _lengths(r, "tokens per rank to sweep (default 4096)")
    r.add_argument("--peers", default="torch_ring,ulysses",
                   help="comma-separated peers (torch_ring, ulysses) or 'none'")
    r.add_argument("--device", default="auto", help="cpu or cuda (auto: cuda when there are N GPUs)")
    r.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    r.add_argument("--iters", type=int, default=7, help="timed fwd+bwd iterations (median)")
    r.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default cores // N)")
    r.add_argument("--no-pin", action="store_true", help="CPU: do not pin each rank to its own core(s)")
    r.add_argument("--profile", action="store_true",
                   help="also time kernel, merge and ring waits inside our layouts, per rank")
    r.add_argument("--memory", action="store_true",
                   help="also the peak memory per rank (on CUDA always; on the CPU it runs torch.profiler, "
                        "whose C++ side prints lines to stderr)")
    r.add_argument("--ulysses-sizes", type=_ints, default=[],
                   help="also run each layout as hierarchical CP with these ulysses_size values (e.g. 2)")
    r.add_argument("--force-peers", action="store_true",
                   help="run torch_ring even on a torch version it is not pinned to")
    _masks(r)
    _global_every(r)
