"""DeepSpeed engines as people run them for long context, on 2 gloo ranks: ZeRO stages 0-3, fp32
and bf16, gradient accumulation, gradient clipping, and checkpoints.

Every configuration trains a tiny Llama for a few optimizer steps with SGD (whose update is
proportional to the gradient, so a gradient off by any factor shows) twice: at
``sequence_parallel_size: 1`` (two data-parallel replicas fed the same full batches, which equals one
process) and at ``sequence_parallel_size: 2`` with the striped layout.  The losses of every
micro-step, the global gradient norm of every step and the parameter updates must agree.  All
SP=1 engines are built before the SP=2 ones (DeepSpeed keeps the last engine's ``mpu`` process-wide).

Checkpoints: ``engine.save_checkpoint`` after some steps, a fresh engine loads it and trains on;
its next losses equal the uninterrupted run's, also across SP=1 -> SP=2 and back.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
import torch.distributed as dist

from dist_helper import run_cases, check_case
from reference import rel_err
from test_deepspeed_packed import _setup as ds_setup

WORLD = 2
SEQ = 22  # fits striped and zigzag on 2 ranks (a multiple of 2 * 2 is not needed for striped)
VOCAB = 61
STEPS = 2
_STATE = {}


def _setup():
    ds_setup()  # DeepSpeed's communication on the gloo group, shared-memory op not built
    _STATE["tmp"] = os.environ.get("STRIPED_SP_TEST_TMP")


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation("sdpa")
    return model


def _batch(step, seed=11):
    """A full micro-batch: 2 rows of SEQ tokens; labels count from the first token (no ignore_index
    at the row start, so a wrap-around shift would be caught), two ignored targets mid-row."""
    g = torch.Generator().manual_seed(seed + step)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 5] = -100
    labels[1, SEQ // 2] = -100
    return {"input_ids": ids, "labels": labels}


CONFIGS = {  # name -> (zero stage, bf16, gradient accumulation steps, gradient clipping[, zero_optimization extras])
    "z0_fp32": (0, False, 1, 0.0),
    "z2_fp32_allreduce": (2, False, 1, 0.0, {"reduce_scatter": False, "overlap_comm": True}),
    "z3_fp32_allreduce": (3, False, 1, 0.0, {"reduce_scatter": False}),  # the path DeepSpeed already scales
    "z1_fp32_ga2_clip": (1, False, 2, 0.05),
    "z2_fp32_ga2": (2, False, 2, 0.0),
    "z3_fp32": (3, False, 1, 0.0),
    "z3_fp32_ga2_clip": (3, False, 2, 0.05),
    "z2_bf16_ga2_clip": (2, True, 2, 0.05),
    "z3_bf16": (3, True, 1, 0.0),
}


def _ds_config(sp, stage, bf16, ga, clip, zero_extra=None):
    cfg = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ga,
        "gradient_clipping": clip, "steps_per_print": 10**6, "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage, **(zero_extra or {})}, "zero_allow_untested_optimizer": True,
        "sequence_parallel_size": sp, "context_parallel": {"algo": "striped"},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _full_params(engine):
    """Every full fp32 parameter (the optimizer's master copy under ZeRO and bf16)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        for n, p in engine.module.named_parameters():
            master = safe_get_full_fp32_param(p) if engine.zero_optimization_stage() > 0 else None
            out[n] = (p if master is None else master).detach().float().clone()
    return out


def _engine(sp, config, seed=3, momentum=0.0):
    from striped_sp.deepspeed import initialize

    model = _tiny_llama(seed)
    opt = torch.optim.SGD(model.parameters(), lr=2.0, momentum=momentum)
    engine, _, _, _ = initialize(model=model, optimizer=opt, config=_ds_config(sp, *config))
    return engine


def _train(engine, first_step, steps):
    """Run ``steps`` optimizer steps from micro-batch ``first_step * ga``; losses and grad norms."""
    from striped_sp.deepspeed import shard_batch

    sp = engine.context_parallel.sequence_parallel_size
    rank = dist.get_rank(engine.context_parallel_group) if sp > 1 else 0
    ga = engine.gradient_accumulation_steps()
    losses, norms = [], []
    for micro in range(first_step * ga, (first_step + steps) * ga):
        batch = shard_batch(_batch(micro), sp, rank, "striped")
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        if (micro + 1) % ga == 0:  # an optimizer step just ran
            norm = engine.get_global_grad_norm()  # None where the engine computes no norm (stage 0)
            norms.append(None if norm is None else float(norm))
    return losses, norms


def _run(sp, name):
    config = CONFIGS[name]
    engine = _engine(sp, config)
    before = _full_params(engine)
    losses, norms = _train(engine, 0, STEPS)
    after = _full_params(engine)
    return losses, norms, {n: after[n] - before[n] for n in after}


def _case_sp1(name):
    _STATE[("ref", name)] = _run(1, name)


def _case_sp2(name):
    ref_losses, ref_norms, ref_delta = _STATE[("ref", name)]
    losses, norms, delta = _run(2, name)
    bf16 = CONFIGS[name][1]
    tol = 2e-2 if bf16 else 1e-4
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < tol, (losses, ref_losses)
    assert [n is None for n in norms] == [n is None for n in ref_norms], (norms, ref_norms)
    assert all(abs(a - b) / abs(b) < tol for a, b in zip(norms, ref_norms) if b is not None), (norms, ref_norms)
    for n in delta:
        assert rel_err(delta[n], ref_delta[n]) < (5e-2 if bf16 else 1e-3), (n, rel_err(delta[n], ref_delta[n]))


def _case_errors():
    """DeepSpeed settings that conflict with SP: a ValueError naming them, before any collective."""
    from striped_sp.deepspeed import initialize

    bad = [({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor=2.0"),
           ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size=2"),
           ({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}, "zero_optimization.mics_shard_size=2"),
           ({"context_parallel": {"algo": "striped", "chunk": 4}}, "context_parallel.chunk: unknown key")]
    for over, match in bad:
        model = _tiny_llama()
        with pytest.raises(ValueError, match=match):
            initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       config={**_ds_config(2, 2, False, 1, 0.0), **over})
    dist.barrier()  # nobody hangs


# ---------------------------------------------------------------------------- checkpoints

CKPT = (3, False, 2, 0.05)  # ZeRO-3, fp32, 2 micro-batches per step, clipping; SGD with momentum


def _ckpt_dir(sp):
    return os.path.join(_STATE["tmp"], f"sp{sp}")


def _case_ckpt_write(sp):
    """Train 1 step, save, train 2 more: the uninterrupted losses of steps 2-3 go to a file."""
    engine = _engine(sp, CKPT, momentum=0.9)
    _train(engine, 0, 1)
    engine.save_checkpoint(_ckpt_dir(sp), tag="step1", client_state={"step": 1})
    losses, norms = _train(engine, 1, 2)
    if dist.get_rank() == 0:
        torch.save((losses, norms), os.path.join(_STATE["tmp"], f"after_sp{sp}.pt"))
    dist.barrier()


def _case_ckpt_resume(sp, written_at):
    """A fresh engine (other initial weights) resumes the checkpoint written at SP=written_at."""
    ref_losses, ref_norms = torch.load(os.path.join(_STATE["tmp"], f"after_sp{written_at}.pt"))
    engine = _engine(sp, CKPT, seed=99, momentum=0.9)
    path, client = engine.load_checkpoint(_ckpt_dir(written_at), tag="step1")
    assert path is not None and client["step"] == 1, (path, client)
    losses, norms = _train(engine, 1, 2)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < 1e-4, (losses, ref_losses)
    assert max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms)) < 1e-4, (norms, ref_norms)


CASES = [("setup", _setup, ()), ("errors", _case_errors, ())]
CASES += [(f"sp1_{name}", _case_sp1, (name,)) for name in CONFIGS]
CASES += [("ckpt_write_sp1", _case_ckpt_write, (1,))]  # SP=1 engines first: DeepSpeed keeps the last mpu
CASES += [(f"sp2_{name}", _case_sp2, (name,)) for name in CONFIGS]
CASES += [("ckpt_write_sp2", _case_ckpt_write, (2,))]
# a fresh set of processes resumes the checkpoints (SP=1 engines first again)
RESUME = [("setup", _setup, ()), ("ckpt_resume_sp1_from_sp2", _case_ckpt_resume, (1, 2)),
          ("ckpt_resume_sp2_from_sp2", _case_ckpt_resume, (2, 2)),
          ("ckpt_resume_sp2_from_sp1", _case_ckpt_resume, (2, 1))]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ["STRIPED_SP_TEST_TMP"] = str(tmp_path_factory.mktemp("ds_ckpt"))
    return run_cases(WORLD, CASES, timeout_s=500)


@pytest.fixture(scope="module")
def resumed(results):
    return run_cases(WORLD, RESUME, timeout_s=300)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_deepspeed_zero_case(results, name):
    check_case(results, name)


@pytest.mark.parametrize("name", [c[0] for c in RESUME])
def test_deepspeed_checkpoint_resume(results, resumed, name):
    if results["ckpt_write_sp1"] is not None or results["ckpt_write_sp2"] is not None:
        pytest.fail("writing the checkpoints failed")
    assert resumed[name] is None, resumed[name]
