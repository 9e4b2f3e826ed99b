"""Every test runs seeded, and a failing test prints its seed.

Before each test module is imported and before each test, ``torch``, ``random`` (and ``numpy``
when installed) are seeded with :func:`seeds.seed_for` of the module's or the test's node id, so
inputs drawn from the global generators are the same on every run; ``$STRIPED_SP_TEST_SEED``
moves every seed at once (``random``: a fresh draw).  A failing test gets a ``seed`` section in
its report naming its seed and how to rerun it.

Fixtures: ``seed`` (this test's seed, for its own generators); ``world_of_one`` (a gloo process
group of this process alone: CP=1 runs of the real code path); ``deterministic_flags`` (the
``deterministic`` flag of every kernel resolution ``ring_attention`` makes).
"""

from __future__ import annotations

import os
import pathlib
import random
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "support"))  # the tests' helpers

from seeds import how_to_reproduce, seed_for  # noqa: E402

#: the marker of each folder of tests/
_MARKERS = {"unit": "unit", "dist": "dist", "integration": "integration", "gpu": "gpu"}


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs two workers) each worker computes on one thread: two
    workers of the machine's default thread count each would oversubscribe its cores (the gloo
    ranks already run on one thread each: dist_helper)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


#: the folders in the order the tests run: the long multi-process launches first, so that under
#: pytest-xdist (make test) the last files left to a worker are the short ones (a long file dealt last
#: would leave the other worker idle until it ends)
_FOLDER_ORDER = ["integration/deepspeed", "integration/megatron", "integration", "dist", "gpu", "unit"]


def _folder_rank(parts: tuple) -> int:
    folder = "/".join(parts[:-1])
    for rank, prefix in enumerate(_FOLDER_ORDER):
        if folder == prefix or folder.startswith(prefix + "/"):
            return rank
    return len(_FOLDER_ORDER)


def pytest_collection_modifyitems(items):
    tests = pathlib.Path(__file__).resolve().parent
    ranks = {}
    for item in items:
        parts = pathlib.Path(str(item.fspath)).resolve().relative_to(tests).parts
        if parts and parts[0] in _MARKERS:
            item.add_marker(getattr(pytest.mark, _MARKERS[parts[0]]))
        ranks[item.nodeid] = _folder_rank(parts)
    items.sort(key=lambda item: ranks[item.nodeid])  # stable: a file's tests keep their order


#: what the gloo ranks of each folder import anyway, for their fork server to import once
#: (tests/support/dist_helper.py's start_fork_server; a module not installed is passed over)
_PRELOAD = {
    "dist": ["torch", "torch.distributed", "striped_sp", "striped_sp.engine.local", "pytest"],
    "deepspeed": ["deepspeed", "deepspeed.sequence.layer", "transformers", "accelerate",
                  "transformers.models.llama.modeling_llama", "transformers.trainer", "striped_sp.deepspeed",
                  "striped_sp.deepspeed.trainer"],
    "megatron": ["megatron.core", "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.models.mamba",
                 "megatron.core.transformer.multi_latent_attention", "striped_sp.megatron",
                 "striped_sp.megatron.attention"],
}


def _uses_the_harness(module) -> bool:
    """Whether a test module runs cases on gloo ranks (holds something of dist_helper's)."""
    return any(getattr(value, "__module__", None) == "dist_helper" for value in vars(module).values())


def pytest_collection_finish(session):
    """Start the gloo ranks' fork server once the tests are selected, when some run cases on gloo
    ranks, with the frameworks their folders need imported once (the first cases wait for it)."""
    if session.config.option.collectonly:
        return
    tests = pathlib.Path(__file__).resolve().parent
    folders, seen = set(), {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__ not in seen:
            seen[module.__name__] = _uses_the_harness(module)
        if module is not None and seen[module.__name__]:
            folders.update(pathlib.Path(str(item.fspath)).resolve().relative_to(tests).parts[:-1])
    if not folders:
        return
    import dist_helper

    kinds = ["dist"] + [kind for kind in ("deepspeed", "megatron") if kind in folders]
    dist_helper.start_fork_server([module for kind in kinds for module in _PRELOAD[kind]])


_SEED = pytest.StashKey[int]()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """This test's seed (the global generators are already seeded with it)."""
    value = seed_for(request.node.nodeid)
    request.node.stash[_SEED] = value
    _seed_everything(value)
    return value


@pytest.fixture(autouse=True)
def _no_deepspeed_config_left():
    """After each test, forget transformers' process-wide DeepSpeed config: a test that built
    ``TrainingArguments(deepspeed=<ZeRO-3 JSON>)`` leaves it alive as long as anything holds those
    arguments (a kept traceback will), and every later ``from_config`` in the same xdist worker then
    runs under ``deepspeed.zero.Init``, whose ``init_distributed`` looks for MPI (mpi4py) outside a
    launcher."""
    yield
    ds = sys.modules.get("transformers.integrations.deepspeed")
    if ds is not None:
        ds.unset_hf_deepspeed_config()


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """Seed the generators before a test module is imported, so module-level draws (a module's
    ``SEED = random.randrange(...)``) are fixed per module, whichever files run with it."""
    if isinstance(collector, pytest.Module):
        _seed_everything(seed_for(collector.nodeid))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _SEED in item.stash:
        report.sections.append(("seed", how_to_reproduce(item.stash[_SEED])))


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo default process group of one rank (this process), destroyed after the test."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in the test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg_init'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def deterministic_flags(monkeypatch) -> list:
    """The ``deterministic`` argument of each ``resolve_kernel`` call made by ``ring_attention``
    during the test (the real resolution still runs)."""
    import striped_sp.engine.request as attention
    from striped_sp.kernels import resolve_kernel

    seen = []

    def spy(backend, device, dtype, head_dim=None, deterministic=False, **kwargs):
        seen.append(deterministic)
        return resolve_kernel(backend, device, dtype, head_dim, deterministic=deterministic, **kwargs)

    monkeypatch.setattr(attention, "resolve_kernel", spy)
    return seen
