"""Megatron-LM / megatron-core adapter: ``--context-parallel-algo striped`` end to end.

Public pieces:

* :func:`add_arguments` (an ``extra_args_provider``), :func:`chain_providers`, :func:`validate_args`;
* :class:`ContextParallelAttention`: a megatron-core core-attention module running striped_sp;
* :func:`patch_layer_spec`: swap every core_attention of a layer / block / MTP spec;
* :func:`get_batch_on_this_cp_rank`, :func:`get_thd_batch_on_this_cp_rank`, :func:`roll_tensor`:
  the data path in a layout (packed THD rows and ``--reset-attention-mask`` documents included);
* :func:`install` / :func:`uninstall`: patch Megatron's own RoPE, batch slicing, spec providers
  and MTP roll so that an unmodified pretrain_gpt.py follows the layout.

megatron-core is imported only when a piece that needs it is used.
"""

from .arguments import ALGOS, DEFAULT_ALGO, add_arguments, algo_of, chain_providers, layout_of, validate_args
from .data import get_batch_on_this_cp_rank, get_thd_batch_on_this_cp_rank, roll_tensor
from .hooks import install, installed_algo, uninstall
from .rope import get_pos_emb_on_this_cp_rank

__all__ = [
    "ALGOS",
    "DEFAULT_ALGO",
    "add_arguments",
    "algo_of",
    "chain_providers",
    "layout_of",
    "validate_args",
    "ContextParallelAttention",
    "patch_layer_spec",
    "core_attention_spec",
    "get_batch_on_this_cp_rank",
    "get_thd_batch_on_this_cp_rank",
    "roll_tensor",
    "get_pos_emb_on_this_cp_rank",
    "install",
    "uninstall",
    "installed_algo",
]

_LAZY = {
    "ContextParallelAttention": ".attention",
    "patch_layer_spec": ".spec",
    "core_attention_spec": ".spec",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        try:
            mod = importlib.import_module(_LAZY[name], __name__)
        except ImportError as exc:
            if "megatron" in str(exc):
                raise ImportError(
                    f"striped_sp.megatron.{name} needs megatron-core: pip install 'striped_sp[megatron]'"
                ) from exc
            raise
        return getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
