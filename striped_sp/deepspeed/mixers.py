"""Token mixers that are not attention: a transformers model that has them is refused by name.

Under context parallelism a rank holds only the layout's tokens of every sequence (under
``striped`` every N-th one).  The attention layers run the ring and see the whole sequence; any
other layer that mixes tokens (a gated delta net, a Mamba / Mamba2 scan, a short convolution, a
linear attention, a chunked attention whose chunks live in a mask) would run on this rank's tokens
as if they were the whole sequence and train silently wrong.  So such a model is refused when the
attention is enabled, and by the routes that build the engine, before any collective.

What the model contains decides, never its name (names go stale; module kinds do not):

* ``config.layer_types`` (of the text config): every entry must be an attention kind the ring runs
  exactly (:data:`RING_LAYER_TYPES`); ``"linear_attention"``, ``"mamba"``, ``"conv"``,
  ``"chunked_attention"`` and anything new are refused, naming the layer.
* the modules: a ``Conv1d`` with a kernel longer than one token (the short causal convolution of
  every Mamba, gated-delta and short-conv mixer), or a parameter only a recurrence over the
  sequence has (:data:`RECURRENCE_PARAMETERS`: a state-space decay ``A_log``, a scan step bias
  ``dt_bias``).  The refusal names the mixer as the decoder layer's child that holds it.

``tests/integration/deepspeed/test_hf_mixers.py`` walks every causal LM class of the installed
transformers with a probe that needs no rule (does a token's output move when another token's
input does, with attention made per-token?) and asserts each one that mixes is refused here.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["RING_LAYER_TYPES", "RECURRENCE_PARAMETERS", "UnhandledMixer", "unhandled_mixers", "check_model_mixers"]

#: ``layer_types`` entries the ring runs exactly: attention (full causal, sliding window), and
#: layers that mix no tokens (Nemotron-H's MLP-only ``moe`` / ``mlp`` layers)
RING_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "moe", "mlp"})
#: parameter names that only a recurrence over the sequence keeps (Mamba, Mamba2, gated delta net)
RECURRENCE_PARAMETERS = frozenset({"A_log", "dt_bias"})


@dataclasses.dataclass(frozen=True)
class UnhandledMixer:
    """One token mixer the ring does not run: ``layer`` (decoder layer index, ``None`` outside the
    layers), ``path`` (the module's dotted name, or ``config.layer_types[i]``), ``kind`` (its class
    name or layer type) and ``evidence`` (what in the model shows it mixes tokens)."""

    layer: int | None
    path: str
    kind: str
    evidence: str

    def describe(self) -> str:
        where = f"layer {self.layer} " if self.layer is not None else ""
        return f"{where}{self.path} ({self.kind}: {self.evidence})"


def _layer_and_owner(path: str) -> tuple[int | None, str]:
    """``model.layers.3.linear_attn.conv1d`` -> ``(3, "model.layers.3.linear_attn")``: the decoder
    layer's index (the first integer in the path) and the layer's child that holds the module."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return int(part), ".".join(parts[: i + 2])
    return None, path


def _mixing_evidence(module: torch.nn.Module) -> str | None:
    if isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
        return f"a Conv1d of kernel {module.kernel_size[0]} over the sequence"
    names = sorted(RECURRENCE_PARAMETERS.intersection(n for n, _ in module.named_parameters(recurse=False)))
    if names:
        return f"the recurrence parameter{'s' if len(names) > 1 else ''} {', '.join(names)}"
    return None


def _layer_type_mixers(model) -> list[UnhandledMixer]:
    config = getattr(model, "config", None)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or ()
    return [UnhandledMixer(i, f"config.layer_types[{i}]", str(kind), "a layer type the ring does not run")
            for i, kind in enumerate(layer_types) if kind not in RING_LAYER_TYPES]


def unhandled_mixers(model: torch.nn.Module) -> list[UnhandledMixer]:
    """Every token mixer of ``model`` that is not an attention the ring runs, one per decoder
    layer's mixer module (then the ``layer_types`` entries of layers no module was found for),
    in layer order.  Reads module types and the config only: no forward, no collective."""
    owners: dict[str, UnhandledMixer] = {}
    modules = dict(model.named_modules())
    for path, module in modules.items():
        evidence = _mixing_evidence(module)
        if evidence is None:
            continue
        layer, owner = _layer_and_owner(path)
        if owner not in owners:
            owners[owner] = UnhandledMixer(layer, owner, type(modules.get(owner, module)).__name__, evidence)
    found = list(owners.values())
    seen_layers = {m.layer for m in found}
    found += [m for m in _layer_type_mixers(model) if m.layer not in seen_layers]
    return sorted(found, key=lambda m: (m.layer is None, m.layer or 0, m.path))


def check_model_mixers(model: torch.nn.Module, what: str = "context parallelism") -> None:
    """``ValueError`` naming the model class and every unhandled mixer (layer index, module, kind)
    when ``model`` mixes tokens other than through attention the ring runs; ``None`` otherwise."""
    found = unhandled_mixers(model)
    if not found:
        return
    shown = "; ".join(m.describe() for m in found[:4])
    more = f"; and {len(found) - 4} more" if len(found) > 4 else ""
    raise ValueError(
        f"{type(model).__name__} mixes tokens outside attention, which {what} would run on this rank's "
        f"tokens only (silently wrong): {shown}{more}. striped_sp's Hugging Face path runs attention "
        "layers only (full causal and sliding windows); train this model with sequence_parallel_size=1, "
        "or run its Mamba layers under striped in a Megatron-LM hybrid model "
        "(docs/deepspeed.md, 'Models with other token mixers')"
    )
