"""Packaging and the command line: LICENSE, the Megatron-LM patches as package data (and in a built
wheel), ``striped-sp patch``, ImportErrors that name the extra, ``--plot`` checked before the work,
full ``--help``, progress bars on stderr only."""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from striped_sp.cli import build_parser, main
from striped_sp.patch_files import PATCH_DIR, available, patch_path, read_patch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TAGS = ["core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0"]
MODES = ["balance", "sim", "run", "hier", "precision", "train", "overhead", "hybrid", "hybrid-split", "fit"]


def test_license_is_the_apache_2_text():
    with open(os.path.join(ROOT, "LICENSE"), "rb") as f:
        text = f.read()
    # md5 of the text published at https://www.apache.org/licenses/LICENSE-2.0.txt (also the LICENSE
    # file that deepspeed and hf_xet ship)
    assert hashlib.md5(text).hexdigest() == "86d3f3a95c324c9479bd8986968f4327"
    with open(os.path.join(ROOT, "setup.cfg")) as f:
        assert "license = Apache-2.0" in f.read()


def test_patches_are_package_data_and_the_root_folder_is_the_same_files():
    assert list(available()) == TAGS
    assert os.path.dirname(PATCH_DIR) == os.path.dirname(os.path.abspath(sys.modules["striped_sp"].__file__))
    for tag, path in available().items():
        # the tests and docs use <repo>/patches/...: the same file
        assert os.path.samefile(path, os.path.join(ROOT, "patches", os.path.basename(path)))
        assert read_patch(tag).startswith("diff --git")
    # a megatron-core version picks its release line's patch
    assert patch_path("0.19.2") == patch_path("core_v0.19.0") == patch_path("v0.19.0")
    assert patch_path("0.16.1") == available()["core_v0.16.1"]
    with pytest.raises(ValueError, match=r"'0\.15\.0'.*core_v0\.16\.1"):
        patch_path("0.15.0")
    with pytest.raises(ValueError, match="'nonsense'"):
        patch_path("nonsense")


def test_patch_command(capsys):
    assert main(["patch", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("\t")[0] for ln in lines] == TAGS
    assert all(os.path.isfile(ln.split("\t")[1]) for ln in lines)
    assert main(["patch", "--print", "0.19.2"]) == 0
    assert capsys.readouterr().out == read_patch("core_v0.19.0")
    assert main(["patch", "--path", "core_v0.17.1"]) == 0
    assert capsys.readouterr().out.strip() == available()["core_v0.17.1"]
    with pytest.raises(SystemExit) as e:
        main(["patch", "--print", "core_v0.1.0"])
    assert e.value.code == 2
    assert "core_v0.1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["patch"])  # one of --list / --print / --path is required


def test_wheel_has_the_patches_and_the_license(tmp_path):
    """Build a wheel from a copy of the sources (no network, no build isolation)."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "striped_sp"), src / "striped_sp",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-q", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("striped_sp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for tag, path in available().items():
        assert f"striped_sp/patches/{os.path.basename(path)}" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "striped_sp/patch_files.py" in names


def test_deepspeed_adapter_names_the_extra_when_deepspeed_is_missing(monkeypatch):
    # a fresh process: the module imports without deepspeed, pydantic, transformers or accelerate
    code = ("import sys\n"
            "for m in ('deepspeed', 'pydantic', 'transformers', 'accelerate'): sys.modules[m] = None\n"
            "import striped_sp.deepspeed as ssd\n"
            "print('imported', ssd.initialize.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "imported initialize" in out.stdout, out.stderr[-3000:]

    import torch

    import striped_sp.deepspeed as ssd

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ImportError, match=r"initialize needs DeepSpeed.*striped_sp\[deepspeed\]"):
        ssd.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 1})
    with pytest.raises(ImportError, match=r"skip_cpu_shm_comm_build needs DeepSpeed.*striped_sp\[deepspeed\]"):
        ssd.skip_cpu_shm_comm_build()


def test_parse_config_names_the_extra_when_pydantic_is_missing(monkeypatch):
    import striped_sp.deepspeed as ssd

    monkeypatch.setitem(sys.modules, "pydantic", None)
    with pytest.raises(ImportError, match=r"pydantic is missing.*striped_sp\[deepspeed\]"):
        ssd.parse_config({"sequence_parallel_size": 1})


def test_plot_without_matplotlib_fails_before_the_work(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as e:
        main(["bench", "balance", "--world-sizes", "2", "--plot", str(tmp_path / "b.png")])
    assert e.value.code == 2
    got = capsys.readouterr()
    assert got.out == ""  # the table comes before the plot: nothing ran
    assert "striped_sp[bench]" in got.err and "--plot" in got.err


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_help_lists_every_mode_and_every_option_has_help_and_default(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    bench = capsys.readouterr().out
    for mode in MODES:
        assert mode in top and mode in bench
    assert "patch" in top
    parsers = list(_parsers(parser))
    assert len(parsers) == 1 + 1 + len(MODES) + 1  # striped-sp, bench, the modes, patch
    for p in parsers:
        text = p.format_help()
        for action in p._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{p.prog} {action.option_strings[0]}: no help"
            d = action.default
            if d not in (None, False, []):
                shown = ",".join(map(str, d)) if isinstance(d, list) else str(d)
                assert "default" in action.help.lower() or f"(default: {shown})" in " ".join(text.split()), \
                    f"{p.prog} {action.option_strings[0]}: default {shown} not shown"


def test_sim_progress_goes_to_stderr_only(capsys):
    pytest.importorskip("tqdm")
    argv = ["bench", "sim", "--world-sizes", "2", "--tokens-per-rank", "16", "--device", "cpu", "--reps", "1"]
    assert main(argv) == 0
    with_bar = capsys.readouterr()
    assert "N=2 S=32 blocks + one-device reference" in with_bar.err
    assert "N=2 S=32" not in with_bar.out and "it/s" not in with_bar.out
    assert main(argv + ["--no-progress"]) == 0
    without = capsys.readouterr()
    assert without.err == ""
    # the table has the same rows and columns either way (the timings differ)
    assert [ln.split()[:4] for ln in with_bar.out.splitlines()[-9:]] == \
        [ln.split()[:4] for ln in without.out.splitlines()[-9:]]


@pytest.mark.parametrize("reps", [1, 3, 5])
@pytest.mark.parametrize("warm_up_s", [0.5, 2.0])
def test_reference_bar_total_matches_the_calls_time_call_makes(reps, warm_up_s):
    """The one-device reference is a few long calls: the bar's total must end equal to its ticks,
    whether time_call takes ``reps`` samples (short warm-up) or ``max(2, reps // 2)`` (long)."""
    from striped_sp.bench.sim import Bar, SimConfig, reference_calls, time_reference

    class Counter:
        def __init__(self, total):
            self.total, self.n = total, 0

        def update(self, n=1):
            self.n += n

        def refresh(self):
            pass

    now = [0.0]
    cfg = SimConfig(reps=reps)
    bar = Bar(0, "", False)
    bar.bar = Counter(reference_calls(cfg))
    for _ in range(2):  # the forward and the backward pass

        def call():
            now[0] += warm_up_s

        time_reference(bar, call, cfg, clock=lambda: now[0])
    assert bar.bar.n == bar.bar.total
    assert bar.bar.n == 2 * (1 + (reps if warm_up_s <= 1.0 else max(2, reps // 2)))


def test_every_test_folder_is_collected(pytestconfig):
    """pytest's default norecursedirs holds "dist": without our own list, `make test` (pytest from
    the root) silently skipped tests/dist, the engine's tests on gloo ranks and the LocalRing."""
    import fnmatch
    import pathlib

    patterns = pytestconfig.getini("norecursedirs")
    tests = pathlib.Path(__file__).resolve().parents[1]
    for folder in ("unit", "dist", "integration", "gpu"):
        assert (tests / folder).is_dir()
        assert not any(fnmatch.fnmatch(folder, p) for p in patterns), (folder, patterns)
