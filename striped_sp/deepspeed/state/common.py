"""What the state-passing forms share: the chunk's documents as the model's kernels take them, and
the convolution over the chunk with its halo."""

from __future__ import annotations

import torch

from ...engine.state_passing import ContiguousChunks, halo

__all__ = ["StateForm", "documents_of", "conv_with_halo"]

#: the per-token and packing arguments a form translates itself (the chunk's own, from the plan)
_TRANSLATED = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids")


class StateForm:
    """What every state-passing form shares: it wraps the split form (``split_form``) that recognises
    the module (the projections, kernels and gated norm are that form's) and runs for any ``N``."""

    kind = ""
    split_form: type = type(None)

    def __init__(self, split):
        self.split, self.module = split, split.module
        self._refusals: dict = {}  # (kernel, argument) -> the kernel's refusal of packed rows, or None

    @classmethod
    def recognise(cls, module: torch.nn.Module):
        split = cls.split_form.recognise(module)
        return None if split is None else cls(split)

    def cannot_pass(self, n: int) -> str | None:
        """Why it cannot run over ``n`` ranks (never: the chunks need no head count)."""
        return None

    def min_chunk(self) -> int:
        """The fewest tokens a chunk may have: its convolution's halo (window - 1)."""
        conv = getattr(self.module, "conv1d", None)
        return (conv if conv is not None else self.module.conv).weight.size(-1) - 1

    def check_packed(self, plan: ContiguousChunks, **kernels) -> None:
        """``ValueError`` before any message where the row's documents would reach a kernel that cannot keep
        them apart (``kernels``: argument -> kernel, e.g. ``cu_seqlens=scan``): transformers' PyTorch fallbacks
        refuse ``cu_seqlens`` / ``seq_idx`` (and so the row at SP=1); in the kernel's own words.  Asked once
        per kernel and argument, with no inputs: a kernel that takes the argument fails on the missing ones
        before it computes anything."""
        for name, kernel in kernels.items():
            key = (kernel, name)
            if key not in self._refusals:
                try:
                    kernel(**{name: torch.zeros(1, dtype=torch.int32)})
                    self._refusals[key] = None
                except ValueError as err:
                    self._refusals[key] = str(err)
                except Exception:  # noqa: BLE001 - it took the argument and then missed its inputs
                    self._refusals[key] = None
            if self._refusals[key]:
                raise ValueError(f"{type(self.module).__name__}: a packed row ({plan.seq_len} tokens, {name} given "
                                 f"to its kernel) under state passing: {self._refusals[key]}")

    def check(self, plan: ContiguousChunks, conv: torch.nn.Module | torch.Tensor) -> None:
        """``ValueError`` before any message when a chunk is shorter than the convolution's halo."""
        width = (conv.weight if isinstance(conv, torch.nn.Module) else conv).size(-1) - 1
        if plan.length < width:
            raise ValueError(f"{type(self.module).__name__}: state passing needs chunks of at least {width} tokens "
                             f"(its convolution's window {width + 1} - 1); {plan.seq_len} tokens on "
                             f"{plan.world_size} ranks give {plan.length}")


def documents_of(plan: ContiguousChunks, kwargs: dict, key: str) -> tuple[ContiguousChunks, dict, bool]:
    """``(plan, kwargs, resets)``: where the model gives its kernels the documents (``key``: ``seq_idx``
    for causal_conv1d / mamba_ssm, ``cu_seq_lens_q`` for fla), the plan with the row's documents and
    ``resets`` true (the form passes the chunk's own ``seq_idx`` / ``cu_seqlens``); else the plan
    without documents (the model resets nowhere: neither does the state).  ``kwargs``: the rest."""
    rest = {k: v for k, v in kwargs.items() if k not in _TRANSLATED}
    if kwargs.get(key) is None:
        return plan.without_documents(), rest, False
    return plan, rest, True


def conv_with_halo(conv, x: torch.Tensor, weight: torch.Tensor, bias, group, plan: ContiguousChunks,
                   resets: bool, **kwargs) -> torch.Tensor:
    """The model's causal depthwise ``conv`` (``causal_conv1d_fn``: ``[b, c, s]``, ``weight`` ``[c, k]``) over
    the chunk ``x`` ``[b, T, c]`` preceded by the previous chunk's last ``k - 1`` inputs -> ``[b, T, c]``."""
    width = weight.size(-1) - 1
    ext = torch.cat((halo(x, width, group, plan), x), dim=1)
    if resets:  # the halo's rows are of the chunk's first document, or zero
        ids = plan.on(x.device).seq_idx.expand(x.size(0), -1)
        kwargs["seq_idx"] = torch.cat((ids[:, :1].expand(-1, width), ids), dim=1).contiguous()
    return conv(ext.transpose(1, 2), weight, bias, **kwargs).transpose(1, 2)[:, width:]
