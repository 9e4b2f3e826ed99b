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

import torch

from ..engine.natural_order import gather_natural, natural_order, take_local
from ..plan.layouts import get_layout
from .mixers import UnhandledMixer, unhandled_mixers

__all__ = ["wrap_mixers", "inside_gathered_mixer"]

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
    (``position_ids``, ``seq_idx``): ``[b, S/N, ...]`` like the hidden states."""
    return (isinstance(value, torch.Tensor) and value is not x and value.dim() >= 2
            and value.size(0) == x.size(0) and value.size(1) == x.size(1))


def _wrapped_forward(forward, path: str, hidden: int, settings_of):
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
        # per-token arguments (position_ids, seq_idx) follow the tokens; the rest (the packed row's
        # global cu_seq_lens, as at SP=1) pass as they are
        rest = tuple(gather_natural(a, group, order) if _per_token(a, x) else a for a in rest)
        others = {k: gather_natural(v, group, order) if _per_token(v, x) else v
                  for k, v in kwargs.items() if k != "hidden_states"}
        token = _INSIDE.set(path)
        try:
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
    """Wrap every runnable mixer of ``model`` (once; a second call leaves wrapped ones alone) so
    it runs on the gathered sequence; ``settings_of()`` gives the active group, layout and the
    batch's boundaries at call time.  Returns the mixers it could not wrap (for the caller to
    refuse); wraps nothing when there are any."""
    found = unhandled_mixers(model)
    left = [m for m in found if not m.runnable]
    if left:
        return left
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    modules = dict(model.named_modules())
    for mixer in found:
        module = modules[mixer.path]
        if getattr(module.forward, "_striped_sp_mixer", None) is None:
            module.forward = _wrapped_forward(module.forward, mixer.path, hidden, settings_of)
    return []
