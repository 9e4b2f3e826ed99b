"""Hugging Face Transformers path: the ring engine as an attention function of the registry.

``enable_hf_attention(model, group, layout, backend)`` registers ``"striped_sp"`` in
transformers' attention-function registry (``AttentionInterface``) and switches the model to it.
Llama/Mistral/Qwen-style models then call :func:`hf_attention_forward` in every attention layer
with their local q/k/v; the model's ``position_ids`` (from :mod:`.data`) carry the layout's global
positions, or the positions inside each packed document, so RoPE is exact.  transformers builds no
mask for an implementation it has no mask function for, so nothing of size ``s x s`` is ever made.

What the attention function reads from transformers' keyword arguments (transformers 5 passes the
model's extra keyword arguments through to every attention layer):

* ``cu_seq_lens_q`` / ``cu_seq_lens_k``: the document boundaries of the *global* packed row, as
  :func:`.shard_batch` leaves them in the batch (not the local tokens' boundaries, which is what
  transformers' flash-attention path would read them as); ``max_length_q/k`` are ignored;
* ``sliding_window=W`` (Mistral; Qwen2-style models pass it for their sliding layers only and
  ``None`` for full ones): a query sees itself and the ``W - 1`` keys before it, i.e.
  ``window_size=(W - 1, 0)``, as transformers' own ``sliding_window_overlay`` mask;
* ``s_aux`` (attention sinks, gpt-oss: one logit per query head with no value): folded once into
  the ring's merged log-sum-exp (``sinks=`` of :class:`~striped_sp.engine.request.RingRequest`);
* ``softcap`` (logit soft-capping, Gemma 2's ``attn_logit_softcapping``; ``None``: off): applied
  inside the kernel (``softcap=`` of :class:`~striped_sp.engine.request.RingRequest`); a named
  backend that cannot soft-cap is a ``ValueError`` naming it and the kernels that can.

The active settings are process-wide (one context-parallel configuration per process), as
transformers' registry itself is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..engine.agreement import CHECK_RANKS_ENV, agreeing, per_call_checks_enabled
from ..plan.layouts import positions
from ..plan.packing import document_positions
from ..engine.request import RingRequest, window_of
from .hybrid import inside_gathered_mixer, wrap_mixers
from .mixers import refuse_mixers
from .packed import batch_bounds

__all__ = ["ATTN_IMPLEMENTATION", "enable_hf_attention", "hf_attention_forward", "hf_window", "register_hf_attention"]

ATTN_IMPLEMENTATION = "striped_sp"


@dataclasses.dataclass(frozen=True)
class _Settings:
    group: Any
    layout: str
    backend: str
    check_positions: bool
    ulysses_groups: Any = None
    #: (causal, scaling, window, softcap) -> the layer kind's RingRequest, built on first use
    requests: dict = dataclasses.field(default_factory=dict, compare=False)

    def request(self, causal: bool, scaling, window, softcap=None) -> RingRequest:
        key = (causal, scaling, window, softcap)
        found = self.requests.get(key)
        if found is None:
            found = self.requests[key] = RingRequest(
                self.group, layout=self.layout, causal=causal, softmax_scale=scaling, backend=self.backend,
                window_size=window, ulysses_groups=self.ulysses_groups, softcap=softcap,
                sharded_by_documents=True)  # shard_batch shards by documents (position_ids checked)
        return found


_ACTIVE: _Settings | None = None
#: the document boundaries of the batch the model runs now (its forward pre-hook reads them), for
#: the hybrid mixers (:mod:`.hybrid`), which refuse packed rows
_BATCH_BOUNDS: list = [None]
#: set by the model's forward pre-hook, cleared by the first attention layer of that forward, which
#: checks the positions (a hybrid's first attention layer need not be layer 0)
_CHECK_PENDING: list = [False]


def _mixer_settings():
    """What a wrapped mixer (:mod:`.hybrid`) needs at call time: group, layout, the batch's bounds."""
    import types

    if _ACTIVE is None:
        raise ValueError("a hybrid mixer ran with striped_sp attention not set up: call enable_hf_attention")
    return types.SimpleNamespace(group=_ACTIVE.group, layout=_ACTIVE.layout, cu_seqlens=_BATCH_BOUNDS[0])


def _import_transformers():
    try:
        import transformers  # noqa: F401
        from transformers import AttentionInterface
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the Hugging Face path needs transformers: pip install 'striped_sp[hf]'") from err
    return AttentionInterface


def register_hf_attention() -> str:
    """Register :func:`hf_attention_forward` as ``attn_implementation="striped_sp"``; returns the name."""
    AttentionInterface = _import_transformers()
    AttentionInterface.register(ATTN_IMPLEMENTATION, hf_attention_forward)
    return ATTN_IMPLEMENTATION


def enable_hf_attention(model, group=None, layout: str = "striped", backend: str = "auto",
                        check_positions: bool = True, ulysses_groups=None):
    """Make ``model`` (a transformers ``PreTrainedModel``) attend with the ring engine over ``group``.

    ``layout``: the core layout its inputs are sharded in (``"striped"``, ``"zigzag"``,
    ``"contiguous"``).  ``check_positions``: in the first attention layer of every forward, check
    that ``position_ids`` are the layout's positions of this rank, or with ``cu_seq_lens_q`` the
    positions inside its documents (catches a batch that was not sharded by
    :func:`striped_sp.deepspeed.shard_batch`, or packed positions without their boundaries).
    ``ulysses_groups``: ``(inner, outer)`` from :func:`striped_sp.ulysses_ring_groups` for
    hierarchical CP (Ulysses inside, the ring across); the data path does not change.
    Returns ``model``.  A hybrid model's other token mixers (gated delta net, Mamba, short
    convolutions) run on the whole gathered sequence (:mod:`.hybrid`); a mixer that cannot
    (:mod:`.mixers`) is a ``ValueError`` naming it.

    Calling it again, on this model or another, re-targets: the later call's group, layout, backend
    and Ulysses groups win, for the attention and the wrapped mixers alike (the settings are
    process-wide); nothing is wrapped or hooked twice, and a deep copy of the model runs its own
    mixers.  Nothing of it reaches the model's files: ``save_pretrained`` writes the plain model's
    config and weights, ``from_pretrained`` gives the plain model, to enable again (loaded with
    ``attn_implementation="striped_sp"`` but not enabled, its first attention is refused by name).
    """
    global _ACTIVE
    RingRequest(group, layout=layout, backend=backend)  # ValueError for an unknown layout or backend
    if getattr(model, "_striped_sp_hooks", None) and getattr(model, "_striped_sp_hooks_group", group) is not group:
        raise ValueError(
            "enable_hf_attention with another group on a model striped_sp.deepspeed.initialize set up: its loss "
            "hooks count targets and sum the loss over the group initialize gave it; call initialize again "
            "(another layout over the same group is fine here)")
    if not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            f"{type(model).__name__} is not a transformers PreTrainedModel (no set_attn_implementation)"
        )
    left = wrap_mixers(model, _mixer_settings)  # hybrids: their scans / convolutions on the whole sequence
    if left:
        refuse_mixers(model, left)
    dropout = getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ValueError(
            f"config.attention_dropout={dropout}: the ring engine has no attention dropout; set it to 0.0"
        )
    register_hf_attention()
    _ACTIVE = _Settings(group, layout, backend, check_positions, ulysses_groups)
    if getattr(model, "_striped_sp_mask_hook", None) is None:
        # transformers drops the mask before the attention function for an implementation
        # without a mask function, so padding has to be caught at the model's input.
        model._striped_sp_mask_hook = model.register_forward_pre_hook(_padding_mask_pre_hook, with_kwargs=True)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"{type(model).__name__} did not switch to attn_implementation={ATTN_IMPLEMENTATION!r} "
            "(it does not use transformers' attention-function registry): its attention would run "
            "on the local tokens only"
        )
    for module in model.modules():  # what hf_attention_forward asks of a transformers attention layer
        module._striped_sp_enabled = True
    return model


def _check_mask(attention_mask) -> None:
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError(
            "striped_sp attention takes no prepared attention mask (it is causal on global positions); "
            f"got {type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))}"
        )
    if not bool(attention_mask.bool().all()):
        raise ValueError(
            "attention_mask has padding: striped_sp attention takes no mask; give the full padded batch to "
            "striped_sp.deepspeed.shard_batch (or ShardedDataLoader), which turns the padding into ignored "
            "targets, and pass the model its output (no attention_mask)")


def _padding_mask_pre_hook(module, args, kwargs):
    _BATCH_BOUNDS[0] = _boundaries(kwargs)
    _CHECK_PENDING[0] = True
    mask = kwargs.get("attention_mask")
    if mask is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
        mask = args[1]
    _check_mask(mask)


def _check_positions(position_ids, local_len: int, settings: _Settings, cu_seqlens=None) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return  # ring_attention raises the proper error
    group = settings.group if settings.group is not None else dist.group.WORLD
    n, r = dist.get_world_size(group), dist.get_rank(group)
    rows = position_ids.reshape(-1, position_ids.size(-1))
    expected = positions(local_len * n, n, r, settings.layout, cu_seqlens).to(position_ids.device)
    accepted = [expected]
    if cu_seqlens is not None:  # per-document positions, as DataCollatorWithFlattening gives them
        accepted.append(document_positions(local_len * n, n, r, settings.layout, cu_seqlens).to(position_ids.device))
    if rows.size(-1) != local_len or not any(bool((rows == e).all()) for e in accepted):
        what = "positions inside the documents of cu_seq_lens_q (or the global ones)" if cu_seqlens is not None else "positions"
        raise ValueError(
            f"position_ids are not the '{settings.layout}' {what} of rank {r} of {n} "
            f"({accepted[-1][:4].tolist()}...): shard the batch with striped_sp.deepspeed.shard_batch "
            "(or ShardedDataLoader) and pass its position_ids (and cu_seq_lens_q/k) to the model"
        )


def _boundaries(kwargs: dict):
    """The global document boundaries from ``cu_seq_lens_q/k`` (``None`` without them), as a tuple
    of ints: compared and read once per batch (the same tensors reach every layer:
    :func:`~striped_sp.deepspeed.packed.batch_bounds`)."""
    return batch_bounds(kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))


def hf_window(sliding_window, causal: bool = True):
    """transformers' ``sliding_window=W`` as ``window_size=(W - 1, 0)``; ``None`` without one
    (:func:`striped_sp.engine.request.window_of`)."""
    return window_of(None, sliding_window, causal)


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature: q ``[b, heads, s_local, d]``, k/v
    ``[b, kv_heads, s_local, d]`` -> (``[b, s_local, heads, d]``, ``None``).  Keyword arguments as in
    the module notes; every check runs before the ring sends anything."""
    settings = _ACTIVE
    if settings is None:
        raise ValueError(
            "attn_implementation='striped_sp' is not set up: call "
            "striped_sp.deepspeed.enable_hf_attention(model, group) or striped_sp.deepspeed.initialize"
        )
    if getattr(module, "config", None) is not None and not getattr(module, "_striped_sp_enabled", False):
        raise ValueError(
            f"{type(module).__name__}: attn_implementation='striped_sp' on a model that enable_hf_attention did not "
            "set up (from_pretrained(..., attn_implementation='striped_sp') or set_attn_implementation alone): call "
            "striped_sp.deepspeed.enable_hf_attention(model, group) on it (it also wraps a hybrid's other token "
            "mixers, which would otherwise run on the local tokens only)")
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported by the ring engine; use 0.0")
    if inside_gathered_mixer() is not None:
        raise ValueError(f"{inside_gathered_mixer()}: an attention inside a token mixer that runs on the gathered "
                         "sequence cannot run the ring; train this model with sequence_parallel_size=1")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    # with $STRIPED_SP_CHECK_RANKS=1 / always every rank learns of another's failed check (one small
    # exchange per call), instead of waiting for it in the ring
    import torch.distributed as dist

    enabled = per_call_checks_enabled() and dist.is_available() and dist.is_initialized()
    with agreeing(settings.group, what="striped_sp attention", device=query.device, enabled=enabled, cached=False):
        _check_mask(attention_mask)
        window = hf_window(kwargs.get("sliding_window"), causal)
        cu_seqlens = _boundaries(kwargs)
        position_ids = kwargs.get("position_ids")
        first = _CHECK_PENDING[0] or getattr(module, "layer_idx", 0) == 0
        _CHECK_PENDING[0] = False
        if settings.check_positions and position_ids is not None and first:
            _check_positions(position_ids, query.size(2), settings, cu_seqlens)
        request = settings.request(causal, scaling, window, kwargs.get("softcap"))
        if cu_seqlens is not None:
            request = request.derive(cu_seqlens=cu_seqlens)
    # s_aux: the attention sinks (gpt-oss), one logit per query head, folded once into the merged lse
    return request(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), sinks=kwargs.get("s_aux")), None
