"""``install(algo)`` / ``uninstall()``: make Megatron's own code follow a striped_sp layout.

Patched (each function in the module that defines it *and* in every loaded module that
imported it by name, so ``from x import f`` copies follow too):

* rotary positions: ``get_pos_emb_on_this_cp_rank`` (RotaryEmbedding, YaRN and multimodal
  rotary import it by name), plus a CPU fallback for RoPE's ``torch.cuda.current_device()``;
  ``apply_rotary_pos_emb`` for packed THD rows (positions inside each document, in the layout);
* batch slicing: ``megatron.core.utils.get_batch_on_this_cp_rank`` and
  ``get_thd_batch_on_this_cp_rank``, and their copies in ``megatron.training`` and
  pretrain_gpt.py when loaded; hybrid-CP slicing refuses;
* the GPT spec providers (local, Transformer Engine, decoder block, decoder layers, MTP
  block): every ``core_attention`` they return becomes ``ContextParallelAttention(algo)``;
  ``GPTModel.__init__`` (and ``HybridModel.__init__``, megatron-core >= 0.18, and
  ``MambaModel.__init__`` before it) does the same to whatever layer, stack and MTP specs it is
  given; the layers the algo cannot run are then refused by name (:mod:`.refusals`: layers
  megatron-core has no CP for, sparse attention); ``TransformerLayer.__init__`` refuses any core attention not ours, naming the model
  class being built (T5, BERT, vision encoders: specs no hook converts);
* Mamba's context parallelism: ``_undo_attention_load_balancing`` / ``_redo_...`` in
  ``megatron.core.ssm.mamba_context_parallel`` put the sequence in order by the layout's
  permutation, dense and packed rows (:mod:`.mamba`);
* gated delta net's context parallelism (megatron-core 0.18+): the same undo / redo names in the
  GDN module, and 0.19's packed-row permutation ``_build_thd_cp_a2a_perm`` (:mod:`.gdn`);
* MTP's ``roll_tensor``: rolls along the global sequence in the layout;
* multi-latent attention without Transformer Engine: the MLA module's ``HAVE_TE`` (:mod:`.mla`);
* ``megatron.training.arguments.validate_args`` (when importable): also runs our checks.

``install`` is idempotent; calling it with another algo switches the algo.  ``uninstall``
restores every original object and is idempotent too.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from typing import Callable

import torch

from . import data, gdn, mamba, mla, refusals, report, rope
from .arguments import check_algo, note_layout, validate_args as _validate_striped_args
from .spec import patch_layer_spec
from .version import check_supported

__all__ = ["install", "uninstall", "installed_algo"]

# module-level: the patches replace attributes of Megatron's modules for the whole process, so the
# algo they follow and the originals to restore are process-wide too (install / uninstall)
_STATE: dict = {"algo": None, "backend": "auto", "patches": [], "announced": False}
_LOG = logging.getLogger("striped_sp.megatron")

#: top-level (non-``megatron.*``) modules of Megatron-LM that import these functions by name
_SCRIPT_MODULES = ("pretrain_gpt", "pretrain_mamba", "gpt_builders", "model_provider", "__main__", "__mp_main__")

_SPEC_PROVIDERS = (
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
    "get_gpt_decoder_layer_specs",
    "get_gpt_decoder_block_spec",
    "get_gpt_mtp_block_spec",
)


def installed_algo() -> str | None:
    """The algo installed now, or ``None``."""
    return _STATE["algo"]


# ---------------------------------------------------------------- replacements (read _STATE)

# A module imported after install() keeps these replacements after uninstall(): they then call
# the Megatron function they replaced.

def _rope_slice(pos_emb, seq_dim, cp_group):
    if _STATE["algo"] is None:
        return _rope_slice.__striped_sp_original__(pos_emb, seq_dim, cp_group)
    return rope.get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group, algo=_STATE["algo"])


def _batch_slice(batch, *args, **kwargs):
    """megatron-core's ``get_batch_on_this_cp_rank``: ``(batch, cp_group=None)`` up to 0.17;
    ``(batch, is_hybrid_cp, cp_group=None, hybrid_cp_group_func=None, ...)`` from 0.18, where the
    batch may also hold a packed row (``cu_seqlens``)."""
    original = _batch_slice.__striped_sp_original__
    if _STATE["algo"] is None:
        return original(batch, *args, **kwargs)
    bound = inspect.signature(original).bind(batch, *args, **kwargs).arguments
    if bound.get("is_hybrid_cp"):
        _refuse("hybrid context parallelism")()
    # use_per_sequence_balancing (0.19) picks zigzag's per-document split; the algo's layout decides.
    return data.get_batch_on_this_cp_rank(batch, algo=_STATE["algo"], cp_group=bound.get("cp_group"))


def _thd_batch_slice(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, cp_size=None, cp_rank=None):
    if _STATE["algo"] is None:
        return _thd_batch_slice.__striped_sp_original__(batch, cu_seqlens, cu_seqlens_padded, max_seqlen,
                                                        cp_size=cp_size, cp_rank=cp_rank)
    return data.get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded, max_seqlen,
                                              cp_size, cp_rank, algo=_STATE["algo"])


def _rope_apply_wrapper(original):
    params = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        bound = params.bind(*args, **kwargs)
        cu = bound.arguments.get("cu_seqlens")
        if _STATE["algo"] is None or cu is None:
            return original(*args, **kwargs)
        cp_group = bound.arguments.get("cp_group")
        if cp_group is None:
            from megatron.core import parallel_state

            cp_group = parallel_state.get_context_parallel_group()
        return rope.apply_rotary_pos_emb_thd(
            bound.arguments["t"], cu, bound.arguments["freqs"], bound.arguments["config"], cp_group,
            mscale=bound.arguments.get("mscale", 1.0), algo=_STATE["algo"],
        )

    return wrapper


def _mtp_roll(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
    if _STATE["algo"] is None:
        return _mtp_roll.__striped_sp_original__(tensor, shifts, dims, cp_group, packed_seq_params)
    return data.roll_tensor(
        tensor, shifts=shifts, dims=dims, cp_group=cp_group,
        packed_seq_params=packed_seq_params, algo=_STATE["algo"],
    )


def _refuse(what: str) -> Callable:
    def refuse(*args, **kwargs):
        raise ValueError(
            f"--context-parallel-algo {_STATE['algo']} does not support {what} yet: "
            "use --context-parallel-algo native"
        )

    return refuse


def _spec_wrapper(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        spec = fn(*args, **kwargs)
        if _STATE["algo"] is None:
            return spec
        if isinstance(spec, list):
            return [patch_layer_spec(s, _STATE["algo"], _STATE["backend"]) for s in spec]
        return patch_layer_spec(spec, _STATE["algo"], _STATE["backend"])

    return wrapper


def _model_init_wrapper(init, spec_args=("transformer_layer_spec", "mtp_block_spec"), check=None):
    """A model's ``__init__`` that runs its layer / stack / MTP specs through
    ``patch_layer_spec``, so that specs from any source (``--spec``, heterogeneous or inference
    specs, user code) follow; ``check(model)`` then refuses layers the layout cannot run."""
    params = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        if _STATE["algo"] is not None:
            bound = params.bind(self, *args, **kwargs)
            for name in spec_args:
                if bound.arguments.get(name) is not None:
                    bound.arguments[name] = patch_layer_spec(bound.arguments[name], _STATE["algo"], _STATE["backend"])
            args, kwargs = bound.args[1:], bound.kwargs
        init(self, *args, **kwargs)
        if _STATE["algo"] is not None and check is not None:
            check(self)
        if _STATE["algo"] is not None:
            _announce(self)

    return wrapper


def _announce(model) -> None:
    """The setup line (:func:`.report.setup_line`), once per install, on global rank 0 (the
    convention of megatron-core's ``log_single_rank``)."""
    if _STATE["announced"]:
        return
    line = report.setup_line(model, _STATE["algo"])
    if line is None:
        return
    _STATE["announced"] = True
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or torch.distributed.get_rank() == 0:
        _LOG.info(line)


def _check_model(model) -> None:
    refusals.check_model_layers(model, _STATE["algo"])


def _layer_init_wrapper(init):
    """``TransformerLayer.__init__`` that refuses, once built, any core attention not ours:
    the layer came from a spec no hook converted (a model class the plugin does not patch)."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if _STATE["algo"] is not None:
            refusals.check_layer_attention(self, _STATE["algo"])

    return wrapper


def _validate_wrapper(fn):
    @functools.wraps(fn)
    def wrapper(args, *rest, **kwargs):
        note_layout(args)  # before Megatron's argument dump, which fn prints
        out = fn(args, *rest, **kwargs)
        _validate_striped_args(args)
        return out

    return wrapper


# ---------------------------------------------------------------- patching machinery

def _loaded_modules():
    for name, mod in list(sys.modules.items()):
        if mod is None:
            continue
        if name == "megatron" or name.startswith("megatron.") or name in _SCRIPT_MODULES:
            yield mod


def _set(owner, attr: str, value) -> None:
    _STATE["patches"].append((owner, attr, owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)))
    setattr(owner, attr, value)


def _replace_everywhere(original, replacement) -> None:
    """Point every loaded Megatron module attribute that *is* ``original`` at ``replacement``."""
    replacement.__striped_sp_original__ = original
    for mod in _loaded_modules():
        try:
            names = [k for k, v in vars(mod).items() if v is original]
        except TypeError:
            continue
        for name in names:
            _set(mod, name, replacement)


def _wrap_function(module_name: str, attr: str, make: Callable) -> None:
    try:
        mod = importlib.import_module(module_name)
    except ImportError:
        return
    original = getattr(mod, attr, None)
    if original is None:
        return
    _replace_everywhere(original, make(original))


def _wrap_method(cls, attr: str) -> None:
    if attr in cls.__dict__:
        _set(cls, attr, rope.cpu_fallback(cls.__dict__[attr]))


def _clear_rope_caches() -> None:
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    for cls in (rotary_pos_embedding.RotaryEmbedding, yarn_rotary_pos_embedding.YarnRotaryEmbedding):
        fwd = cls.__dict__.get("forward")
        if hasattr(fwd, "cache_clear"):
            fwd.cache_clear()


def _apply() -> None:
    # Load the modules that import the patched functions by name first, so their copies follow.
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import megatron.core.transformer.attention  # noqa: F401
    import megatron.core.transformer.multi_token_prediction  # noqa: F401
    from megatron.core.models.common.embeddings import (
        rope_utils,
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )

    # Rotary positions, and RoPE on CPU.
    _replace_everywhere(rope_utils.get_pos_emb_on_this_cp_rank, _rope_slice)
    _wrap_function("megatron.core.models.common.embeddings.rope_utils", "apply_rotary_pos_emb",
                   _rope_apply_wrapper)
    for cls in (
        rotary_pos_embedding.RotaryEmbedding,
        rotary_pos_embedding.MultimodalRotaryEmbedding,
        yarn_rotary_pos_embedding.YarnRotaryEmbedding,
    ):
        _wrap_method(cls, "__init__")
        _wrap_method(cls, "get_emb")

    # Batch slicing (megatron.training and pretrain_gpt.py import it by name).
    for name in ("megatron.training.utils", "megatron.training.arguments"):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - megatron.training is optional
            pass
    import megatron.core.utils as core_utils

    _replace_everywhere(core_utils.get_batch_on_this_cp_rank, _batch_slice)
    if hasattr(core_utils, "get_thd_batch_on_this_cp_rank"):
        _replace_everywhere(core_utils.get_thd_batch_on_this_cp_rank, _thd_batch_slice)
    if hasattr(core_utils, "get_batch_on_this_hybrid_cp_rank"):
        _replace_everywhere(core_utils.get_batch_on_this_hybrid_cp_rank, _refuse("hybrid context parallelism"))

    # Spec providers.
    for attr in _SPEC_PROVIDERS:
        _wrap_function("megatron.core.models.gpt.gpt_layer_specs", attr, _spec_wrapper)

    # Every GPT model built while installed, whatever its spec's source.
    from megatron.core.models.gpt.gpt_model import GPTModel

    _set(GPTModel, "__init__", _model_init_wrapper(GPTModel.__dict__["__init__"], check=_check_model))
    try:  # megatron-core >= 0.18 (GPTModel's successor): its stack spec holds layers and MTP
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:
        HybridModel = None
    if HybridModel is not None:
        _set(HybridModel, "__init__", _model_init_wrapper(
            HybridModel.__dict__["__init__"], ("hybrid_stack_spec",), _check_model))
    try:  # megatron-core 0.16 / 0.17's hybrid model (pretrain_mamba.py); later a HybridModel subclass
        from megatron.core.models.mamba.mamba_model import MambaModel
    except ImportError:
        MambaModel = None
    if MambaModel is not None and (HybridModel is None or not issubclass(MambaModel, HybridModel)):
        _set(MambaModel, "__init__", _model_init_wrapper(
            MambaModel.__dict__["__init__"], ("mamba_stack_spec",), _check_model))
    # Any other model (T5, BERT, vision encoders, user classes): its layers' specs are not
    # converted, so a layer built with a core attention not ours is refused, naming the model.
    from megatron.core.transformer.transformer_layer import TransformerLayer

    _set(TransformerLayer, "__init__", _layer_init_wrapper(TransformerLayer.__dict__["__init__"]))

    # Mamba's context parallelism: its sequence order for the conv and scan follows the layout.
    mamba.patch_context_parallel(_set, installed_algo)
    # Gated delta net's context parallelism (megatron-core 0.18+): the same, dense and packed rows.
    gdn.patch_context_parallel(_set, installed_algo)

    # Multi-latent attention on the local spec without Transformer Engine (megatron-core 0.16.1).
    fix = mla.te_flag_fix()
    if fix is not None:
        _set(*fix)

    # MTP roll.
    from megatron.core.transformer import multi_token_prediction

    _replace_everywhere(multi_token_prediction.roll_tensor, _mtp_roll)

    # Argument checks, when megatron.training is there.
    if "megatron.training.arguments" in sys.modules:
        _wrap_function("megatron.training.arguments", "validate_args", _validate_wrapper)


def install(algo: str = "striped", backend: str = "auto") -> None:
    """Patch Megatron so that its RoPE, data path, specs and MTP follow ``algo``'s layout.

    ``algo`` is ``striped``, ``zigzag`` or ``ring`` (or a striped layout key such as
    ``"striped:stripe=4,place=auto"``: :func:`~striped_sp.megatron.algo_of` of the parsed
    arguments); ``native`` uninstalls.  Idempotent;
    calling it again with another algo switches the algo everywhere.  A megatron-core release
    outside the tested range (:mod:`.version`) raises ``ValueError`` naming it and the override.
    """
    check_algo(algo)
    if algo == "native":
        uninstall()
        return
    check_supported()
    _STATE["backend"] = backend
    _STATE["announced"] = False  # the next model built says how it runs
    if _STATE["algo"] is None:
        _STATE["algo"] = algo
        try:
            _apply()
        except BaseException:
            uninstall()
            raise
    else:
        _STATE["algo"] = algo
    _clear_rope_caches()


def uninstall() -> None:
    """Undo :func:`install`: every patched attribute gets its original object back."""
    patches = _STATE["patches"]
    while patches:
        owner, attr, original = patches.pop()
        setattr(owner, attr, original)
    if _STATE["algo"] is not None:
        _STATE["algo"] = None
        _clear_rope_caches()
