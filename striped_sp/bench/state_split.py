"""One hybrid mixer layer under state passing, beside the head all-to-all, the gather and SP=1.

``python -m striped_sp.bench.state_split --kinds gated_delta,mamba2 --world-sizes 2,4 --seq-lens 4096,16384``
(``--json FILE``: the records too; ``--fit FILE ...``: refit :mod:`striped_sp.plan.mixer_cost` from them,
:mod:`.mixer_fit`)

Per mixer kind (transformers' own modules, :func:`striped_sp.bench.hybrid_split.mixer_of`), ring size ``N``
and sequence length ``S``, on ``N`` spawned gloo ranks (one compute thread each), forward + backward of
the layer on this rank's ``S/N`` tokens (layout striped):

* ``state``: :mod:`striped_sp.deepspeed.state` (contiguous chunks, one all-to-all of the hidden states
  each way, the halo and the summaries all-gathered, the outputs corrected);
* ``split``: the head all-to-all (:mod:`striped_sp.deepspeed.split`), where the heads divide by ``N``;
* ``gathered``: the whole row gathered, the module on all ``S`` tokens;
* ``sp1``: the module on all ``S`` tokens in one process (rank 0).

Figures: the busiest rank's CPU time (median of ``--reps`` after a warm-up) and the bytes one rank
sends per layer, forward and backward (all-to-alls: ``(N - 1) / N`` of what it hands them; the
all-gathers and their reduce-scatters: ``(N - 1)`` times its own part).  ``--transfer``: instead,
the gated delta net's correction alone on one process (:func:`striped_sp.engine.state_fold.delta_rule_transfer`
against the model's kernel on the chunk, and against a second pass of the kernel from the entry state).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from .common import init_rank, median, spawn_ranks

KINDS = ("gated_delta", "mamba2", "short_conv")
MODES = ("state", "split", "gathered", "sp1")


def _counters():
    """Count what this rank hands the state-passing collectives and the head all-to-all."""
    from ..engine import head_split, state_passing

    sent = {"state": 0, "split": 0}
    exchange, gather, heads = state_passing._exchange, state_passing._all_gather_flat, head_split._exchange

    def counted_exchange(x, group, out_rows, send_counts, recv_counts):
        sent["state"] += x.numel() * x.element_size() * (len(send_counts) - 1) // len(send_counts)
        return exchange(x, group, out_rows, send_counts, recv_counts)

    def counted_gather(out, x, group=None):
        n = out.numel() // x.numel()
        sent["state"] += 2 * (n - 1) * x.numel() * x.element_size()  # and its reduce-scatter backward
        return gather(out, x, group=group)

    def counted_heads(chunks, group):
        sent["split"] += chunks.numel() * chunks.element_size() * (chunks.size(0) - 1) // chunks.size(0)
        return heads(chunks, group)

    state_passing._exchange, state_passing._all_gather_flat = counted_exchange, counted_gather
    head_split._exchange = counted_heads
    return sent


def _runner(mode, module, split, state, seq, n, rank):
    import torch.distributed as dist

    from ..engine.natural_order import gather_natural, natural_order, take_local
    from ..engine.state_passing import contiguous_chunks

    group, order = dist.group.WORLD, natural_order(seq, n, rank, "striped")
    if mode == "state":
        plan = contiguous_chunks(seq, n, rank, "striped")
        return lambda x: state.run(x, group, plan, {})
    if mode == "split":
        return lambda x: split.run(x, group, order, {})
    if mode == "gathered":
        return lambda x: take_local(module(gather_natural(x, group, order)), order)
    return module


def _worker(rank, args, n, device_type, init_file, results):
    import torch.distributed as dist

    from ..deepspeed.split import split_or_reason
    from ..deepspeed.state import find_state
    from .hybrid_split import mixer_of

    init_rank(rank, n, "cpu", init_file, 1800.0, threads=1)
    sent = _counters()
    records = []
    for kind in args.kinds:
        torch.manual_seed(0)
        module = mixer_of(kind, args.hidden, args.key_heads).train()
        split, _ = split_or_reason(module, n)
        state = find_state(module)
        for seq in args.seq_lens:
            rec = {"kind": kind, "N": n, "S": seq}
            gen = torch.Generator().manual_seed(rank)
            for mode in args.modes:
                runs = (mode != "split" or split is not None) and (mode != "sp1" or rank == 0)
                tokens = seq if mode == "sp1" else seq // n
                x, g = (torch.randn(1, tokens, args.hidden, generator=gen) for _ in range(2))
                run = _runner(mode, module, split, state, seq, n, rank)
                cpu, before = [], dict(sent)
                for i in range(args.reps + 1):
                    dist.barrier()
                    if not runs:
                        continue
                    before = dict(sent)
                    c0 = time.process_time()
                    run(x.clone().requires_grad_()).backward(g)
                    if i:
                        cpu.append(time.process_time() - c0)
                    module.zero_grad(set_to_none=True)
                stat = torch.tensor([median(cpu) if cpu else 0.0], dtype=torch.float64)
                dist.all_reduce(stat, op=dist.ReduceOp.MAX)
                rec[f"{mode}_cpu_ms"] = stat.item() * 1e3 if runs or mode == "sp1" else None
                if mode in ("state", "split"):
                    rec[f"{mode}_MiB_sent"] = (sent[mode] - before[mode]) / 2**20 if runs else None
            if "state" in args.modes and "sp1" in args.modes:
                rec["state_x_N_over_sp1"] = rec["state_cpu_ms"] * n / rec["sp1_cpu_ms"]
            records.append(rec)
    dist.barrier()
    dist.destroy_process_group()
    results.put(("ok", rank, records))


def transfer(seq: int, heads: int = 4, dk: int = 64, reps: int = 3) -> dict:
    """The gated delta net's correction on one chunk of ``seq`` tokens, one thread: the model's kernel
    (transformers' torch ``chunk_gated_delta_rule``) fwd + bwd, :func:`delta_rule_transfer` (``R`` and ``M``)
    fwd + bwd, and the kernel again from an entry state (the second pass it replaces)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as kernel

    from ..engine.state_fold import delta_rule_transfer

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, heads, dk, generator=g, requires_grad=True) for _ in range(3))
    decay = (-torch.rand(1, seq, heads, generator=g) * 0.1).requires_grad_()
    beta = torch.rand(1, seq, heads, generator=g).requires_grad_()
    entry = torch.randn(1, heads, dk, dk, generator=g)

    def timed(fn):
        times = []
        for i in range(reps + 1):
            c0 = time.process_time()
            out = fn()
            sum(o.float().sum() for o in out if o is not None).backward()
            if i:
                times.append(time.process_time() - c0)
        return median(times) * 1e3

    norm = lambda u: u / u.norm(dim=-1, keepdim=True)  # noqa: E731
    base = timed(lambda: kernel(q, k, v, g=decay, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True))
    fix = timed(lambda: delta_rule_transfer(norm(q) * dk ** -0.5, norm(k), decay, beta))
    again = timed(lambda: kernel(q, k, v, g=decay, beta=beta, initial_state=entry, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True))
    return {"tokens": seq, "heads": heads, "dk": dk, "kernel_ms": base, "chunked_correction_ms": fix,
            "second_pass_ms": again, "correction_over_kernel": fix / base}


def main(argv=None) -> int:
    from .report import format_table

    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--kinds", default="gated_delta,mamba2")
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--seq-lens", default="4096,16384")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--key-heads", type=int, default=None, help="a gated delta net's key heads (default: hidden / 64)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES), help="the forms to time (default: all)")
    p.add_argument("--json", default=None, help="also write the records to this file")
    p.add_argument("--transfer", action="store_true")
    p.add_argument("--fit", nargs="+", metavar="JSON", help="refit the forms' cost model from --json files")
    p.add_argument("--fit-lens", default="4096,16384", help="with --fit: the row lengths fitted on (others: tested)")
    p.add_argument("--fit-world-sizes", default="", help="with --fit: the N fitted on (default: all; others: tested)")
    args = p.parse_args(argv)
    if args.fit:
        from .mixer_fit import main as refit

        sizes = {int(s) for s in args.fit_world_sizes.split(",") if s}
        return refit(args.fit, {int(s) for s in args.fit_lens.split(",")}, sizes)
    args.kinds, args.modes = tuple(args.kinds.split(",")), tuple(args.modes.split(","))
    unknown = set(args.modes) - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: {', '.join(sorted(unknown))} not among {', '.join(MODES)}")
    args.seq_lens = tuple(int(s) for s in args.seq_lens.split(","))
    if args.transfer:
        rows = [transfer(s) for s in args.seq_lens]
        print(format_table(rows, [(k, k) for k in rows[0]]))
        return 0
    records = []
    for n in (int(s) for s in args.world_sizes.split(",")):
        records += spawn_ranks(_worker, (args, n, "cpu"), n, 3600.0, f"state passing N={n}")[0]
    print(f"one mixer layer, fwd+bwd, hidden {args.hidden} (key heads {args.key_heads or 'as value heads'}), float32, "
          f"gloo, one thread per rank, striped; medians of {args.reps}; cpu ms: the busiest rank's\n")
    print(format_table(records, [(k, k) for k in records[0]]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
