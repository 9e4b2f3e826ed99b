"""Run many test cases on N gloo ranks started once.

``run_cases(world_size, cases)`` spawns ``world_size`` processes, starts one gloo process group,
runs every case on every rank, and returns ``{case_name: None | "rank r: traceback"}``.
A case is ``(name, fn, args)`` where ``fn(*args)`` is a module-level function (so it pickles).
Start-up dominates on 2 cores, hence one spawn per module and world size.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist

CASE_TIMEOUT_S = 120


def _worker(rank, world_size, init_file, cases, results):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=CASE_TIMEOUT_S),
    )
    out = {}
    for name, fn, args in cases:
        try:
            fn(*args)
            out[name] = None
        except BaseException:  # noqa: BLE001 - reported to the parent
            out[name] = f"rank {rank}: {traceback.format_exc()}"
    results.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def run_cases(world_size: int, cases: list, timeout_s: float = 600.0) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, cases, results), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        merged = {name: None for name, _, _ in cases}
        got = 0
        try:
            while got < world_size:
                rank, out = results.get(timeout=timeout_s)
                got += 1
                for name, err in out.items():
                    if err is not None and merged[name] is None:
                        merged[name] = err
        except queue.Empty:
            for name in merged:
                merged[name] = merged[name] or f"timed out after {timeout_s}s on {world_size} ranks"
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return merged


_groups = {}


def cp_group(n):
    """This rank's CP group of size ``n`` and its rank in it (collective on first use).

    ``n`` = world size: the default group; ``1``: a group per rank; ``2`` in a world of 4: the
    non-adjacent pairs ``[0, 2]`` and ``[1, 3]`` (neighbours must come from the group)."""
    world = dist.get_world_size()
    if n == world:
        return None, dist.get_rank()
    if n not in _groups:
        if n == 1:
            groups = [dist.new_group([r]) for r in range(world)]
            _groups[n] = groups[dist.get_rank()]
        elif n == 2 and world == 4:
            groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            _groups[n] = groups[dist.get_rank() % 2]
        else:
            raise AssertionError(f"no sub-group of size {n} in a world of {world}")
    group = _groups[n]
    return group, dist.get_rank(group)


class CaseTable:
    """Cases per world size, each world spawned once on first use; ``params()`` for pytest."""

    def __init__(self, cases_by_world: dict):
        self.cases = cases_by_world
        self._results = {}

    def params(self) -> list:
        return [(w, name) for w, cases in self.cases.items() for name, _, _ in cases]

    def result(self, world: int, name: str):
        if world not in self._results:
            self._results[world] = run_cases(world, self.cases[world])
        return self._results[world][name]


def check_case(results: dict, name: str) -> None:
    """Fail ``name`` with its traceback; every case fails at once when the ``setup`` case did."""
    import pytest

    if name != "setup" and results.get("setup") is not None:
        pytest.fail(f"setup failed:\n{results['setup']}")
    assert results[name] is None, results[name]
