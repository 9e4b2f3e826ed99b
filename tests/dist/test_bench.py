"""The benchmark: the work model against a brute-force count, and smoke tests of sim and run
(well-formed JSON at tiny sizes; speed is never asserted)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
import torch

from striped_sp.bench.work import critical_path_over_ideal, score_entries, step_entries
from striped_sp.cli import main
from striped_sp.plan.layouts import LAYOUTS

SIM_KEYS = {"layout", "world_size", "seq_len", "pass", "critical_path_ms", "speedup_vs_contiguous", "efficiency"}
RUN_KEYS = {"impl", "world_size", "seq_len", "median_ms", "speedup_vs_contiguous", "docs", "window",
            "padding_tokens", "peak_mib", "samples_ms", "cpu_samples_ms"}
#: a striped line's plan (bench/report.py plan_report: the default striped has one too)
PLAN_KEYS = {"plan", "plan_balance", "plan_stripe_size", "plan_whole_max", "plan_order", "plan_whole_documents", "plan_cost_model",
             "predicted_ms", "predicted_forward_ms"}


def _brute_force(layout: str, world_size: int, local_len: int) -> list[list[int]]:
    """entries[t][r] from the global causal mask: pairs (query of r, key of source) with k <= q."""
    lay = LAYOUTS[layout]
    seq = world_size * local_len
    pos = [lay.positions(seq, world_size, r) for r in range(world_size)]
    return [
        [int((pos[(r - t) % world_size][None, :] <= pos[r][:, None]).sum()) for r in range(world_size)]
        for t in range(world_size)
    ]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_work_model_matches_brute_force(layout, world_size):
    for local_len in (2, 6, 10):
        expect = _brute_force(layout, world_size, local_len)
        assert step_entries(layout, world_size, local_len) == expect
        seq = world_size * local_len
        # every causal pair counted exactly once
        assert sum(map(sum, expect)) == seq * (seq + 1) // 2
        assert score_entries(layout, world_size, 0, local_len) == sum(row[0] for row in expect)
        ideal = seq * (seq + 1) / 2 / world_size
        assert critical_path_over_ideal(layout, world_size, local_len) == pytest.approx(
            sum(max(row) for row in expect) / ideal, rel=1e-12)


def test_balance_json(tmp_path, capsys):
    path = tmp_path / "balance.json"
    assert main(["bench", "balance", "--world-sizes", "2,8", "--tokens-per-rank", "1024",
                 "--json", str(path)]) == 0
    recs = json.loads(path.read_text())
    assert len(recs) == 6
    assert all(set(r) == {"layout", "world_size", "critical_path_over_ideal"} for r in recs)
    by = {(r["layout"], r["world_size"]): r["critical_path_over_ideal"] for r in recs}
    assert by[("contiguous", 8)] == pytest.approx(15 / 8, rel=0.01)
    assert by[("striped", 8)] <= 1.01
    assert "critical/ideal" in capsys.readouterr().out


def test_sim_smoke(tmp_path, capsys):
    path, png = tmp_path / "sim.json", tmp_path / "sim.png"
    assert main(["bench", "sim", "--world-sizes", "2,3", "--tokens-per-rank", "6", "--heads", "4",
                 "--kv-heads", "2", "--head-dim", "8", "--reps", "1", "--link-gbps", "10",
                 "--device", "cpu", "--no-progress", "--json", str(path), "--plot", str(png)]) == 0
    recs = json.loads(path.read_text())
    assert len(recs) == 2 * 3 * 3  # (N, S) points x passes x layouts
    for r in recs:
        assert set(r) == SIM_KEYS
        assert r["pass"] in ("forward", "backward", "fwd+bwd")
        assert r["critical_path_ms"] > 0 and r["efficiency"] > 0
        assert r["seq_len"] == 6 * r["world_size"]
    assert all(r["speedup_vs_contiguous"] == 1.0 for r in recs if r["layout"] == "contiguous")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "efficiency" in capsys.readouterr().out
    # --every-block (no effect now: every (rank, step) always runs), no reference: efficiency left empty
    assert main(["bench", "sim", "--world-sizes", "2", "--seq-lens", "8", "--heads", "2", "--head-dim", "8",
                 "--reps", "1", "--every-block", "--no-reference", "--layouts", "striped,contiguous",
                 "--device", "cpu", "--no-progress", "--json", str(path)]) == 0
    recs = json.loads(path.read_text())
    assert len(recs) == 3 * 2 and all(set(r) == SIM_KEYS and r["efficiency"] is None for r in recs)


def _peer_installed(peer: str) -> bool:
    """Whether ``peer`` can run here: its package importable at a version it is written for."""
    if peer == "torch_ring":
        from striped_sp.bench.peers import TORCH_RING_TESTED

        return torch.__version__.split("+")[0].startswith(TORCH_RING_TESTED)
    return importlib.util.find_spec("deepspeed") is not None


def _check_peer_line(peer: str, line: str) -> None:
    """A peer's row of ``bench run``: it ran and matched ring_attention on the same inputs; a peer
    that is not installed here may be skipped with its factory's reason (``skipped: <peer>: why``).
    A peer that crashed (``skipped: <Error>: ...``, ``failed on another rank``) fails the test,
    and so does any skip of a peer that is installed."""
    m = re.search(r"max_abs_err vs ring_attention ([0-9.e+-]+)", line)
    if m:
        assert float(m.group(1)) < 1e-5, line
        return
    assert not _peer_installed(peer), f"{peer} is installed here but did not run: {line}"
    assert re.search(rf"skipped: {peer}: \S", line), f"{peer} crashed or gave no reason: {line}"


def test_peer_line_check_refuses_crashes(monkeypatch):
    """The check above fails a crashed peer even where a genuine skip would be accepted."""
    ok = "ulysses     contiguous layout, max_abs_err vs ring_attention 2.4e-07"
    _check_peer_line("ulysses", ok)
    with pytest.raises(AssertionError):
        _check_peer_line("ulysses", ok.replace("2.4e-07", "3.1e-01"))
    monkeypatch.setattr(sys.modules[__name__], "_peer_installed", lambda peer: False)
    _check_peer_line("ulysses", "ulysses   skipped: ulysses: deepspeed not importable (ModuleNotFoundError: x)")
    for crash in ("skipped: RuntimeError: Connection closed by peer", "skipped: failed on another rank",
                  "skipped: torch_ring: private API pinned"):  # the last: another peer's reason
        with pytest.raises(AssertionError):
            _check_peer_line("ulysses", f"ulysses   {crash}")
    monkeypatch.setattr(sys.modules[__name__], "_peer_installed", lambda peer: True)
    with pytest.raises(AssertionError, match="installed here but did not run"):
        _check_peer_line("ulysses", "ulysses   skipped: ulysses: deepspeed not importable")


def test_run_smoke(tmp_path, capsys, monkeypatch):
    path = tmp_path / "run.json"
    extensions = tmp_path / "torch_extensions"  # DeepSpeed's CPU shm op must not be compiled
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    assert main(["bench", "run", "--world-size", "2", "--seq-lens", "12", "--heads", "2",
                 "--head-dim", "8", "--warmup", "0", "--iters", "1", "--peers", "torch_ring,ulysses",
                 "--device", "cpu", "--threads", "1", "--profile", "--no-progress", "--ulysses-sizes", "2",
                 "--memory", "--json", str(path)]) == 0
    recs = json.loads(path.read_text())
    assert {r["impl"] for r in recs} == {"striped", "zigzag", "contiguous", "torch_ring", "ulysses",
                                         "striped+u2", "zigzag+u2", "contiguous+u2", "sdpa_1proc"}
    for r in recs:
        assert set(r) == RUN_KEYS | (PLAN_KEYS if r["impl"] == "striped" else set()), r["impl"]
        assert r["world_size"] == (1 if r["impl"] == "sdpa_1proc" else 2) and r["seq_len"] == 12
        # every line that ran has its peak memory: at least its own inputs (q, k, v, dout; fp32)
        inputs_mib = 4 * r["seq_len"] // r["world_size"] * 2 * 8 * 4 / 2**20
        assert r["median_ms"] is None or r["peak_mib"] >= inputs_mib, r
    out = capsys.readouterr().out
    for peer in ("torch_ring", "ulysses"):
        _check_peer_line(peer, next(l for l in out.splitlines() if l.startswith(peer)))
    assert "where the time goes" in out
    assert not extensions.exists() or not any(extensions.iterdir())


def test_cli_rejects_bad_input(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "sim", "--world-sizes", "0"])
    with pytest.raises(SystemExit) as exit_:  # a ValueError becomes its message and exit status 2
        main(["bench", "sim", "--world-sizes", "4", "--seq-lens", "6", "--no-progress", "--device", "cpu"])
    assert exit_.value.code == 2 and "multiple" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "sim", "--world-sizes", "2", "--tokens-per-rank", "8", "--no-progress", "--device", "cpu",
              "--strict-block", "aligned"])
    assert "'aligned' (requested) needs a kernel whose non-square causal mask is bottom-right" in capsys.readouterr().err


def test_sim_tensor_formats_agree_on_the_work(capsys):
    """``--tensor-format bshd`` runs the same plans through the kernel's [b, s, h, d] API: the same
    rows (layout, N, pass) with the same work model column, which the plans' score entries give."""
    work = {}
    for fmt in ("native", "bshd"):
        assert main(["bench", "sim", "--world-sizes", "2", "--tokens-per-rank", "16", "--heads", "2", "--head-dim", "8",
                     "--reps", "1", "--no-progress", "--device", "cpu", "--tensor-format", fmt]) == 0
        out = capsys.readouterr().out
        assert f"tensor format {fmt}" in out
        rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["striped"], ["zigzag"], ["contiguous"])]
        work[fmt] = {(r[0], r[1], r[4]): r[7] for r in rows if len(r) == 9}
    assert len(work["native"]) == 9, work["native"]  # 3 layouts x forward / backward / fwd+bwd
    assert work["native"] == work["bshd"]
    assert work["native"][("striped", "2", "forward")] != work["native"][("contiguous", "2", "forward")]


def test_time_call_never_counts_the_warm_up():
    """Samples come from a fake clock: the cold first call (10 s) must not be in the median."""
    import torch

    from striped_sp.bench.common import time_call

    durations = iter([10.0, 1.0, 1.0, 1.0, 1.0])
    now = [0.0]

    def clock():
        return now[0]

    def fn():
        now[0] += next(durations)

    assert time_call(fn, torch.device("cpu"), reps=3, long_s=100.0, clock=clock) == 1.0
    durations, now[0] = iter([10.0, 2.0, 4.0, 9.0]), 0.0  # a long warm-up: 2 samples after it
    assert time_call(fn, torch.device("cpu"), reps=3, long_s=1.0, clock=clock) == 3.0


def _counted(plans, method):
    """Each rank's plan with its own copy of the kernel, whose ``method`` counts its calls."""
    import copy
    import dataclasses

    counts = [0] * len(plans)
    out = []
    for r, plan in enumerate(plans):
        kernel = copy.copy(plan.kernel)
        inner = getattr(kernel, method)

        def call(*a, r=r, inner=inner):
            counts[r] += 1
            return inner(*a)

        setattr(kernel, method, call)
        out.append(dataclasses.replace(plan, kernel=kernel))
    return out, counts


@pytest.fixture
def one_thread():
    """One compute thread, as ``bench sim`` runs (two threads on a loaded machine time their waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cfg(**kw):
    from striped_sp.bench.sim import SimConfig

    return SimConfig(**{"heads": 2, "head_dim": 8, "reps": 2, "reference": False, "progress": False, **kw})


def test_sim_runs_the_engines_executor_on_every_rank(monkeypatch, one_thread):
    """The sim times the engine's executor: each rank's kernel calls per run are its plan's
    launches (all (rank, step) run, none shared); patching the executor changes what it measures."""
    from striped_sp.bench import sim
    from striped_sp.engine import autograd
    from striped_sp.engine.request import RingRequest

    cfg = _cfg()
    kernel = sim.sim_kernel(cfg)
    plans, counts = _counted(sim.ring_plans(cfg, RingRequest(None, layout="zigzag"), 4, 8, kernel), "forward_native")
    bar = sim.Bar(0, "", False)
    base = sim.time_rings(cfg, {"z": (plans, sim.random_inputs(cfg, 8, torch.Generator()))}, bar)["z"]
    assert counts == [(cfg.reps + 1) * sum(p.launches(t) for t in range(p.steps)) for p in plans]
    real = autograd.forward_steps

    def slow(*a):  # the executor, 20 ms longer in every rank's part of every round
        import time

        steps = real(*a)
        try:
            while True:
                t0 = time.thread_time()  # 20 ms of work per round, on either clock of the sim
                while time.thread_time() - t0 < 0.02:
                    pass
                yield next(steps)
        except StopIteration as done:
            return done.value

    monkeypatch.setattr(autograd, "forward_steps", slow)
    slowed = sim.time_rings(cfg, {"z": (plans, sim.random_inputs(cfg, 8, torch.Generator()))}, bar)["z"]
    assert slowed["forward"] >= base["forward"] + 4 * 0.02  # 4 rounds of the forward ring
    assert slowed["backward"] < slowed["forward"] + 1.0


def test_sim_link_model_takes_the_bytes_the_ring_sends(one_thread):
    """--link-gbps: a round lasts as long as the transfer posted in it (the LocalRing's bytes):
    K and V of one rank, fp32, over N - 1 forward rounds."""
    from striped_sp.bench import sim
    from striped_sp.engine.request import RingRequest

    cfg = _cfg(reps=1, link_gbps=1e-6, kv_heads=1)  # 1 kB/s: the transfers dominate
    plans = sim.ring_plans(cfg, RingRequest(None, layout="striped"), 4, 8, sim.sim_kernel(cfg))
    crit = sim.time_rings(cfg, {"s": (plans, sim.random_inputs(cfg, 8, torch.Generator()))}, sim.Bar(0, "", False))
    kv_bytes = 2 * 8 * 1 * 8 * 4
    assert crit["s"]["forward"] == pytest.approx(3 * kv_bytes / 1e3, rel=0.05)
    assert crit["s"]["backward"] > crit["s"]["forward"]  # dK/dV travel too
