"""A model of hierarchical CP: the predicted step time of every Ulysses x ring split of N ranks.

``ring_attention(..., ulysses_size=u)`` runs an all-to-all over heads inside groups of ``u``
consecutive ranks and the striped ring across the ``r = N / u`` groups.  This model predicts one
attention layer's forward + backward time per split from FLOPs and bytes, on nodes of
``ranks_per_node`` ranks joined by a slower link.  It is a model, not a measurement: use it to
choose ``u``, then measure that choice with ``bench run``.

Per rank, with ``s`` tokens, ``S = N s``, ``H`` query heads, ``Hkv`` kv heads (replicated to
``u`` when ``Hkv < u``), head dim ``d``, ``b`` bytes per element:

* compute: causal attention is ``2 S^2 H d`` FLOPs forward and 2.5x that backward, shared evenly
  by the ``N`` ranks (striped is balanced), at ``tflops`` achieved;
* all-to-all (not overlapped): forward sends q, k, v and returns out, backward the same volume:
  ``2 (2 s H d + 2 s Hkv d) (u - 1) / u`` elements, over the node link when the group fits in a
  node, else the inter-node link;
* ring (overlapped with the compute of each step): each of the ``r - 1`` hops carries the
  visiting K and V (``2 s Hkv d`` elements); backward also the fp32 dK/dV; a hop runs at the
  slowest link of the ring (inter-node as soon as the ring leaves a node).
"""

from __future__ import annotations

import dataclasses

__all__ = ["HierConfig", "splits", "predict", "model_records"]


@dataclasses.dataclass
class HierConfig:
    world_sizes: tuple = (8, 16, 32, 64, 128, 256)
    tokens_per_rank: int = 32768
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    bytes_per_elem: int = 2          # bf16 activations
    grad_bytes: int = 4              # fp32 dK/dV on the ring
    tflops: float = 350.0            # achieved attention TFLOP/s per GPU
    intra_gbps: float = 450.0        # GB/s per GPU inside a node (NVLink)
    inter_gbps: float = 50.0         # GB/s per GPU across nodes (InfiniBand)
    ranks_per_node: int = 8


def splits(world_size: int, heads: int, kv_heads: int) -> list[int]:
    """The Ulysses sizes ``u`` that the engine accepts for ``world_size`` ranks and these heads."""
    return [u for u in range(1, world_size + 1)
            if world_size % u == 0 and heads % u == 0 and (kv_heads % u == 0 or u % kv_heads == 0)]


def predict(cfg: HierConfig, world_size: int, u: int) -> dict:
    """Predicted milliseconds of one layer's attention, forward + backward, for the split ``u``."""
    n, s, h, d = world_size, cfg.tokens_per_rank, cfg.heads, cfg.head_dim
    r = n // u
    hkv = max(cfg.kv_heads, u) if u > 1 else cfg.kv_heads
    total = n * s
    flops_fwd = 2.0 * total * total * h * d / n
    c_fwd = flops_fwd / (cfg.tflops * 1e12)
    c_bwd = 2.5 * c_fwd
    a2a_elems = 2 * (2 * s * h * d + 2 * s * hkv * d) * (u - 1) / u
    a2a_link = cfg.intra_gbps if u <= cfg.ranks_per_node else cfg.inter_gbps
    a2a = a2a_elems * cfg.bytes_per_elem / (a2a_link * 1e9)
    ring_link = cfg.intra_gbps if n <= cfg.ranks_per_node else cfg.inter_gbps
    kv = 2 * s * hkv * d  # the visiting K and V: the group's u*s tokens, this member's hkv/u heads
    t_kv = kv * cfg.bytes_per_elem / (ring_link * 1e9)
    t_dkv = kv * cfg.grad_bytes / (ring_link * 1e9)
    if r == 1:
        ring_fwd, ring_bwd = c_fwd, c_bwd
    else:
        ring_fwd = (r - 1) * max(c_fwd / r, t_kv) + c_fwd / r
        ring_bwd = (r - 1) * max(c_bwd / r, t_kv + t_dkv) + c_bwd / r + t_dkv
    time = a2a + ring_fwd + ring_bwd
    return {"world_size": n, "ulysses": u, "ring": r, "ms": 1e3 * time, "compute_ms": 1e3 * (c_fwd + c_bwd),
            "a2a_ms": 1e3 * a2a, "exposed_ring_ms": 1e3 * (ring_fwd + ring_bwd - c_fwd - c_bwd),
            "a2a_link": "intra" if a2a_link == cfg.intra_gbps else "inter",
            "ring_link": "-" if r == 1 else ("intra" if ring_link == cfg.intra_gbps else "inter")}


def model_records(cfg: HierConfig) -> list[dict]:
    """Every valid split of every world size, with ``best`` marking the fastest per size."""
    out = []
    for n in cfg.world_sizes:
        recs = [predict(cfg, n, u) for u in splits(n, cfg.heads, cfg.kv_heads)]
        best = min(recs, key=lambda rec: rec["ms"])
        for rec in recs:
            rec["best"] = rec is best
        out.extend(recs)
    return out


def register(modes) -> None:
    """Add ``striped-sp bench hier`` to the bench sub-commands."""
    p = modes.add_parser("hier", help="model: predicted time of every Ulysses x ring split (hierarchical CP)",
                         description="A model (FLOPs and bytes, nothing runs): the predicted forward + backward time\n"
                                     "of one attention layer for every Ulysses x ring split of N ranks.")
    defaults = HierConfig()
    p.add_argument("--world-sizes", default="8,16,32,64,128,256", help="comma-separated ranks N")
    helps = {"tokens_per_rank": "tokens per rank", "heads": "query heads", "kv_heads": "key/value heads",
             "head_dim": "head dimension", "ranks_per_node": "ranks (GPUs) per node",
             "tflops": "achieved attention TFLOP/s per GPU", "intra_gbps": "GB/s per GPU inside a node (NVLink)",
             "inter_gbps": "GB/s per GPU across nodes (InfiniBand)"}
    for name in ("tokens_per_rank", "heads", "kv_heads", "head_dim", "ranks_per_node"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name), help=helps[name])
    for name in ("tflops", "intra_gbps", "inter_gbps"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name), help=helps[name])
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.add_argument("--plot", metavar="PATH", help="write a PNG: predicted time over pure ring, per split and N")
    p.set_defaults(run=_main)


def plot(path: str, records: list[dict], title: str) -> None:
    """PNG of every split's predicted time relative to the pure ring, against N (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ring = {r["world_size"]: r["ms"] for r in records if r["ulysses"] == 1}
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=90)
    for u in sorted({r["ulysses"] for r in records}):
        pts = sorted((r["world_size"], r["ms"] / ring[r["world_size"]]) for r in records if r["ulysses"] == u)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"u = {u}" if u > 1 else "pure ring")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks N")
    ax.set_ylabel("predicted time / pure ring")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _main(args) -> int:
    import json

    sizes = tuple(int(x) for x in str(args.world_sizes).split(",") if x)
    cfg = HierConfig(world_sizes=sizes, tokens_per_rank=args.tokens_per_rank, heads=args.heads,
                     kv_heads=args.kv_heads, head_dim=args.head_dim, ranks_per_node=args.ranks_per_node,
                     tflops=args.tflops, intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps)
    for bad, rule in ((cfg.heads % cfg.kv_heads, "--heads must be a multiple of --kv-heads"),
                      (min(sizes, default=0) < 1, "--world-sizes must be positive")):
        if bad:
            raise SystemExit(rule)
    recs = model_records(cfg)
    print(f"model: {cfg.heads} q / {cfg.kv_heads} kv heads, head_dim {cfg.head_dim}, {cfg.tokens_per_rank} "
          f"tokens/rank, {cfg.tflops:g} TFLOP/s, {cfg.intra_gbps:g} GB/s in nodes of {cfg.ranks_per_node}, "
          f"{cfg.inter_gbps:g} GB/s across (one layer, fwd+bwd, predicted)")
    print(f"{'N':>5} {'u x r':>9} {'ms':>9} {'compute':>9} {'a2a':>8} {'ring exp.':>9}  links")
    for rec in recs:
        mark = "  <- best" if rec["best"] else ""
        print(f"{rec['world_size']:>5} {rec['ulysses']:>4} x {rec['ring']:<4}{rec['ms']:>9.1f} {rec['compute_ms']:>9.1f} "
              f"{rec['a2a_ms']:>8.1f} {rec['exposed_ring_ms']:>9.1f}  a2a {rec['a2a_link']}, ring {rec['ring_link']}{mark}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=1)
    if args.plot:
        plot(args.plot, recs, f"{cfg.heads}q/{cfg.kv_heads}kv x {cfg.head_dim}, {cfg.tokens_per_rank} tokens/rank, "
                              f"{cfg.intra_gbps:g} / {cfg.inter_gbps:g} GB/s, nodes of {cfg.ranks_per_node} (model)")
    return 0
