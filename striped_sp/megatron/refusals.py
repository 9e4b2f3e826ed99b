"""What ``--context-parallel-algo`` (other than ``native``) refuses to build, and why: by name, at
construction, before any batch.

Under an installed algo, Megatron's batch slicing hands every layer the algo's tokens.  A layer
is correct on them only if the plugin runs it (its core attention is ours) or its own context
parallelism places tokens as the algo does.  Everything else is refused here:

* attention whose core attention the plugin did not convert (the layer was built from a spec
  that never passed through :func:`~striped_sp.megatron.patch_layer_spec`: T5, BERT, vision
  encoders, any other model class): :func:`check_layer_attention`, run after every
  ``TransformerLayer.__init__``, names the model being built;
* (not refused) Mamba layers and, where megatron-core gives it context parallelism (from 0.18),
  gated delta net: megatron-core's undo / redo of zigzag's order is replaced by the layout's
  permutation (:mod:`.mamba`, :mod:`.gdn`), so every algo runs them;
* gated delta net in megatron-core 0.16 / 0.17 and DeepSeek sparse attention before 0.19:
  megatron-core itself has no context parallelism for them (its ``TransformerConfig`` asserts
  ``context_parallel_size == 1``), so no algo runs them at CP > 1;
* DeepSeek sparse attention in 0.19 (megatron-core's own all-gather context parallelism, under
  ``native``): the plugin does not run its sparse indexer, and swapping its core attention for
  dense attention would silently change the model (:func:`refuse_sparse_core_attention`).
"""

from __future__ import annotations

import sys

from .version import megatron_core_line, megatron_core_version

__all__ = ["check_model_layers", "check_layer_attention", "refuse_sparse_core_attention", "SPARSE_CORE_ATTENTION"]

#: core-attention classes that are not dense attention: swapping them for ours changes the model
SPARSE_CORE_ATTENTION = ("DSAttention",)
#: the first megatron-core release line whose own context parallelism covers the layer
_MEGATRON_CP_SINCE = {"GatedDeltaNet": (0, 18), "DSAttention": (0, 19)}
_WHAT = {"MambaLayer": "Mamba ('M')", "GatedDeltaNet": "gated delta net ('G')",
         "DSAttention": "DeepSeek sparse attention ('D')"}


def _megatron_has_cp(cls_name: str) -> bool:
    return megatron_core_line() >= _MEGATRON_CP_SINCE[cls_name]


def _no_megatron_cp(cls_name: str) -> str:
    return (f"megatron-core {megatron_core_version()} itself has no context parallelism for "
            f"{_WHAT[cls_name]} layers (its TransformerConfig requires context_parallel_size 1 with them; "
            f"megatron-core gives them context parallelism from "
            f"{'.'.join(map(str, _MEGATRON_CP_SINCE[cls_name]))})")


def refuse_sparse_core_attention(algo: str, module_name: str) -> ValueError:
    """The error for a spec whose core attention is ``module_name`` (one of
    :data:`SPARSE_CORE_ATTENTION`): the plugin would replace it by dense attention."""
    if _megatron_has_cp(module_name):
        why = ("megatron-core's own context parallelism for it (all-gather, --cp-comm-type allgather) runs "
               "under --context-parallel-algo native")
    else:
        why = _no_megatron_cp(module_name) + ", so train it at context parallel size 1"
    return ValueError(
        f"--context-parallel-algo {algo} does not run {_WHAT[module_name]} layers: striped_sp would replace "
        f"their sparse {module_name} by dense attention; {why}")


def _cp_size(model) -> int:
    cp = getattr(getattr(model, "pg_collection", None), "cp", None)
    if cp is not None and hasattr(cp, "size"):
        return cp.size()
    return getattr(getattr(model, "config", None), "context_parallel_size", 1) or 1


def check_model_layers(model, algo: str) -> None:
    """Refuse, by name and before any forward, the layers of ``model`` (a GPTModel, HybridModel or
    MambaModel just built) that ``algo`` cannot run."""
    model_name = type(model).__name__
    for module in model.modules():
        name = type(module).__name__
        if name == "GatedDeltaNet" and not _megatron_has_cp(name):
            if _cp_size(model) > 1:
                raise ValueError(f"--context-parallel-algo {algo}: {model_name} has {_WHAT[name]} layers; "
                                 f"{_no_megatron_cp(name)}, so no --context-parallel-algo runs them at CP > 1")
        elif any(key in name for key in SPARSE_CORE_ATTENTION):
            raise refuse_sparse_core_attention(algo, "DSAttention")


def _model_under_construction(default: str) -> str:
    """The class name of the outermost ``torch.nn.Module`` whose ``__init__`` is on the stack."""
    import torch

    found = default
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                found = type(owner).__name__
        frame = frame.f_back
    return found


def check_layer_attention(layer, algo: str) -> None:
    """After a ``TransformerLayer`` is built under ``algo``: every core attention in it must be
    ours, else the layer would run Megatron's own context parallelism on ``algo``'s tokens.
    The error names the model being built and the foreign core attention."""
    from .attention import ContextParallelAttention

    import torch

    for module in layer.modules():
        core = getattr(module, "core_attention", None)
        if isinstance(core, torch.nn.Module) and not isinstance(core, ContextParallelAttention):
            model = _model_under_construction(type(layer).__name__)
            raise ValueError(
                f"--context-parallel-algo {algo}: {model} builds its attention with "
                f"{type(core).__name__}, which striped_sp does not run (it converts the layer specs given to "
                "GPTModel, HybridModel and MambaModel, and what striped_sp.megatron.patch_layer_spec returns); "
                f"it would run Megatron's own context parallelism on {algo}'s token layout, silently wrong. "
                f"Use --context-parallel-algo native for {model}, or build its layers from "
                "striped_sp.megatron.patch_layer_spec(spec)")
