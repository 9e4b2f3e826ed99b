"""Attention sinks in Megatron-LM's own training loop through the patched route, on megatron-core
0.19 (``make test-megatron MCORE=0.19.2``): pretrain_gpt.py of a copy of the core_v0.19.0 checkout
with ``patches/megatron_lm_core_v0.19.0_context_parallel_algo.patch`` applied, ``--softmax-type
learnable`` and a window on every other layer, at CP=2 striped, against the unmodified checkout at
CP=1 (megatron-core's own ``DotProductAttention``).

The runs and the comparison are ``test_megatron_lm_sinks.py``'s (its CP=1 run is shared within a
session): 2 gloo ranks, 3 iterations, learning rate 0.05, ``lm loss`` to 1e-5 relative and
``grad norm`` within 1.5e-3 of what Megatron logs.  Other releases skip: there the no-patch sinks
run and the patched loop run of ``test_megatron_lm_loop.py`` cover the route (the suite's time).

Seen failing with the sinks' gradient dropped (``STRIPED_SP_TEST_PLANT=sink-grad-dropped``, run by
hand on the patched route).
"""

from __future__ import annotations

import shutil

import pytest

from megatron_lm_runs import launch, patched_checkout
from test_megatron_lm_loop import (
    _MODEL_ARGS, _STRIPED, _TRAIN_ARGS, _arg, _logged, _matches, _megatron_core_release, _tail,
)
from test_megatron_lm_loop import megatron_lm  # noqa: F401  (fixture: tag, its sources, a scratch folder)
from test_megatron_lm_sinks import _ITERS, _RUN_TIMEOUT_S, _SINKS, _logs

_PATCHED: dict = {}
_RELEASE = _megatron_core_release()
pytestmark = pytest.mark.skipif(
    _RELEASE is None or _RELEASE < (0, 19),
    reason=f"the patched route's sinks run is checked on megatron-core 0.19 (installed: {_RELEASE}); "
           "make test-megatron MCORE=0.19.2")


def _patched(megatron_lm, plant=None):  # noqa: F811
    """The patched checkout's run at CP=2 striped with the sinks: (returncode, log text), cached."""
    if plant not in _PATCHED:
        tag, root, tmp_root = megatron_lm
        if shutil.which("git") is None:
            pytest.skip("git not found (the patched route applies patches/ with git apply)")
        checkout = patched_checkout(root, tmp_root, tag, f"patched-sinks-{tag}")
        _PATCHED[plant] = launch(["--script", checkout], [*_MODEL_ARGS, *_TRAIN_ARGS, *_SINKS, *_STRIPED], checkout,
                                 tmp_root, _RUN_TIMEOUT_S, plant)
    return _PATCHED[plant]


def test_patched_pretrain_gpt_learnable_sinks_striped_cp2_logs_the_cp1_losses(megatron_lm):  # noqa: F811
    ref = _logs(1, megatron_lm)
    rc, text = _patched(megatron_lm)
    assert rc == 0, f"--softmax-type learnable, patched route, CP=2 striped failed:\n{_tail(text)}"
    assert _arg(text, "softmax_type") == "learnable" and _arg(text, "context_parallel_algo") == "striped", _tail(text)
    assert _arg(text, "context_parallel_size") == "2", _tail(text)
    assert "; sinks learnable" in text, _tail(text)  # the setup line: our core attention holds the sinks
    rows = _logged(text)
    assert [r[0] for r in rows] == list(range(1, _ITERS + 1)), _tail(text)
    assert _matches(rows, ref), f"patched CP=2 striped {rows} != CP=1 {ref}  [(iteration, lm loss, grad norm)]"
    assert rows[-1][1] != rows[0][1], "the loss did not move: no optimizer step happened"
