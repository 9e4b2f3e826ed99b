"""TRL's ``SFTTrainer`` with packing (or padding-free batches) and striped context parallelism.

The user's usual SFT script; the one change is the import of the trainer class.  The DeepSpeed
JSON (``ds_config_trainer.json`` beside this file) holds ``"sequence_parallel_size": 2`` and the
``"context_parallel"`` section.  A tiny Llama-style model (built from a config, random init,
nothing downloaded) with an in-memory word-level tokenizer learns documents of random lengths
(arithmetic patterns), packed by TRL (``packing=True``, best-fit decreasing) into rows of
``--max-length`` tokens.  The script trains twice from the same seed on the same rows: first a
plain ``trl.SFTTrainer`` at ``sequence_parallel_size=1`` (2 data-parallel replicas, none of our
code), then ``ContextParallelSFTTrainer`` at SP=2 (1 replica, twice the gradient accumulation, so
every optimizer step holds the same rows), and prints both logged losses per step.

    python examples/deepspeed/train_trl.py                   # spawns 2 CPU ranks itself
    python examples/deepspeed/train_trl.py --padding-free    # unpacked documents, flattened per batch
    torchrun --nproc_per_node 2 examples/deepspeed/train_trl.py

Needs ``pip install 'striped_sp[deepspeed,trl]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from train import launch, tiny_llama  # noqa: E402  (the plain-engine example's model and launcher)

VOCAB = 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed", default=os.path.join(HERE, "ds_config_trainer.json"), help="DeepSpeed JSON")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--max-length", type=int, default=256, help="tokens per packed row")
    p.add_argument("--padding-free", action="store_true", help="padding_free=True without packing")
    p.add_argument("--output-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "striped_sp_trl"))
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not started by a launcher")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def word_tokenizer(vocab: int):
    """A word-level tokenizer ``t2 .. t{vocab-1}`` with ``<pad>`` = 0 and ``</s>`` = 1, built in memory."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="</s>")


def pattern_documents(n: int, longest: int, vocab: int):
    """``n`` tokenized documents of 8..longest tokens: arithmetic progressions mod the vocabulary."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(7)
    docs = []
    for _ in range(n):
        length, start, step = (torch.randint(8, longest + 1, (1,), generator=g).item(),
                               *torch.randint(2, vocab, (2,), generator=g).tolist())
        docs.append([2 + (start + (step % 7 + 1) * j) % (vocab - 2) for j in range(length)])
    return Dataset.from_dict({"input_ids": docs})


def run(args, ds_config: dict, sp: int) -> list[float]:
    """Train ``args.steps`` steps at ``sequence_parallel_size=sp``; the logged loss of every step."""
    from accelerate.state import AcceleratorState
    from trl import SFTConfig, SFTTrainer

    from striped_sp.deepspeed.trl import ContextParallelSFTTrainer

    AcceleratorState._reset_state(True)  # the second run in this process
    world = int(os.environ["WORLD_SIZE"])
    config = dict(ds_config, sequence_parallel_size=sp)
    if sp == 1:
        config.pop("context_parallel", None)  # the plain run: DeepSpeed and TRL as they come
    micro, replicas = 2, world // sp
    gas = 4 // replicas  # 4 micro-batches of 2 rows per optimizer step in both runs
    sft = dict(packing=True, max_length=args.max_length) if not args.padding_free else \
        dict(padding_free=True, max_length=None)
    training_args = SFTConfig(
        output_dir=args.output_dir, deepspeed=config, per_device_train_batch_size=micro,
        gradient_accumulation_steps=gas, learning_rate=5e-3, max_steps=args.steps, logging_steps=1,
        save_strategy="no", report_to=[], train_sampling_strategy="sequential", bf16=False,
        gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(), dataloader_pin_memory=False,
        seed=0, **sft)
    trainer_class = SFTTrainer if sp == 1 else ContextParallelSFTTrainer  # the one change in a user's script
    trainer = trainer_class(model=tiny_llama(VOCAB), args=training_args, processing_class=word_tokenizer(VOCAB),
                            train_dataset=pattern_documents(48 * args.steps, args.max_length // 2, VOCAB))
    trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def main(args) -> None:
    import torch.distributed as dist

    from striped_sp.deepspeed import check_requested, parse_config, skip_cpu_shm_comm_build

    skip_cpu_shm_comm_build()  # CPU: no JIT build of DeepSpeed's inference-only shm op in the SP=1 run
    with open(args.deepspeed) as f:
        ds_config = json.load(f)
    # the config's own errors first (each names its key), before the batch arithmetic of run() uses it
    check_requested(ds_config)
    sp = parse_config(ds_config, world_size=int(os.environ["WORLD_SIZE"])).sequence_parallel_size
    plain = run(args, ds_config, 1)  # SP=1 first: DeepSpeed keeps the mpu of the last engine
    striped = run(args, ds_config, sp)
    if dist.get_rank() == 0:
        what = "padding-free batches" if args.padding_free else f"packed rows of {args.max_length} tokens"
        print(f"\nSFTTrainer, {what}, world size {os.environ['WORLD_SIZE']}: SP=1 vs SP={sp}")
        for step, (a, b) in enumerate(zip(plain, striped), 1):
            print(f"step {step:>3}  SP=1 {a:.6f}  SP={sp} {b:.6f}  rel diff {abs(a - b) / abs(a):.1e}")


if __name__ == "__main__":
    launch(main, parse_args)
