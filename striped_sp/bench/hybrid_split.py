"""``striped-sp bench hybrid-split``: one hybrid mixer layer split over the group against gathered.

Per mixer kind (transformers' own modules from a tiny config of width ``C``: ``short_conv``
LFM2's short convolution, ``gated_delta`` Qwen3-Next's gated delta net, ``mamba2`` Bamba's Mamba2
mixer, ``mamba`` Jamba's Mamba), ring size ``N`` and sequence length ``S``, on ``N`` spawned gloo
ranks (one compute thread each), forward + backward of the layer on this rank's ``S/N`` tokens:

* ``split``: the split form (:mod:`striped_sp.deepspeed.split`): one all-to-all each way, the conv
  and scan on all ``S`` tokens for ``1/N`` of the heads / channels;
* ``gathered``: the whole sequence gathered into natural order
  (:func:`striped_sp.engine.natural_order.gather_natural`), the module on all ``S`` tokens, this
  rank's tokens kept;
* ``local``: the module on ``S/N`` tokens alone (no communication, not exact: the floor);
* ``sp1``: the module on all ``S`` tokens in one process (the layer at SP=1), on rank 0.

Figures: the busiest rank's process CPU time (median over ``--reps`` after a warm-up; the steady
figure on a shared machine), the slowest rank's wall time, the largest peak of tensor memory over
the ranks (:class:`~striped_sp.bench.memory.MemoryPeak`, one extra repetition), and the bytes each
rank sends: the all-to-alls' (what leaves the rank: ``(N - 1) / N`` of what it hands
``all_to_all_single``), Mamba's all-reduce of ``S x (dt_rank + 2 d_state)`` per direction as a ring
all-reduce moves it, and the gather's (``bench hybrid``'s formula).
"""

from __future__ import annotations

import dataclasses

import torch

from .common import init_rank, load_average
from .hybrid_cost import gather_bytes
from .split_runs import spawn_all, timed_steps

__all__ = ["HybridSplitConfig", "KINDS", "mixer_of", "measure", "predict_gdn", "register"]

KINDS = ("short_conv", "gated_delta", "mamba2", "mamba")
MODES = ("split", "gathered", "local", "sp1")


@dataclasses.dataclass
class HybridSplitConfig:
    kinds: tuple = KINDS
    world_sizes: tuple = (2, 4)
    seq_lens: tuple = (4096, 16384)
    hidden: int = 256
    reps: int = 3
    seed: int = 0
    timeout_s: float = 1800.0
    #: peak memory only for rows up to this length (the CPU profiler's own memory grows with the
    #: events it records: some GB for a gated delta net at 16k); ``None``: every row
    memory_max_seq: int | None = None
    #: ``--model``: the ways the tiny hybrid runs (:data:`striped_sp.bench.hybrid_model.MODEL_MODES`)
    model_modes: tuple = ("sp1", "split", "gathered")


def mixer_of(kind: str, hidden: int, key_heads: int | None = None) -> torch.nn.Module:
    """transformers' mixer module of ``kind`` at width ``hidden`` (float32, seeded by the caller;
    ``key_heads``: a gated delta net's, default its value heads')."""
    from .hybrid_cost import mixer_module

    if kind in ("short_conv", "gated_delta"):
        return mixer_module(kind, hidden, key_heads=key_heads)
    if kind == "mamba2":
        from transformers import BambaConfig
        from transformers.models.bamba.modeling_bamba import BambaMixer

        config = BambaConfig(hidden_size=hidden, num_hidden_layers=1, mamba_n_heads=hidden * 2 // 64, mamba_d_head=64,
                             mamba_d_state=64, mamba_n_groups=1, mamba_chunk_size=256, mamba_expand=2,
                             num_attention_heads=4, num_key_value_heads=4, attn_layer_indices=[])
        return BambaMixer(config, 0)
    if kind == "mamba":
        from transformers import JambaConfig
        from transformers.models.jamba.modeling_jamba import JambaMambaMixer

        config = JambaConfig(hidden_size=hidden, num_hidden_layers=1, mamba_d_state=16, mamba_expand=2,
                             num_attention_heads=4, num_key_value_heads=4, attn_layer_period=2, attn_layer_offset=1)
        return JambaMambaMixer(config, 0)
    raise ValueError(f"mixer kind {kind!r}: expected one of {', '.join(KINDS)}")


def _count_exchange_bytes():
    """Patch the split mixers' all-to-all in this process to count the bytes handed to it."""
    from ..engine import head_split

    counter = {"bytes": 0}
    real = head_split._exchange

    def counted(chunks, group):
        counter["bytes"] += chunks.numel() * chunks.element_size()
        return real(chunks, group)

    head_split._exchange = counted
    return counter


def _worker(rank, cfg: HybridSplitConfig, n: int, device_type: str, init_file, results):
    results.put(("ok", rank, _worker_body(rank, cfg, n, init_file)))


def _runner(mode: str, module, split, order, n: int):
    import torch.distributed as dist

    from ..engine.natural_order import gather_natural, take_local

    group = dist.group.WORLD
    if mode == "split":
        return lambda x: split.run(x, group, order, {})
    if mode == "gathered":
        return lambda x: take_local(module(gather_natural(x, group, order)), order)
    return module


def _worker_body(rank, cfg: HybridSplitConfig, n: int, init_file) -> list[dict]:
    import torch.distributed as dist

    from ..deepspeed.split import find_split
    from ..engine.natural_order import natural_order

    init_rank(rank, n, "cpu", init_file, cfg.timeout_s, threads=1)
    counter = _count_exchange_bytes()
    records = []
    for kind in cfg.kinds:
        torch.manual_seed(cfg.seed)
        module = mixer_of(kind, cfg.hidden).train()
        split = find_split(module)
        for seq in cfg.seq_lens:
            order = natural_order(seq, n, rank, "striped")
            gen = torch.Generator().manual_seed(cfg.seed + rank)
            modes = MODES if rank == 0 else MODES[:3]
            rec = {"kind": kind, "world_size": n, "seq_len": seq, "hidden": cfg.hidden, "reps": cfg.reps}
            for mode in MODES:
                tokens = seq if mode == "sp1" else seq // n
                x = torch.randn(1, tokens, cfg.hidden, generator=gen)
                g = torch.randn(1, tokens, cfg.hidden, generator=gen)
                run = _runner(mode, module, split, order, n)

                def step(xi, run=run, g=g):
                    run(xi).backward(g)
                    module.zero_grad(set_to_none=True)

                measured = cfg.memory_max_seq is None or seq <= cfg.memory_max_seq
                stats, sent = timed_steps(step, cfg.reps, mode in modes, measured,
                                          prepare=lambda x=x: (x.clone().requires_grad_(),),
                                          count=lambda: counter["bytes"])
                rec[f"{mode}_cpu_ms"], rec[f"{mode}_ms"] = stats["cpu_ms"], stats["ms"]
                rec[f"{mode}_peak_mib"] = stats["peak_mib"] if measured else None
                if mode == "split":
                    rec["split_bytes"] = sent * (n - 1) // n
            if kind == "mamba":  # the all-reduce of x_proj's partial sums, forward and backward
                m = module
                width = m.time_step_rank + 2 * m.ssm_state_size
                rec["split_bytes"] += 2 * 2 * (n - 1) * seq * width * 4 // n
            rec["gather_bytes"] = sum(v for k, v in gather_bytes(seq, n, cfg.hidden, 4).items() if k != "gather_bwd_bytes")
            records.append(rec)
    dist.barrier()
    dist.destroy_process_group()
    return records


def measure(cfg: HybridSplitConfig) -> list[dict]:
    """One record per (kind, N, S) (module docstring); ratios against ``sp1``."""
    records = spawn_all(cfg, KINDS, _worker, "bench hybrid-split")
    for r in records:
        n = r["world_size"]
        r["split_cpu_x_n_over_sp1"] = r["split_cpu_ms"] * n / r["sp1_cpu_ms"]
        r["split_peak_x_n_over_sp1"] = (r["split_peak_mib"] * n / r["sp1_peak_mib"]
                                        if r["split_peak_mib"] is not None else None)
        r["gathered_over_split_cpu"] = r["gathered_cpu_ms"] / r["split_cpu_ms"]
    return records


#: Qwen3-Next-80B-A3B's shapes (its config.json): hidden, value heads, key heads, head dims, attention kv heads x dim
QWEN3_NEXT = dict(hidden=2048, value_heads=32, key_heads=16, key_dim=128, value_dim=128, kv_heads=2, head_dim=256)


def predict_gdn(seq_len: int, n: int, hidden: int, value_heads: int, key_heads: int, key_dim: int, value_dim: int,
                kv_heads: int, head_dim: int, element_size: int = 2) -> dict:
    """Per rank and gated delta net layer, computed from the shapes (no measurement): bytes sent forward +
    backward split (the cut's channels: every rank's key heads, counted once per rank that reads them,
    its value heads' v, b, a in; its heads' output back) and gathered (all-gather + reduce-scatter of
    ``S x hidden``), one attention layer's ring for scale (K, V forward and backward, the fp32 dK / dV
    accumulators), and the mixer's input activations a rank holds (``tokens x channels x e``)."""
    v_local = value_heads // n
    k_local = max(1, key_heads * v_local // value_heads)
    cut_in = n * (2 * k_local * key_dim + v_local * (value_dim + 2))     # channels sent per token, all ranks
    cut_out = value_heads * value_dim
    leaves = (n - 1) / n
    local = seq_len // n
    split = 2 * local * (cut_in + cut_out) * element_size * leaves
    gathered = 2 * seq_len * hidden * element_size * leaves
    kv = local * kv_heads * head_dim
    ring = (n - 1) * 2 * kv * element_size * 2 + n * 2 * kv * 4
    whole = 2 * key_heads * key_dim + value_heads * (value_dim + 2)
    return {"seq_len": seq_len, "world_size": n, "split_bytes": split, "gathered_bytes": gathered, "ring_bytes": ring,
            "split_act_bytes": seq_len * (cut_in // n) * element_size, "gathered_act_bytes": seq_len * whole * element_size}


COLUMNS = [("kind", "mixer"), ("world_size", "N"), ("seq_len", "S"), ("sp1_cpu_ms", "SP=1 cpu ms"),
           ("split_cpu_ms", "split cpu ms"), ("gathered_cpu_ms", "gathered cpu ms"), ("local_cpu_ms", "S/N alone cpu ms"),
           ("split_cpu_x_n_over_sp1", "split x N / SP=1"), ("gathered_over_split_cpu", "gathered / split"),
           ("sp1_peak_mib", "SP=1 peak MiB"), ("split_peak_mib", "split peak MiB"),
           ("gathered_peak_mib", "gathered peak MiB"), ("split_peak_x_n_over_sp1", "split peak x N / SP=1"),
           ("split_bytes", "split B sent"), ("gather_bytes", "gather B (gloo)")]


def register(modes) -> None:
    """Add ``striped-sp bench hybrid-split``."""
    from .cli_args import _ints

    p = modes.add_parser("hybrid-split", help="a hybrid's mixer layer split over the group vs gathered vs SP=1",
                         description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated mixer kinds ({', '.join(KINDS)})")
    p.add_argument("--world-sizes", type=_ints, default=[2, 4], help="ranks N, one spawn each")
    p.add_argument("--seq-lens", type=_ints, default=[4096, 16384], help="global sequence lengths S")
    p.add_argument("--hidden", type=int, default=256, help="the model's hidden size C")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up (medians)")
    p.add_argument("--memory-max-seq", type=int, default=None,
                   help="measure peak memory only for rows up to this length (the CPU profiler's own memory grows "
                        "with the row: some GB for a gated delta net at 16k); default: every row")
    p.add_argument("--model", action="store_true",
                   help="the whole tiny hybrid of each kind (3 mixer layers, then attention: Qwen3-Next, Bamba, "
                        "Jamba, LFM2), fwd+bwd of one row: the plain model at SP=1 in one process against the "
                        "enabled model at SP=N, split and gathered (striped_sp.bench.hybrid_model)")
    p.add_argument("--model-modes", default="sp1,split,gathered",
                   help="--model: the ways the model runs (sp1 always; split, gathered: at SP=N)")
    p.add_argument("--predict", action="store_true",
                   help="no measurement: a Qwen3-Next-80B-like gated delta net layer's bytes and activations per "
                        "rank, split vs gathered, at --seq-lens and --world-sizes, bf16 (predict_gdn)")
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.set_defaults(run=_main)


def _main(args) -> int:
    from .report import format_table, write_json

    if args.predict:
        from .report import format_table

        rows = [predict_gdn(s, n, **QWEN3_NEXT) for s in args.seq_lens for n in args.world_sizes]
        for r in rows:
            for k in [k for k in r if k.endswith("_bytes")]:
                r[k.replace("_bytes", "_gib")] = r.pop(k) / 2**30
        print("predicted, per rank and gated delta net layer of a Qwen3-Next-80B-like model (hidden 2048, 32 value / "
              "16 key heads x 128), bf16: bytes sent forward + backward, and the mixer's input activations held\n")
        print(format_table(rows, [(k, k) for k in rows[0]]))
        return 0
    cfg = HybridSplitConfig(kinds=tuple(k for k in args.kinds.split(",") if k), world_sizes=tuple(args.world_sizes),
                            seq_lens=tuple(args.seq_lens), hidden=args.hidden, reps=args.reps,
                            memory_max_seq=args.memory_max_seq,
                            model_modes=("sp1", *[m for m in args.model_modes.split(",") if m and m != "sp1"]))
    if args.model:
        return _main_model(cfg, args.json)
    load0 = load_average()
    recs = measure(cfg)
    print(f"one mixer layer, fwd+bwd, hidden {cfg.hidden}, float32, CPU, gloo, one thread per rank, layout striped; "
          f"medians of {cfg.reps} reps;\ncpu ms: the busiest rank's CPU time; peak: the largest rank's tensor memory "
          f"above its inputs; bytes: what one rank sends per layer;\nload average {load0} / {load_average()}\n")
    print(format_table(recs, COLUMNS))
    if args.json:
        write_json(args.json, recs)
    return 0


def _main_model(cfg: HybridSplitConfig, json_path) -> int:
    from . import hybrid_model
    from .report import format_table, write_json

    recs = hybrid_model.measure_models(cfg)
    print(f"a tiny hybrid (3 mixer layers, then attention), width {cfg.hidden}, fwd+bwd of one row, float32, CPU, "
          f"gloo, one thread per rank, layout striped; medians of {cfg.reps} reps;\ncpu ms: the busiest rank's CPU "
          "time; peak: the largest rank's tensor memory above the step's start; SP=1: the plain model, one "
          "process\n")
    print(format_table(recs, hybrid_model.COLUMNS))
    for r in recs:
        print(f"{r['kind']}: {r['mixers']}")
    if json_path:
        write_json(json_path, recs)
    return 0
