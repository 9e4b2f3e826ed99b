"""examples/megatron/train_tiny_gpt.py runs on 2 spawned ranks and tracks its CP=1 run, and that
CP=1 run (striped_sp's code at CP=1) equals an independent float64 reference
(tests/support/megatron_demo_reference.py), so the demo's agreement is not a circular one."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from paths import ROOT, SUPPORT

HERE = str(SUPPORT)
SCRIPT = os.path.join(str(ROOT), "examples", "megatron", "train_tiny_gpt.py")


# the packed demo under release (make test-release): make test keeps the dense one, and packed THD rows
# through megatron-core in test_megatron_packed.py
@pytest.mark.parametrize("extra", [[], pytest.param(["--packed", "--seq-length", "128"], marks=pytest.mark.release)],
                         ids=["dense", "packed"])
def test_tiny_gpt_matches_cp1_for_a_few_steps(extra):
    res = subprocess.run([sys.executable, SCRIPT, "--steps", "4", "--batch", "4", *extra],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$", res.stdout, re.M)
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    for _, cp2, cp1, diff in rows:
        assert abs(float(cp2) - float(cp1)) <= 1e-5 * float(cp1) + 1e-6
    assert "largest |loss CP=2 - loss CP=1|" in res.stdout
    if extra:
        assert re.search(r"padding needed: striped 0 tokens, native per-document zigzag \d+ tokens", res.stdout)


def test_demo_cp1_run_equals_an_independent_reference():
    """The demo's CP=1 model and training steps, on its own dense and packed batches, against the
    same model with a float64 core attention written without striped_sp (loss and gradients)."""
    res = subprocess.run([sys.executable, os.path.join(HERE, "megatron_demo_reference.py")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("ok ") == 3, res.stdout
