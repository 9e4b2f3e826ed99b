"""``striped-sp bench hybrid``: what a hybrid model's non-attention mixer costs under context parallelism.

On the Hugging Face path a gated delta net, a Mamba scan or a short convolution runs on the whole
sequence gathered into natural order (:mod:`striped_sp.engine.natural_order`,
:mod:`striped_sp.deepspeed.hybrid`): an all-gather of the layer input forward, a reduce-scatter of
its gradient backward (on gloo an all-reduce and a slice).  This mode measures, per mixer layer,
at each ring size ``N`` and sequence length ``S`` (hidden ``C = heads x head_dim``):

* the gather: :func:`~striped_sp.engine.natural_order.gather_natural` forward and backward on
  ``[1, S/N, C]``, on ``N`` spawned gloo ranks (NCCL on CUDA);
* the attention ring of one attention layer of the same width:
  :func:`striped_sp.ring_attention` (causal, the layout) forward and backward on ``[1, S/N, H, D]``;
* the mixer's own forward + backward on one process, on all ``S`` tokens (what every rank runs
  now) and on ``S/N`` tokens (what a head-split all-to-all or an ideal split would leave each rank):
  transformers' ``Lfm2ShortConv`` (``short_conv``) or ``Qwen3NextGatedDeltaNet`` (``gated_delta``,
  its PyTorch fallback without fla) from a tiny config of width ``C``.

Bytes are computed from the shapes, per rank, as a ring algorithm receives them (``e``: the
element size):

* gather forward (all-gather): ``(N-1)/N x S x C x e``;
* gather backward, reduce-scatter (NCCL): ``(N-1)/N x S x C x e``; gloo has no reduce-scatter and
  runs an all-reduce: ``2 (N-1)/N x S x C x e`` (``gather_bwd_bytes_gloo``);
* ring forward and backward: the bytes of every tensor the ring's transport sends from this rank,
  counted from their shapes (K and V forward, ``(N-1) x 2 x S/N x H_kv x D x e`` on a dense causal
  row; backward K, V and the fp32 dK / dV accumulators).

Times: each rank one compute thread; per repetition the slowest rank's wall time and the busiest
rank's process CPU time, forward and backward apart; the record holds medians over ``--reps``
after one warm-up.  On a shared CPU the CPU time is the steadier figure; a collective's wait shows
in the wall time only (gloo blocks in the kernel while waiting).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .common import init_rank, median, spawn_ranks, time_once

__all__ = ["HybridCostConfig", "MIXERS", "gather_bytes", "mixer_module", "measure", "register"]

MIXERS = ("short_conv", "gated_delta")


@dataclasses.dataclass
class HybridCostConfig:
    world_sizes: tuple = (2, 4)
    seq_lens: tuple = (4096, 16384)
    heads: int = 4
    kv_heads: int | None = None  # default: heads
    head_dim: int = 64
    mixer: str = "short_conv"
    layout: str = "striped"
    dtype: str = "float32"
    reps: int = 5
    seed: int = 0
    device: str = "cpu"
    timeout_s: float = 900.0

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


def gather_bytes(seq_len: int, world_size: int, hidden: int, element_size: int) -> dict:
    """Bytes one rank receives for one mixer layer's gather, computed from the shapes (ring
    algorithms): ``gather_fwd_bytes`` (all-gather), ``gather_bwd_bytes`` (reduce-scatter),
    ``gather_bwd_bytes_gloo`` (the all-reduce gloo runs instead)."""
    n = world_size
    whole = seq_len * hidden * element_size
    return {"gather_fwd_bytes": whole * (n - 1) // n, "gather_bwd_bytes": whole * (n - 1) // n,
            "gather_bwd_bytes_gloo": 2 * whole * (n - 1) // n}


def mixer_module(name: str, hidden: int, dtype=torch.float32, key_heads: int | None = None) -> torch.nn.Module:
    """transformers' mixer ``name`` from a tiny config of width ``hidden`` (seeded by the caller); a gated
    delta net has ``hidden / 64`` value heads and ``key_heads`` key heads (default: as many)."""
    if name == "short_conv":
        from transformers import Lfm2Config
        from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

        config = Lfm2Config(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                            intermediate_size=4 * hidden, vocab_size=256, layer_types=["conv"])
        return Lfm2ShortConv(config, 0).to(dtype)
    if name == "gated_delta":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        heads = max(1, hidden // 64)
        config = Qwen3NextConfig(hidden_size=hidden, num_hidden_layers=1, linear_num_value_heads=heads,
                                 linear_num_key_heads=key_heads or heads, linear_key_head_dim=64, linear_value_head_dim=64,
                                 linear_conv_kernel_dim=4, num_attention_heads=4, num_key_value_heads=4,
                                 head_dim=64, intermediate_size=4 * hidden, vocab_size=256,
                                 layer_types=["linear_attention"])
        return Qwen3NextGatedDeltaNet(config, 0).to(dtype)
    raise ValueError(f"mixer {name!r}: expected one of {', '.join(MIXERS)}")


_CPU = torch.device("cpu")  # mixer_times runs on the CPU: time_once's syncs are no-ops


def mixer_times(cfg: HybridCostConfig, lengths) -> dict:
    """``{tokens: (fwd_cpu_s, bwd_cpu_s)}``: medians of the mixer's forward and backward on one
    process with one thread, process CPU time."""
    dtype = getattr(torch, cfg.dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(cfg.seed)
        mod = mixer_module(cfg.mixer, cfg.hidden, dtype)
        out = {}
        for s in sorted(set(lengths)):
            x = torch.randn(1, s, cfg.hidden, dtype=dtype)
            g = torch.randn(1, s, cfg.hidden, dtype=dtype)
            fwd, bwd = [], []
            for i in range(cfg.reps + 1):
                xi = x.clone().requires_grad_()
                box = {}
                tf = time_once(lambda: box.setdefault("y", mod(xi)), _CPU, time.process_time)
                y = box["y"][0] if isinstance(box["y"], tuple) else box["y"]
                tb = time_once(lambda: y.backward(g), _CPU, time.process_time)
                mod.zero_grad(set_to_none=True)
                if i:
                    fwd.append(tf)
                    bwd.append(tb)
            out[s] = (median(fwd), median(bwd))
        return out
    finally:
        torch.set_num_threads(threads)


def _count_ring_bytes():
    """Patch the ring transport of this process to count the bytes it sends; returns the counter."""
    from ..engine import transport

    counter = {"bytes": 0}
    shift = transport.TorchTransport.shift

    def counted(self, tensors, *args, **kwargs):
        counter["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        return shift(self, tensors, *args, **kwargs)

    transport.TorchTransport.shift = counted
    return counter


def _worker(rank, cfg: HybridCostConfig, world_size: int, device_type: str, init_file, results):
    """spawn_ranks' target: the rank's records (its errors go to the parent by spawn_ranks)."""
    results.put(("ok", rank, _worker_body(rank, cfg, world_size, device_type, init_file)))


def _worker_body(rank, cfg: HybridCostConfig, n: int, device_type: str, init_file) -> list[dict]:
    import torch.distributed as dist

    from ..engine.natural_order import gather_natural, natural_order
    from ..engine.request import ring_attention
    from .common import sync

    device = init_rank(rank, n, device_type, init_file, cfg.timeout_s, threads=1)
    dtype = getattr(torch, cfg.dtype)
    group = dist.group.WORLD
    counter = _count_ring_bytes()
    kv = cfg.kv_heads or cfg.heads
    clocks = (time.perf_counter, time.process_time)

    def timed(fn):
        dist.barrier()
        sync(device)
        t0 = [c() for c in clocks]
        out = fn()
        sync(device)
        return out, [c() - t for c, t in zip(clocks, t0)]

    records = []
    for seq in cfg.seq_lens:
        s = seq // n
        gen = torch.Generator().manual_seed(cfg.seed + rank)
        x = torch.randn(1, s, cfg.hidden, generator=gen, dtype=dtype).to(device)
        gx = torch.randn(1, seq, cfg.hidden, generator=gen, dtype=dtype).to(device)
        q = torch.randn(1, s, cfg.heads, cfg.head_dim, generator=gen, dtype=dtype).to(device)
        k, v = (torch.randn(1, s, kv, cfg.head_dim, generator=gen, dtype=dtype).to(device) for _ in range(2))
        do = torch.randn_like(q)
        order = natural_order(seq, n, rank, cfg.layout)
        samples = {key: [] for key in ("gather_fwd", "gather_bwd", "ring_fwd", "ring_bwd")}
        ring_bytes = (0, 0)
        for i in range(cfg.reps + 1):
            xi = x.clone().requires_grad_()
            y, tf = timed(lambda: gather_natural(xi, group, order))
            _, tb = timed(lambda: y.backward(gx))
            qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
            c0 = counter["bytes"]
            o, rf = timed(lambda: ring_attention(qi, ki, vi, group, layout=cfg.layout))
            c1 = counter["bytes"]
            _, rb = timed(lambda: o.backward(do))
            ring_bytes = (c1 - c0, counter["bytes"] - c1)
            if i:
                for key, t in (("gather_fwd", tf), ("gather_bwd", tb), ("ring_fwd", rf), ("ring_bwd", rb)):
                    samples[key].append(t)
        # per repetition: the slowest rank's wall time, the busiest rank's CPU time
        flat = torch.tensor([[t for key in samples for t in samples[key][j]] for j in range(cfg.reps)],
                            dtype=torch.float64, device=device)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        flat = flat.cpu().tolist()
        rec = {"world_size": n, "seq_len": seq, "layout": cfg.layout, "hidden": cfg.hidden, "heads": cfg.heads,
               "kv_heads": kv, "head_dim": cfg.head_dim, "dtype": cfg.dtype, "reps": cfg.reps,
               **gather_bytes(seq, n, cfg.hidden, torch.finfo(dtype).bits // 8),
               "ring_fwd_bytes": ring_bytes[0], "ring_bwd_bytes": ring_bytes[1]}
        for j, key in enumerate(samples):
            rec[f"{key}_ms"] = median(row[2 * j] for row in flat) * 1e3
            rec[f"{key}_cpu_ms"] = median(row[2 * j + 1] for row in flat) * 1e3
        records.append(rec)
    dist.barrier()
    dist.destroy_process_group()
    return records


def measure(cfg: HybridCostConfig) -> list[dict]:
    """One record per (N, S): the gather's and the ring's bytes and times (module docstring), the
    mixer's CPU time on all ``S`` and on ``S/N`` tokens, and the ratios."""
    for n in cfg.world_sizes:
        for s in cfg.seq_lens:
            if s % n:
                raise ValueError(f"seq_len {s} does not divide by N={n}")
    if cfg.mixer not in MIXERS:
        raise ValueError(f"mixer {cfg.mixer!r}: expected one of {', '.join(MIXERS)}")
    device_type = torch.device(cfg.device).type
    records = []
    for n in cfg.world_sizes:
        got = spawn_ranks(_worker, (cfg, n, device_type), n, cfg.timeout_s, f"bench hybrid N={n}")
        records += got[0]
    mixer = mixer_times(cfg, [s for s in cfg.seq_lens] + [s // n for n in cfg.world_sizes for s in cfg.seq_lens])
    for r in records:
        n, s = r["world_size"], r["seq_len"]
        whole, part = mixer[s], mixer[s // n]
        r.update(mixer=cfg.mixer, mixer_whole_ms=sum(whole) * 1e3, mixer_local_ms=sum(part) * 1e3,
                 mixer_whole_fwd_ms=whole[0] * 1e3, mixer_whole_bwd_ms=whole[1] * 1e3)
        r["mixer_extra_ms"] = r["mixer_whole_ms"] - r["mixer_local_ms"]
        r["gather_ms"] = r["gather_fwd_ms"] + r["gather_bwd_ms"]
        r["gather_cpu_ms"] = r["gather_fwd_cpu_ms"] + r["gather_bwd_cpu_ms"]
        r["ring_ms"] = r["ring_fwd_ms"] + r["ring_bwd_ms"]
        r["ring_cpu_ms"] = r["ring_fwd_cpu_ms"] + r["ring_bwd_cpu_ms"]
        r["gather_bytes_total"] = r["gather_fwd_bytes"] + r["gather_bwd_bytes_gloo"]
        r["ring_bytes_total"] = r["ring_fwd_bytes"] + r["ring_bwd_bytes"]
        r["mixer_cost_over_ring"] = (r["gather_ms"] + r["mixer_extra_ms"]) / r["ring_ms"] if r["ring_ms"] else None
        r["mixer_cost_over_ring_cpu"] = ((r["gather_cpu_ms"] + r["mixer_extra_ms"]) / r["ring_cpu_ms"]
                                         if r["ring_cpu_ms"] else None)
    return records


COLUMNS = [("world_size", "N"), ("seq_len", "S"), ("gather_fwd_bytes", "gather fwd B"),
           ("gather_bwd_bytes_gloo", "gather bwd B (gloo)"), ("ring_fwd_bytes", "ring fwd B"),
           ("ring_bwd_bytes", "ring bwd B"), ("gather_ms", "gather ms"), ("gather_cpu_ms", "gather cpu ms"),
           ("ring_ms", "ring ms"), ("ring_cpu_ms", "ring cpu ms"), ("mixer_whole_ms", "mixer S ms"),
           ("mixer_local_ms", "mixer S/N ms"), ("mixer_cost_over_ring", "(gather+extra)/ring"),
           ("mixer_cost_over_ring_cpu", "cpu (gather+extra)/ring")]


def register(modes) -> None:
    """Add ``striped-sp bench hybrid``."""
    from .cli_args import _ints

    p = modes.add_parser("hybrid", help="a hybrid's mixer layer under CP: the gather against the attention ring",
                         description="Per mixer layer of a hybrid model (gated delta net, Mamba, short conv) under\n"
                                     "context parallelism on the Hugging Face path: the whole-sequence gather's bytes\n"
                                     "and time (forward all-gather, backward reduce-scatter / gloo all-reduce) against\n"
                                     "one attention layer's ring (striped_sp.ring_attention forward + backward), on N\n"
                                     "spawned ranks, and the mixer's own compute on all S tokens vs S/N (one process,\n"
                                     "CPU time).  Bytes are computed from the shapes, per rank (ring algorithms).")
    p.add_argument("--world-sizes", type=_ints, default=[2, 4], help="ranks N, one spawn each")
    p.add_argument("--seq-lens", type=_ints, default=[4096, 16384], help="global sequence lengths S")
    p.add_argument("--heads", type=int, default=4, help="attention heads (hidden = heads x head-dim)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension")
    p.add_argument("--mixer", choices=MIXERS, default="short_conv",
                   help="short_conv: transformers' Lfm2ShortConv; gated_delta: Qwen3NextGatedDeltaNet (torch fallback)")
    p.add_argument("--layout", default="striped", help="the layout (striped, zigzag, contiguous)")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions after one warm-up (medians)")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, N GPUs)")
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.set_defaults(run=_main)


def _main(args) -> int:
    from .common import load_average
    from .report import format_table, write_json

    cfg = HybridCostConfig(world_sizes=tuple(args.world_sizes), seq_lens=tuple(args.seq_lens), heads=args.heads,
                           kv_heads=args.kv_heads, head_dim=args.head_dim, mixer=args.mixer, layout=args.layout,
                           dtype=args.dtype, reps=args.reps, device=args.device)
    load0 = load_average()
    recs = measure(cfg)
    print(f"one mixer layer ({cfg.mixer}) vs one attention layer's ring, layout {cfg.layout}, hidden {cfg.hidden} "
          f"({cfg.heads} heads x {cfg.head_dim}), {cfg.dtype}, {cfg.device}; medians of {cfg.reps} reps, fwd+bwd;\n"
          "bytes per rank computed from the shapes (ring algorithms; ring: the tensors its transport sends);\n"
          "ms: the slowest rank's wall time, cpu ms: the busiest rank's CPU time; mixer: one process, one "
          "thread, CPU time;\n(gather+extra)/ring: the gather's time plus the mixer's extra compute "
          "(S vs S/N tokens) over the ring's time, wall (cpu: CPU times, the steadier on a shared machine);\n"
          f"load average {load0} / {load_average()}\n")
    print(format_table(recs, COLUMNS))
    if args.json:
        write_json(args.json, recs)
    return 0
