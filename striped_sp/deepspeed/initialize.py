"""``initialize``: ``deepspeed.initialize`` with striped context parallelism from the config.

Order of work (all validation before the first collective):

1. read the config and check ``sequence_parallel_size`` and the ``context_parallel`` section;
2. on the CPU accelerator skip the JIT build of DeepSpeed's shared-memory op (:mod:`.env`);
3. start DeepSpeed's communication, check ``sequence_parallel_size`` divides the world size;
4. build (or reuse) DeepSpeed's sequence-parallel groups (:mod:`.groups`);
5. point the model's attention at the ring engine: DeepSpeed ``DistributedAttention`` modules are
   swapped for :class:`.DistributedAttention`, ours are configured, a transformers model gets
   ``attn_implementation="striped_sp"`` and a loss that is the global value on every rank;
6. ``deepspeed.initialize`` with the groups as ``mpu``; under ZeRO-3 its reduce-scatter is made to
   sum over the SP group as the other stages do (:mod:`.zero`);
7. the training data loader: a data-parallel sampler (every rank of an SP group gets the same
   samples) under :class:`.ShardedDataLoader` (shifted labels, local tokens in the layout).
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ..plan.layouts import get_layout
from .config import ContextParallelSettings, check_requested, load_config, parse_config
from .distributed_attention import DistributedAttention
from .env import skip_cpu_shm_comm_build
from .mixers import check_model_mixers
from .groups import SequenceParallelGroups, sequence_parallel_groups, ulysses_groups
from .report import announce
from .window_hint import with_model_window
from .data import IGNORE_INDEX, ShardedDataLoader
from .zero import check_sequence_parallel_settings, fix_zero3_sequence_parallel_grads

__all__ = ["initialize", "adapt_model", "global_loss_hook", "check_model", "check_model_heads"]

_DEFAULT_PORT = 29500

#: set by :func:`~striped_sp.deepspeed.enable_accelerate`'s ``deepspeed.initialize`` wrapper to the
#: window hint ``(window, global_every)`` its data loaders were made with, so that the attention
#: runs their layout whatever the model says; ``None``: the hint comes from the model here
LOADER_WINDOW_HINT: contextvars.ContextVar = contextvars.ContextVar("striped_sp_loader_window_hint", default=None)


def _with_window(settings: ContextParallelSettings, model, training_data) -> ContextParallelSettings:
    """The settings with the model's window hint where this call builds the loader (``training_data``),
    the loaders' hint under accelerate's wrapper, else as parsed (the user shards in ``"striped"``)."""
    fixed = LOADER_WINDOW_HINT.get()
    if fixed is not None:
        return dataclasses.replace(settings, window=fixed[0], global_every=fixed[1])
    return settings if training_data is None else with_model_window(settings, model)


def _resolve_config(args, config, config_params):
    """The config dict and the args to hand on, with DeepSpeed's precedence."""
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("give the DeepSpeed config once: args.deepspeed_config or config=, not both")
        config = from_args
        args = copy.copy(args)
        args.deepspeed_config = None  # we pass the parsed dict instead
    if config is None:
        raise ValueError("DeepSpeed needs a config: pass config= (a dict or a JSON path) or args.deepspeed_config")
    return args, load_config(config)


def _is_hf_model(model) -> bool:
    return hasattr(model, "set_attn_implementation") and hasattr(model, "config")


def check_model(model, settings: ContextParallelSettings) -> None:
    """What a model must be for ``settings``, checked where a route is built, before any
    collective: its heads against ``ulysses_size`` (:func:`check_model_heads`) and, for a
    transformers model, no token mixer the ring does not run (:func:`.mixers.check_model_mixers`).
    Without context parallelism: not a model an earlier call set up for it (nothing undoes that)."""
    if not settings.enabled:
        if _is_hf_model(model) and getattr(model.config, "_attn_implementation", None) == "striped_sp":
            raise ValueError(
                f"sequence_parallel_size={settings.sequence_parallel_size}, but the model was set up for context "
                "parallelism by an earlier striped_sp.deepspeed.initialize / enable_hf_attention "
                "(attn_implementation='striped_sp', a hybrid's mixers wrapped, the loss hooks on its group), which "
                "a call without it does not undo: build or load the model again (from_pretrained gives the plain "
                "model)")
        return
    check_model_heads(model, settings)
    if _is_hf_model(model):
        check_model_mixers(model)


def check_model_heads(model, settings: ContextParallelSettings) -> None:
    """``context_parallel.ulysses_size`` against a transformers model's head counts (its text
    config's ``num_attention_heads`` and ``num_key_value_heads``): ``ValueError`` naming the key,
    the counts and the rule, before any collective (the engine's rule, :func:`check_ulysses`).
    Other models' heads are known at their first forward only, where the engine checks them."""
    from ..engine.ulysses import check_ulysses

    u = settings.ulysses_size
    config = getattr(model, "config", None)
    if not settings.enabled or u == 1 or config is None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int):
        return
    kv = getattr(text, "num_key_value_heads", None) or heads
    try:
        check_ulysses(u, settings.sequence_parallel_size, heads, kv)
    except ValueError as err:
        raise ValueError(f"context_parallel.ulysses_size={u} does not fit the model's heads "
                         f"(num_attention_heads={heads}, num_key_value_heads={kv}): {err}") from None


def _swap_deepspeed_attention(model: torch.nn.Module, settings: ContextParallelSettings) -> int:
    """Replace every ``deepspeed.sequence.layer.DistributedAttention`` child with ours."""
    from deepspeed.sequence.layer import DistributedAttention as DSDistributedAttention

    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DSDistributedAttention):
                ours = DistributedAttention(
                    child.local_attn, child.spg, child.scatter_idx, child.gather_idx,
                    layout=settings.layout, backend=settings.backend,
                )
                setattr(parent, name, ours)
                swapped += 1
    return swapped


def global_loss_hook(group):
    """A forward hook (``with_kwargs=True``) that makes ``output.loss`` the group-wide loss value
    while its gradient stays this rank's share.

    The forward gets ``num_items_in_batch`` (the group-wide count of counted targets, from
    :func:`.shard_batch` or from :func:`shifted_labels_pre_hook`), so each rank's loss is its
    summed local loss over the global count and the global loss is their sum.  DeepSpeed sums
    gradients over the SP group, so the update is exact.
    """

    def hook(module, args, kwargs, output):
        loss = getattr(output, "loss", None)
        if loss is None:
            return output
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        output.loss = loss + (total - loss.detach())
        return output

    return hook


def shifted_labels_pre_hook(group):
    """A forward pre-hook (``with_kwargs=True``) for HF models under SP.

    Refuses unshifted labels (transformers would shift them on the local tokens), and when
    ``shift_labels`` come without ``num_items_in_batch`` counts the targets over the group
    (one all-reduce), so that every rank's loss is its share of the *global* mean.
    """

    def hook(module, args, kwargs):
        shift_labels = kwargs.get("shift_labels")
        if kwargs.get("labels") is not None and shift_labels is None:
            raise ValueError(
                "labels without shift_labels under sequence parallelism: shift them on the full sequence "
                "before sharding with striped_sp.deepspeed.shard_batch (or use the loader initialize returns)"
            )
        if shift_labels is not None and kwargs.get("num_items_in_batch") is None:
            count = (shift_labels != IGNORE_INDEX).sum()
            dist.all_reduce(count, group=group)
            kwargs = {**kwargs, "num_items_in_batch": count}
            return args, kwargs
        return None

    return hook


def adapt_model(model: torch.nn.Module, settings: ContextParallelSettings, groups: SequenceParallelGroups) -> list:
    """Point ``model``'s attention at the ring engine over ``groups.group``; returns hook handles."""
    if not settings.enabled:
        return []
    from .hf import enable_hf_attention

    if settings.timeout_s is not None:  # context_parallel.timeout_s
        from ..engine.transport import set_ring_timeout

        set_ring_timeout(settings.timeout_s)
    if settings.calibrate:  # context_parallel.calibrate: one model for every rank, before any batch
        from ..engine.calibration import calibrate_cost_model

        # over every rank (every rank calls initialize), not the SP group: ranks that shard batches
        # by the same `auto` choices in other SP groups (tensor-parallel peers) must hold one model
        calibrate_cost_model(group=None, backend=settings.backend)
    _swap_deepspeed_attention(model, settings)
    hierarchical = ulysses_groups(groups, settings.ulysses_size)
    ours = [m for m in model.modules() if isinstance(m, DistributedAttention)]
    for module in ours:
        if module.spg is None:
            module.spg = groups.group
        elif dist.get_world_size(module.spg) != settings.sequence_parallel_size:
            raise ValueError(
                f"a DistributedAttention's sequence_process_group has {dist.get_world_size(module.spg)} "
                f"ranks but sequence_parallel_size={settings.sequence_parallel_size}"
            )
        module.configure(layout=settings.layout, backend=settings.backend, ulysses_groups=hierarchical)
    for handle in getattr(model, "_striped_sp_hooks", []):  # adapted before: hooks once only
        handle.remove()
    handles = []
    if _is_hf_model(model):
        model._striped_sp_hooks = []
        enable_hf_attention(model, groups.group, settings.layout, settings.backend, ulysses_groups=hierarchical)
        handles.append(model.register_forward_pre_hook(shifted_labels_pre_hook(groups.group), with_kwargs=True))
        handles.append(model.register_forward_hook(global_loss_hook(groups.group), with_kwargs=True))
        model._striped_sp_hooks = handles
        model._striped_sp_hooks_group = groups.group  # enable_hf_attention refuses another group after this
    elif not ours:
        warnings.warn(
            "sequence_parallel_size > 1 but the model has no DistributedAttention module and is not a "
            "transformers model: its attention must call striped_sp.ring_attention itself",
            stacklevel=3,
        )
    return handles


def _training_loader(engine, training_data, collate_fn, groups: SequenceParallelGroups,
                     settings: ContextParallelSettings):
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

    if isinstance(training_data, IterableDataset):
        sampler = None  # the dataset itself must yield this replica's samples
    else:
        sampler = DistributedSampler(training_data, num_replicas=groups.dp_size, rank=groups.dp_rank)
    loader = DataLoader(
        training_data, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler,
        collate_fn=collate_fn, drop_last=engine.dataloader_drop_last(),
    )
    return ShardedDataLoader(loader, groups.group, settings.layout)


def initialize(
    args: Any = None,
    model: torch.nn.Module = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = _DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
):
    """Same arguments and return values as ``deepspeed.initialize``:
    ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Reads ``sequence_parallel_size`` and ``context_parallel`` from the config; builds or reuses
    the sequence-parallel groups and passes them to DeepSpeed as ``mpu``; makes the model's
    attention and the returned training data loader follow the configured layout.  The engine
    gets ``engine.context_parallel`` (the parsed settings) and ``engine.context_parallel_group``.
    Bad config values raise ``ValueError`` naming the key, before any collective.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if model is None:
        raise ValueError("initialize needs a model")
    args, cfg = _resolve_config(args, config, config_params)
    check_requested(cfg)
    settings = _with_window(parse_config(cfg), model, training_data)
    if settings.enabled and mesh_param is not None:
        raise ValueError("mesh_param and sequence_parallel_size > 1 do not mix: the SP groups come from the config")
    if settings.enabled:
        check_sequence_parallel_settings(cfg, model)
    check_model(model, settings)
    skip_cpu_shm_comm_build()
    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=distributed_port, dist_init_required=dist_init_required,
    )
    settings = _with_window(parse_config(cfg, world_size=dist.get_world_size()), model, training_data)
    if settings.enabled:
        cfg.pop("data_parallel_size", None)  # checked above; the groups come through mpu, not a mesh
    groups = sequence_parallel_groups(settings.sequence_parallel_size, mpu)
    adapt_model(model, settings, groups)
    announce(model, settings, groups, cfg)
    if (settings.enabled and training_data is None and not get_layout(settings.layout).contiguous_slices
            and any(isinstance(m, DistributedAttention) for m in model.modules())):
        warnings.warn(
            f"context_parallel.algo={settings.algo!r}: DistributedAttention now expects each rank's "
            f"tokens in the {settings.layout!r} layout. Shard every batch with "
            "striped_sp.deepspeed.shard_batch (or pass training_data to get a loader that does); a "
            "data path that slices the sequence contiguously (Megatron-DeepSpeed's get_batch) "
            "needs context_parallel.algo='ring'",
            stacklevel=2,
        )
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
        training_data=None, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
        mpu=groups.mpu, dist_init_required=dist_init_required, collate_fn=collate_fn,
        config=cfg, mesh_param=mesh_param,
    )
    fix_zero3_sequence_parallel_grads(engine)
    engine.context_parallel = settings
    engine.context_parallel_group = groups.group
    loader = None
    if training_data is not None:
        loader = _training_loader(engine, training_data, collate_fn, groups, settings)
    return engine, optimizer, loader, lr_scheduler
