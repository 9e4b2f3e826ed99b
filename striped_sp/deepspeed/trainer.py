"""Hugging Face ``Trainer`` with striped context parallelism from the ``--deepspeed`` JSON.

```python
from striped_sp.deepspeed import ContextParallelTrainer as Trainer   # the one line
trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed="ds_config.json"),
                  train_dataset=train, eval_dataset=dev, data_collator=collator)
trainer.train(); trainer.evaluate(); trainer.save_model()
```

with ``"sequence_parallel_size"`` and ``"context_parallel"`` in ``ds_config.json`` (``"auto"`` values
as usual).  The Trainer's accelerator is set up by :func:`.enable_accelerate`: data loaders sample
over data-parallel replicas only and shard every batch after the collator (labels shifted on the
full row), the engine comes from :func:`striped_sp.deepspeed.initialize` (attention, global loss,
SP groups as ``mpu``, ZeRO-3 gradient fix).

The loss.  With ``average_tokens_across_devices=True`` (the default, required here) the Trainer
counts the targets of the whole optimizer step over every process (each target sits on exactly
one rank of its group, so that count is exact), each rank's loss is its summed local loss over
that count, and the Trainer multiplies it by the number of processes because DeepSpeed *averages*
over them.  DeepSpeed sums over the sequence-parallel group and averages over data-parallel
replicas only, so :meth:`ContextParallelTrainer.compute_loss` divides by ``sequence_parallel_size``:
every optimizer step then follows the exact token mean of the step, as at SP=1.  The loss the
Trainer logs is the same as at SP=1.

Refused with a ``ValueError`` naming the setting (at construction, before any collective):
``deepspeed`` unset while the JSON asks for SP, ``average_tokens_across_devices=False``,
``label_smoothing_factor > 0`` (it re-shifts labels on the local tokens), a ``compute_loss_func``,
``train_sampling_strategy="group_by_length"`` or ``"batch_rebalance"`` (``group_by_length=True`` before
transformers 5; the loader's sampler is a data-parallel ``DistributedSampler``),
``parallelism_config`` with ``sp_size``/``cp_size``/``tp_size > 1``, and what :func:`.parse_config`
and :func:`.check_sequence_parallel_settings` refuse.

A plain ``transformers.Trainer`` given the same JSON is refused when it is built, naming this class
(:mod:`.trainer_guard`, installed by ``import striped_sp.deepspeed``); ``__init__`` here runs under
:func:`.trainer_guard.building_ours`, so this class and its subclasses pass.
"""

from __future__ import annotations

try:
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("ContextParallelTrainer needs transformers and accelerate: "
                      "pip install 'striped_sp[hf]' accelerate") from err

from .accelerate import enable_accelerate
from .config import check_requested, load_config, parse_config
from .initialize import check_model
from .window_hint import with_model_window
from .trainer_guard import building_ours
from .zero import check_sequence_parallel_settings

__all__ = ["ContextParallelTrainer", "check_training_arguments"]


def _world_size(args) -> int:
    return int(getattr(args, "world_size", 1) or 1)


def check_training_arguments(args, compute_loss_func=None):
    """The parsed settings of ``args.deepspeed``; ``ValueError`` for settings that conflict with SP."""
    if getattr(args, "deepspeed", None) is None:
        raise ValueError("ContextParallelTrainer needs TrainingArguments(deepspeed=...): the DeepSpeed JSON with "
                         "sequence_parallel_size and the context_parallel section")
    cfg = args.hf_deepspeed_config.config if getattr(args, "hf_deepspeed_config", None) else load_config(args.deepspeed)
    check_requested(cfg)
    settings = parse_config(cfg, world_size=_world_size(args))
    if not settings.enabled:
        return settings
    check_sequence_parallel_settings(cfg)
    problems = []
    if not args.average_tokens_across_devices:
        problems.append("average_tokens_across_devices=False: the loss of a rank's tokens must be divided by the "
                        "target count of the whole step (set it to True)")
    if getattr(args, "label_smoothing_factor", 0.0):
        problems.append(f"label_smoothing_factor={args.label_smoothing_factor}: its loss shifts the labels again "
                        "on the local tokens (set it to 0)")
    strategy = getattr(args, "train_sampling_strategy", None)  # transformers 5.24; older: group_by_length=True
    strategy = "group_by_length" if getattr(args, "group_by_length", False) else strategy
    if strategy in ("group_by_length", "batch_rebalance"):
        problems.append(f"train_sampling_strategy={strategy!r}: the samples are split over data-parallel replicas "
                        "by a DistributedSampler (random or in order); use 'random' or 'sequential'")
    if compute_loss_func is not None:
        problems.append("compute_loss_func: a custom loss sees this rank's tokens only; use the model's loss")
    pc = getattr(args, "parallelism_config", None)
    for key in ("sp_size", "cp_size", "tp_size"):
        if pc is not None and (getattr(pc, key, 1) or 1) > 1:
            problems.append(f"parallelism_config.{key}={getattr(pc, key)}: striped context parallelism comes "
                            "from the DeepSpeed JSON; leave it at 1")
    if problems:
        raise ValueError(f"sequence_parallel_size={settings.sequence_parallel_size} conflicts with "
                         "TrainingArguments: " + "; ".join(problems))
    return settings


class ContextParallelTrainer(Trainer):
    """``transformers.Trainer`` that trains with striped context parallelism when the DeepSpeed
    JSON of ``args.deepspeed`` has ``sequence_parallel_size > 1`` (see the module notes)."""

    def __init__(self, *args, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is None:
            raise ValueError("ContextParallelTrainer needs args=TrainingArguments(deepspeed=...)")
        self.context_parallel = check_training_arguments(training_args, kwargs.get("compute_loss_func"))
        model = kwargs.get("model", args[0] if args else None)
        self._striped_sp_model = None if isinstance(model, str) else model
        if self._striped_sp_model is not None:
            check_model(model, self.context_parallel)
            self.context_parallel = with_model_window(self.context_parallel, model)
        with building_ours():  # the guard on plain Trainers given our JSON lets this one pass
            super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        enable_accelerate(self.accelerator, seed=self.args.seed, config=self.args.hf_deepspeed_config.config,
                          model=self._striped_sp_model)

    def get_total_train_batch_size(self, args) -> int:
        return super().get_total_train_batch_size(args) // self.context_parallel.sequence_parallel_size

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)
        sp = self.context_parallel.sequence_parallel_size
        if sp == 1 or num_items_in_batch is None or not self.model_accepts_loss_kwargs:
            return out
        # the Trainer multiplied by all processes; DeepSpeed averages over data-parallel ones only
        return (out[0] / sp, out[1]) if return_outputs else out / sp
