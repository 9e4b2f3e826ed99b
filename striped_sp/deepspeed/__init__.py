"""DeepSpeed adapter: striped context parallelism switched on from the DeepSpeed JSON config.

```python
import striped_sp.deepspeed as ssd
engine, optimizer, loader, scheduler = ssd.initialize(model=model, optimizer=opt,
                                                      training_data=dataset, config="ds_config.json")
```

deepspeed and transformers are imported lazily, inside the functions that need them, so the
module imports without them (the Hugging Face path needs transformers only); a function that needs
DeepSpeed raises an ``ImportError`` naming the ``deepspeed`` extra when it is missing.

Importing it also installs :mod:`.trainer_guard`: a ``transformers.Trainer`` that is not
:class:`ContextParallelTrainer` (or a TRL trainer that is not ``ContextParallelSFTTrainer``), built
with a DeepSpeed JSON that asks for context parallelism, raises a ``ValueError`` naming the class to
use at the end of its ``__init__``.
"""

import functools as _functools

from .accelerate import enable_accelerate
from .config import ALGOS, ContextParallelSettings, check_requested, load_config, parse_config
from .data import IGNORE_INDEX, ShardedDataLoader, ShardingCollator, check_same_batch, shard_batch
from .distributed_attention import DistributedAttention
from .env import skip_cpu_shm_comm_build
from .groups import SequenceParallelGroups, sequence_parallel_groups
from .hf import ATTN_IMPLEMENTATION, enable_hf_attention, hf_attention_forward, hf_window, register_hf_attention
from .initialize import adapt_model, global_loss_hook, initialize
from .trainer_guard import install_trainer_guard as _install_trainer_guard
from .zero import fix_zero3_sequence_parallel_grads

# a plain transformers.Trainer / trl.SFTTrainer given the context-parallel JSON is refused when it is
# built, naming ContextParallelTrainer (one callback in transformers' default list, added when
# transformers.trainer is imported; see .trainer_guard)
_install_trainer_guard()


def _needs_deepspeed(fn):
    """``fn``, with DeepSpeed's absence (its lazy ``import deepspeed`` failing) reported as an
    ``ImportError`` that names the function and the extra to install."""

    @_functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ModuleNotFoundError as err:
            if err.name != "deepspeed":  # a module inside deepspeed, or another package: not ours to name
                raise
            raise ImportError(f"striped_sp.deepspeed.{fn.__name__} needs DeepSpeed, which is not installed: "
                              "pip install 'striped_sp[deepspeed]'") from err

    return call


initialize = _needs_deepspeed(initialize)
skip_cpu_shm_comm_build = _needs_deepspeed(skip_cpu_shm_comm_build)
sequence_parallel_groups = _needs_deepspeed(sequence_parallel_groups)
enable_accelerate = _needs_deepspeed(enable_accelerate)
fix_zero3_sequence_parallel_grads = _needs_deepspeed(fix_zero3_sequence_parallel_grads)

__all__ = [
    "initialize",
    "DistributedAttention",
    "parse_config",
    "load_config",
    "check_requested",
    "ContextParallelSettings",
    "ALGOS",
    "shard_batch",
    "ShardedDataLoader",
    "ShardingCollator",
    "check_same_batch",
    "IGNORE_INDEX",
    "enable_hf_attention",
    "register_hf_attention",
    "hf_attention_forward",
    "hf_window",
    "ATTN_IMPLEMENTATION",
    "sequence_parallel_groups",
    "SequenceParallelGroups",
    "adapt_model",
    "global_loss_hook",
    "skip_cpu_shm_comm_build",
    "enable_accelerate",
    "ContextParallelTrainer",
    "fix_zero3_sequence_parallel_grads",
]


def __getattr__(name):  # the Trainer subclass needs transformers: imported on first use
    if name == "ContextParallelTrainer":
        from .trainer import ContextParallelTrainer

        return ContextParallelTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
