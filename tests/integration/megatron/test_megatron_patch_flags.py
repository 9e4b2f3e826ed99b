"""The patched Megatron-LM route registers and applies striped_sp's flags.

A copy of Megatron-LM's sources (``../shared/megatron-lm/<tag>``, the tag of the installed
megatron-core release) gets ``patches/megatron_lm_<tag>_context_parallel_algo.patch``; a fresh
process then runs that checkout's own ``megatron.training.arguments.parse_args`` and
``validate_args`` on pretrain_gpt.py command lines:

* ``--striped-stripe-size`` and ``--context-parallel-timeout-s`` parse (before the fix: "unrecognized
  arguments"), the stripe size reaches the installed layout and the timeout the ring;
* bad values fail naming the flag (a ``ValueError`` from validate_args, or argparse's error);
* native keeps Megatron's own sequence-length check, and a Megatron-LM without striped_sp still
  parses native (striped_sp blocked in the process), while the striped flags are then unknown.

One process per striped_sp presence runs all its command lines (start-up dominates).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from test_megatron_lm_loop import _PATCHES, _ROOT, _TESTS, _check_packages, _sources, _tag

_BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--train-iters", "3", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "128", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-rope-fusion", "--attention-dropout", "0",
    "--distributed-backend", "gloo", "--context-parallel-size", "2",
]

# Runs each command line of the JSON list in argv[1] through parse_args + validate_args of the
# checkout on sys.path; prints one JSON result per line after the marker.
_PROBE = r"""
import contextlib, io, json, sys
cases, blocked = json.loads(sys.argv[1]), sys.argv[3] == "block"
sys.path.insert(0, sys.argv[2])

class NotInstalled:  # striped_sp as if not installed: importing it raises what a missing package does
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] == "striped_sp":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

if blocked:
    sys.meta_path.insert(0, NotInstalled)
import megatron_cpu_shims
megatron_cpu_shims.apply()
from megatron.training.arguments import parse_args, validate_args
for argv in cases:
    sys.argv[:] = ["pretrain_gpt.py"] + argv
    err, out = io.StringIO(), {}
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parse_args()
            validate_args(args)
        out = {"algo": args.context_parallel_algo,
               "stripe": getattr(args, "striped_stripe_size", "absent"),
               "timeout": getattr(args, "context_parallel_timeout_s", "absent")}
    except BaseException as exc:
        out = {"error": type(exc).__name__, "message": str(exc) + err.getvalue()}
    if not blocked:
        import striped_sp.megatron as sm
        from striped_sp.engine.transport import ring_timeout, set_ring_timeout
        out.update(installed=sm.installed_algo(), ring_timeout=ring_timeout().total_seconds())
        sm.uninstall()
        set_ring_timeout(None)
    print("@@RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    """(tag, the patched copy of that Megatron-LM tag)."""
    tag = _tag()
    root = _sources(tag)
    _check_packages(tag)
    if shutil.which("git") is None:
        pytest.skip("git not found (the patched route applies patches/ with git apply)")
    checkout = str(tmp_path_factory.mktemp("patched") / tag)
    shutil.copytree(root, checkout, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    patch = os.path.join(_PATCHES, f"megatron_lm_{tag}_context_parallel_algo.patch")
    res = subprocess.run(["git", "apply", patch], cwd=checkout, capture_output=True, text=True)
    assert res.returncode == 0, f"git apply {patch}: {res.stderr}"
    return tag, checkout


def _parse(checkout, cases, striped_sp=True):
    """Results of parse_args + validate_args of the patched checkout, one per command line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (checkout, _ROOT, env.get("PYTHONPATH")) if p)
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", WORLD_SIZE="2", RANK="0", LOCAL_RANK="0",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("STRIPED_SP_RING_TIMEOUT_S", None)
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps([_BASE + c for c in cases]), _TESTS,
         "use" if striped_sp else "block"],
        env=env, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line[len("@@RESULT "):]) for line in res.stdout.splitlines()
            if line.startswith("@@RESULT ")]
    assert res.returncode == 0 and len(rows) == len(cases), res.stdout[-3000:] + res.stderr[-3000:]
    return rows


def test_patched_megatron_lm_parses_and_applies_the_striped_flags(patched):
    tag, checkout = patched
    (good, bad_stripe, bad_timeout, stripe_not_int, timeout_not_float, native_stripe, seq, native, native_seq,
     striped_seq) = _parse(
        checkout, [
            ["--seq-length", "2048", "--context-parallel-algo", "striped", "--striped-stripe-size", "512",
             "--context-parallel-timeout-s", "60"],
            ["--seq-length", "2048", "--context-parallel-algo", "striped", "--striped-stripe-size", "0"],
            ["--seq-length", "2048", "--context-parallel-algo", "striped", "--context-parallel-timeout-s", "-5"],
            ["--seq-length", "2048", "--context-parallel-algo", "striped", "--striped-stripe-size", "1.5"],
            ["--seq-length", "2048", "--context-parallel-algo", "striped", "--context-parallel-timeout-s", "soon"],
            ["--seq-length", "2048", "--context-parallel-algo", "native", "--striped-stripe-size", "4"],
            # the stripe size reaches the layout's sequence rule: 1536 is no multiple of 2 * 512
            ["--seq-length", "1536", "--context-parallel-algo", "striped", "--striped-stripe-size", "512"],
            ["--seq-length", "2048", "--context-parallel-algo", "native"],
            ["--seq-length", "2046", "--context-parallel-algo", "native"],  # Megatron's own check stays
            ["--seq-length", "2046", "--context-parallel-algo", "striped"],  # and only for native
        ])
    assert good == {"algo": "striped", "stripe": 512, "timeout": 60.0, "installed": "striped:stripe=512",
                    "ring_timeout": 60.0}, (tag, good)
    assert bad_stripe["error"] == "ValueError" and "--striped-stripe-size 0" in bad_stripe["message"], bad_stripe
    assert bad_timeout["error"] == "ValueError" and "--context-parallel-timeout-s -5" in bad_timeout["message"]
    for row, flag in ((stripe_not_int, "--striped-stripe-size"), (timeout_not_float, "--context-parallel-timeout-s")):
        assert row["error"] == "SystemExit" and f"argument {flag}: invalid" in row["message"], row
    assert native_stripe["error"] == "ValueError" and "--striped-stripe-size 4 applies to" in native_stripe["message"]
    assert seq["error"] == "ValueError" and "--striped-stripe-size" in seq["message"] and "1536" in seq["message"]
    # no stripe flag: None (under striped the per-batch search; native takes no stripe size)
    assert native == {"algo": "native", "stripe": None, "timeout": None, "installed": None,
                      "ring_timeout": 600.0}, native
    assert native_seq["error"] == "AssertionError" and "2 * context-parallel-size" in native_seq["message"]
    assert striped_seq["installed"] == "striped" and "error" not in striped_seq, striped_seq
    for row in (bad_stripe, bad_timeout, stripe_not_int, timeout_not_float, native_stripe, seq, native_seq):
        assert row["installed"] is None and row["ring_timeout"] == 600.0, row  # nothing half-applied


def test_patched_megatron_lm_without_striped_sp_parses_native(patched):
    tag, checkout = patched
    native, striped_flag = _parse(checkout, [
        ["--seq-length", "2048", "--context-parallel-algo", "native"],
        ["--seq-length", "2048", "--striped-stripe-size", "4"],
    ], striped_sp=False)
    assert native == {"algo": "native", "stripe": "absent", "timeout": "absent"}, (tag, native)
    assert striped_flag["error"] == "SystemExit" and "unrecognized arguments: --striped-stripe-size 4" \
        in striped_flag["message"], striped_flag
