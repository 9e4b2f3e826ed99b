"""TRL's ``SFTTrainer`` with striped context parallelism from the ``--deepspeed`` JSON.

```python
from trl import SFTConfig
from striped_sp.deepspeed.trl import ContextParallelSFTTrainer as SFTTrainer   # the one line
trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=train,
                     args=SFTConfig(..., packing=True,            # or padding_free=True
                                    deepspeed="ds_config.json"))  # sequence_parallel_size + context_parallel
trainer.train()
```

What TRL 1.16 does on its own.  ``SFTTrainer`` refuses ``packing`` / ``eval_packing`` only when
*accelerate's* context parallelism is on (``parallelism_config.cp_size > 1``, in its ``__init__``):
that path runs torch's ``context_parallel`` SDPA, which drops the attention mask, so packed
documents would see each other.  Our route keeps the documents apart (the global ``cu_seq_lens``
go to every attention layer, see :mod:`.packed`), so that refusal does not concern it, and it
never fires here: ``parallelism_config`` stays unset (:func:`.check_training_arguments` refuses
``cp_size``/``sp_size > 1``).  A *plain* ``SFTTrainer`` with our JSON would not shard at all
(it is refused when built, naming this class: :mod:`.trainer_guard`);
:class:`~.trainer.ContextParallelTrainer` (the loaders, the engine, the loss scale) supplies that.

What is left for this class: TRL computes its loss from the fused LM head's per-token
log-probabilities (``model(..., fused_lm_head=True).log_probs``, scored against our pre-shifted
``shift_labels`` without shifting again), not from the model's ``loss``, so the hook that makes
the model's loss the group-wide value (:func:`.global_loss_hook`) does not reach it:

* training: each rank's loss is its local share; the *value* is summed over the sequence-parallel
  group (the gradient stays the local share, as the hook does), so the logged loss is the step's
  token mean, as at SP=1;
* evaluation (no step-wide count from the Trainer): the divisor is the micro-batch's target count
  over the group (``num_items_in_batch`` from :func:`.shard_batch`), not this rank's own count, and
  the value is summed over the group: the eval loss is the mean over the whole micro-batch.

TRL's padding-free collator (``DataCollatorForLanguageModeling(padding_free=True)``, used for
``padding_free=True`` and for ``packing=True`` with the ``bfd`` strategies) flattens the micro-batch
into one row with ``position_ids`` restarting at 0 per document, ``cu_seq_lens_q/k``, ``max_length_q/k``
and ``seq_idx``, labels ``-100`` at every document start; :func:`.shard_batch` reads the documents
from it, pads the row for the layout and shards it.  Padded rows (``padding_free=False``,
``packing_strategy="wrapped"``) are sharded as ordinary padded rows.

Refused with a ``ValueError`` (before ``Trainer.__init__``, so before any collective), besides what
:class:`~.trainer.ContextParallelTrainer` refuses: a MoE load-balancing loss
(``router_aux_loss_coef`` with a router model): it is not a sum over tokens, so the local tokens'
values do not add up to the full row's.  Metrics: ``entropy`` and ``mean_token_accuracy`` are
exact (sums over every rank); ``num_tokens`` counts the row padding the layout adds.
Tested with trl 1.16.0, transformers 5.24, accelerate 1.15.
"""

from __future__ import annotations

import torch

try:
    from trl import SFTTrainer
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("ContextParallelSFTTrainer needs trl: pip install 'striped_sp[deepspeed,trl]'") from err

from .groups import sequence_parallel_groups
from .trainer import ContextParallelTrainer, check_training_arguments

__all__ = ["ContextParallelSFTTrainer"]


def _sum_value_over(loss: torch.Tensor, group) -> torch.Tensor:
    """``loss`` whose value is the sum over ``group`` and whose gradient stays this rank's."""
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return loss + (total - loss.detach())


def _check_router_loss(model, args) -> None:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    coef = args.router_aux_loss_coef
    if coef is None:
        coef = getattr(text, "router_aux_loss_coef", 0.0)
    if hasattr(text, "output_router_logits") and coef:
        raise ValueError(f"router_aux_loss_coef={coef} with sequence parallelism: the MoE load-balancing loss of "
                         "this rank's tokens is not its share of the full row's; set router_aux_loss_coef=0.0")


class ContextParallelSFTTrainer(ContextParallelTrainer, SFTTrainer):
    """``trl.SFTTrainer`` that trains with striped context parallelism when the DeepSpeed JSON of
    ``args.deepspeed`` has ``sequence_parallel_size > 1`` (see the module notes)."""

    def __init__(self, model=None, args=None, *rest, **kwargs):
        if (args is not None and not isinstance(model, str)
                and check_training_arguments(args, kwargs.get("compute_loss_func")).enabled):
            _check_router_loss(model, args)
        super().__init__(model, args, *rest, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        sp = self.context_parallel.sequence_parallel_size
        if sp == 1:
            return SFTTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        # training: the Trainer's count of the whole step; evaluation: the micro-batch's, over the group
        step_count = num_items_in_batch is not None
        count = num_items_in_batch if step_count else inputs.get("num_items_in_batch")
        out = SFTTrainer.compute_loss(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=count)
        loss = out[0] if return_outputs else out
        if count is not None:
            # SFTTrainer multiplied by all processes, for DDP's mean; DeepSpeed sums over SP, averages over DP
            loss = loss / (sp if step_count else self.accelerator.num_processes)
            loss = _sum_value_over(loss, sequence_parallel_groups(sp).group)
        return (loss, out[1]) if return_outputs else loss
