"""Megatron-LM's own training loop: pretrain_gpt.py at CP=2 striped against CP=1, on CPU.

Each run is Megatron-LM's real ``pretrain_gpt.py`` (argument parsing and validation, mock data,
``get_batch``, Megatron's ``DistributedDataParallel`` over DP x CP, ``get_forward_backward_func``,
the GPT ``loss_func``, Megatron's optimizer and LR schedule) on 2 gloo ranks, for 3 iterations.
What is compared is what Megatron itself logs per iteration: ``lm loss`` and ``grad norm``.

* reference: the unmodified checkout at CP=1 (so DP=2), no striped_sp code in the model;
* patched: a copy of the checkout with ``patches/megatron_lm_<tag>_context_parallel_algo.patch``
  applied, ``--context-parallel-size 2 --context-parallel-algo striped`` (DP=1);
* no-patch: the unmodified checkout through ``striped_sp.megatron.pretrain_gpt``, same flags.

The global batch (2 samples, micro-batch 1) is the same in every run, so the same mock samples
reach the loss: DP=2 x 1 micro-batch at CP=1, DP=1 x 2 micro-batches at CP=2.

Megatron-LM's sources come from ``../shared/megatron-lm/<tag>`` (or ``MEGATRON_LM_DIR`` with
``MEGATRON_LM_TAG=<tag>``), the tag chosen by the installed megatron-core release (0.16 -> core_v0.16.1,
..., 0.19 -> core_v0.19.0). CUDA-only calls are mapped onto the CPU by ``tests/support/megatron_cpu_shims.py``
in the launched processes only (``tests/support/megatron_lm_launch.py``). Nothing of the loop is left
out; what does not run on CPU is what the flags turn off anyway: Megatron's CUDA fused kernels
(softmax, bias-GeLU, bias-dropout-add, persistent layer norm, gradient-accumulation fusion, RoPE
fusion), Transformer Engine (``--transformer-impl local``), torch.compile'd fusions (run eagerly)
and triton's batch-invariant kernels.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from paths import ROOT, SUPPORT

_TESTS = str(SUPPORT)  # the helpers: the launch script, the CPU shims
_ROOT = str(ROOT)
_PATCHES = os.path.join(_ROOT, "patches")
_SHARED_MLM = os.path.join(_ROOT, "..", "shared", "megatron-lm")
_LAUNCH = os.path.join(_TESTS, "megatron_lm_launch.py")
_TAG_OF_RELEASE = {
    (0, 16): "core_v0.16.1",
    (0, 17): "core_v0.17.1",
    (0, 18): "core_v0.18.2",
    (0, 19): "core_v0.19.0",
}
_RUN_TIMEOUT_S = 300
_ITERS = 3

_MODEL_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--position-embedding-type", "rope", "--no-rope-fusion",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    # Weights large enough for peaked attention: at Megatron's default std 0.02 the softmax is
    # nearly uniform and a 1% wrong softmax scale moves the logged loss by < 1e-6.
    "--init-method-std", "0.3",
    "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-persist-layer-norm",
]
_TRAIN_ARGS = [
    "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", str(_ITERS),
    "--lr", "1e-4", "--lr-decay-style", "constant", "--clip-grad", "1.0", "--seed", "1234",
    "--calculate-per-token-loss",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--num-workers", "0",
    "--distributed-backend", "gloo",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
]
_STRIPED = ["--context-parallel-size", "2", "--context-parallel-algo", "striped"]



def _megatron_core_release():
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        parts = version("megatron-core").split(".")
    except PackageNotFoundError:
        return None
    return int(parts[0]), int(parts[1])


def _tag():
    release = _megatron_core_release()
    if release is None:
        pytest.skip("megatron-core is not installed (pip install -e '.[megatron]')")
    tag = _TAG_OF_RELEASE.get(release)
    if tag is None:
        pytest.skip(f"megatron-core {release[0]}.{release[1]} is outside the tested range 0.16 - 0.19")
    return tag


def _sources(tag):
    root = os.environ.get("MEGATRON_LM_DIR") if os.environ.get("MEGATRON_LM_TAG") == tag else None
    root = os.path.abspath(root or os.path.join(_SHARED_MLM, tag))
    if not os.path.isfile(os.path.join(root, "pretrain_gpt.py")):
        pytest.skip(
            f"no Megatron-LM {tag} sources (megatron.training, pretrain_gpt.py): put them in "
            f"../shared/megatron-lm/{tag}, or set MEGATRON_LM_DIR and MEGATRON_LM_TAG={tag}"
        )
    return root


# What Megatron-LM's megatron.training imports beyond the megatron-core wheel (module: package),
# measured in a fresh environment with torch, megatron-core, pytest and striped_sp only.
_TRAINING_NEEDS = {
    "core_v0.16.1": {"six": "six", "regex": "regex", "yaml": "pyyaml", "pydantic": "pydantic"},
    "core_v0.19.0": {},  # with megatron-core 0.19.2 (whose torch brings triton)
}


def _check_packages(tag):
    needs = _TRAINING_NEEDS.get(tag, {})
    missing = [pkg for module, pkg in needs.items() if importlib.util.find_spec(module) is None]
    if missing:
        pytest.skip(f"Megatron-LM {tag}'s megatron.training needs: pip install {' '.join(missing)}")


def _skip_if_a_package_is_missing(tag, text):
    """Releases not measured in _TRAINING_NEEDS: a module missing for Megatron-LM's own code
    skips with its name (striped_sp, megatron and torch are never skipped over)."""
    m = re.search(r"ModuleNotFoundError: No module named '([^'.]+)", text)
    if m and m.group(1) not in ("striped_sp", "megatron", "torch"):
        pytest.skip(f"Megatron-LM {tag}'s megatron.training needs the module {m.group(1)!r}")


_RUNS: dict = {}


def _run(route, tag, root, tmp_root, scale_factor=None):
    """Run pretrain_gpt.py on 2 gloo ranks; returns (returncode, log text). Cached per route."""
    key = (route, tag, scale_factor)
    if key in _RUNS:
        return _RUNS[key]
    if route == "patched":
        if shutil.which("git") is None:
            pytest.skip("git not found (the patched route applies patches/ with git apply)")
        checkout = os.path.join(tmp_root, f"patched-{tag}")
        if not os.path.isdir(checkout):
            shutil.copytree(root, checkout, ignore=shutil.ignore_patterns("__pycache__", ".git"))
            patch = os.path.join(_PATCHES, f"megatron_lm_{tag}_context_parallel_algo.patch")
            res = subprocess.run(["git", "apply", patch], cwd=checkout, capture_output=True, text=True)
            assert res.returncode == 0, f"git apply {patch}: {res.stderr}"
        entry, extra = ["--script", checkout], _STRIPED
    elif route == "no-patch":
        checkout, entry, extra = root, ["--no-patch", root], _STRIPED
    else:  # reference: the unmodified checkout at CP=1, nothing of striped_sp in the loop
        checkout, entry, extra = root, ["--script", root], ["--context-parallel-size", "1"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (checkout, _ROOT, env.get("PYTHONPATH")) if p)
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MEGATRON_LM_DIR", None)
    env.pop("STRIPED_SP_TEST_SCALE_FACTOR", None)
    if scale_factor is not None:
        env["STRIPED_SP_TEST_SCALE_FACTOR"] = repr(scale_factor)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           _LAUNCH, *entry, *_MODEL_ARGS, *_TRAIN_ARGS, *extra]
    try:
        res = subprocess.run(cmd, cwd=tmp_root, env=env, capture_output=True, text=True,
                             timeout=_RUN_TIMEOUT_S)
        out = (res.returncode, res.stdout + res.stderr)
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"") + (exc.stderr or b"")
        out = (-1, (text.decode() if isinstance(text, bytes) else text) + "\n[timed out]")
    _RUNS[key] = out
    return out


_LOG_LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: ([0-9.Ee+-]+) \|.*\| grad norm: ([0-9.]+) \|"
)


def _logged(text):
    """Megatron's per-iteration log lines -> [(iteration, lm loss, grad norm)]."""
    rows = []
    for line in text.splitlines():
        m = _LOG_LINE.search(line)
        if m:
            rows.append((int(m.group(1)), float(m.group(2)), float(m.group(3))))
    return rows


def _arg(text, name):
    m = re.search(rf"^\s*{name} \.+ (\S+)\s*$", text, re.MULTILINE)
    return m.group(1) if m else None


def _tail(text, n=6000):
    return text[-n:]


@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory):
    tag = _tag()
    root = _sources(tag)
    _check_packages(tag)
    return tag, root, str(tmp_path_factory.mktemp("megatron_lm_loop"))


def _reference(megatron_lm):
    tag, root, tmp = megatron_lm
    rc, text = _run("reference", tag, root, tmp)
    if rc != 0:
        _skip_if_a_package_is_missing(tag, text)
    assert rc == 0, f"Megatron-LM {tag} pretrain_gpt.py at CP=1 failed:\n{_tail(text)}"
    rows = _logged(text)
    assert [r[0] for r in rows] == list(range(1, _ITERS + 1)), _tail(text)
    assert _arg(text, "context_parallel_size") == "1" and _arg(text, "data_parallel_size") == "2"
    return rows


def _matches(rows, ref):
    """Whether Megatron's logs agree: lm loss within 1e-5 relative (it is logged with 7
    significant digits), grad norm within 1.5e-3 (logged with 3 decimals)."""
    return [r[0] for r in rows] == [r[0] for r in ref] and all(
        abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and abs(norm - ref_norm) <= 1.5e-3
        for (_, loss, norm), (_, ref_loss, ref_norm) in zip(rows, ref)
    )


@pytest.mark.parametrize("route", ["patched", "no-patch"])
def test_pretrain_gpt_striped_cp2_logs_the_cp1_losses(megatron_lm, route):
    """Megatron's logged lm loss and grad norm: CP=2 striped (DP=1) == CP=1 (DP=2), 3 iterations."""
    tag, root, tmp = megatron_lm
    ref = _reference(megatron_lm)
    rc, text = _run(route, tag, root, tmp)
    assert rc == 0, f"{route} route, Megatron-LM {tag}, CP=2 striped failed:\n{_tail(text)}"
    assert _arg(text, "context_parallel_algo") == "striped", _tail(text)
    assert _arg(text, "context_parallel_size") == "2" and _arg(text, "data_parallel_size") == "1"
    rows = _logged(text)
    assert _matches(rows, ref), f"CP=2 striped {rows} != CP=1 {ref}  [(iteration, lm loss, grad norm)]"
    assert rows[-1][1] != rows[0][1], "the loss did not move: no optimizer step happened"


@pytest.mark.release  # make test-release: a planted bug, the comparison's own check
def test_a_wrong_softmax_scale_fails_the_comparison(megatron_lm):
    """The comparison is sharp enough: a 1% wrong softmax scale in striped_sp's core attention
    (planted through the launcher) moves Megatron's logged loss or grad norm out of tolerance."""
    tag, root, tmp = megatron_lm
    ref = _reference(megatron_lm)
    rc, text = _run("no-patch", tag, root, tmp, scale_factor=1.01)
    assert rc == 0, f"no-patch route with a planted scale, Megatron-LM {tag}:\n{_tail(text)}"
    rows = _logged(text)
    assert len(rows) == len(ref), _tail(text)
    assert not _matches(rows, ref), f"a 1% wrong softmax scale went unnoticed: {rows} vs {ref}"
