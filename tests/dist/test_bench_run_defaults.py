"""``bench run`` with its defaults on the CPU: quiet and fair to the first layout.

* no ``torch.profiler`` unless asked (``--memory``): its C++ side prints ``USDT: ...
  profiler_start/stop`` lines to stderr for every measured region; the memory column is then empty;
* the process is warmed up before the first timed layout whatever ``--warmup`` says: with
  ``--warmup 0`` the first layout timed (striped) no longer carries the process start-up (it read
  130x contiguous's time at 256 tokens before).
"""

import json

from striped_sp.cli import main


def _run(tmp_path, *extra):
    path = tmp_path / "run.json"
    assert main(["bench", "run", "--world-size", "2", "--seq-lens", "256", "--heads", "2", "--head-dim", "16",
                 "--warmup", "0", "--iters", "1", "--peers", "none", "--device", "cpu", "--threads", "1",
                 "--no-progress", "--json", str(path), *extra]) == 0
    return {r["impl"]: r for r in json.loads(path.read_text())}


def test_run_defaults_are_quiet(tmp_path, capfd):
    recs = _run(tmp_path)
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler" not in err, err[-2000:]
    assert all(r["peak_mib"] is None for r in recs.values()), recs


def test_the_first_layout_timed_is_charged_no_process_start_up(tmp_path):
    recs = _run(tmp_path, "--memory")  # README's memory command: --warmup 0, the profiler on
    first, base = recs["striped"]["median_ms"], recs["contiguous"]["median_ms"]
    assert first < 10 * base, f"the first layout timed took {first:.1f} ms, contiguous {base:.1f} ms"
    assert all(r["peak_mib"] > 0 for r in recs.values()), recs


def test_train_help_gives_the_presets_and_the_run_time(capsys):
    import pytest

    from striped_sp.bench.train import PRESETS

    with pytest.raises(SystemExit):
        main(["bench", "train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for preset in PRESETS.values():
        assert f"vocab {preset['vocab']}" in out and f"{preset['rounds']} rounds" in out
        assert f"(window {preset['window']})" in out
    assert "Run time:" in out and "minutes on a 2-core CPU" in out
    assert f"default: the preset's, cpu {PRESETS['cpu']['layers']}, paper {PRESETS['paper']['layers']}" in out
