"""megatron-core >= 0.19's HybridModel under ``--context-parallel-algo``, on 2 gloo ranks.

* attention and MLP layers (pattern ``*-*-``), RoPE, GQA, dense rows and packed THD rows: CP=2
  equals CP=1 with an independent float64 core attention, on loss and every gradient;
* Mamba layers are accepted under ``striped`` and ``zigzag`` (their context parallelism follows
  the layout: megatron/mamba.py; exactness with real Mamba layers in test_megatron_mamba.py).

CPU shim (tests only): HybridStack builds its final norm with Transformer Engine's ``TENorm``;
here it is a torch LayerNorm.
"""

import random

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import run_cases
from megatron_layers import attention_and_mlp_specs, check_dense_row
from megatron_reference import compare, document_mask, use_reference_attention

pytest.importorskip("megatron.core")
try:
    from megatron.core.models.hybrid.hybrid_model import HybridModel  # noqa: F401
except ImportError:
    pytest.skip("HybridModel needs megatron-core >= 0.19 (make test-megatron MCORE=0.19.2)",
                allow_module_level=True)

SEED = random.randrange(2**31)
VOCAB, SEQ = 48, 24
DOCS = [9, 1, 6, 8]  # 24 tokens, one document shorter than CP


def _cpu_shims():
    from megatron.core.models.hybrid import hybrid_block

    hybrid_block.TENorm = lambda config, hidden_size, eps=1e-5, **kw: torch.nn.LayerNorm(hidden_size, eps=eps)


def _stack_spec(extra=None):
    """Attention layers ('*') and MLP layers ('-') from megatron-core's local GPT layer spec."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    attention, mlp = attention_and_mlp_specs()
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        attention_layer=attention, mlp_layer=mlp, **(extra or {})))


def _model(group, pattern="*-*-", spec=None, seed=1):
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from striped_sp.megatron.toy import pg_collection

    config = TransformerConfig(num_layers=len(pattern), hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                               num_query_groups=2, use_cpu_initialization=True, attention_dropout=0.0,
                               hidden_dropout=0.0, context_parallel_size=group.size())
    torch.manual_seed(seed)
    return HybridModel(config, spec or _stack_spec(), vocab_size=VOCAB, max_sequence_length=64,
                       hybrid_layer_pattern=pattern, position_embedding_type="rope",
                       pg_collection=pg_collection(group))


def _groups():
    from megatron.core import parallel_state

    from striped_sp.megatron.toy import single_rank_group

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    return single_rank_group(), parallel_state.get_context_parallel_group()


def check_hybrid(algo, packed, seed):
    import striped_sp.megatron as sm

    _cpu_shims()
    alone, group = _groups()
    sm.install(algo)
    ref = _model(alone, seed=seed)
    use_reference_attention(ref, ref.config)
    model = _model(group, seed=seed)
    assert any(isinstance(m, sm.ContextParallelAttention) for m in model.modules())
    if not packed:
        check_dense_row(model, ref, algo, group, seed, VOCAB, SEQ)
        return
    gen = torch.Generator().manual_seed(seed + 1)
    tokens, labels = (torch.randint(0, VOCAB, (1, SEQ), generator=gen) for _ in range(2))
    bounds = [0]
    for n in DOCS:
        bounds.append(bounds[-1] + n)
    positions = torch.cat([torch.arange(n) for n in DOCS])[None]
    ref_loss = ref(tokens, positions, document_mask(bounds, SEQ), labels=labels).sum()
    batch = {"tokens": tokens, "labels": labels, "position_ids": positions}
    cu = torch.tensor(bounds, dtype=torch.int32)
    local, params = sm.get_thd_batch_on_this_cp_rank(batch, cu, None, torch.tensor([max(DOCS)]),
                                                     algo=algo, cp_group=group)
    loss = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                 packed_seq_params=params).sum()
    ref_loss.backward()
    loss.backward()
    compare(model, ref, loss, ref_loss, group, seed)


class MambaLayer(torch.nn.Module):
    """Stands in for megatron-core's MambaLayer (mamba-ssm is CUDA-only); only its name matters."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def check_mamba_accepted():
    import striped_sp.megatron as sm
    from megatron.core.transformer.spec_utils import ModuleSpec

    _cpu_shims()
    _, group = _groups()
    spec = _stack_spec({"mamba_layer": ModuleSpec(module=MambaLayer)})
    for algo in ("striped", "zigzag"):
        sm.install(algo)
        _model(group, "M*-", spec)


CASES = [
    ("hybrid-striped-dense", check_hybrid, ("striped", False, SEED)),
    ("hybrid-striped-packed", check_hybrid, ("striped", True, SEED + 1)),
    ("hybrid-ring-packed", check_hybrid, ("ring", True, SEED + 2)),
    ("hybrid-zigzag-dense", check_hybrid, ("zigzag", False, SEED + 3)),
    ("mamba-accepted", check_mamba_accepted, ()),
]
_results = {}


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_hybrid_model_on_2_ranks(name):
    if not _results:
        _results.update(run_cases(2, CASES))
    assert _results[name] is None, _results[name]
