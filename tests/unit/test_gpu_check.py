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
    assert steps == {"all"}


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


# -- the one command (issue 48, item 2) -------------------------------------------------------------

PLUGIN = '''
"""Two doubles for gpu_check's `all`: a backend whose every call fails, one whose calls hang."""
import time

from striped_sp.kernels import register
from striped_sp.kernels.math_ref import MathKernel


class Failing(MathKernel):
    name = "failing"

    def forward(self, *args, **kwargs):
        raise RuntimeError("the failing double's forward")


class Hanging(MathKernel):
    name = "hanging"

    def forward(self, *args, **kwargs):
        time.sleep(3600)


register(Failing())
register(Hanging())
'''


def test_the_budget_fits_the_lease():
    """Every backend's limit and the CUDA tests' add up to the lease's 8 minutes at most."""
    assert gpu_check.budget() <= gpu_check.BUDGET_S == 480
    assert set(gpu_check.TIMEOUTS) == set(gpu_check.CUDA_BACKENDS)
    assert gpu_check.TIMEOUTS["fa4"] == max(gpu_check.TIMEOUTS.values())  # its compiles
    text = (ROOT / "examples" / "gpu_check.sh").read_text()
    assert re.findall(r"\$STEP (\w+)", text) == ["all"]  # one command: nothing else timed outside the budget
    assert not re.search(r"^\s*timeout ", text, re.M)


def test_all_records_each_case_as_it_exists_and_survives_a_failing_and_a_hanging_backend(tmp_path, monkeypatch,
                                                                                          capsys):
    """`all` at a tiny size on the CPU: torch, a backend that fails, one that hangs (killed at its
    limit, recorded as the timeout of the case it ran; a fresh worker goes on), math; every record
    in records.jsonl, the summary printed last."""
    import striped_sp.kernels as kernels

    monkeypatch.setattr(kernels, "KERNELS", dict(kernels.KERNELS))  # the plugin's doubles stay in this test
    (tmp_path / "plugin_dir").mkdir()
    (tmp_path / "plugin_dir" / "gpu_check_doubles.py").write_text(PLUGIN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "plugin_dir"))
    monkeypatch.syspath_prepend(str(tmp_path / "plugin_dir"))
    out = tmp_path / "out"
    rc = gpu_check.main(["all", "--out", str(out), "--device", "cpu", "--tiny", "--plugin", "gpu_check_doubles",
                         "--backends", "torch,failing,hanging,math", "--timeouts", "torch=120,failing=120,hanging=8,math=120"])
    printed = capsys.readouterr().out
    records = gpu_check.read_records(out)
    assert rc == 1  # a failure and a timeout
    exact = [r for r in records if r["kind"] == "exact"]
    assert {r["backend"] for r in exact} == {"torch", "math"} and all(r["ok"] for r in exact)
    assert len([r for r in exact if r["backend"] == "math"]) == 7
    done = {(r["backend"], r["task"]): r for r in records if r["kind"] == "done"}
    for b in ("torch", "math"):
        assert all(done[(b, t)]["status"] == "ok" for t in ("exact", "sim_dense", "sim_packed", "sim_window"))
        assert all(pathlib.Path(done[(b, t)]["json"]).exists() for t in ("sim_dense", "sim_packed", "sim_window"))
    assert done[("failing", "exact")]["status"] == "error" and "failing double" in done[("failing", "exact")]["error"]
    timeouts = [r for r in records if r.get("status") == "timeout"]
    assert len(timeouts) == 1 and timeouts[0]["backend"] == "hanging" and timeouts[0]["task"].startswith("exact")
    assert not any(r["kind"] == "done" and r["backend"] == "hanging" and r["status"] == "ok" for r in records)
    assert records[0]["kind"] == "env" and (out / "env.json").exists()
    last = printed.strip().splitlines()
    assert all(done[("failing", t)]["status"] == "error" for t in ("sim_dense", "sim_packed", "sim_window"))
    assert last[-1] == "== 5 not ok" and any("hanging" in x and "timeout" in x for x in last)  # 4 failed, 1 hung
