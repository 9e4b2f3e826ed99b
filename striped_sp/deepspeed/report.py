"""The setup line of the DeepSpeed route (:func:`striped_sp.setup_report.setup_line`), said once by
:func:`~striped_sp.deepspeed.initialize` on global rank 0, and the line that says context
parallelism is off where the JSON has the section at ``sequence_parallel_size: 1``.

Both go to the ``striped_sp.deepspeed`` logger at INFO, which is on by default: DeepSpeed's own
logger stays at WARNING unless the user raises it, and a user who set the run going with a
``context_parallel`` section must see that it is on.  The logger is set to INFO (unless the user
set its level) and, where no handler is configured anywhere, gets one on stderr; nothing else's
level changes."""

from __future__ import annotations

import logging
import sys

import torch
import torch.distributed as dist

from .config import SECTION, ContextParallelSettings
from .hybrid import mixer_summary

__all__ = ["setup_line", "announce", "LOGGER"]

#: the logger the setup line goes to (INFO, shown by default; silence it with its level)
LOGGER = logging.getLogger("striped_sp.deepspeed")


def _dtype(model, config: dict) -> torch.dtype:
    """The dtype attention will run in: the JSON's bf16 / fp16, else the model's parameters'."""
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if (config.get(key) or {}).get("enabled") is True:
            return dtype
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    return torch.float32 if param is None else param.dtype


def _head_dim(model):
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None)
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(head_dim, int) and isinstance(heads, int) and isinstance(getattr(text, "hidden_size", None), int):
        head_dim = text.hidden_size // heads
    return head_dim if isinstance(head_dim, int) else None


def _gqa(model) -> bool | None:
    """Whether the model's attention has fewer kv heads than query heads (``None``: not said)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    return kv < heads if isinstance(heads, int) and isinstance(kv, int) else None


def attention_extras(model) -> tuple[bool, float]:
    """``(sinks, softcap)`` of ``model``'s attention: whether a module holds learnable sinks (gpt-oss'
    ``sinks`` parameter) and the config's ``attn_logit_softcapping`` (Gemma 2; 0.0 when off)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "attn_logit_softcapping", None)
    sinks = any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules())
    return sinks, float(cap) if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap else 0.0


def setup_line(model, settings: ContextParallelSettings, groups, config: dict) -> str:
    """The line for ``model`` adapted with ``settings`` over ``groups`` (:class:`.SequenceParallelGroups`)."""
    from ..setup_report import setup_line as line

    sp, u = settings.sequence_parallel_size, settings.ulysses_size
    ranks = dist.get_process_group_ranks(groups.group) if groups.group is not None else [dist.get_rank()]
    split = f"; Ulysses {u} x ring {sp // u}" if u > 1 else ""
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None and param.device.type != "meta" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    sinks, softcap = attention_extras(model)
    extras = ("; sinks on" if sinks else "") + (f"; softcap {softcap}" if softcap else "")
    mixers = mixer_summary(model, sp)
    extras += f"; {mixers}" if mixers else ""
    return line(f"DeepSpeed, context_parallel.algo {settings.algo}", settings.layout,
                f"sequence_parallel_size {sp} (ranks {ranks} of {dist.get_world_size()}, {groups.dp_size} "
                f"data-parallel replicas{split})", settings.backend, device, _dtype(model, config),
                _head_dim(model), '"calibrate": true measures it', gqa=_gqa(model), softcap=softcap) + extras


def _say(message: str) -> None:
    """``message`` at INFO on :data:`LOGGER`, on global rank 0 only, shown without any logging setup."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if LOGGER.level == logging.NOTSET:
        LOGGER.setLevel(logging.INFO)
    if not LOGGER.hasHandlers():  # Python would show only warnings (its last-resort handler)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[striped_sp] %(message)s"))
        LOGGER.addHandler(handler)
    LOGGER.info(message)


def announce(model, settings: ContextParallelSettings, groups, config: dict) -> None:
    """Say the setup line on global rank 0 (or, where the JSON has the section at
    ``sequence_parallel_size: 1``, that context parallelism is off)."""
    if settings.enabled:
        _say(setup_line(model, settings, groups, config))
    elif config.get(SECTION) is not None:
        _say(f"striped_sp off: sequence_parallel_size {settings.sequence_parallel_size}, the {SECTION} "
             "section is not used (every rank a data-parallel replica)")
