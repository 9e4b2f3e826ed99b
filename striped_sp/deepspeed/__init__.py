"""DeepSpeed adapter: striped context parallelism switched on from the DeepSpeed JSON config.

```python
import striped_sp.deepspeed as ssd
engine, optimizer, loader, scheduler = ssd.initialize(model=model, optimizer=opt,
                                                      training_data=dataset, config="ds_config.json")
```

deepspeed and transformers are imported lazily, inside the functions that need them.
"""

from .accelerate import enable_accelerate
from .config import ALGOS, ContextParallelSettings, load_config, parse_config
from .data import IGNORE_INDEX, ShardedDataLoader, ShardingCollator, check_same_batch, shard_batch
from .distributed_attention import DistributedAttention
from .env import skip_cpu_shm_comm_build
from .groups import SequenceParallelGroups, sequence_parallel_groups
from .hf import ATTN_IMPLEMENTATION, enable_hf_attention, hf_attention_forward, hf_window, register_hf_attention
from .initialize import adapt_model, global_loss_hook, initialize
from .zero import fix_zero3_sequence_parallel_grads

__all__ = [
    "initialize",
    "DistributedAttention",
    "parse_config",
    "load_config",
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
