"""examples/megatron/train_tiny_gpt.py runs on 2 spawned ranks and tracks the CP=1 run."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "examples", "megatron", "train_tiny_gpt.py")


@pytest.mark.parametrize("extra", [[], ["--packed", "--seq-length", "128"]], ids=["dense", "packed"])
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
