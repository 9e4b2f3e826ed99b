"""Demo: every layout on N ranks against a float64 single-process reference.

    python -m striped_sp.demo --world-size 2          # spawns 2 gloo ranks on the CPU
    torchrun --nproc-per-node 4 -m striped_sp.demo    # under torchrun: NCCL on GPUs, else gloo

Prints, per layout, the max relative error of the output and of dq/dk/dv, and each rank's
causal work: attention score entries computed per (batch, head); first for one causal document
per row, then for a packed row of many documents under a sliding window (``--docs``, ``--window``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .engine.request import ring_attention
from .bench.docs import workload
from .bench.work import masked_step_entries, score_entries
from .plan.layouts import LAYOUTS, shard


def _reference(q, k, v, dout, scale, bounds=None, left=-1):
    """float64 attention with the causal mask, inside documents ``bounds``, window ``left``."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    g = q.size(2) // k.size(2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * scale
    pos = torch.arange(q.size(1))
    hidden = pos.unsqueeze(0) > pos.unsqueeze(1)
    if bounds is not None:
        doc = torch.searchsorted(torch.tensor(bounds[1:]), pos, right=True)
        hidden |= doc.unsqueeze(0) != doc.unsqueeze(1)
    if left >= 0:
        hidden |= pos.unsqueeze(0) < pos.unsqueeze(1) - left
    s = s.masked_fill(hidden, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.repeat_interleave(g, 2))
    (out * dout.double()).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _run_packed(rank, world_size, args, device):
    """Packed documents under a window: ``{layout: (err, work, critical/ideal, padding, documents)}``."""
    rows = {}
    for layout in LAYOUTS:
        work = workload(layout, world_size, args.tokens_per_rank, args.docs, args.window or None, args.seed)
        bounds, seq = list(work.mask.bounds), work.mask.seq_len
        gen = torch.Generator().manual_seed(args.seed)
        q, dout = (torch.randn(1, seq, args.heads, args.head_dim, generator=gen) for _ in range(2))
        k, v = (torch.randn(1, seq, args.kv_heads, args.head_dim, generator=gen) for _ in range(2))
        ref = _reference(q, k, v, dout, args.head_dim ** -0.5, bounds, work.mask.left)
        sh = lambda t: shard(t, world_size, rank, layout=layout, cu_seqlens=bounds).to(device)  # noqa: E731
        ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, layout=layout, cu_seqlens=torch.tensor(bounds),
                             window_size=(args.window, 0) if args.window else None)
        (out * sh(dout)).sum().backward()
        err = max(
            ((a.double().cpu() - sh(b).cpu()).abs().max() / b.abs().max()).item()
            for a, b in zip((out, ql.grad, kl.grad, vl.grad), ref)
        )
        entries = masked_step_entries(work)
        critical = sum(max(row) for row in entries) / work.ideal_entries
        rows[layout] = (err, sum(row[rank] for row in entries), critical, work.padding_tokens, len(bounds) - 1)
    return rows


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
    return {"dense": rows, "packed": _run_packed(rank, world_size, args, device)}


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
    p.add_argument("--docs", default="lognormal:median=48,sigma=1.0",
                   help="document-length mix of the packed row (see striped-sp bench --docs)")
    p.add_argument("--window", type=int, default=40, help="sliding window of the packed run (0: none)")
    args = p.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        per_rank = _under_torchrun(args)
        if per_rank is None:
            return
    else:
        per_rank = _spawn(args)
    seq = args.tokens_per_rank * args.world_size
    ranks = range(args.world_size)
    print(f"causal ring attention, {args.world_size} ranks, {seq} tokens "
          f"({args.tokens_per_rank}/rank), {args.heads} q heads / {args.kv_heads} kv heads, float32")
    print("error: max relative error of out, dq, dk, dv against a float64 single-process reference")
    print("work: attention score entries computed per (batch, head), per rank\n")
    _table(per_rank, "dense", ranks, "max/min",
           lambda layout, work: f"  {max(work) / min(work):7.3f}")
    packed = {layout: per_rank[0]["packed"][layout] for layout in LAYOUTS}
    print(f"\npacked row: {packed['striped'][4]} documents ({args.docs}), window {args.window or 'none'}; "
          "zigzag pads every document to a multiple of 2N (Transformer Engine's rule)")
    print("critical/ideal: sum over ring steps of the busiest rank's entries / (visible entries / N)\n")
    _table(per_rank, "packed", ranks, f"{'padding':>7}  critical/ideal",
           lambda layout, work: f"  {packed[layout][3]:>7}  {packed[layout][2]:14.3f}")


def _table(per_rank, kind, ranks, last_header, last_cells) -> None:
    """Per layout: the max error over ranks, each rank's work, then ``last_cells(layout, work)``."""
    header = f"{'layout':<11} {'max rel err':>11}  " + "  ".join(f"{f'rank {r}':>9}" for r in ranks) + "  " + last_header
    print(header)
    print("-" * len(header))
    for layout in LAYOUTS:
        err = max(per_rank[r][kind][layout][0] for r in ranks)
        work = [per_rank[r][kind][layout][1] for r in ranks]
        print(f"{layout:<11} {err:>11.2e}  " + "  ".join(f"{w:>9}" for w in work) + last_cells(layout, work))

if __name__ == "__main__":
    main()
