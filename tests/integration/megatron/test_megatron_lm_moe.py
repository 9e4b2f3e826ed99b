"""MoE in Megatron-LM's own training loop: pretrain_gpt.py at CP=2 striped against CP=1, on CPU.

The runs of ``test_megatron_lm_loop.py`` (Megatron-LM's real ``pretrain_gpt.py`` on 2 gloo ranks,
3 iterations, the CPU shims of ``tests/support/megatron_cpu_shims.py`` in both runs alike), with a
GPT whose two layers are MoE layers: 4 experts, top-2, the alltoall token dispatcher, and both
load-balancing losses at once (``--moe-router-load-balancing-type aux_loss seq_aux_loss``, each with
coefficient 1: large enough that their gradients show in the grad norm).  Sequence 256, micro-batch 2
(so the per-sequence loss is not the batch one), global batch 4: DP=2 x 1 micro-batch at CP=1,
DP=1 x 2 micro-batches at CP=2.  What Megatron logs per iteration is compared: ``lm loss``, both
load-balancing losses and ``mtp_1 loss`` (7 significant digits), ``grad norm`` (3 decimals).

* ``moe``: the no-patch route at CP=2 striped against the unmodified checkout at CP=1, without
  ``--calculate-per-token-loss``;
* ``moe-mtp-eod``: the patched route, MoE + one MTP layer + EOD documents (``--reset-attention-mask
  --reset-position-ids --eod-mask-loss``; the mock data's token cycle puts an EOD every 129 tokens),
  with ``--calculate-per-token-loss`` (MTP needs it under CP).

Two things are Megatron's own semantics under CP, not the layout's (native CP computes them the same
way: they are in megatron-core's router and GPT model, not in the attention; native CP itself cannot
run here, it needs Transformer Engine's attention):

* with ``--calculate-per-token-loss``, megatron-core 0.16 to 0.18 scales each CP rank's aux loss by
  its local token count, so the aux-loss gradient at CP=N is 1/N of CP=1's (Megatron-LM issue #1652;
  0.19.2 scales by the TP x CP size).  The CP=1 reference of ``moe-mtp-eod`` therefore runs the
  coefficients divided by the CP size, which is what CP=2 computes;
* ``mtp_1 loss`` is logged as the mean over DP x CP ranks of each rank's own masked mean: with EOD
  tokens masked, CP ranks hold different counts and the logged figure moves in the 5th digit.  It is
  compared to 1e-4 relative; the MTP gradients are in the grad norm.

The comparison is seen to catch two planted bugs (``tests/support/megatron_lm_launch.py``): the batch
cut contiguously instead of striped, and routers that reduce their token counts without the CP group.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from test_megatron_lm_loop import (
    _LAUNCH, _MODEL_ARGS, _ROOT, _TRAIN_ARGS, _arg, _megatron_core_release, _skip_if_a_package_is_missing, _tail,
)
from test_megatron_lm_loop import megatron_lm  # noqa: F401  (fixture: tag, its sources, a scratch folder)
from test_megatron_patch_flags import patched  # noqa: F401  (fixture: tag, a patched copy of its sources)

_RUN_TIMEOUT_S = 300
_ITERS = 3
_CP = 2
_COEFF = 1.0
_SHAPE = ["--seq-length", "256", "--max-position-embeddings", "256",
          "--micro-batch-size", "2", "--global-batch-size", "4"]  # later flags override the loop test's
_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
        "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"]
_MTP_EOD = ["--mtp-num-layers", "1", "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
_PER_TOKEN = "--calculate-per-token-loss"

#: name -> (route at CP=2, extra flags, per-token loss)
_CASES = {
    "moe": ("no-patch", [], False),
    "moe-mtp-eod": ("patched", _MTP_EOD, True),
}

#: relative tolerance per logged loss (grad norm: absolute, half a unit of its 3rd decimal and more)
_LOSS_TOL = {"lm loss": 1e-5, "load_balancing_loss": 1e-5, "seq_load_balancing_loss": 1e-5, "mtp_1 loss": 1e-4}
_NORM_TOL = 1.5e-3


def _reference_coeff(per_token):
    """The CP=1 coefficient that computes what CP=2 does with ``_COEFF`` (see the module docstring)."""
    release = _megatron_core_release()
    return _COEFF / _CP if per_token and release is not None and release < (0, 19) else _COEFF


_RUNS: dict = {}


def _run(case, cp, request, plant=None):
    """Run pretrain_gpt.py on 2 gloo ranks for ``case`` at CP=``cp``; (returncode, log text), cached.
    CP=1 runs the unmodified checkout; CP=2 the case's route (``patched``: the patched copy)."""
    key = (case, cp, plant)
    if key in _RUNS:
        return _RUNS[key]
    _, root, tmp_root = request.getfixturevalue("megatron_lm")
    route, extra, per_token = _CASES[case]
    if cp > 1 and route == "patched":
        checkout = request.getfixturevalue("patched")[1]
        entry = ["--script", checkout]
    else:
        checkout, entry = root, ["--no-patch" if cp > 1 else "--script", root]
    coeff = _COEFF if cp > 1 else _reference_coeff(per_token)
    train = [a for a in _TRAIN_ARGS if per_token or a != _PER_TOKEN]
    parallel = ["--context-parallel-size", str(cp)] + (["--context-parallel-algo", "striped"] if cp > 1 else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (checkout, _ROOT, env.get("PYTHONPATH")) if p)
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for name in ("MEGATRON_LM_DIR", "STRIPED_SP_TEST_SCALE_FACTOR", "STRIPED_SP_TEST_PLANT"):
        env.pop(name, None)
    if plant:
        env["STRIPED_SP_TEST_PLANT"] = plant
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", _LAUNCH, *entry,
           *_MODEL_ARGS, *train, *_SHAPE, *_MOE, "--moe-aux-loss-coeff", str(coeff), str(coeff), *extra, *parallel]
    try:
        res = subprocess.run(cmd, cwd=tmp_root, env=env, capture_output=True, text=True, timeout=_RUN_TIMEOUT_S)
        _RUNS[key] = (res.returncode, res.stdout + res.stderr)
    except subprocess.TimeoutExpired as exc:  # what it printed before it was stopped
        printed = [t.decode() if isinstance(t, bytes) else t or "" for t in (exc.stdout, exc.stderr)]
        _RUNS[key] = (-1, "".join(printed) + "\n[timed out]")
    return _RUNS[key]


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)$")
_FIELD = re.compile(r"^\s*([a-z_0-9 ]+): ([0-9.Ee+-]+)\s*$")


def _logged(text):
    """Megatron's per-iteration log lines -> [(iteration, {logged name: value})]."""
    rows = []
    for line in text.splitlines():
        m = _ITERATION.search(line)
        if m:
            fields = (_FIELD.match(part) for part in m.group(2).split("|"))
            rows.append((int(m.group(1)), {f.group(1): float(f.group(2)) for f in fields if f}))
    return rows


def _mismatches(rows, ref):
    """What disagrees between two runs' logs ([] when they agree within the tolerances)."""
    if [i for i, _ in rows] != [i for i, _ in ref]:
        return [("iterations", [i for i, _ in rows], [i for i, _ in ref])]
    bad = []
    for (i, got), (_, want) in zip(rows, ref):
        for name in list(_LOSS_TOL) + ["grad norm"]:
            if name not in want and name not in got:
                continue
            if name not in want or name not in got:
                bad.append((i, name, got.get(name), want.get(name)))
                continue
            tol = _NORM_TOL if name == "grad norm" else _LOSS_TOL[name] * abs(want[name])
            if abs(got[name] - want[name]) > tol:
                bad.append((i, name, got[name], want[name]))
    return bad


def _skip_unless_supported(case):
    release = _megatron_core_release()
    if case == "moe-mtp-eod" and release is not None and release >= (0, 17):
        # as in test_megatron_packed.py: native CP too, by Megatron's design
        pytest.skip("megatron-core >= 0.17 weights each CP rank's MTP loss by its own rolled-token ratio")


def _logs(case, cp, request, plant=None):
    rc, text = _run(case, cp, request, plant)
    if rc != 0 and cp == 1:
        _skip_if_a_package_is_missing(request.getfixturevalue("megatron_lm")[0], text)
    assert rc == 0, f"{case}, CP={cp}{', ' + plant if plant else ''}: pretrain_gpt.py failed:\n{_tail(text)}"
    assert _arg(text, "context_parallel_size") == str(cp), _tail(text)
    assert _arg(text, "num_experts") == "4" and _arg(text, "moe_token_dispatcher_type") == "alltoall", _tail(text)
    if cp > 1:
        assert _arg(text, "context_parallel_algo") == "striped", _tail(text)
    rows = _logged(text)
    assert [i for i, _ in rows] == list(range(1, _ITERS + 1)), _tail(text)
    return rows


# make test runs the patched route's case (MoE with MTP and per-token loss); the no-patch route's MoE
# case is left to make test-release (make test runs that route in test_megatron_lm_loop.py)
@pytest.mark.parametrize("case", [pytest.param("moe", marks=pytest.mark.release), "moe-mtp-eod"])
def test_moe_striped_cp2_logs_the_cp1_losses(request, case):
    """Megatron's logged losses (LM, both load-balancing losses, MTP) and grad norm: CP=2 striped
    (DP=1) == CP=1 (DP=2), 3 iterations."""
    _skip_unless_supported(case)
    ref = _logs(case, 1, request)
    rows = _logs(case, _CP, request)
    want = {"lm loss", "load_balancing_loss", "seq_load_balancing_loss", "grad norm"}
    if case == "moe-mtp-eod":
        want.add("mtp_1 loss")
    assert want <= set(ref[0][1]), ref  # every loss the case runs is logged
    assert not _mismatches(rows, ref), (
        f"CP=2 striped {rows}\n!= CP=1 {ref}\n[(iteration, name, CP=2, CP=1)]: {_mismatches(rows, ref)}")
    assert rows[-1][1]["lm loss"] != rows[0][1]["lm loss"], "the loss did not move: no optimizer step happened"


@pytest.mark.release  # make test-release: planted bugs, the comparison's own check
@pytest.mark.parametrize("plant", ["contiguous-batch", "router-without-cp"])
def test_a_planted_bug_fails_the_moe_comparison(request, plant):
    """The comparison is sharp enough: the batch cut contiguously (RoPE and the attention still
    striped), or routers reducing their token counts without the CP group, each move Megatron's
    logged losses or grad norm out of tolerance."""
    ref = _logs("moe", 1, request)
    rows = _logs("moe", _CP, request, plant=plant)
    assert _mismatches(rows, ref), f"{plant} went unnoticed: {rows} vs {ref}"
