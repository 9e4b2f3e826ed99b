"""``striped-sp patch --status / --apply``: a patch already applied is told apart from one that
does not apply (git's "patch does not apply" in both cases), on a copy of Megatron-LM core_v0.16.1."""

import os
import shutil

import pytest

from paths import ROOT
from striped_sp import cli

TAG = "core_v0.16.1"
SOURCES = ROOT.parent / "shared" / "megatron-lm" / TAG


@pytest.fixture
def checkout(tmp_path):
    if not (SOURCES / "pretrain_gpt.py").is_file():
        pytest.skip(f"no Megatron-LM {TAG} sources in {SOURCES}")
    if shutil.which("git") is None:
        pytest.skip("git not found")
    for name in ("pretrain_gpt.py", "gpt_builders.py", os.path.join("megatron", "training", "arguments.py")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SOURCES / name, tmp_path / name)
    return tmp_path


def test_status_and_apply_tell_an_applied_patch(checkout, capsys):
    assert cli.main(["patch", "--status", TAG, "-C", str(checkout)]) == 1
    assert "not applied" in capsys.readouterr().out
    assert cli.main(["patch", "--apply", TAG, "-C", str(checkout)]) == 0
    assert "applied the" in capsys.readouterr().out
    assert "context_parallel_algo" in (checkout / "megatron" / "training" / "arguments.py").read_text()
    assert cli.main(["patch", "--status", TAG, "-C", str(checkout)]) == 0
    assert "already applied" in capsys.readouterr().out
    assert cli.main(["patch", "--apply", TAG, "-C", str(checkout)]) == 0  # twice: a no-op, not git's error
    assert "already applied" in capsys.readouterr().out


def test_a_checkout_of_another_tag_is_named_as_such(checkout, capsys):
    path = checkout / "megatron" / "training" / "arguments.py"
    path.write_text(path.read_text().replace("args", "argz"))  # the patched lines changed
    assert cli.main(["patch", "--status", TAG, "-C", str(checkout)]) == 2
    assert "neither applies nor is applied" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["patch", "--apply", TAG, "-C", str(checkout)])
    assert "another Megatron-LM tag" in capsys.readouterr().err
