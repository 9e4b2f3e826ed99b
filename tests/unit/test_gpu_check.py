"""examples/gpu_check.sh's Python steps (striped_sp/bench/gpu_check.py) on the CPU at a tiny size:
imports, argument parsing, the exactness step on the CPU backends and on FA4 under its double, and
every ``bench sim`` command line the script runs parsed by the real CLI (one of them run)."""

from __future__ import annotations

import json
import pathlib
import re
import shlex

import pytest
import torch

import striped_sp.kernels.fa4_kernel as fa4_mod
from fa4_double import install_fa4
from striped_sp import cli
from striped_sp.bench import gpu_check

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_script_calls_only_steps_that_exist():
    text = (ROOT / "examples" / "gpu_check.sh").read_text()
    assert "kernels_torch" not in text
    steps = set(re.findall(r"\$STEP (\w+)", text))
    assert steps == {"env", "exact", "gqa", "sims"}


def test_env_and_exact_steps_on_cpu(tmp_path, capsys):
    assert gpu_check.main(["env", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "env.json").read_text())["torch"] == torch.__version__
    assert gpu_check.main(["exact", "--out", str(tmp_path), "--device", "cpu", "--tiny"]) == 0
    records = json.loads((tmp_path / "exact.json").read_text())["records"]
    assert {r["backend"] for r in records} == {"torch", "math"} and all(r["ok"] for r in records)
    assert len({r["case"] for r in records}) == 7


def test_exact_step_on_fa4_under_its_double(monkeypatch):
    monkeypatch.setattr(fa4_mod, "_capability", lambda device: (10, 0))
    install_fa4(monkeypatch)
    records = gpu_check.exactness("cpu", torch.bfloat16, kernels={"fa4": fa4_mod.FA4Kernel()}, n=2, per_rank=12,
                                  heads=(4, 2), head_dim=16)
    assert len(records) == 7 and all(r["ok"] for r in records), records


def test_sim_command_lines_parse_and_one_runs(tmp_path, capsys):
    assert gpu_check.main(["sims", "--out", str(tmp_path), "--device", "cpu", "--tiny"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6  # dense, packed, window for torch and math
    parser = cli.build_parser()
    for line in lines:
        parser.parse_args(shlex.split(line))
    full = gpu_check.sim_commands("out", ["fa4"])
    for cmd in full:
        args = parser.parse_args(cmd)
        assert (args.heads, args.kv_heads, args.head_dim, args.tokens_per_rank) == (32, 8, 128, [8192])
    assert cli.main(shlex.split(lines[0])) == 0
    assert json.loads(pathlib.Path(shlex.split(lines[0])[-1]).read_text())
