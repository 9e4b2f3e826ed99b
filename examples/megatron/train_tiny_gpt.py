"""Train a tiny megatron-core GPT with ``--context-parallel-algo striped`` on CPU, beside CP=1.

    python examples/megatron/train_tiny_gpt.py                 # spawns 2 gloo ranks, CP=2
    python examples/megatron/train_tiny_gpt.py --world-size 4 --cp 2 --algo zigzag

The model: megatron-core ``GPTModel``, 2 layers, RoPE, grouped-query attention (4 query heads,
2 kv heads), float32.  The task: each sequence holds one *key* token (one of 16) somewhere in
its first quarter, then noise, then a run of *query* tokens at the very end whose target is
the key.  The answer lies hundreds of tokens back, on another CP rank for most query tokens,
so the loss falls below chance (ln 16 = 2.77) only if attention across shards works; it
reaches ~0.1 in 80 steps (about 30 s on 2 CPU cores).

Two runs train side by side from the same seed on the same global batches, with torch AdamW
(Megatron's optimizer is CUDA-only) and gradients all-reduced over DP x CP (the whole world):

* CP=N: context parallel with the chosen algo, DP = world / N;
* CP=1: every rank attends its own whole sequences, DP = world.

Per step it prints both losses and their difference, then the largest difference.

``--packed``: every row is a packed THD row of documents of uneven lengths (some shorter than
the CP size), each holding its own key and queries, as Megatron's ``--sft`` path packs them
(``cu_seqlens``, ``PackedSeqParams``); attention never crosses a document.  It also prints the
padding that Megatron's native per-document zigzag (every document a multiple of 2 x CP) would
need for the same rows, where striped needs none.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, _ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks to spawn (default 2)")
    p.add_argument("--cp", type=int, default=2, help="context-parallel size; divides --world-size")
    p.add_argument("--algo", default="striped", choices=["striped", "zigzag", "ring"])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--keys", type=int, default=16, help="distinct key tokens (chance loss = ln keys)")
    p.add_argument("--answers", type=int, default=16, help="query tokens at the end of each sequence")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--init-std", type=float, default=0.1,
                   help="weight init std (larger than Megatron's 0.02 so the toy learns in ~80 steps)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--packed", action="store_true",
                   help="packed THD rows of several documents each (Megatron's --sft format)")
    args = p.parse_args(argv)
    if args.world_size % args.cp != 0:
        p.error(f"--cp {args.cp} must divide --world-size {args.world_size}")
    if args.batch % args.world_size != 0:
        p.error(f"--batch {args.batch} must be a multiple of --world-size {args.world_size}")
    if args.vocab < args.keys + 2:
        p.error("--vocab must exceed --keys + 1 (keys, one query token, noise)")
    return args


def make_batch(args, step: int) -> dict:
    """The global batch of ``step``: tokens, labels, loss_mask, position_ids, each [batch, seq]."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step)
    b, s, k = args.batch, args.seq_length, args.keys
    query = k  # the query token; keys are 0..k-1, noise k+1..vocab-1
    tokens = torch.randint(k + 1, args.vocab, (b, s), generator=gen)
    key = torch.randint(0, k, (b,), generator=gen)
    where = torch.randint(0, s // 4, (b,), generator=gen)
    tokens[torch.arange(b), where] = key
    tokens[:, s - args.answers:] = query
    labels = torch.zeros(b, s, dtype=torch.long)
    labels[:, s - args.answers:] = key[:, None]
    loss_mask = torch.zeros(b, s)
    loss_mask[:, s - args.answers:] = 1.0
    position_ids = torch.arange(s).expand(b, s).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def make_packed_rows(args, step: int) -> list:
    """The global batch of ``step`` as packed rows: per row a dict of ``[1, seq]`` tensors and
    ``cu_seqlens`` (int32 document bounds).  Each document: noise, its key in its first quarter,
    queries at its end whose target is the key."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step)
    s, k = args.seq_length, args.keys
    rows = []
    for _ in range(args.batch):
        lengths, left = [], s
        while left > 0:
            n = int(torch.randint(1, max(2, s // 3), (1,), generator=gen))
            n = left if left - n < 8 else n
            lengths.append(n)
            left -= n
        tokens = torch.randint(k + 1, args.vocab, (1, s), generator=gen)
        labels = torch.zeros(1, s, dtype=torch.long)
        loss_mask = torch.zeros(1, s)
        position_ids = torch.zeros(1, s, dtype=torch.long)
        start = 0
        for n in lengths:
            position_ids[0, start:start + n] = torch.arange(n)
            answers = min(args.answers, n // 3)
            if answers:
                key = int(torch.randint(0, k, (1,), generator=gen))
                tokens[0, start + int(torch.randint(0, max(1, n // 4), (1,), generator=gen))] = key
                tokens[0, start + n - answers:start + n] = k
                labels[0, start + n - answers:start + n] = key
                loss_mask[0, start + n - answers:start + n] = 1.0
            start += n
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        rows.append({"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                     "position_ids": position_ids, "cu_seqlens": cu})
    return rows


def packed_train_step(model, opt, rows, total_tokens: float, algo: str, cp_group) -> float:
    """One AdamW step over packed rows (one THD forward each, as micro-batch size 1); returns the
    global mean loss.  Rows are padded only where the layout needs it (zigzag: every document)."""
    import striped_sp
    import striped_sp.megatron as sm
    from striped_sp.megatron.toy import all_reduce_grads

    opt.zero_grad(set_to_none=True)
    local_sum = torch.zeros(())
    for row in rows:
        pad = striped_sp.pad_documents(row["cu_seqlens"], cp_group.size(), sm.layout_of(algo))
        batch = {key: pad.pad(row[key], dim=1) for key in ("tokens", "labels", "loss_mask", "position_ids")}
        lengths = (row["cu_seqlens"][1:] - row["cu_seqlens"][:-1]).tolist()
        real = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        padded = pad.cu_seqlens[:len(lengths) + 1].to(torch.int32)
        max_seqlen = torch.tensor([int((pad.cu_seqlens[1:] - pad.cu_seqlens[:-1]).max())])
        local, params = sm.get_thd_batch_on_this_cp_rank(batch, real, padded, max_seqlen, algo=algo,
                                                         cp_group=cp_group)
        losses = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                       packed_seq_params=params)
        loss = (losses.float() * local["loss_mask"]).sum()
        (loss / total_tokens).backward()
        local_sum += loss.detach()
    all_reduce_grads(model)
    opt.step()
    dist.all_reduce(local_sum)
    return local_sum.item() / total_tokens


def train_step(model, opt, batch, total_tokens: float) -> float:
    """One AdamW step; returns the global mean loss (all-reduced over the world = DP x CP)."""
    from striped_sp.megatron.toy import all_reduce_grads

    opt.zero_grad(set_to_none=True)
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s]
    local = (losses.float() * batch["loss_mask"]).sum()
    (local / total_tokens).backward()
    all_reduce_grads(model)  # sum over DP x CP: each rank's part of the global mean
    opt.step()
    loss = local.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / total_tokens


def _dense_step(args, step, model_cp, opt_cp, model_ref, opt_ref, rank, world_size, dp_rank, dp_size):
    import striped_sp.megatron as sm

    full = make_batch(args, step)
    total = float(full["loss_mask"].sum())
    per_dp = args.batch // dp_size
    mine = {k: v[dp_rank * per_dp:(dp_rank + 1) * per_dp] for k, v in full.items()}
    loss_cp = train_step(model_cp, opt_cp, sm.get_batch_on_this_cp_rank(mine, args.algo), total)
    per_rank = args.batch // world_size
    own = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in full.items()}
    return loss_cp, train_step(model_ref, opt_ref, own, total)


def _print_padding(rows, cp: int) -> None:
    import striped_sp

    docs = sum(r["cu_seqlens"].numel() - 1 for r in rows)
    tokens = sum(r["tokens"].size(1) for r in rows)
    short = sum(int(((r["cu_seqlens"][1:] - r["cu_seqlens"][:-1]) < cp).sum()) for r in rows)
    pads = {lay: sum(striped_sp.pad_documents(r["cu_seqlens"], cp, lay).padding_tokens for r in rows)
            for lay in ("striped", "zigzag")}
    print(f"packed rows of step 0: {docs} documents in {tokens} tokens ({short} shorter than CP={cp}); "
          f"padding needed: striped {pads['striped']} tokens, native per-document zigzag "
          f"{pads['zigzag']} tokens ({100 * pads['zigzag'] / tokens:.0f}% more)\n")


def run(rank: int, world_size: int, args, init_method: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    from megatron.core import parallel_state

    import striped_sp.megatron as sm
    from striped_sp.megatron.toy import single_rank_group, tiny_gpt

    parallel_state.initialize_model_parallel(context_parallel_size=args.cp)
    sm.install(args.algo)  # RoPE positions, batch slicing, specs and MTP follow the layout
    cp_group = parallel_state.get_context_parallel_group()
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    alone = single_rank_group()

    common = dict(vocab_size=args.vocab, max_seq_len=args.seq_length, hidden=64, heads=4,
                  kv_heads=2, layers=2, position_embedding_type="rope", seed=args.seed,
                  init_std=args.init_std)
    model_cp = tiny_gpt(cp_group, args.algo, **common)
    model_ref = tiny_gpt(alone, args.algo, **common)
    opt_cp = torch.optim.AdamW(model_cp.parameters(), lr=args.lr, weight_decay=0.0)
    opt_ref = torch.optim.AdamW(model_ref.parameters(), lr=args.lr, weight_decay=0.0)

    if rank == 0:
        print(f"megatron-core GPTModel: 2 layers, RoPE, 4 query / 2 kv heads; seq {args.seq_length}, "
              f"global batch {args.batch}, {args.steps} steps, AdamW lr {args.lr}")
        print(f"world {world_size} gloo ranks: CP={args.cp} x DP={dp_size} "
              f"(--context-parallel-algo {args.algo})  vs  CP=1 x DP={world_size}")
        print(f"chance loss ln({args.keys}) = {math.log(args.keys):.3f}\n")
        if args.packed:
            _print_padding(make_packed_rows(args, 0), args.cp)
        print(f"{'step':>4}  {'loss CP=' + str(args.cp):>12}  {'loss CP=1':>12}  {'|diff|':>9}")
    worst, first, last = 0.0, None, None
    t0 = time.time()
    for step in range(args.steps):
        if args.packed:
            rows = make_packed_rows(args, step)
            total = float(sum(r["loss_mask"].sum() for r in rows))
            per_dp, per_rank = args.batch // dp_size, args.batch // world_size
            loss_cp = packed_train_step(model_cp, opt_cp, rows[dp_rank * per_dp:(dp_rank + 1) * per_dp],
                                        total, args.algo, cp_group)
            loss_ref = packed_train_step(model_ref, opt_ref, rows[rank * per_rank:(rank + 1) * per_rank],
                                         total, args.algo, alone)
        else:
            loss_cp, loss_ref = _dense_step(args, step, model_cp, opt_cp, model_ref, opt_ref, rank,
                                            world_size, dp_rank, dp_size)
        diff = abs(loss_cp - loss_ref)
        worst = max(worst, diff)
        first = loss_cp if first is None else first
        last = loss_cp
        if rank == 0:
            print(f"{step:4d}  {loss_cp:12.6f}  {loss_ref:12.6f}  {diff:9.2e}", flush=True)
    if rank == 0:
        print(f"\nlargest |loss CP={args.cp} - loss CP=1| over {args.steps} steps: {worst:.2e}")
        print(f"loss CP={args.cp}: {first:.3f} -> {last:.3f} (chance {math.log(args.keys):.3f}); "
              f"{time.time() - t0:.1f} s of training")
    sm.uninstall()
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://")
        return
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'pg_init')}"
        mp.spawn(run, args=(args.world_size, args, init), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
