"""Is a shipped Megatron-LM patch applied to a checkout, and apply it once: ``striped-sp patch
--status TAG`` / ``--apply TAG`` (``-C DIR``: the checkout, default the current folder).

Three states, told apart with ``git apply --check`` and ``git apply --reverse --check`` (git reads
a plain folder too, no repository needed):

* ``applies``: not applied yet, and the patch applies cleanly;
* ``applied``: already applied (its reverse applies cleanly), so applying it again is a no-op
  rather than git's "patch does not apply";
* ``conflicts``: neither: the checkout is another tag or has local changes in the patched lines.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from .patch_files import patch_path

__all__ = ["patch_status", "apply_patch", "describe"]


def _git_apply(path: str, directory: str, *flags: str) -> subprocess.CompletedProcess:
    if shutil.which("git") is None:
        raise ValueError("striped-sp patch --status / --apply need git on PATH (git apply reads the patch)")
    if not os.path.isdir(directory):
        raise ValueError(f"-C {directory!r} is not a folder: give the Megatron-LM checkout")
    return subprocess.run(["git", "apply", *flags, path], cwd=directory, capture_output=True, text=True)


def patch_status(tag: str, directory: str = ".") -> tuple[str, str]:
    """``(state, git's message)`` of the patch for ``tag`` in ``directory``: state ``"applies"``,
    ``"applied"`` or ``"conflicts"`` (the message of the forward check then says where)."""
    path = patch_path(tag)
    forward = _git_apply(path, directory, "--check")
    if forward.returncode == 0:
        return "applies", ""
    if _git_apply(path, directory, "--reverse", "--check").returncode == 0:
        return "applied", ""
    return "conflicts", forward.stderr.strip()


def describe(tag: str, directory: str, state: str, detail: str = "") -> str:
    """One line saying what ``state`` means for the user, and what to do."""
    where = os.path.abspath(directory)
    if state == "applied":
        return f"the {tag} patch is already applied in {where}: nothing to do"
    if state == "applies":
        return f"the {tag} patch is not applied in {where} and applies cleanly: striped-sp patch --apply {tag}"
    return (f"the {tag} patch neither applies nor is applied in {where}: the checkout is another Megatron-LM "
            f"tag (striped-sp patch --list) or has local changes in the patched lines. git says: {detail}")


def apply_patch(tag: str, directory: str = ".") -> str:
    """Apply the patch for ``tag`` in ``directory`` unless it is already applied; returns the line
    :func:`describe` gives for the state found.  ``ValueError`` if it neither applies nor is applied."""
    state, detail = patch_status(tag, directory)
    if state == "conflicts":
        raise ValueError(describe(tag, directory, state, detail))
    if state == "applied":
        return describe(tag, directory, state)
    done = _git_apply(patch_path(tag), directory)
    if done.returncode != 0:  # pragma: no cover - the check above passed
        raise ValueError(f"git apply failed in {os.path.abspath(directory)}: {done.stderr.strip()}")
    return f"applied the {tag} patch in {os.path.abspath(directory)}"
