"""Under ``--context-parallel-algo`` (not native), a model whose layers the plugin neither runs nor
converts is refused by name when it is built (megatron/refusals.py), and MambaModel is converted.

* MambaModel (megatron-core 0.16 / 0.17: its own class; later a HybridModel subclass): its stack
  spec's attention becomes ours; its Mamba layers are accepted under every algo (megatron/mamba.py);
  '*-*-' at CP=2 under striped equals CP=1 with an independent float64 core attention (loss and
  every gradient, 2 gloo ranks);
* any other model (here a user class and megatron-core's BertModel) built from a spec no hook
  converted: refused, naming the model and its core attention;
* gated delta net where megatron-core has no context parallelism for it (0.16 / 0.17; accepted
  from 0.18, megatron/gdn.py) and DeepSeek sparse attention: refused, saying that megatron-core itself has none (DSA's core attention is
  never silently swapped for dense attention).

Mamba layers are stand-ins named ``MambaLayer`` (mamba-ssm is CUDA-only): only the name matters.
"""

import copy
import inspect
import random

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

import striped_sp.megatron as sm  # noqa: E402
from dist_helper import run_cases  # noqa: E402
from megatron_layers import attention_and_mlp_specs, check_dense_row  # noqa: E402
from megatron_reference import use_reference_attention  # noqa: E402
from striped_sp.megatron.version import megatron_core_line  # noqa: E402

SEED = random.randrange(2**31)
VOCAB, SEQ = 48, 24


class MambaLayer(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()


class GatedDeltaNet(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()


def _config(cp=1, layers=3):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=layers, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                             num_query_groups=2, use_cpu_initialization=True, attention_dropout=0.0,
                             hidden_dropout=0.0, context_parallel_size=cp)


def _layer_specs():
    """Attention ('*') and MLP ('-') layers with Megatron's own core attention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return attention_and_mlp_specs(DotProductAttention)


def _mamba_model(group, pattern, seed=1):
    """megatron-core's MambaModel with a CPU stack (MambaStack up to 0.17, HybridStack after)."""
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.transformer.spec_utils import ModuleSpec

    from striped_sp.megatron.toy import pg_collection

    try:
        from megatron.core.models.hybrid import hybrid_block as block
        stack, submodules = block.HybridStack, block.HybridStackSubmodules
    except ImportError:
        from megatron.core.ssm import mamba_block as block
        stack, submodules = block.MambaStack, block.MambaStackSubmodules
    block.TENorm = lambda config, hidden_size, eps=1e-5, **kw: torch.nn.LayerNorm(hidden_size, eps=eps)
    attention, mlp = _layer_specs()
    spec = ModuleSpec(module=stack, submodules=submodules(
        attention_layer=attention, mlp_layer=mlp, mamba_layer=ModuleSpec(module=MambaLayer)))
    init = getattr(MambaModel.__init__, "__wrapped__", MambaModel.__init__)
    params = inspect.signature(init).parameters
    if "hybrid_override_pattern" in params and "hybrid_layer_pattern" not in params:
        pattern_kw = {"hybrid_override_pattern": pattern}
    else:
        pattern_kw = {"hybrid_layer_pattern": pattern}
    torch.manual_seed(seed)
    return MambaModel(_config(group.size(), len(pattern)), mamba_stack_spec=spec, vocab_size=VOCAB,
                      max_sequence_length=64, position_embedding_type="rope",
                      pg_collection=pg_collection(group), **pattern_kw)


@pytest.fixture
def installed(world_of_one):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    try:
        yield world_of_one
    finally:
        sm.uninstall()
        parallel_state.destroy_model_parallel()


def test_mamba_model_is_converted_and_its_mamba_layers_accepted(installed):
    # Mamba's own context parallelism follows every layout (megatron/mamba.py; exactness in
    # test_megatron_mamba.py): its layers are not refused
    sm.install("striped")
    _mamba_model(installed, "M*-")
    model = _mamba_model(installed, "*-")
    assert any(isinstance(m, sm.ContextParallelAttention) for m in model.modules())
    sm.install("zigzag")
    _mamba_model(installed, "M*-")


class ForeignModel(torch.nn.Module):
    """A model class the plugin does not patch: its block is built from an unconverted spec."""

    def __init__(self, config, spec):
        super().__init__()
        from megatron.core.transformer.transformer_block import TransformerBlock

        self.decoder = TransformerBlock(config, spec)


def test_a_model_class_whose_layers_are_not_converted_is_refused_by_name(installed):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()  # before install: Megatron's own core attention
    sm.install("striped")
    with pytest.raises(ValueError, match=r"striped: ForeignModel builds its attention with DotProductAttention"):
        ForeignModel(_config(layers=2), spec)
    sm.uninstall()
    ForeignModel(_config(layers=2), spec)  # native: Megatron's own, untouched


def test_bert_is_refused_by_name(installed):
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    sm.install("zigzag")
    with pytest.raises(ValueError, match=r"zigzag: BertModel builds its attention with DotProductAttention"):
        BertModel(_config(layers=2), num_tokentypes=0, transformer_layer_spec=bert_layer_local_spec,
                  vocab_size=VOCAB, max_sequence_length=64)


def test_gated_delta_net_refusal_says_whether_megatron_has_cp_for_it(installed, monkeypatch):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from striped_sp.megatron import refusals

    attention, _ = _layer_specs()
    gdn = copy.deepcopy(attention)
    gdn.submodules.self_attention = ModuleSpec(module=GatedDeltaNet)
    block = TransformerBlockSubmodules(layer_specs=[attention, gdn])
    monkeypatch.setattr(refusals, "_cp_size", lambda model: 2)
    expected = r"GPTModel has gated delta net \('G'\) layers; megatron-core \S+ itself has no context parallel"
    for algo in ("striped", "zigzag"):
        sm.install(algo)
        if megatron_core_line() < (0, 18):
            with pytest.raises(ValueError, match=expected):
                GPTModel(_config(layers=2), block, vocab_size=VOCAB, max_sequence_length=64)
        else:  # megatron-core's own GDN context parallelism, in the layout's order (megatron/gdn.py)
            GPTModel(_config(layers=2), block, vocab_size=VOCAB, max_sequence_length=64)


def test_sparse_attention_is_refused_not_swapped_for_dense(installed):
    from megatron.core.transformer.spec_utils import ModuleSpec

    try:
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention
    except ImportError as exc:
        pytest.skip(f"megatron-core's DSAttention does not import here: {exc}")

    from striped_sp.megatron.spec import replace_core_attention

    attention, _ = _layer_specs()
    dsa = replace_core_attention(attention, ModuleSpec(module=DSAttention))
    if megatron_core_line() < (0, 19):
        expected = r"DeepSeek sparse attention .* megatron-core \S+ itself has no context parallelism"
    else:
        expected = r"DeepSeek sparse attention .*all-gather.* native"
    with pytest.raises(ValueError, match=expected):
        sm.patch_layer_spec(dsa, "striped")


# ---------------------------------------------------------------- MambaModel at CP=2, exact


def check_mamba_model_exact(algo, seed):
    from megatron.core import parallel_state

    from striped_sp.megatron.toy import single_rank_group

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    alone, group = single_rank_group(), parallel_state.get_context_parallel_group()
    sm.install(algo)
    ref = _mamba_model(alone, "*-*-", seed=seed)
    use_reference_attention(ref, ref.config)
    model = _mamba_model(group, "*-*-", seed=seed)
    assert any(isinstance(m, sm.ContextParallelAttention) for m in model.modules())
    check_dense_row(model, ref, algo, group, seed, VOCAB, SEQ)
    sm.uninstall()


CASES = [("mamba-model-striped", check_mamba_model_exact, ("striped", SEED))]
_results = {}


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_mamba_model_on_2_ranks(name):
    if not _results:
        _results.update(run_cases(2, CASES))
    assert _results[name] is None, _results[name]
