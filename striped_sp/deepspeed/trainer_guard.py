"""A plain ``transformers.Trainer`` (or ``trl.SFTTrainer``) given the context-parallel JSON: refused
when it is built, naming the class to use.

A Trainer that is not :class:`~.trainer.ContextParallelTrainer` reads our JSON with transformers,
accelerate and DeepSpeed only: it shards nothing and fails far from the cause (accelerate's
"``context_parallel.backend`` not found in kwargs" when ``train()`` starts, or DeepSpeed's
``train_batch_size`` assertion after ``deepspeed.initialize`` has built its ops, minutes in on a
CPU machine).  So, while ``striped_sp.deepspeed`` is imported in the process, one
callback (:func:`guard_class`) is in transformers' list of default callbacks
(``transformers.trainer.DEFAULT_CALLBACKS``, which every Trainer and TRL trainer adds to its own):
its ``on_init_end``, the last step of ``Trainer.__init__`` (before any data loader, engine or
DeepSpeed op), raises a ``ValueError`` naming the class to use when the DeepSpeed config of the
``TrainingArguments`` has a ``"context_parallel"`` section with a ``sequence_parallel_size`` other
than 1 (or none), unless the Trainer being built is one of ours (:func:`building_ours`, entered by
``ContextParallelTrainer.__init__`` and so by every subclass, ``ContextParallelSFTTrainer``
included).  A JSON without the section, or with ``"sequence_parallel_size": 1`` written out (a
reference run), passes untouched; the callback does nothing at any other event.

transformers is not imported for this (``import transformers.trainer`` takes seconds): the
callback is added when ``transformers.trainer`` is first imported (:func:`after_import`, a one-shot
post-import hook on ``sys.meta_path``), or at once when it already is.  Installing is idempotent.
Known limit: TRL's ``SFTTrainer.__init__`` tokenizes and packs its datasets before it calls
``Trainer.__init__``, so with TRL the refusal comes after that preparation.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.abc
import logging
import sys
from typing import Callable

from .config import SECTION, load_config

__all__ = ["guard_class", "install_trainer_guard", "building_ours", "after_import", "refusal"]

logger = logging.getLogger(__name__)

TARGET = "transformers.trainer"

#: True while one of our Trainer classes runs its ``__init__`` (this thread / task only)
_OURS: contextvars.ContextVar[bool] = contextvars.ContextVar("striped_sp_context_parallel_trainer", default=False)


@contextlib.contextmanager
def building_ours():
    """Inside: the Trainer being built is one of ours, and the guard lets it pass."""
    token = _OURS.set(True)
    try:
        yield
    finally:
        _OURS.reset(token)


def _config_of(args) -> dict | None:
    """The DeepSpeed config dict of ``args`` (``TrainingArguments``), ``None`` without one."""
    hf = getattr(args, "hf_deepspeed_config", None)
    config = getattr(hf, "config", None)
    if isinstance(config, dict):
        return config
    given = getattr(args, "deepspeed", None)
    try:
        return None if given is None else load_config(given)
    except ValueError:  # not ours to refuse: transformers reads the config itself
        return None


def _class_to_use(args) -> str:
    trl = sys.modules.get("trl")
    sft_config = getattr(trl, "SFTConfig", None) if trl is not None else None
    if sft_config is not None and isinstance(args, sft_config):
        return ("striped_sp.deepspeed.trl.ContextParallelSFTTrainer "
                "(`from striped_sp.deepspeed.trl import ContextParallelSFTTrainer as SFTTrainer`)")
    return "striped_sp.deepspeed.ContextParallelTrainer (`from striped_sp.deepspeed import ContextParallelTrainer as Trainer`)"


def refusal(args) -> str | None:
    """The message refusing a Trainer that is not ours with ``args``, or ``None`` when it may run:
    no DeepSpeed config, no ``context_parallel`` section, or ``"sequence_parallel_size": 1``."""
    config = _config_of(args)
    if not isinstance(config, dict) or config.get(SECTION) is None:
        return None
    sp = config.get("sequence_parallel_size")
    if type(sp) is int and sp == 1:
        return None
    asked = f"sequence_parallel_size={sp!r}" if "sequence_parallel_size" in config else "without sequence_parallel_size"
    return (f"TrainingArguments(deepspeed=...) asks for context parallelism (a \"{SECTION}\" section, {asked}), "
            "but the trainer being built is not striped_sp's: it would not shard the sequence, and would fail "
            "later (accelerate's 'context_parallel.backend not found in kwargs', or DeepSpeed's train_batch_size "
            f"assertion after building its ops). Build it with {_class_to_use(args)}, or drop the \"{SECTION}\" "
            "section (or write \"sequence_parallel_size\": 1) for a run without context parallelism")


@functools.lru_cache(maxsize=None)
def guard_class():
    """The callback class (a transformers ``TrainerCallback``; imports ``transformers.trainer``)."""
    from transformers import TrainerCallback

    class ContextParallelGuard(TrainerCallback):
        """Refuses, at the end of ``Trainer.__init__``, a Trainer that is not ours given the
        context-parallel JSON (:func:`refusal`); nothing at any other event."""

        striped_sp_guard = True

        def on_init_end(self, args, state, control, **kwargs):
            if not _OURS.get():
                message = refusal(args)
                if message is not None:
                    raise ValueError(message)

    ContextParallelGuard.__qualname__ = "ContextParallelGuard"
    return ContextParallelGuard


def _install(module) -> None:
    callbacks = getattr(module, "DEFAULT_CALLBACKS", None)
    if not isinstance(callbacks, list) or any(getattr(cb, "striped_sp_guard", False) for cb in callbacks):
        return  # another transformers (nothing to hook), or already installed
    callbacks.append(guard_class())


def install_trainer_guard() -> None:
    """Add the guard (:func:`guard_class`) to transformers' default callbacks, now if
    ``transformers.trainer`` is imported, else when it is.  Idempotent."""
    module = sys.modules.get(TARGET)
    if module is not None:
        _install(module)
    else:
        after_import(TARGET, _install)


class _AfterImport(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while hooks wait: finds a waited-for module with the finders after
    it, and runs the hooks on the module once it has executed; gone when no hook waits."""

    def __init__(self):
        self.hooks: dict[str, list[Callable]] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.hooks:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Then(spec.loader, self, fullname)
        return spec

    def ran(self, fullname: str, module) -> None:
        for hook in self.hooks.pop(fullname, []):
            try:
                hook(module)
            except Exception:  # a hook must never break the import it waited for
                logger.warning("striped_sp: a hook after importing %s failed", fullname, exc_info=True)
        if not self.hooks and self in sys.meta_path:
            sys.meta_path.remove(self)


class _Then(importlib.abc.Loader):
    """``loader``, then the hooks; the module keeps ``loader`` as its own."""

    def __init__(self, loader, finder: _AfterImport, fullname: str):
        self.loader, self.finder, self.fullname = loader, finder, fullname

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.finder.ran(self.fullname, sys.modules.get(self.fullname, module))


_FINDER = _AfterImport()


def after_import(name: str, hook: Callable) -> None:
    """Run ``hook(module)`` once, right after module ``name`` is first imported (at once if it is
    already).  A hook given twice runs once."""
    module = sys.modules.get(name)
    if module is not None:
        hook(module)
        return
    hooks = _FINDER.hooks.setdefault(name, [])
    if hook not in hooks:
        hooks.append(hook)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
