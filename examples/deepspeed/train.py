"""Train a tiny Llama-style model under DeepSpeed with striped context parallelism.

The model is built from a config (random init, nothing downloaded).  The script trains it twice
from the same seed on the same samples: first with ``sequence_parallel_size=1`` (plain data
parallelism), then with the config's context parallelism, and prints both losses per step.
Both runs see the same global batch: the SP=1 run has more data-parallel replicas and
proportionally fewer gradient-accumulation steps.

    python examples/deepspeed/train.py                      # spawns 2 CPU ranks itself
    python examples/deepspeed/train.py --packed --window 64 # packed documents, a Mistral window
    torchrun --nproc_per_node 2 examples/deepspeed/train.py # or any launcher that sets RANK etc.

On CPU it sets ``DS_ACCELERATOR=cpu`` (gloo); ``striped_sp.deepspeed.initialize`` skips
DeepSpeed's shared-memory op build there.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(HERE, "ds_config.json"), help="DeepSpeed JSON config")
    p.add_argument("--algo", choices=("striped", "zigzag", "ring"), help="override context_parallel.algo")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--packed", action="store_true",
                   help="rows of 5 documents of random lengths, position_ids restarting per document")
    p.add_argument("--window", type=int, default=None, help="a Mistral model with this sliding_window")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not started by a launcher")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p.parse_args(argv)


class PatternData(torch.utils.data.Dataset):
    """Learnable token sequences: arithmetic progressions mod the vocabulary, seeded by index."""

    def __init__(self, n, seq_len, vocab):
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + i)
        start, step = torch.randint(0, self.vocab, (2,), generator=g).tolist()
        ids = (start + (step % 7 + 1) * torch.arange(self.seq_len)) % self.vocab
        return {"input_ids": ids, "labels": ids.clone()}


class PackedPatternData(PatternData):
    """Rows packed from 5 pattern documents of seeded random lengths (as DataCollatorWithFlattening
    lays them out: ``position_ids`` restart at 0 per document).  Every row has the same number of
    targets, so data-parallel averaging and the SP=2 run weight tokens alike."""

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(2000 + i)
        cuts = torch.randperm(self.seq_len - 1, generator=g)[:4].add(1).sort().values.tolist()
        bounds = [0, *cuts, self.seq_len]
        docs = [super(PackedPatternData, self).__getitem__(7 * i + d)["input_ids"][: b - a]
                for d, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
        ids = torch.cat(docs)
        pos = torch.cat([torch.arange(len(d)) for d in docs])
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def tiny_llama(vocab, window=None):
    """A Llama-style model; with ``window``, a Mistral (the same, with ``sliding_window``)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  attention_dropout=0.0, tie_word_embeddings=False)
    if window is None:
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=window))
    # training: no KV cache (with one, transformers' sdpa/eager masks ignore the packed documents)
    model.config.use_cache = False
    model.set_attn_implementation("sdpa")
    return model


def train(config: dict, args, vocab=128) -> list[float]:
    """Train ``args.steps`` optimizer steps; returns the global mean loss of each step."""
    import torch.distributed as dist

    import striped_sp.deepspeed as ssd

    model = tiny_llama(vocab, args.window)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    world = int(os.environ["WORLD_SIZE"])
    sp = config.get("sequence_parallel_size", 1)
    global_batch = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * (world // sp)
    data = (PackedPatternData if args.packed else PatternData)(args.steps * global_batch, args.seq_len, vocab)
    engine, _, loader, _ = ssd.initialize(model=model, optimizer=optimizer, training_data=data, config=config)
    gas = engine.gradient_accumulation_steps()
    dp_group = None  # averaging over every rank = over data parallel (SP ranks hold equal values)
    losses, acc = [], 0.0
    for i, batch in enumerate(loader):
        batch = {k: v.to(engine.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        acc += loss.item() / gas
        if (i + 1) % gas == 0:
            total = torch.tensor([acc], device=engine.device)
            dist.all_reduce(total, group=dp_group)
            losses.append(total.item() / world)
            acc = 0.0
    return losses


def main(args) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    with open(args.config) as f:
        config = json.load(f)
    if args.algo:
        config.setdefault("context_parallel", {})["algo"] = args.algo
    world = int(os.environ["WORLD_SIZE"])
    import striped_sp.deepspeed as ssd

    # the config's own errors first (each names its key), before the batch arithmetic below uses it
    ssd.check_requested(config)
    sp = ssd.parse_config(config, world_size=world).sequence_parallel_size
    # the SP=1 reference: same global batch, more replicas, fewer accumulation steps
    ref = dict(config, sequence_parallel_size=1)
    ref_gas = config["gradient_accumulation_steps"] * (world // sp) // world
    if ref_gas * world != config["gradient_accumulation_steps"] * (world // sp):
        sys.exit(f"gradient_accumulation_steps must be a multiple of sequence_parallel_size={sp} for the comparison")
    ref["gradient_accumulation_steps"] = ref_gas
    ref_losses = train(ref, args)  # first: DeepSpeed keeps the SP groups of a later engine
    losses = train(config, args)
    algo = config.get("context_parallel", {}).get("algo", "striped")
    if rank == 0:
        extra = (", packed rows of 5 documents" if args.packed else "") + (f", window {args.window}" if args.window else "")
        print(f"\nloss per step, world size {world}, seq len {args.seq_len}{extra}")
        print(f"{'step':>4}  {'SP=1':>12}  {f'SP={sp} {algo}':>16}  {'rel diff':>9}")
        for step, (a, b) in enumerate(zip(ref_losses, losses), 1):
            print(f"{step:>4}  {a:>12.6f}  {b:>16.6f}  {abs(a - b) / abs(a):>9.2e}")
    dist.barrier()


def _spawned(local_rank, main_fn, parse_fn, world_size, port, argv):
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    main_fn(parse_fn(argv))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(main_fn, parse_fn) -> None:
    """``main_fn(parse_fn())`` under a launcher that sets ``RANK`` etc., else on ``--world-size``
    spawned CPU (or GPU) ranks."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # run from a clone without installing
    cli = parse_fn()
    if "RANK" in os.environ:  # started by torchrun / the deepspeed launcher
        main_fn(cli)
    else:
        import torch.multiprocessing as mp

        mp.start_processes(_spawned, args=(main_fn, parse_fn, cli.world_size, _free_port(), sys.argv[1:]),
                           nprocs=cli.world_size, start_method="spawn")


if __name__ == "__main__":
    launch(main, parse_args)
