"""Hugging Face Accelerate with DeepSpeed: striped context parallelism from the JSON, one call.

```python
from accelerate import Accelerator
import striped_sp.deepspeed as ssd

accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config="ds_config.json"))
ssd.enable_accelerate(accelerator)          # the one line; reads the JSON's context_parallel section
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for batch in loader:                        # this rank's tokens, labels shifted on the full row
    loss = model(**batch).loss              # the exact global mean, on every rank
    accelerator.backward(loss)
    optimizer.step(); optimizer.zero_grad()
```

What :func:`enable_accelerate` changes on that one ``Accelerator`` (nothing process-wide):

* ``prepare`` of a ``DataLoader``: instead of accelerate's split of the samples over all processes,
  a sampler over the data-parallel replicas only (every rank of a sequence-parallel group gets the
  same samples, in the same order), and every batch through :func:`.shard_batch` after the
  collator (:class:`.ShardingCollator`).  The loader's sampler must be a random or sequential one
  (replaced by a ``DistributedSampler`` over the replicas); an ``IterableDataset`` must itself yield
  this replica's samples, the same on every rank of a group;
* ``prepare`` of the model: the engine comes from :func:`striped_sp.deepspeed.initialize` (the same
  arguments as ``deepspeed.initialize``) with the config accelerate filled in: SP groups as
  ``mpu``, the model's attention, the global-loss hooks and the ZeRO-3 gradient fix.  accelerate
  fills ``train_batch_size`` as if every process were a data-parallel replica; that key is dropped
  and DeepSpeed derives it from the micro-batch size and gradient accumulation.

This follows what accelerate does for DeepSpeed's own ALST/Ulysses (``ParallelismConfig(sp_backend=
"deepspeed")`` registers ``UlyssesSPAttentionHF`` and wraps loaders in ``UlyssesSPDataLoaderAdapter``
inside ``prepare``), with one difference: ALST gives every rank other samples and gathers them
inside the group; here the ranks of a group load the same samples (as Megatron and
:func:`.initialize` do).  Do not combine it with a ``parallelism_config`` that has ``sp_size > 1``.
Tested with accelerate 1.15.0 and transformers 5.24.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

from .config import ContextParallelSettings, check_requested, load_config, parse_config
from .data import ShardingCollator
from .env import skip_cpu_shm_comm_build
from .initialize import check_model
from .groups import sequence_parallel_groups
from .window_hint import with_model_window

__all__ = ["enable_accelerate", "EpochDataLoader", "deepspeed_config_of"]


class EpochDataLoader(torch.utils.data.DataLoader):
    """A ``DataLoader`` with ``set_epoch`` (reshuffles its data-parallel sampler), as accelerate's and
    the Trainer's loops call it."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def deepspeed_config_of(accelerator) -> dict:
    """The DeepSpeed config dict of ``accelerator`` (``ValueError`` if it has no DeepSpeed plugin)."""
    state = getattr(accelerator, "state", None)
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is None and getattr(state, "_cpu", False):
        raise ValueError("enable_accelerate found no DeepSpeed plugin on a CPU Accelerator: Accelerator(cpu=True) "
                         "drops the deepspeed_plugin (accelerate runs DeepSpeed only without cpu=True); on a CPU-only "
                         "machine create PartialState(cpu=True) first, then Accelerator(deepspeed_plugin=...) without "
                         "cpu=True (TrainingArguments(use_cpu=True) does this)")
    if plugin is None:
        raise ValueError("enable_accelerate needs an Accelerator with a DeepSpeed plugin "
                         "(Accelerator(deepspeed_plugin=...) or accelerate launch --use_deepspeed / "
                         "TrainingArguments(deepspeed='ds_config.json'))")
    return plugin.deepspeed_config


def _check_accelerator(accelerator, settings: ContextParallelSettings) -> None:
    """``ValueError`` for accelerator settings that conflict with SP (before any collective)."""
    if settings.enabled and getattr(accelerator, "split_batches", False):
        raise ValueError(f"Accelerator(split_batches=True) with sequence_parallel_size={settings.sequence_parallel_size}: "
                         "the loader's batch_size must be the micro-batch of one data-parallel replica; use "
                         "split_batches=False")
    pc = getattr(accelerator, "parallelism_config", None)
    for key in ("sp_size", "cp_size", "tp_size"):
        if pc is not None and (getattr(pc, key, 1) or 1) > 1 and settings.enabled:
            raise ValueError(
                f"parallelism_config.{key}={getattr(pc, key)} and the DeepSpeed config's "
                f"sequence_parallel_size={settings.sequence_parallel_size}: striped context parallelism "
                f"comes from the JSON; leave parallelism_config.{key} at 1")


def _loader_like(data_loader, settings: ContextParallelSettings, groups, shuffle: bool, seed: int):
    """``data_loader`` again, with a data-parallel-only sampler and a :class:`.ShardingCollator` (so a
    loader that accelerate rebuilds from its parts, as ``skip_first_batches`` does, still shards)."""
    from torch.utils.data import DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

    dataset = data_loader.dataset
    if getattr(data_loader, "batch_size", None) is None:
        raise ValueError("a DataLoader with a batch_sampler cannot be sharded for context parallelism: give it "
                         "batch_size (its micro-batch size) and a plain sampler")
    sampler = None
    if not isinstance(dataset, IterableDataset):
        if not isinstance(data_loader.sampler, (RandomSampler, SequentialSampler)):
            raise ValueError(f"a DataLoader with a {type(data_loader.sampler).__name__}: under context parallelism "
                             "the samples are split over data-parallel replicas by a DistributedSampler (random or "
                             "in order); give the DataLoader shuffle=True or False instead (e.g. group_by_length=False)")
        shuffle = shuffle and isinstance(data_loader.sampler, RandomSampler)
        sampler = DistributedSampler(dataset, num_replicas=groups.dp_size, rank=groups.dp_rank,
                                     shuffle=shuffle, seed=seed)
    collate = ShardingCollator(data_loader.collate_fn, groups.size, groups.rank, settings.layout)
    return EpochDataLoader(dataset, batch_size=data_loader.batch_size, sampler=sampler, collate_fn=collate,
                           drop_last=data_loader.drop_last, num_workers=data_loader.num_workers,
                           pin_memory=data_loader.pin_memory)


def _drop_auto_values(config: dict) -> dict:
    """accelerate takes every ``"auto"`` string in the DeepSpeed config as a value for it to fill in,
    and refuses ``context_parallel.backend: "auto"``: drop those keys from the config accelerate
    sees, and return them, for :func:`_deepspeed_initialize_is_ours` to hand back to our
    ``initialize`` (``stripe_size`` / ``doc_placement`` ``"auto"`` are choices, not defaults)."""
    from .config import SECTION

    section = config.get(SECTION)
    if not isinstance(section, dict):
        return {}
    config[SECTION] = {k: v for k, v in section.items() if v != "auto"}
    return {k: v for k, v in section.items() if v == "auto"}


@contextlib.contextmanager
def _deepspeed_initialize_is_ours(autos: dict, settings: ContextParallelSettings):
    """Inside: ``deepspeed.initialize`` is :func:`striped_sp.deepspeed.initialize` (accelerate looks
    it up at call time), dropping accelerate's ``train_batch_size`` under SP and putting back the
    section's ``"auto"`` values (``autos``) that accelerate was not shown."""
    import deepspeed

    from .config import SECTION
    from .initialize import LOADER_WINDOW_HINT, initialize

    def ours(*args, **kwargs):
        cfg = kwargs.get("config_params", kwargs.get("config"))
        if isinstance(cfg, dict) and parse_config(cfg).enabled:
            cfg = {k: v for k, v in cfg.items() if k != "train_batch_size"}
            cfg[SECTION] = {**cfg.get(SECTION, {}), **autos}
            kwargs["config_params" if "config_params" in kwargs else "config"] = cfg
        deepspeed.initialize = original  # ours calls DeepSpeed's
        # the attention runs the layout the loaders were made with (their window hint, or none)
        token = LOADER_WINDOW_HINT.set((settings.window, settings.global_every))
        try:
            return initialize(*args, **kwargs)
        finally:
            LOADER_WINDOW_HINT.reset(token)

    original = deepspeed.initialize
    deepspeed.initialize = ours
    try:
        yield
    finally:
        deepspeed.initialize = original


def enable_accelerate(accelerator, seed: int = 0, config: Any = None, model: Any = None) -> ContextParallelSettings:
    """Make ``accelerator.prepare`` set up striped context parallelism from its DeepSpeed config
    (or ``config``, a dict or JSON path).  Call it before ``prepare``; every rank must.

    ``seed``: the data-parallel sampler's shuffle seed.  ``model``: the transformers model to be
    prepared, whose sliding window (if any) the striped default's layout takes as a hint
    (:mod:`.window_hint`; without it the default runs as for a model without a window).  Returns the
    parsed settings.  Raises
    ``ValueError`` (before any collective) for a bad ``context_parallel`` section, an SP size not
    dividing the world, ``split_batches=True``, or a ``parallelism_config`` that also splits the
    sequence or the heads.
    """
    import torch.distributed as dist

    cfg = load_config(deepspeed_config_of(accelerator) if config is None else config)
    check_requested(cfg)
    settings = with_model_window(parse_config(cfg, world_size=accelerator.num_processes), model)
    _check_accelerator(accelerator, settings)
    if model is not None:
        check_model(model, settings)
    autos = _drop_auto_values(deepspeed_config_of(accelerator))
    if getattr(accelerator, "_striped_sp", None) is not None:
        return accelerator._striped_sp
    accelerator._striped_sp = settings
    if not settings.enabled:
        return settings
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized: create the Accelerator with the DeepSpeed plugin "
                         "under a distributed launcher first")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    skip_cpu_shm_comm_build()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())  # DeepSpeed's comm
    groups = sequence_parallel_groups(settings.sequence_parallel_size)
    prepare_loader = accelerator.prepare_data_loader
    prepare_deepspeed = accelerator._prepare_deepspeed

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if not isinstance(data_loader, torch.utils.data.DataLoader):
            return prepare_loader(data_loader, device_placement=device_placement,
                                  slice_fn_for_dispatch=slice_fn_for_dispatch)
        loader = _loader_like(data_loader, settings, groups, shuffle=True, seed=seed)
        self._dataloaders.append(loader)
        return loader

    def _prepare_deepspeed(self, *args):
        with _deepspeed_initialize_is_ours(autos, settings):
            return prepare_deepspeed(*args)

    accelerator.prepare_data_loader = types.MethodType(prepare_data_loader, accelerator)
    accelerator._prepare_deepspeed = types.MethodType(_prepare_deepspeed, accelerator)
    return settings
