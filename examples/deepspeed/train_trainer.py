"""The Hugging Face ``Trainer`` with striped context parallelism from ``--deepspeed ds_config.json``.

The user's usual Trainer script; the one change is the import of the Trainer class.  The JSON
(``ds_config_trainer.json`` beside this file) holds ``"sequence_parallel_size": 2`` and the
``"context_parallel"`` section, with the Trainer's usual ``"auto"`` values.  A tiny Llama-style
model is built from a config (random init, nothing downloaded) and trained on learnable patterns.

    python examples/deepspeed/train_trainer.py                          # spawns 2 CPU ranks itself
    python examples/deepspeed/train_trainer.py --zero 3 --steps 8 --bf16
    torchrun --nproc_per_node 2 examples/deepspeed/train_trainer.py     # or any launcher
    deepspeed --num_gpus 2 examples/deepspeed/train_trainer.py --deepspeed examples/deepspeed/ds_config_trainer.json

On CPU it sets ``DS_ACCELERATOR=cpu`` and ``use_cpu=True`` (accelerate picks gloo only for a CPU
state).  Prints the Trainer's logged loss per step, the evaluation loss, and where the model went.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from train import PatternData, launch, tiny_llama  # noqa: E402  (the plain-engine example's model, data, launcher)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed", default=os.path.join(HERE, "ds_config_trainer.json"), help="DeepSpeed JSON")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="override zero_optimization.stage")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--bf16", action="store_true", help="bf16 training (fills the JSON's bf16 'auto')")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--output-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "striped_sp_trainer"))
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not started by a launcher")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(args) -> None:
    from transformers import TrainingArguments

    from striped_sp.deepspeed import ContextParallelTrainer as Trainer  # the one line
    from striped_sp.deepspeed import check_requested, parse_config

    with open(args.deepspeed) as f:
        ds_config = json.load(f)
    if args.zero is not None:
        ds_config["zero_optimization"]["stage"] = args.zero
        ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    vocab, micro, gas = 128, 1, 2
    world = int(os.environ["WORLD_SIZE"])
    # the config's own errors first (each names its key), before the batch arithmetic below uses it
    check_requested(ds_config)
    sp = parse_config(ds_config, world_size=world).sequence_parallel_size
    samples = args.steps * micro * gas * (world // sp)
    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=ds_config, per_device_train_batch_size=micro,
        per_device_eval_batch_size=micro, gradient_accumulation_steps=gas, learning_rate=5e-3,
        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to=[],
        bf16=args.bf16, use_cpu=not torch.cuda.is_available(), dataloader_pin_memory=False, seed=0)
    trainer = Trainer(model=tiny_llama(vocab), args=training_args,
                      train_dataset=PatternData(samples, args.seq_len, vocab),
                      eval_dataset=PatternData(4, args.seq_len, vocab))
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()
    if trainer.is_world_process_zero():
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        print(f"\nTrainer, world size {world}, sequence_parallel_size {sp}, "
              f"ZeRO-{ds_config['zero_optimization']['stage']}, seq len {args.seq_len}")
        for step, loss in enumerate(losses, 1):
            print(f"step {step:>3}  loss {loss:.6f}")
        print(f"eval_loss {metrics['eval_loss']:.6f}; model saved to {args.output_dir}")


if __name__ == "__main__":
    launch(main, parse_args)
