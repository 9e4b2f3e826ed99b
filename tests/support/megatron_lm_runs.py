"""Launching Megatron-LM's pretrain_gpt.py on 2 CPU gloo ranks for the loop tests: a patched copy of
a checkout, and one run of ``tests/support/megatron_lm_launch.py`` (the CPU shims, the plants)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from paths import ROOT, SUPPORT

LAUNCH = os.path.join(str(SUPPORT), "megatron_lm_launch.py")
PATCHES = os.path.join(str(ROOT), "patches")


def patched_checkout(root: str, tmp_root: str, tag: str, name: str) -> str:
    """A copy of the checkout ``root`` in ``tmp_root/name`` with ``patches/``'s patch of ``tag`` applied
    (made once); a failing ``git apply`` fails the test."""
    checkout = os.path.join(tmp_root, name)
    if not os.path.isdir(checkout):
        shutil.copytree(root, checkout, ignore=shutil.ignore_patterns("__pycache__", ".git"))
        patch = os.path.join(PATCHES, f"megatron_lm_{tag}_context_parallel_algo.patch")
        res = subprocess.run(["git", "apply", patch], cwd=checkout, capture_output=True, text=True)
        assert res.returncode == 0, f"git apply {patch}: {res.stderr}"
    return checkout


def launch(entry: list, args: list, checkout: str, cwd: str, timeout_s: float, plant: str | None = None):
    """``torchrun --nproc-per-node 2 megatron_lm_launch.py *entry *args`` with ``checkout`` and the project
    on ``PYTHONPATH`` and ``plant`` (``STRIPED_SP_TEST_PLANT``); ``(returncode, stdout + stderr)``,
    ``-1`` when it ran past ``timeout_s``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (checkout, str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for name in ("MEGATRON_LM_DIR", "STRIPED_SP_TEST_SCALE_FACTOR", "STRIPED_SP_TEST_PLANT"):
        env.pop(name, None)
    if plant:
        env["STRIPED_SP_TEST_PLANT"] = plant
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", LAUNCH,
           *entry, *args]
    try:
        res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
        return res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as exc:
        printed = [t.decode() if isinstance(t, bytes) else t or "" for t in (exc.stdout, exc.stderr)]
        return -1, "".join(printed) + "\n[timed out]"
