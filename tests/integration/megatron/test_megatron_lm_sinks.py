"""Attention sinks in Megatron-LM's own training loop: pretrain_gpt.py with ``--softmax-type
learnable`` at CP=2 striped (the no-patch route) against the unmodified checkout at CP=1, on CPU.

The runs of ``test_megatron_lm_loop.py`` (2 gloo ranks, 3 iterations, the CPU shims in both runs
alike), with learnable sinks and a window on every other layer (``--window-size 16,0
--window-attn-skip-freq 2``, gpt-oss' pattern at this toy's length).  The CP=1 run is megatron-core's
own ``DotProductAttention`` (its ``SoftmaxOne``); what Megatron logs is compared as that test
does: ``lm loss`` to 1e-5 relative (7 significant digits), ``grad norm`` within 1.5e-3.  The
learning rate is 0.05 (later flags override the loop test's 1e-4), so that the sinks' own updates
show in the logged loss: the comparison is seen to fail with the sinks' gradient dropped
(``sink-grad-dropped`` in ``tests/support/megatron_lm_launch.py``; at 1e-4 it went unnoticed).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_megatron_lm_loop import (
    _LAUNCH, _MODEL_ARGS, _ROOT, _TRAIN_ARGS, _arg, _logged, _matches, _skip_if_a_package_is_missing, _tail,
)
from test_megatron_lm_loop import megatron_lm  # noqa: F401  (fixture: tag, its sources, a scratch folder)

_RUN_TIMEOUT_S = 300
_ITERS = 3
_SINKS = ["--lr", "0.05", "--softmax-type", "learnable", "--window-size", "16,0", "--window-attn-skip-freq", "2"]
_RUNS: dict = {}


def _run(cp, megatron_lm, plant=None):
    key = (cp, plant)
    if key in _RUNS:
        return _RUNS[key]
    _, root, tmp_root = megatron_lm
    entry = ["--no-patch" if cp > 1 else "--script", root]
    parallel = ["--context-parallel-size", str(cp)] + (["--context-parallel-algo", "striped"] if cp > 1 else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, _ROOT, env.get("PYTHONPATH")) if p)
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for name in ("MEGATRON_LM_DIR", "STRIPED_SP_TEST_SCALE_FACTOR", "STRIPED_SP_TEST_PLANT"):
        env.pop(name, None)
    if plant:
        env["STRIPED_SP_TEST_PLANT"] = plant
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", _LAUNCH, *entry,
           *_MODEL_ARGS, *_TRAIN_ARGS, *_SINKS, *parallel]
    try:
        res = subprocess.run(cmd, cwd=tmp_root, env=env, capture_output=True, text=True, timeout=_RUN_TIMEOUT_S)
        _RUNS[key] = (res.returncode, res.stdout + res.stderr)
    except subprocess.TimeoutExpired as exc:
        printed = [t.decode() if isinstance(t, bytes) else t or "" for t in (exc.stdout, exc.stderr)]
        _RUNS[key] = (-1, "".join(printed) + "\n[timed out]")
    return _RUNS[key]


def _logs(cp, megatron_lm, plant=None):
    rc, text = _run(cp, megatron_lm, plant)
    if rc != 0 and cp == 1:
        _skip_if_a_package_is_missing(megatron_lm[0], text)
    assert rc == 0, f"--softmax-type learnable, CP={cp}: pretrain_gpt.py failed:\n{_tail(text)}"
    assert _arg(text, "context_parallel_size") == str(cp), _tail(text)
    assert _arg(text, "softmax_type") == "learnable", _tail(text)
    if cp > 1:
        assert _arg(text, "context_parallel_algo") == "striped", _tail(text)
        assert "; sinks learnable" in text, _tail(text)  # the setup line
    rows = _logged(text)
    assert [r[0] for r in rows] == list(range(1, _ITERS + 1)), _tail(text)
    return rows


@pytest.mark.release  # run by make test-release and make test-megatron (CI); sinks stay exact-checked in test_megatron_sinks*.py
def test_pretrain_gpt_learnable_sinks_striped_cp2_logs_the_cp1_losses(megatron_lm):  # noqa: F811
    ref = _logs(1, megatron_lm)
    rows = _logs(2, megatron_lm)
    assert _matches(rows, ref), f"CP=2 striped {rows} != CP=1 {ref}  [(iteration, lm loss, grad norm)]"
    assert rows[-1][1] != rows[0][1], "the loss did not move: no optimizer step happened"


@pytest.mark.release  # make test-release: a planted bug, the comparison's own check
def test_a_dropped_sink_gradient_fails_the_comparison(megatron_lm):  # noqa: F811
    ref = _logs(1, megatron_lm)
    rows = _logs(2, megatron_lm, plant="sink-grad-dropped")
    assert not _matches(rows, ref), f"a dropped sink gradient went unnoticed: {rows} vs {ref}"
