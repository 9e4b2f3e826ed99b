"""Run many test cases on N gloo ranks started once.

``run_cases(world_size, cases)`` starts ``world_size`` processes, starts one gloo process group,
runs every case on every rank, and returns ``{case_name: None | report}``.
A case is ``(name, fn, args)`` where ``fn(*args)`` is a module-level function (so it pickles).
Start-up dominates on 2 cores, hence one start per module and world size, and each rank a fresh
process forked from a fork server that imported torch and the frameworks once
(:func:`start_fork_server`, which tests/conftest.py starts while the in-process tests run), not a
fresh interpreter importing them again (several seconds of CPU per rank); spawn where the platform
has no fork server, where a GPU may be used (CUDA must not be touched before a fork), or with
``$STRIPED_SP_TEST_START=spawn``.

A rank that breaks alone must not stall the module, nor hide which case broke:

* each worker runs with a ring timeout of :data:`RING_TIMEOUT_S` (``$STRIPED_SP_RING_TIMEOUT_S``:
  the ring transfers and ``ring_attention``'s agreement wait; a case that passes ``timeout=`` keeps
  its own) and gloo groups whose own timeout is :data:`PG_TIMEOUT_S` (the default group and every
  ``new_group`` made without one: barriers, the adapters' agreement exchange), both well under the
  harness limit ``timeout_s``;
* the ranks run the cases in step: each reports "starting case i" and then its result to the parent,
  which starts case i + 1 once every rank finished case i.  A case's report names each rank that
  failed it, with its traceback and seconds (and the ranks it passed on);
* after a case that may have left the group out of step (a rank timed out or lost a peer in it,
  died, or is still inside it a grace period after another rank failed it: the ring and group
  timeouts plus 30 s) the ranks stop: that case names the stuck or dead rank (a dead one with the
  end of its stderr, where gloo says why it aborted), the later ones read "not run: rank r stuck in
  case X (...)", "not run: rank r died in case X (...)" or "not run: case X failed, first on rank
  r, and rank(s) [...] timed out or lost a peer in it ...".  A failure that leaves the ranks in
  step (every rank done, none timed out) does not stop the others.  At the harness limit every
  case still open is reported the same way, per rank.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

#: each worker's ring timeout in seconds (ring transfers and ring_attention's agreement), unless the
#: test passes ``ring_timeout_s`` or ``$STRIPED_SP_RING_TIMEOUT_S`` is set when the tests start
RING_TIMEOUT_S = 30.0
#: the gloo groups' own timeout in seconds: collectives outside the ring (barriers, the adapters'
#: agreement exchange, the tests' own all-reduces and groups)
PG_TIMEOUT_S = 60.0
_RING_TIMEOUT_ENV = "STRIPED_SP_RING_TIMEOUT_S"  # striped_sp.engine.transport.TIMEOUT_ENV (not imported here)
_PRELOAD_ENV = "STRIPED_SP_TEST_PRELOAD"  # read by worker_preload.py in the fork server
_BROKEN_TEXT = ("gloo", "Connection closed", "Connection reset", "imed out", "timeout")


def _breaks_the_group(err: BaseException) -> bool:
    """A failure after which this rank's messages may be out of step: a timeout, a lost peer."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (TimeoutError, dist.DistError)) or \
                (isinstance(err, RuntimeError) and any(t in str(err) for t in _BROKEN_TEXT)):
            return True
        err = err.__cause__ or err.__context__
    return False


def _worker(rank, world_size, init_file, cases, conn, ring_timeout_s, pg_timeout_s, stderr_path, env=None):
    """One rank: take the parent's environment ``env`` (a rank forked from the fork server starts
    with the server's), start the group, then run case ``i`` each time the parent sends ``i`` (``None``:
    the end), telling the parent ``start`` and ``done`` over ``conn`` (its own pipe: a rank that dies
    mid-message cannot block the others' reports, as a shared queue's lock would).  Its stderr goes
    to ``stderr_path`` (the parent passes it on, and quotes it for a rank that died: gloo's abort),
    its stdout to ``stdout.<rank>`` beside it (passed on too: the fork server's own stdout is not
    the current test's)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    for stream, path in ((1, os.path.join(os.path.dirname(stderr_path), f"stdout.{rank}")), (2, stderr_path)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, stream)
        os.close(fd)
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if ring_timeout_s is not None:
        os.environ[_RING_TIMEOUT_ENV] = f"{ring_timeout_s:g}"
    pg_timeout = datetime.timedelta(seconds=pg_timeout_s)
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = pg_timeout  # every group made without a timeout (new_group, DeepSpeed's)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=pg_timeout)
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("failed", f"rank {rank} could not start the process group:\n{traceback.format_exc()}"))
        return
    conn.send(("ready",))
    while True:
        index = conn.recv()
        if index is None:
            break
        name, fn, args = cases[index]
        conn.send(("start", index))
        start = time.monotonic()
        try:
            fn(*args)
            err, broken = None, False
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            err = f"rank {rank} (after {time.monotonic() - start:.1f} s): {traceback.format_exc()}"
            broken = _breaks_the_group(exc)
        conn.send(("done", index, err, broken))
    try:
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the results are in
        pass


_QUOTE = "; its stderr ended:\n    "


def _last_words(tmp, rank, lines=6) -> str:
    """The end of a dead rank's stderr (gloo says there why it aborted), quoted."""
    try:
        with open(os.path.join(tmp, f"stderr.{rank}"), errors="replace") as f:
            tail = [line.rstrip() for line in f.readlines() if line.strip()][-lines:]
    except OSError:
        return ""
    return _QUOTE + "\n    ".join(tail) if tail else ""


class _Run:
    """The parent's view: what each rank started, finished and reported."""

    def __init__(self, cases, world_size):
        self.cases, self.n = cases, world_size
        self.current = {}  # rank -> index of the case it started last
        self.done = {}  # (index, rank) -> error or None
        self.order = []  # (index, rank) of each failure, as they came
        self.broken = {}  # index -> the ranks it left out of step (a timeout, a lost peer)
        self.failed_at = {}  # index -> monotonic time of its first failure (or first death in it)
        self.gone = {}  # rank -> (verb, detail): ("died", "exit code -6") or ("stuck", "...")

    def name(self, index):
        return self.cases[index][0]

    def where(self, rank, quote: bool = True) -> str:
        """``rank 1 stuck in case 'x' (detail)`` (``quote``: with a dead rank's last stderr lines)."""
        verb, detail = self.gone[rank]
        if not quote:
            detail = detail.split(_QUOTE)[0]
        index = self.current.get(rank)
        at = "before the first case" if index is None else f"in case {self.name(index)!r}"
        return f"rank {rank} {verb} {at} ({detail})"

    def report(self, index, stop_reason) -> str | None:
        """One case's report (``stop_reason``: why the ranks did not reach it, when they did not)."""
        passed = [r for r in range(self.n) if (index, r) in self.done and self.done[(index, r)] is None]
        missing = [r for r in range(self.n) if (index, r) not in self.done]
        inside = [r for r in missing if self.current.get(r) == index]
        lines = [("timed out: " if self.gone.get(r, ("stuck",))[0] == "stuck" else "") +  # the cause first
                 (self.where(r) if r in self.gone else f"rank {r} gave no result") for r in inside]
        lines += [self.done[(i, r)] for i, r in self.order if i == index]  # then the failures as they came
        if missing and not inside:
            lines.append(f"not run{f' on rank(s) {missing}' if lines or passed else ''}: {stop_reason}")
        if lines and passed:
            lines.append(f"(passed on rank(s) {passed})")
        return "\n".join(lines) or None


def _fork_server() -> bool:
    """Whether the ranks fork from the fork server (the module docstring says when not)."""
    gpu_build = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
    gpu_node = any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))
    return ("forkserver" in mp.get_all_start_methods() and not (gpu_build and gpu_node)
            and os.environ.get("STRIPED_SP_TEST_START", "forkserver") == "forkserver")


def _context():
    """The fork server (its preloaded modules: :func:`start_fork_server`) or spawn: either way
    each rank is a fresh process of its own, with no process group yet."""
    if not _fork_server():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["worker_preload"])  # no effect once the server runs
    return ctx


def start_fork_server(modules: list) -> None:
    """Start the ranks' fork server now, importing ``modules`` once (``worker_preload``) before
    the first cases need them; a no-op where it already runs or the ranks are spawned."""
    if not _fork_server():
        return
    from multiprocessing import forkserver
    from unittest import mock

    path = os.pathsep.join(filter(None, (os.path.dirname(__file__), os.environ.get("PYTHONPATH"))))
    # the server reads the list (worker_preload) and imports on Python's default path: 3.11 passes it
    # no sys.path, so this folder goes on its PYTHONPATH (the tests' own environment is restored)
    with mock.patch.dict(os.environ, {_PRELOAD_ENV: ",".join(modules), "PYTHONPATH": path}):
        _context()
        forkserver.ensure_running()


def run_cases(world_size: int, cases: list, timeout_s: float = 600.0, *, ring_timeout_s: float | None = None,
              pg_timeout_s: float = PG_TIMEOUT_S, grace_s: float | None = None) -> dict:
    """Run ``cases`` on ``world_size`` gloo ranks in step; ``{name: None | report}`` (module docstring).

    ``timeout_s``: the whole run's limit.  ``ring_timeout_s``: the workers' ring timeout (``None``:
    ``$STRIPED_SP_RING_TIMEOUT_S`` when set, else :data:`RING_TIMEOUT_S`); ``pg_timeout_s``: the gloo
    groups' own; ``grace_s``: how long the other ranks may still run a case one rank failed (or
    died in; ``None``: the ring and group timeouts plus 30 s, by when their waits have ended)."""
    if ring_timeout_s is None and _RING_TIMEOUT_ENV not in os.environ:
        ring_timeout_s = RING_TIMEOUT_S
    if grace_s is None:
        ring_s = ring_timeout_s if ring_timeout_s is not None else float(os.environ[_RING_TIMEOUT_ENV])
        grace_s = ring_s + pg_timeout_s + 30.0
    names = [name for name, _, _ in cases]
    assert len(set(names)) == len(names), f"case names must be unique: {names}"
    ctx = _context()
    pipes = [ctx.Pipe() for _ in range(world_size)]  # (parent end, worker end) per rank
    conns = [parent for parent, _ in pipes]
    run = _Run(cases, world_size)
    stop_reason = None
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world_size, init_file, cases, pipes[r][1], ring_timeout_s, pg_timeout_s,
                                   os.path.join(tmp, f"stderr.{r}"), dict(os.environ)))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for _, child in pipes:
            child.close()
        deadline = time.monotonic() + timeout_s
        ready, index = set(), -1  # index: the case the ranks are in (-1: starting up)
        silent = set()  # ranks whose pipe closed

        def start(i):
            for c in conns:
                try:
                    c.send(i)
                except OSError:  # that rank is gone: found below
                    pass
            return i

        def died(r, now):
            if r not in run.gone:
                procs[r].join(timeout=1)
                run.gone[r] = ("died", f"exit code {procs[r].exitcode}{_last_words(tmp, r)}")
                run.failed_at.setdefault(index, now)
                if index >= 0 and run.current.get(r) != index:
                    run.current[r] = index  # died between its "done" and "start": this case

        try:
            while stop_reason is None and index < len(cases):
                if index >= 0:
                    open_ranks = [r for r in range(world_size) if (index, r) not in run.done]
                    if not open_ranks:  # every rank finished the case
                        if index in run.broken:
                            first = next(r for i, r in run.order if i == index)
                            stop_reason = (f"case {run.name(index)!r} failed, first on rank {first}, and rank(s) "
                                           f"{sorted(run.broken[index])} timed out or lost a peer in it: the group "
                                           "may be out of step, the ranks stopped there")
                            break
                        index = start(index + 1) if index + 1 < len(cases) else len(cases)
                        continue
                    if all(run.gone.get(r, ("",))[0] == "died" for r in open_ranks):
                        stop_reason = "; ".join(run.where(r, quote=False) for r in open_ranks)
                        break
                live = [c for r, c in enumerate(conns) if r not in silent]
                for c in mp_connection.wait(live, timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                    rank = conns.index(c)
                    try:
                        msg = c.recv()
                    except Exception:  # noqa: BLE001 - closed (the rank exited) or cut mid-message
                        silent.add(rank)
                        died(rank, time.monotonic())
                        continue
                    kind = msg[0]
                    if kind == "ready":
                        ready.add(rank)
                        if len(ready) == world_size:
                            index = start(0)
                    elif kind == "start":
                        run.current[rank] = msg[1]
                    elif kind == "done":
                        run.done[(msg[1], rank)] = msg[2]
                        if msg[2] is not None:
                            run.failed_at.setdefault(msg[1], time.monotonic())
                            run.order.append((msg[1], rank))
                        if msg[3]:
                            run.broken.setdefault(msg[1], set()).add(rank)
                    else:  # "failed": no process group on this rank
                        stop_reason = msg[1]
                now = time.monotonic()
                for r, p in enumerate(procs):  # a dead rank whose closed pipe was not read yet
                    if not p.is_alive() and r not in silent:
                        silent.add(r)
                        died(r, now)
                if index < 0 and run.gone:
                    stop_reason = "; ".join(run.where(r, quote=False) for r in run.gone)
                    break
                late = index in run.failed_at and now - run.failed_at[index] > grace_s
                if late or now >= deadline:
                    detail = (f"still running {grace_s:g} s after another rank failed it" if late
                              else f"at the harness limit of {timeout_s:g} s")
                    open_ranks = [r for r in range(world_size) if (index, r) not in run.done]
                    for r in open_ranks:
                        run.gone.setdefault(r, ("stuck", detail))
                    stop_reason = "; ".join(run.where(r, quote=False) for r in open_ranks) or "the ranks did not start"
        finally:
            clean = stop_reason is None
            start(None)
            for p in procs:
                p.join(timeout=30 if clean else 1)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            for c in conns:
                c.close()
            for r in range(world_size):  # the workers' output, for pytest's capture as before
                for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                    path = os.path.join(tmp, f"{name}.{r}")
                    if os.path.exists(path) and os.path.getsize(path):
                        with open(path, errors="replace") as f:
                            stream.write(f"--- rank {r} {name} ---\n{f.read()}")
    return {name: run.report(i, stop_reason) for i, name in enumerate(names)}


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
    """Cases per world size, each world spawned once on first use; ``params()`` for pytest.

    ``release(world, name)``: whether a case is left to ``make test-release`` (marked ``release``);
    those run in a spawn of their own, so that ``make test`` does not run them with its first case
    (a case named ``setup`` runs in both spawns)."""

    def __init__(self, cases_by_world: dict, release=None):
        self.cases = cases_by_world
        self._release = release or (lambda world, name: False)
        self._results = {}

    def _is_release(self, world: int, name: str) -> bool:
        return name != "setup" and bool(self._release(world, name))

    def params(self) -> list:
        import pytest

        return [pytest.param(w, name, marks=pytest.mark.release) if self._is_release(w, name) else (w, name)
                for w, cases in self.cases.items() for name, _, _ in cases]

    def result(self, world: int, name: str):
        key = (world, self._is_release(world, name))
        if key not in self._results:
            cases = [case for case in self.cases[world] if case[0] == "setup" or self._is_release(world, case[0]) == key[1]]
            self._results[key] = run_cases(world, cases)
        return self._results[key][name]


def check_case(results: dict, name: str) -> None:
    """Fail ``name`` with its traceback; every case fails at once when the ``setup`` case did."""
    import pytest

    if name != "setup" and results.get("setup") is not None:
        pytest.fail(f"setup failed:\n{results['setup']}")
    assert results[name] is None, results[name]
