"""Hybrid transformers models on the Hugging Face path: every non-attention token mixer runs on the
whole sequence in natural order (:mod:`striped_sp.engine.natural_order`).

:func:`wrap_mixers` wraps the forward of each mixer module :mod:`.mixers` finds (a gated delta net,
a Mamba / Mamba2 mixer, a short convolution: the decoder layer's child that holds the scan or the
convolution).  The wrapped forward gathers its input ``hidden_states`` ``[b, S/N, hidden]`` from
the group into natural order, runs the model's own module (its own kernels: fla / mamba_ssm /
causal-conv1d where installed, transformers' PyTorch fallbacks elsewhere) on all ``S`` tokens, and
keeps this rank's tokens of the output.  The result equals the model at SP=1 token for token;
the cost is the gather's (see the module notes there): N times the mixer's compute and activations.

Where it stops, by name:

* packed rows: the mixer gets what it gets at SP=1, the whole row in natural order, its
  per-token arguments (``position_ids``, ``seq_idx``) gathered alike and the batch's global
  ``cu_seq_lens_q/k`` as they are: it separates the documents exactly as the model does at SP=1;
* packed rows under a layout that pads each document (``zigzag``: multiples of 2N), whose
  padding a mixer would scan as tokens: refused;
* a mixer input that is not ``[b, S/N, hidden]`` (a mixer that is the convolution itself,
  channels first): refused at its first forward, on every rank, before the gather;
* a ring attention inside a wrapped mixer (it would see the whole sequence as local): refused.
"""

from __future__ import annotations

import contextvars
import functools
import os

import torch

from ..engine.natural_order import gather_natural, natural_order, take_local
from ..engine.state_passing import contiguous_chunks, to_chunks
from ..plan import mixer_cost
from ..plan.layouts import get_layout
from .mixers import UnhandledMixer, unhandled_mixers
from .split import find_split, split_or_reason
from .state import find_state

__all__ = ["wrap_mixers", "inside_gathered_mixer", "mixer_modes", "mixer_summary"]

#: set while a wrapped mixer runs on the gathered sequence
_INSIDE = contextvars.ContextVar("striped_sp_inside_gathered_mixer", default=None)


def inside_gathered_mixer() -> str | None:
    """The path of the wrapped mixer running now, or ``None``."""
    return _INSIDE.get()


def _hidden_states(args, kwargs):
    if args and isinstance(args[0], torch.Tensor):
        return args[0], lambda x, rest, kw: ((x, *rest), kw), args[1:]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"], lambda x, rest, kw: (rest, {**kw, "hidden_states": x}), args
    return None, None, args


def _per_token(value, x: torch.Tensor) -> bool:
    """A tensor of the mixer's other arguments that holds one entry per local token
    (``position_ids``, ``seq_idx``): ``[b, S/N, ...]`` like the hidden states, or ``[1, S/N, ...]``
    shared by the batch's rows (as transformers builds ``position_ids`` when none are given)."""
    return (isinstance(value, torch.Tensor) and value is not x and value.dim() >= 2
            and value.size(0) in (1, x.size(0)) and value.size(1) == x.size(1))


#: names a mixer's forward takes besides hidden_states that the split forms handle themselves
_SPLIT_DROPS = ("cache", "cache_params", "past_key_values", "attention_mask")


#: ``0`` runs every mixer gathered (to compare, or to rule the split out); anything else: split where it can
SPLIT_ENV = "STRIPED_SP_SPLIT_MIXERS"


def split_mixers_enabled() -> bool:
    """Whether mixers split over the group (``$STRIPED_SP_SPLIT_MIXERS`` not ``0``)."""
    return os.environ.get(SPLIT_ENV, "1").strip() != "0"


#: how a mixer that can split runs: ``auto`` (by the forms' cost model, :mod:`striped_sp.plan.mixer_cost`: the
#: head all-to-all, state passing or the gather, per kind, N and row length; state passing where the heads do
#: not divide), ``state`` (state passing wherever the form is known), ``split`` (never state passing)
MODE_ENV = "STRIPED_SP_MIXER_MODE"
_MODES = ("auto", "state", "split")
#: the cost model's forms -> the modes the setup line names
_NAMES = {"split": "split", "state": "state passing", "gathered": "gathered"}


def mixer_mode() -> str:
    """``$STRIPED_SP_MIXER_MODE`` (``auto`` unless set); ``ValueError`` naming it for another value."""
    mode = os.environ.get(MODE_ENV, "auto").strip() or "auto"
    if mode not in _MODES:
        raise ValueError(f"${MODE_ENV}={mode!r}: must be one of {', '.join(_MODES)}")
    return mode


def _predicted(predicted: dict) -> str:
    """``"state passing 1817 ms, split 1954 ms, gathered 4053 ms"``, cheapest first."""
    return ", ".join(f"{_NAMES[f]} {ms:.0f} ms" for f, ms in sorted(predicted.items(), key=lambda kv: kv[1]))


def _by_length(kind: str, n: int, can_split: bool, can_pass: bool) -> str:
    """The cost model's choice along row lengths, where it changes, and its predictions on both sides."""
    runs = mixer_cost.switches(kind, n, can_split, can_pass)
    said = [f"{_NAMES[runs[0][1]]} below {runs[1][0]} tokens per row"]
    said += [f"{_NAMES[form]} from {length}" for length, form, _ in runs[1:]]
    at = [f"at {length // 2}: {_predicted(mixer_cost.choose(kind, n, length // 2, can_split, can_pass)[1])}; "
          f"at {length}: {_predicted(predicted)}" for length, _, predicted in runs[1:]]
    return f"{kind}: {', '.join(said)} (predicted fwd+bwd per layer {'; '.join(at)})"


def choose_form(module, n: int, seq_len: int | None = None):
    """``(form, mode, why)`` for ``module`` over ``n`` ranks on rows of ``seq_len`` tokens: ``mode``
    ``"split"`` (the head all-to-all), ``"state passing"`` (contiguous chunks joined by their states: any
    N, heads or not) or ``"gathered"`` (``form`` ``None``); ``why``: the kind and, where the cost model
    chose, its predictions, or the reason it cannot split.  ``seq_len`` ``None`` (the setup line, before
    any batch): where the choice depends on the row's length, ``mode`` ``"by row length"`` and ``why``
    the lengths where it changes (``form`` ``None``).  A pure function of shapes: every rank chooses alike."""
    split, reason = split_or_reason(module, n)
    if not split_mixers_enabled():
        return None, "gathered", f"${SPLIT_ENV}=0"
    mode = mixer_mode()
    state = find_state(module) if mode != "split" else None
    if mode != "auto" or state is None or split is None:  # one form can run, or the user named it
        if state is not None and (split is None or mode == "state"):
            return state, "state passing", state.kind
        if split is not None:
            return split, "split", split.kind
        return None, "gathered", reason
    kind, forms = state.kind, {"split": split, "state": state, "gathered": None}
    if seq_len is None:
        runs = mixer_cost.switches(kind, n, True, True)
        if len(runs) > 1:
            return None, "by row length", _by_length(kind, n, True, True)
        form = runs[0][1]
        return forms[form], _NAMES[form], kind
    can_pass = seq_len // n >= state.min_chunk()
    form, predicted = mixer_cost.choose(kind, n, seq_len, True, can_pass)
    why = f"{kind}: {_predicted(predicted)} at {seq_len} tokens" if predicted else kind
    return forms[form], _NAMES[form], why


def _split_for(module, n: int, seq_len: int, rest: tuple, kwargs: dict):
    """The form of ``module`` for ``n`` ranks and rows of ``seq_len`` tokens (:func:`choose_form`), or
    ``None`` (the gather runs): no form, the cost model's choice, a cache (generation), or positional
    arguments past the hidden states it cannot name.  (A padding mask needs no look: padding is refused
    at the model's input.)"""
    if module is None or not split_mixers_enabled():
        return None
    known = module.__dict__.setdefault("_striped_sp_splits", {})  # a copy of the module copies its forms
    key = (n, mixer_mode(), seq_len)
    if key not in known:  # once per module, group size, mode and row length: later calls look it up
        known[key] = choose_form(module, n, seq_len)[0]
    split = known[key]
    if split is None or any(a is not None for a in rest):
        return None
    if any(kwargs.get(k) is not None for k in ("cache", "cache_params", "past_key_values")):
        return None
    return split


def _split_kwargs(kwargs: dict) -> dict:
    """The keyword arguments a split form passes on to the model's kernels (as the forward does)."""
    return {k: v for k, v in kwargs.items() if k not in _SPLIT_DROPS}


def _wrapped_forward(forward, path: str, hidden: int, settings_of, module=None):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        import torch.distributed as dist

        settings = settings_of()
        x, rebuild, rest = _hidden_states(args, kwargs)
        if x is None or x.dim() != 3 or x.size(-1) != hidden:
            shape = None if x is None else tuple(x.shape)
            raise ValueError(
                f"{path}: a token mixer whose input is not hidden_states [batch, tokens, {hidden}] (got "
                f"{shape}) cannot run on the gathered sequence; train this model with sequence_parallel_size=1")
        group = settings.group if settings.group is not None else dist.group.WORLD
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        if settings.cu_seqlens is not None and get_layout(settings.layout).document_multiple(n) > 1:
            raise ValueError(
                f"{path}: packed rows under layout {settings.layout!r} pad every document to a multiple of "
                f"{get_layout(settings.layout).document_multiple(n)} tokens, and a token mixer would scan the padding "
                "as tokens: use the 'striped' layout (no padding) with this hybrid model")
        order = natural_order(x.size(1) * n, n, rank, settings.layout, settings.cu_seqlens)
        split = _split_for(module, n, x.size(1) * n, rest, kwargs)
        # per-token arguments (position_ids, seq_idx) follow the tokens; the rest (the packed row's
        # global cu_seq_lens, as at SP=1) pass as they are
        if split is not None:
            kwargs = _split_kwargs(kwargs)
        gather = split is None or not hasattr(split, "cannot_pass")
        rest = tuple(gather_natural(a, group, order) if gather and _per_token(a, x) else a for a in rest)
        others = {k: gather_natural(v, group, order) if gather and _per_token(v, x) else v
                  for k, v in kwargs.items() if k != "hidden_states"}
        token = _INSIDE.set(path)
        try:
            if split is not None and hasattr(split, "cannot_pass"):  # contiguous chunks, states passed
                plan = contiguous_chunks(x.size(1) * n, n, rank, settings.layout, settings.cu_seqlens)
                # of the per-token arguments only seq_idx reaches a kernel: it follows the tokens
                chunked = {k: to_chunks(v, group, plan) if _per_token(v, x) else v for k, v in kwargs.items()
                           if k != "hidden_states" and (k == "seq_idx" or not _per_token(v, x))}
                return split.run(x, group, plan, chunked)
            if split is not None:  # heads / channels over the group, one all-to-all each way
                return split.run(x, group, order, others)
            args2, kwargs2 = rebuild(gather_natural(x, group, order), rest, others)
            out = forward(*args2, **kwargs2)
        finally:
            _INSIDE.reset(token)
        if isinstance(out, torch.Tensor):
            return take_local(out, order)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (take_local(out[0], order), *out[1:])
        raise ValueError(f"{path}: the mixer returned {type(out).__name__}, not hidden states")

    run._striped_sp_mixer = path
    return run


def wrap_mixers(model: torch.nn.Module, settings_of) -> list[UnhandledMixer]:
    """Wrap every runnable mixer of ``model`` so it runs on the gathered sequence; ``settings_of()``
    gives the active group, layout and the batch's boundaries at call time.  A second call wraps
    nothing twice and points every wrapped mixer at its ``settings_of`` (the later call wins).  The
    wrapper is a method of its module, so a deep copy of the model runs its own mixers (a closure
    over the module's bound forward would run the original's weights).  Returns the mixers it could
    not wrap (for the caller to refuse); wraps nothing when there are any."""
    import types

    def method(path: str, inner, own: bool):
        def run(self, *args, **kwargs):
            forward = inner.__func__.__get__(self) if own else inner  # own: the copy's forward in a copy
            return _wrapped_forward(forward, path, hidden, self._striped_sp_settings_of, self)(*args, **kwargs)

        run._striped_sp_mixer = path
        return run

    found = unhandled_mixers(model)
    left = [m for m in found if not m.runnable]
    if left:
        return left
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    modules = dict(model.named_modules())
    for mixer in found:
        path, module = mixer_module(modules, mixer.path)
        module._striped_sp_settings_of = settings_of
        if getattr(module.forward, "_striped_sp_mixer", None) is None:
            inner = module.forward
            module.forward = types.MethodType(method(path, inner, getattr(inner, "__self__", None) is module),
                                              module)
    return []


def mixer_module(modules: dict, path: str) -> tuple[str, torch.nn.Module]:
    """The module to wrap for the mixer found at ``path`` (a decoder layer's child): itself, or where
    it has no split form and exactly one module inside it has one (Zamba2's hybrid layer holds its
    Mamba2 mixer one level down), that one, so that the mixer splits instead of gathering."""
    module = modules[path]
    if find_split(module) is None:
        inner = [(p, m) for p, m in modules.items() if p.startswith(path + ".") and find_split(m) is not None]
        if len(inner) == 1:
            return inner[0]
    return path, module


def mixer_modes(model: torch.nn.Module, n: int, seq_len: int | None = None) -> list[tuple[str, str, str]]:
    """How each non-attention mixer of ``model`` runs over ``n`` ranks on rows of ``seq_len`` tokens:
    ``(path, mode, why)`` with ``mode`` ``"split"`` (the head all-to-all) or ``"state passing"`` (``why``: its
    kind, e.g. ``"gated delta net"``, and where the cost model chose, its predicted ms of each form),
    ``"gathered"`` (``why``: the reason it cannot split, or the predictions), or without ``seq_len``
    ``"by row length"`` (``why``: the lengths where the choice changes, :func:`choose_form`).  Reads
    module types only: no forward, no collective."""
    modules = dict(model.named_modules())
    modes = []
    for mixer in unhandled_mixers(model):
        if mixer.path not in modules:
            continue
        path, module = mixer_module(modules, mixer.path)
        modes.append((path, *choose_form(module, n, seq_len)[1:]))
    return modes


def mixer_summary(model: torch.nn.Module, n: int, seq_len: int | None = None) -> str:
    """For the setup line: ``"mixers: 6 split (gated delta net), 1 gathered: model.layers.3.mamba
    (3 heads are not divisible by 2 ranks)"``, or where the cost model's choice depends on the row
    length, ``"6 by row length (gated delta net: split below 8192 tokens per row, state passing from
    8192 (predicted ...))"``; ``""`` for a model without such mixers."""
    modes = mixer_modes(model, n, seq_len)
    if not modes:
        return ""
    parts = []
    for run in ("by row length", "split", "state passing"):
        kinds = sorted({why for _, mode, why in modes if mode == run})
        count = sum(mode == run for _, mode, _ in modes)
        if count:
            parts.append(f"{count} {run} ({', '.join(kinds)})")
    gathered = [f"{path} ({why})" for path, mode, why in modes if mode == "gathered"]
    if gathered:
        shown = "; ".join(gathered[:3]) + (f"; and {len(gathered) - 3} more" if len(gathered) > 3 else "")
        parts.append(f"{len(gathered)} gathered (each rank runs the whole sequence): {shown}")
    return "mixers: " + ", ".join(parts)
