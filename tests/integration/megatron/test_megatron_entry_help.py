"""``python -m striped_sp.megatron.pretrain_gpt --help`` prints the plugin's flags on any machine:
without a Megatron-LM checkout, and with one whose training modules need triton (GPU-only), which
then gets one line saying why Megatron-LM's own flags are not shown."""

import os
import subprocess
import sys

import pytest

from paths import ROOT

FLAGS = ("--context-parallel-algo", "--striped-stripe-size", "--striped-doc-placement", "--striped-calibrate",
         "--context-parallel-timeout-s")
CHECKOUT = ROOT.parent / "shared" / "megatron-lm" / "core_v0.16.1"


def _help(tmp_path, megatron_lm_dir=None):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_DIR"}
    if megatron_lm_dir is not None:
        env["MEGATRON_LM_DIR"] = str(megatron_lm_dir)
    return subprocess.run([sys.executable, "-m", "striped_sp.megatron.pretrain_gpt", "--help"], cwd=tmp_path,
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)


def test_help_without_a_checkout_prints_the_plugins_flags(tmp_path):
    res = _help(tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    for flag in FLAGS:
        assert flag in res.stdout
    assert "Megatron-LM's own flags: not shown (cannot find Megatron-LM's pretrain_gpt.py" in res.stdout
    assert "Traceback" not in res.stderr


def test_help_with_a_checkout_that_needs_gpu_packages(tmp_path):
    pytest.importorskip("megatron.core")
    if not (CHECKOUT / "pretrain_gpt.py").is_file():
        pytest.skip(f"no Megatron-LM checkout at {CHECKOUT}")
    res = _help(tmp_path, CHECKOUT)
    assert res.returncode == 0, res.stderr[-2000:]
    for flag in FLAGS:
        assert flag in res.stdout
    assert "--num-layers" in res.stdout or "not shown: its modules do not import here" in res.stdout
    assert "Traceback" not in res.stderr and "UserWarning" not in res.stderr, res.stderr[-2000:]
