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

* packed rows (``cu_seq_lens_q`` / restarting ``position_ids``): a mixer would scan across the
  documents' boundaries, where the model at SP=1 may not: refused;
* a mixer input that is not ``[b, S/N, hidden]`` (a mixer that is the convolution itself,
  channels first): refused at its first forward, on every rank, before the gather;
* a ring attention inside a wrapped mixer (it would see the whole sequence as local): refused.
"""

from __future__ import annotations

import contextvars
import functools

import torch

from ..engine.natural_order import gather_natural, natural_order, take_local
from .mixers import UnhandledMixer, unhandled_mixers

__all__ = ["wrap_mixers", "inside_gathered_mixer"]

#: set while a wrapped mixer runs on the gathered sequence
_INSIDE = contextvars.ContextVar("striped_sp_inside_gathered_mixer", default=None)


def inside_gathered_mixer() -> str | None:
    """The path of the wrapped mixer running now, or ``None``."""
    return _INSIDE.get()


def _hidden_states(args, kwargs):
    if args and isinstance(args[0], torch.Tensor):
        return args[0], lambda x: ((x, *args[1:]), kwargs)
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"], lambda x: (args, {**kwargs, "hidden_states": x})
    return None, None


def _wrapped_forward(forward, path: str, hidden: int, settings_of):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        import torch.distributed as dist

        settings = settings_of()
        x, rebuild = _hidden_states(args, kwargs)
        if x is None or x.dim() != 3 or x.size(-1) != hidden:
            shape = None if x is None else tuple(x.shape)
            raise ValueError(
                f"{path}: a token mixer whose input is not hidden_states [batch, tokens, {hidden}] (got "
                f"{shape}) cannot run on the gathered sequence; train this model with sequence_parallel_size=1")
        if settings.cu_seqlens is not None:
            raise ValueError(
                f"{path}: packed rows (cu_seq_lens_q) with a hybrid model are not supported: the mixer would scan "
                "across document boundaries; use one sequence per row (padding) with this model")
        group = settings.group if settings.group is not None else dist.group.WORLD
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        order = natural_order(x.size(1) * n, n, rank, settings.layout)
        token = _INSIDE.set(path)
        try:
            args2, kwargs2 = rebuild(gather_natural(x, group, order))
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
