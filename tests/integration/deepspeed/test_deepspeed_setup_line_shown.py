"""A default DeepSpeed run says that striped is on (issue 46): the setup line reaches the terminal
with no logging configured (DeepSpeed's logger stays at WARNING), exactly once, on rank 0 only.

The run is a real launch of two gloo processes (``torch.distributed.run``) in a fresh interpreter,
so nothing of pytest's logging capture is involved."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

SCRIPT = textwrap.dedent("""
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import striped_sp.deepspeed as ssd

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": SP,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 0}, "context_parallel": {"algo": "striped"}}
    ssd.initialize(model=model, model_parameters=model.parameters(), config=config)
    import sys, torch.distributed as dist
    sys.stdout.write(f"rank {int(os.environ['RANK'])} done\\n")  # one write: the two ranks' lines never interleave
    sys.stdout.flush()
    dist.barrier()
    sys.stderr.flush()
    os._exit(0)  # what is under test is done; gloo's teardown at exit can abort a rank (SIGABRT)
""")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(tmp_path, sp):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.replace("SP", str(sp)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "LOGLEVEL"))}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(_free_port()), str(script)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "rank 0 done" in out and "rank 1 done" in out, out[-3000:]
    return out


def test_a_default_run_prints_the_setup_line_once_on_rank_0(tmp_path):
    out = _launch(tmp_path, 2)
    lines = [line for line in out.splitlines() if "striped_sp on (DeepSpeed" in line]
    assert len(lines) == 1, out[-3000:]
    for part in ("context_parallel.algo striped", "sequence_parallel_size 2 (ranks [0, 1] of 2", "kernel ",
                 "stripe size"):
        assert part in lines[0], (part, lines[0])


def test_a_default_run_at_sequence_parallel_size_1_says_the_section_is_off(tmp_path):
    out = _launch(tmp_path, 1)
    lines = [line for line in out.splitlines() if "striped_sp off: sequence_parallel_size 1" in line]
    assert len(lines) == 1, out[-3000:]
