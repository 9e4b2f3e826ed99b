"""Demo: every layout on N ranks against a float64 single-process reference.

    python -m striped_sp.demo --world-size 2          # spawns 2 gloo ranks on the CPU
    torchrun --nproc-per-node 4 -m striped_sp.demo    # under torchrun: NCCL on GPUs, else gloo

Prints, per layout, the max relative error of the output and of dq/dk/dv, and each rank's
causal work: attention score entries computed per (batch, head).
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .attention import ring_attention
from .bench.work import score_entries
from .layouts import LAYOUTS, shard


def _reference(q, k, v, dout, scale):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    g = q.size(2) // k.size(2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * scale
    n = q.size(1)
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.repeat_interleave(g, 2))
    (out * dout.double()).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _run_layouts(rank, world_size, args, device):
    """On this rank: every layout's max relative error and causal work, ``{layout: (err, work)}``."""
    gen = torch.Generator().manual_seed(args.seed)
    seq = args.tokens_per_rank * world_size
    shape_q = (args.batch, seq, args.heads, args.head_dim)
    shape_kv = (args.batch, seq, args.kv_heads, args.head_dim)
    q, dout = torch.randn(shape_q, generator=gen), torch.randn(shape_q, generator=gen)
    k, v = torch.randn(shape_kv, generator=gen), torch.randn(shape_kv, generator=gen)
    ref = _reference(q, k, v, dout, args.head_dim ** -0.5)
    rows = {}
    for layout in LAYOUTS:
        sh = lambda t: shard(t, world_size, rank, layout=layout).to(device)  # noqa: E731
        ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, layout=layout)
        (out * sh(dout)).sum().backward()
        err = max(
            ((a.double().cpu() - sh(b).cpu()).abs().max() / b.abs().max()).item()
            for a, b in zip((out, ql.grad, kl.grad, vl.grad), ref)
        )
        rows[layout] = (err, score_entries(layout, world_size, rank, args.tokens_per_rank))
    return rows


def _worker(rank, world_size, init_file, args, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    results.put((rank, _run_layouts(rank, world_size, args, torch.device("cpu"))))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(args) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(r, args.world_size, init_file, args, results))
                 for r in range(args.world_size)]
        for proc in procs:
            proc.start()
        per_rank = dict(results.get(timeout=600) for _ in procs)
        for proc in procs:
            proc.join()
    return per_rank


def _under_torchrun(args) -> dict | None:
    """Run as one of torchrun's ranks; rank 0 gets every rank's rows, the others ``None``."""
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    args.world_size = world_size
    gathered = [None] * world_size
    dist.all_gather_object(gathered, _run_layouts(rank, world_size, args, device))
    dist.destroy_process_group()
    return dict(enumerate(gathered)) if rank == 0 else None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--tokens-per-rank", type=int, default=250)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        per_rank = _under_torchrun(args)
        if per_rank is None:
            return
    else:
        per_rank = _spawn(args)
    seq = args.tokens_per_rank * args.world_size
    print(f"causal ring attention, {args.world_size} ranks, {seq} tokens "
          f"({args.tokens_per_rank}/rank), {args.heads} q heads / {args.kv_heads} kv heads, float32")
    print("error: max relative error of out, dq, dk, dv against a float64 single-process reference")
    print("work: attention score entries computed per (batch, head), per rank\n")
    ranks = range(args.world_size)
    header = f"{'layout':<11} {'max rel err':>11}  " + "  ".join(f"{f'rank {r}':>9}" for r in ranks) + "  max/min"
    print(header)
    print("-" * len(header))
    for layout in LAYOUTS:
        err = max(per_rank[r][layout][0] for r in ranks)
        work = [per_rank[r][layout][1] for r in ranks]
        print(f"{layout:<11} {err:>11.2e}  " + "  ".join(f"{w:>9}" for w in work)
              + f"  {max(work) / min(work):7.3f}")


if __name__ == "__main__":
    main()
