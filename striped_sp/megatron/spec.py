"""``patch_layer_spec``: swap every core_attention of a megatron-core spec for ours.

Works on anything the GPT spec providers return: a single layer ``ModuleSpec``, a decoder
``TransformerBlockSubmodules`` (MoE), a list of layer specs, and an MTP block spec.  The
input is never modified: the result is a deep copy.
"""

from __future__ import annotations

import copy
import dataclasses

from .arguments import check_algo, layout_of
from .refusals import SPARSE_CORE_ATTENTION, refuse_sparse_core_attention

__all__ = ["patch_layer_spec", "replace_core_attention", "core_attention_spec"]

_SKIP_FIELDS = ("module", "params", "metainfo")


def core_attention_spec(algo: str = "striped", backend: str = "auto", te_state: bool = False):
    """A ``ModuleSpec`` building :class:`ContextParallelAttention` with ``algo``; with ``te_state``
    the variant whose checkpoints carry Transformer Engine's ``_extra_state`` entry."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .attention import ContextParallelAttention, ContextParallelAttentionTEState

    layout_of(algo)  # ValueError for native / unknown
    module = ContextParallelAttentionTEState if te_state else ContextParallelAttention
    return ModuleSpec(module=module, params={"algo": algo, "backend": backend})


def _is_transformer_engine(core_attention) -> bool:
    module = getattr(core_attention, "module", core_attention)
    name = getattr(module, "__name__", "")
    return name.startswith("TE") or name == "ContextParallelAttentionTEState"  # or already swapped


def _swap(node, replacement, seen: set) -> int:
    """Replace every ``core_attention`` field below ``node`` in place by ``replacement(old)``;
    count the swaps."""
    if node is None or id(node) in seen:
        return 0
    seen.add(id(node))
    count = 0
    if isinstance(node, (list, tuple)):
        for item in node:
            count += _swap(item, replacement, seen)
        return count
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            if f.name in _SKIP_FIELDS:
                continue
            if f.name == "core_attention":
                setattr(node, f.name, replacement(getattr(node, f.name)))
                count += 1
            else:
                count += _swap(getattr(node, f.name), replacement, seen)
    return count


def _replace(spec, replacement):
    patched = copy.deepcopy(spec)
    if _swap(patched, replacement, set()) == 0:
        raise ValueError(
            f"found no core_attention in {type(spec).__name__}: pass a GPT layer, "
            "decoder block or MTP block spec"
        )
    return patched


def replace_core_attention(spec, core_attention):
    """A deep copy of ``spec`` with every ``core_attention`` set to ``core_attention``
    (a ``ModuleSpec`` or module class).  ``ValueError`` if the spec has none."""
    return _replace(spec, lambda _old: core_attention)


def patch_layer_spec(spec, algo: str = "striped", backend: str = "auto"):
    """A copy of ``spec`` whose every core attention is ``ContextParallelAttention(algo)``.

    ``algo="native"`` returns ``spec`` unchanged; ``None`` (an MTP block spec for a stage with
    no MTP layers) is returned as is, and so is a block spec with no layers (an embedding- or
    loss-only pipeline stage).  A spec without any core_attention raises ``ValueError``, and so does
    one with a sparse core attention (DeepSeek sparse attention), which ours would not replace
    faithfully.
    """
    check_algo(algo)
    if spec is None or algo == "native":
        return spec
    if (isinstance(spec, (list, tuple)) and not spec) or getattr(spec, "layer_specs", None) == []:
        return copy.deepcopy(spec)  # a pipeline stage with no decoder layers
    # Where Transformer Engine's core attention was, keep its checkpoint entry (_extra_state), so
    # checkpoints move between --context-parallel-algo native and ours in both directions.
    def replacement(old):
        name = getattr(getattr(old, "module", old), "__name__", "")
        if name in SPARSE_CORE_ATTENTION:  # not dense attention: swapping it would change the model
            raise refuse_sparse_core_attention(algo, name)
        return core_attention_spec(algo, backend, te_state=_is_transformer_engine(old))

    return _replace(spec, replacement)
