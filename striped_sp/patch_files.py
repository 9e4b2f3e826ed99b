"""The Megatron-LM patch files shipped inside the package (``striped_sp/patches/``).

One patch per supported Megatron-LM release line adds ``--context-parallel-algo`` to
``pretrain_gpt.py`` (see docs/megatron.md).  The files are package data, so an installed wheel has
them too: ``striped-sp patch --list``, ``striped-sp patch --print core_v0.19.0 | git apply``.
A tag is the Megatron-LM git tag (``core_v0.19.0``); a megatron-core version (``0.19.2``) picks the
patch of its release line.  Nothing here imports Megatron.
"""

from __future__ import annotations

import os
import re

__all__ = ["PATCH_DIR", "available", "patch_path", "read_patch"]

#: the folder of the patch files inside the installed package
PATCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patches")
_NAME = re.compile(r"^megatron_lm_(core_v(\d+)\.(\d+)\.\d+)_context_parallel_algo\.patch$")


def available() -> dict[str, str]:
    """``{tag: absolute path}`` of every shipped patch, sorted by tag (``core_v0.16.1``, ...)."""
    found = {}
    for name in os.listdir(PATCH_DIR) if os.path.isdir(PATCH_DIR) else ():
        m = _NAME.match(name)
        if m:
            found[m.group(1)] = os.path.join(PATCH_DIR, name)
    return dict(sorted(found.items(), key=lambda kv: tuple(int(x) for x in kv[0][len("core_v"):].split("."))))


def patch_path(tag: str) -> str:
    """The path of the patch for ``tag``: a Megatron-LM tag (``core_v0.19.0``) or a megatron-core
    version (``0.19.2``, ``v0.19.2``: the patch of its release line).  ``ValueError`` naming the
    tag and the shipped ones when there is none."""
    patches = available()
    text = str(tag).strip()
    if text in patches:
        return patches[text]
    m = re.match(r"^(?:core_)?v?(\d+)\.(\d+)(?:\.\d+)?(?:[.+-].*)?$", text)
    if m:
        line = [t for t in patches if t.split(".")[:2] == [f"core_v{m.group(1)}", m.group(2)]]
        if line:
            return patches[line[-1]]
    raise ValueError(f"no Megatron-LM patch for {tag!r}: the shipped ones are {', '.join(patches) or 'none'} "
                     "(a tag, or a megatron-core version such as 0.19.2 for its release line)")


def read_patch(tag: str) -> str:
    """The text of the patch for ``tag`` (see :func:`patch_path`)."""
    with open(patch_path(tag)) as f:
        return f.read()
