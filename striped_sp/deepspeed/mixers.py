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
* a model none of whose modules calls transformers' attention registry (xLSTM): its mixing is
  all something else;
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
import functools
import inspect

import torch

__all__ = ["RING_LAYER_TYPES", "RECURRENCE_PARAMETERS", "UnhandledMixer", "unhandled_mixers", "runnable",
           "check_model_mixers", "refuse_mixers"]

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

    @property
    def runnable(self) -> bool:
        """Whether :mod:`.hybrid` runs it on the gathered sequence: a module holds it (a
        ``layer_types`` entry with no module, a linear or chunked attention, does not)."""
        return not self.path.startswith("config.")

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


@functools.lru_cache(maxsize=None)
def _calls_attention_functions(cls: type) -> bool:
    """Whether ``cls.forward`` looks its attention up in transformers' registry (every attention
    module that the ring can replace does: ``ALL_ATTENTION_FUNCTIONS``)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def _no_attention(model) -> list[UnhandledMixer]:
    """A transformers model none of whose modules calls the attention registry mixes its tokens by
    something else entirely (xLSTM, RWKV): one entry for the whole model."""
    if not hasattr(model, "set_attn_implementation"):
        return []
    if any(_calls_attention_functions(type(m)) for m in model.modules()):
        return []
    return [UnhandledMixer(None, "config.model", type(model).__name__,
                           "no module calls transformers' attention functions, so its token mixing is all "
                           "something else")]


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
    found += _no_attention(model)
    return sorted(found, key=lambda m: (m.layer is None, m.layer or 0, m.path))


def runnable(model: torch.nn.Module) -> bool:
    """Whether every token mixer of ``model`` that is not attention runs on the gathered sequence
    (:mod:`.hybrid`); ``False`` when one cannot (then nothing of the model is wrapped)."""
    return all(m.runnable for m in unhandled_mixers(model))


def check_model_mixers(model: torch.nn.Module, what: str = "context parallelism") -> None:
    """``ValueError`` naming the model class and every mixer the plugin cannot run (layer index,
    module or layer type, kind) when ``model`` has any; ``None`` otherwise.  Mixers that run on the
    gathered sequence (:mod:`.hybrid`) pass while every mixer of the model does."""
    found = unhandled_mixers(model)
    if all(m.runnable for m in found):
        return
    refuse_mixers(model, [m for m in found if not m.runnable], what)


def refuse_mixers(model, mixers: list, what: str = "context parallelism") -> None:
    """The ``ValueError`` for ``mixers`` of ``model`` (see :func:`check_model_mixers`)."""
    shown = "; ".join(m.describe() for m in mixers[:4])
    more = f"; and {len(mixers) - 4} more" if len(mixers) > 4 else ""
    raise ValueError(
        f"{type(model).__name__} mixes tokens outside attention in a way {what} cannot run "
        f"(it would see this rank's tokens only: silently wrong): {shown}{more}. striped_sp's Hugging Face "
        "path runs attention layers (full causal and sliding windows) and, on the whole gathered sequence, "
        "the mixer modules that hold a scan or a convolution (gated delta net, Mamba, short convolutions); "
        "train this model with sequence_parallel_size=1 (docs/deepspeed.md, 'Models with other token mixers')"
    )
