"""Side by side with DeepSpeed's own ALST/Ulysses on 2 gloo ranks: the same tiny Llama, the same
samples in the same order, SGD with clipping, ZeRO-1; the per-step losses, the gradient norms and
the parameters after the steps must agree within fp32 rounding.

ALST as DeepSpeed documents it: ``UlyssesSPAttentionHF.register_with_transformers`` (it takes over
transformers' ``"sdpa"`` entry process-wide, hence a module of its own), the returned ``mpu`` passed
to ``deepspeed.initialize``, and ``UlyssesSPDataLoaderAdapter`` over a loader that gives every rank
other samples (rank r: samples r, r + 2, ...); each adapter step runs one rank's sample on both
ranks, so its micro-batch order is 0, 1, 2, ...  Its loss is the token mean of the sample over the
SP group (the count all-reduced, each rank's summed loss over it, as transformers' Trainer weights
ALST losses by their target counts).  Ours: :func:`striped_sp.deepspeed.initialize` and a
:class:`~striped_sp.deepspeed.ShardedDataLoader` (every rank of the group loads the same samples, in order).
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
import torch.distributed as dist

from dist_helper import run_cases
from reference import rel_err
from test_deepspeed_packed import _setup as ds_setup

WORLD = 2
SEQ, VOCAB, SAMPLES, LR, CLIP = 20, 61, 6, 1.0, 0.05
_STATE = {}


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(8)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.0, tie_word_embeddings=False, use_cache=False)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation("sdpa")
    return model


class _Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(21)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[2 + i: 4 + 2 * i] = -100  # uneven target counts per sample and per rank
        return {"input_ids": self.ids[i], "labels": labels, "position_ids": torch.arange(SEQ)}


def _config(sp):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
            "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**6, "sequence_parallel_size": sp}


def _params(engine):
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}


def _case_alst():
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    ds_setup()
    model = _tiny_llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=WORLD,
        micro_batch_size=1, seq_length_is_variable=True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                           config=_config(WORLD), mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    data = _Data()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=WORLD, rank=dist.get_rank(), shuffle=False)
    loader = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader(data, batch_size=1, sampler=sampler),
                                        sp_rank=dist.get_rank(group), sp_group=group, sp_world_size=WORLD,
                                        device=torch.device("cpu"))
    losses, norms = [], []
    for batch in loader:
        count = (batch["shift_labels"] != -100).sum()
        dist.all_reduce(count, group=group)
        loss = engine(**batch, labels=batch["shift_labels"], num_items_in_batch=count).loss  # this rank's share
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(float(total))
        norms.append(float(engine.get_global_grad_norm()))
    _STATE["alst"] = (losses, norms, _params(engine))


def _case_striped():
    from striped_sp.deepspeed import ShardedDataLoader, initialize

    alst_losses, alst_norms, alst_params = _STATE["alst"]
    model = _tiny_llama()
    engine, _, _, _ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                 config={**_config(WORLD), "context_parallel": {"algo": "striped"}})
    # every rank of the group loads the same samples, in order; sharded after the collator
    loader = ShardedDataLoader(torch.utils.data.DataLoader(_Data(), batch_size=1), engine.context_parallel_group)
    losses, norms = [], []
    for batch in loader:
        loss = engine(**batch).loss  # the global mean on every rank
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        norms.append(float(engine.get_global_grad_norm()))  # before clipping: a scale error shows here
    assert len(losses) == len(alst_losses) == SAMPLES
    assert max(abs(a - b) / b for a, b in zip(losses, alst_losses)) < 1e-5, (losses, alst_losses)
    assert max(abs(a - b) / b for a, b in zip(norms, alst_norms)) < 1e-5, (norms, alst_norms)
    assert len(set(round(x, 3) for x in losses)) > 1  # the steps differ: the samples and the weights moved
    for name, p in _params(engine).items():
        assert rel_err(p, alst_params[name]) < 1e-5, name


CASES = [("alst", _case_alst, ()), ("striped_vs_alst", _case_striped, ())]


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, CASES, timeout_s=300)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_deepspeed_alst_case(results, name):
    if name != "alst" and results["alst"] is not None:
        pytest.fail(f"the ALST run failed:\n{results['alst']}")
    assert results[name] is None, results[name]
