"""bf16 gradient error against the ring size, for each dtype dK/dV travel the ring in.

In the backward pass each rank's dK/dV accumulator goes round the ring and every rank adds its
blocks' contribution.  With ``grad_comm_dtype=float32`` (the default) the additions are fp32 and the
error of a bf16 run does not grow with ``N``; with ``bfloat16`` the accumulator is rounded to bf16
at each of the ``N`` hops, which halves those bytes and adds one rounding per hop.

For every ``N`` the *same* global inputs (seed, sequence length divisible by every ``N``) run on
``N`` gloo ranks on this machine; dq/dk/dv are compared with a float64 single-process reference.
"""

from __future__ import annotations

import dataclasses
import datetime
import math

import torch
import torch.distributed as dist

from .common import random_qkv, spawn_ranks

__all__ = ["PrecisionConfig", "measure"]


@dataclasses.dataclass
class PrecisionConfig:
    world_sizes: tuple = (2, 3, 4, 5, 6, 7, 8)
    tokens: int = 840  # divisible by 2..8
    heads: int = 4
    head_dim: int = 64
    layout: str = "striped"
    comm_dtypes: tuple = ("float32", "bfloat16")
    seed: int = 0
    progress: bool = True  # a bar over the world sizes on stderr (tqdm)


def _reference(cfg: PrecisionConfig):
    gen = torch.Generator().manual_seed(cfg.seed)
    q, k, v, dout = random_qkv(1, cfg.tokens, cfg.heads, cfg.heads, cfg.head_dim, "cpu", torch.bfloat16, gen,
                               grad=False)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qr, kr) / math.sqrt(cfg.head_dim)
    pos = torch.arange(cfg.tokens)
    s = s.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    (torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vr) * dout.double()).sum().backward()
    return (q, k, v, dout), (qr.grad, kr.grad, vr.grad)


def _worker(rank, n, cfg, init_file, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=300))
    from ..engine.request import ring_attention
    from ..plan.layouts import shard

    (q, k, v, dout), ref = _reference(cfg)
    out = {}
    for name in cfg.comm_dtypes:
        local = [shard(t, n, rank, layout=cfg.layout).requires_grad_() for t in (q, k, v)]
        o = ring_attention(*local, layout=cfg.layout, grad_comm_dtype=getattr(torch, name))
        o.backward(shard(dout, n, rank, layout=cfg.layout))
        errs = []
        for mine, want in zip(local, ref):
            want = shard(want, n, rank, layout=cfg.layout)
            # squared norms summed over the ranks: ||grad - ref|| / ||ref|| over the whole sequence
            sq = torch.tensor([(mine.grad.double() - want).pow(2).sum().item(), want.pow(2).sum().item()])
            dist.all_reduce(sq)
            errs.append(math.sqrt(sq[0].item() / sq[1].item()))
        out[name] = errs
    results.put(("ok", rank, out))  # the same on every rank (the errors are summed over the ranks)
    dist.barrier()
    dist.destroy_process_group()


def measure(cfg: PrecisionConfig) -> list[dict]:
    """``[{"world_size", "grad_comm_dtype", "dq", "dk", "dv"}]``: relative errors (norm of the
    difference over norm of the reference, whole sequence) of bf16 runs."""
    from .common import progress

    records = []
    for n in progress(cfg.world_sizes, total=len(cfg.world_sizes), desc="precision N", enabled=cfg.progress):
        if cfg.tokens % n:
            raise ValueError(f"tokens={cfg.tokens} must divide by every world size (got {n})")
        got = spawn_ranks(_worker, (n, cfg), n, 600, f"bench precision N={n}")[0]
        for name, (dq, dk, dv) in got.items():
            records.append({"world_size": n, "grad_comm_dtype": name, "dq": dq, "dk": dk, "dv": dv})
    return records


def register(modes) -> None:
    """Add ``striped-sp bench precision``."""
    p = modes.add_parser("precision", help="bf16 gradient error against N for each grad_comm_dtype",
                         description="bf16 gradient error against the ring size N, for each dtype dK/dV travel\n"
                                     "the ring in (N gloo processes on this machine per ring size).")
    p.add_argument("--world-sizes", default="2,3,4,5,6,7,8", help="comma-separated ranks N, one run each")
    p.add_argument("--tokens", type=int, default=840, help="global sequence length (divisible by every N)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=_main)


def _main(args) -> int:
    sizes = tuple(int(x) for x in args.world_sizes.split(",") if x)
    recs = measure(PrecisionConfig(world_sizes=sizes, tokens=args.tokens, progress=not args.no_progress))
    print("bf16 q/k/v, causal, striped; ||grad - float64 reference|| / ||reference|| over the sequence")
    print(f"{'N':>3}  {'dK/dV travel as':<16}{'dq':>10}{'dk':>10}{'dv':>10}")
    for r in recs:
        print(f"{r['world_size']:>3}  {r['grad_comm_dtype']:<16}{r['dq']:>10.2e}{r['dk']:>10.2e}{r['dv']:>10.2e}")
    return 0
