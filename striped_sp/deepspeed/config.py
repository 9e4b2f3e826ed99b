"""The ``context_parallel`` section of a DeepSpeed JSON config, and ``sequence_parallel_size``.

```json
{"sequence_parallel_size": 2, "context_parallel": {"algo": "striped", "backend": "auto", "timeout_s": 600,
                                                    "stripe_size": 1, "doc_placement": "split", "order": "round"}}
```

``stripe_size`` (int >= 1, ``"doc"``: per-document stripes, or ``"auto"``: per batch the plan the
cost model predicts fastest, :mod:`striped_sp.plan.search`) and ``doc_placement`` (``"split"``, ``"auto"`` or the longest document, an
int >= 1, kept whole on one rank) and ``order`` (``"round"``: stripe ``g`` to rank ``g mod N``, the
paper's; ``"mirror"``: ranks ``0..N-1`` then ``N-1..0``, zigzag's order, with an integer ``stripe_size``)
are the striped layout's parameters
(:class:`striped_sp.plan.layouts.Striped`), for ``algo="striped"`` only; ``layout`` is then one key such
as ``"striped:stripe=4,place=auto"`` that the data loader, the HF attention and
``DistributedAttention`` all take.

``sequence_parallel_size`` is DeepSpeed's own key (default 1); the ``context_parallel`` section is
ours.  The section is validated with DeepSpeed's pydantic config-model machinery
(:class:`deepspeed.runtime.config_utils.DeepSpeedConfigModel`: unknown keys are refused, ``"auto"``
means the default); every problem is re-raised as a ``ValueError`` that names the key and the rule.
Nothing here communicates.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from ..engine.ulysses import check_ulysses
from ..kernels import BACKENDS
from ..plan.layouts import ALGOS as LAYOUT_ALGOS, get_layout
from ..plan.mirror import check_order
from ..plan.placement import check_placement, check_stripe_size

__all__ = ["SECTION", "ALGOS", "ContextParallelSettings", "parse_config", "load_config", "check_requested"]

SECTION = "context_parallel"
#: config ``algo`` -> core layout name (the one table, :data:`striped_sp.plan.layouts.ALGOS`)
ALGOS = LAYOUT_ALGOS


@dataclasses.dataclass(frozen=True)
class ContextParallelSettings:
    """The parsed settings: ``layout`` is the core layout name for ``algo``."""

    sequence_parallel_size: int = 1
    algo: str = "striped"
    backend: str = "auto"
    #: hierarchical CP: a Ulysses all-to-all over heads inside groups of this many consecutive SP
    #: ranks, the ring across them (1: the plain ring; sequence_parallel_size: pure Ulysses)
    ulysses_size: int = 1
    #: the ring timeout in seconds (:func:`striped_sp.engine.transport.set_ring_timeout`, applied when the model is
    #: adapted); ``None``: ``$STRIPED_SP_RING_TIMEOUT_S`` or 600
    timeout_s: float | None = None
    #: calibrate the kernel's cost model for ``auto`` choices on global rank 0 when the model
    #: is adapted, and adopt it on every rank (:func:`striped_sp.calibrate_cost_model`)
    calibrate: bool = False
    #: striped only: tokens dealt to ranks in stripes of this many (1: token by token); ``None`` (not
    #: given): the layout's default (striped: the per-batch search, :class:`~striped_sp.plan.layouts.Striped`)
    stripe_size: int | str | None = None
    #: striped only, packed rows: ``"split"`` (every document striped), ``"auto"`` or an int (documents
    #: of at most that many tokens kept whole on one rank, dealt by a balancing solver); ``None``: the default
    doc_placement: str | int | None = None
    #: striped only: ``"round"`` or ``"mirror"`` (:func:`~striped_sp.plan.mirror.check_order`); ``None``: round
    order: str | None = None
    #: not a JSON key: the striped default's window hint, set from a transformers model's
    #: ``sliding_window`` and ``layer_types`` where the model is adapted (:mod:`.window_hint`):
    #: the window in tokens and one global layer in every ``global_every`` (``None``: none)
    window: int | None = None
    global_every: int | None = None

    @property
    def layout(self) -> str:
        """The core layout key: ``"striped"`` (the default: per packed batch the plan the cost model
        predicts fastest), ``"striped:window=4096,global_every=6"`` (the default with a model's window
        hint), ``"zigzag"``, ``"contiguous"``, or with the striped parameters given e.g.
        ``"striped:stripe=4,place=auto"``, ``"striped:stripe=1"`` (pinned)."""
        if ALGOS[self.algo] != "striped":
            return ALGOS[self.algo]
        if self.order == "mirror":  # "round" is what every striped layout does unless told
            from ..plan.layouts import Striped

            return Striped(stripe_size=self.stripe_size, doc_placement=self.doc_placement, order=self.order).key
        if self.stripe_size is None and self.doc_placement is None:
            if self.window is None:
                return ALGOS[self.algo]
            from ..plan.layouts import Striped

            return Striped(window=self.window, global_every=self.global_every).key
        return get_layout(ALGOS[self.algo], self.stripe_size, self.doc_placement).key

    @property
    def enabled(self) -> bool:
        return self.sequence_parallel_size > 1


# module-level: the pydantic model class, built once on first use because deepspeed is imported lazily
_MODEL_CLASS = None


def _pydantic():
    """pydantic (a DeepSpeed dependency), or an ``ImportError`` naming the extra that installs it."""
    try:
        import pydantic
    except ImportError as err:
        raise ImportError("striped_sp.deepspeed.parse_config validates the context_parallel section with "
                          "DeepSpeed's pydantic config models, and pydantic is missing: "
                          "pip install 'striped_sp[deepspeed]'") from err
    return pydantic


def _model_class():
    """The pydantic model of the section, built on first use (deepspeed is imported lazily)."""
    global _MODEL_CLASS
    if _MODEL_CLASS is None:
        from typing import Literal, Optional, Union

        pydantic = _pydantic()
        try:
            from deepspeed.runtime.config_utils import DeepSpeedConfigModel
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "striped_sp.deepspeed needs DeepSpeed: pip install 'striped_sp[deepspeed]'"
            ) from err

        class ContextParallelConfig(DeepSpeedConfigModel):
            """``context_parallel``: ``algo`` (striped / zigzag / ring) and the kernel ``backend``."""

            algo: Literal[tuple(ALGOS)] = "striped"  # type: ignore[valid-type]
            backend: Literal[BACKENDS] = "auto"  # type: ignore[valid-type]
            ulysses_size: pydantic.StrictInt = pydantic.Field(default=1, ge=1)
            timeout_s: Optional[float] = pydantic.Field(default=None, gt=0, allow_inf_nan=False)
            calibrate: pydantic.StrictBool = False
            #: these two are listed for the allowed keys and checked by _striped_value (DeepSpeed's models
            #: read "auto" as "the default", and "auto" is a placement of its own here)
            stripe_size: Union[str, int] = 1
            doc_placement: Union[str, int] = "split"
            order: str = "round"

        _MODEL_CLASS = ContextParallelConfig
    return _MODEL_CLASS


def load_config(config: Any) -> dict:
    """A DeepSpeed config given as a dict, or a path to a JSON file, as a dict."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config) as f:
            text = f.read()
        try:  # DeepSpeed reads its config files as hjson (JSON with comments); it depends on hjson
            import hjson

            loaded = hjson.loads(text)
        except ImportError:
            loaded = json.loads(text)
        if not isinstance(loaded, dict):
            raise ValueError(f"DeepSpeed config {config!s} must hold a JSON object, got {type(loaded).__name__}")
        return loaded
    raise ValueError(f"DeepSpeed config must be a dict or the path of a JSON file, got {config!r}")


def _sequence_parallel_size(config: Mapping, world_size: int | None) -> int:
    sp = config.get("sequence_parallel_size", 1)
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise ValueError(f"sequence_parallel_size={sp!r} must be a positive integer")
    if world_size is not None:
        if sp > world_size or world_size % sp != 0:
            raise ValueError(
                f"sequence_parallel_size={sp} must divide the world size ({world_size})"
            )
        dp = config.get("data_parallel_size")
        if dp is not None and dp * sp != world_size:
            raise ValueError(
                f"data_parallel_size={dp!r} times sequence_parallel_size={sp} must equal the world "
                f"size ({world_size})"
            )
    return sp


def check_requested(config: Mapping) -> None:
    """``ValueError`` naming both keys when the config has the ``context_parallel`` section but no
    ``sequence_parallel_size``: DeepSpeed would default it to 1 and train without context
    parallelism, without a word.  ``"sequence_parallel_size": 1`` written out (a reference run
    without it, as the examples make) passes.  Run by every entry point (``initialize``, the
    Trainers, ``enable_accelerate``) before any collective, not by :func:`parse_config`."""
    if config.get(SECTION) is not None and "sequence_parallel_size" not in config:
        raise ValueError(
            f"the DeepSpeed config has a \"{SECTION}\" section but no \"sequence_parallel_size\": DeepSpeed "
            "would run sequence_parallel_size=1, every rank a data-parallel replica, without context parallelism. "
            "Set \"sequence_parallel_size\" to the number of ranks that share a sequence (> 1, dividing the world "
            f"size), or write \"sequence_parallel_size\": 1 for a run without it")


def _describe(err) -> str:
    """One line per pydantic error, each naming the key and the rule."""
    allowed = ", ".join(_model_class().model_fields)
    lines = []
    for e in err.errors():
        key = ".".join([SECTION, *map(str, e["loc"])])
        if e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key; the allowed keys are {allowed}")
        else:
            lines.append(f"{key}={e.get('input')!r}: {e['msg']}")
    return "; ".join(lines)


def parse_config(config: Any, world_size: int | None = None) -> ContextParallelSettings:
    """Read ``sequence_parallel_size`` and the ``context_parallel`` section of a DeepSpeed config.

    ``config``: a dict or a JSON file path.  ``world_size``: when given, ``sequence_parallel_size``
    must divide it.  A missing section means the defaults (``algo="striped"``, ``backend="auto"``).
    Raises ``ValueError`` naming the key and the rule; ``ImportError`` naming the ``deepspeed`` extra
    when pydantic or DeepSpeed is missing.
    """
    pydantic = _pydantic()
    cfg = load_config(config)
    sp = _sequence_parallel_size(cfg, world_size)
    section = cfg.get(SECTION, {})
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ValueError(f"{SECTION} must be a JSON object (a dict), got {type(section).__name__}")
    bad_keys = [k for k in section if not isinstance(k, str)]
    if bad_keys:
        raise ValueError(f"{SECTION}: keys must be strings, got {bad_keys!r}")
    try:
        model = _model_class()(**{k: v for k, v in section.items() if k not in ("doc_placement", "stripe_size", "order")})
    except pydantic.ValidationError as err:
        raise ValueError(_describe(err)) from None
    u = int(model.ulysses_size)
    try:  # the engine's rule; the heads are checked with it again when the model runs (unknown here)
        check_ulysses(u, sp, heads=u, kv_heads=u)
    except ValueError as err:
        raise ValueError(f"{SECTION}.ulysses_size={u} with sequence_parallel_size={sp}: {err} "
                         "(Ulysses groups of ulysses_size ranks, a ring across them)") from None
    stripe = _striped_value(section, "stripe_size", None, check_stripe_size,
                            "a positive integer, 'doc' (per document: 2N stripes dealt to ranks 0..N-1, then back) "
                            "or 'auto' (per batch, the plan the cost model predicts fastest)")
    placement = _doc_placement(section, None)
    order = _striped_value(section, "order", None, check_order,
                           "'round' (stripe g to rank g mod N) or 'mirror' (ranks 0..N-1 then N-1..0, zigzag's order)")
    _check_striped_keys(model.algo, stripe, placement, order)
    settings = ContextParallelSettings(sequence_parallel_size=sp, algo=model.algo, backend=model.backend,
                                       ulysses_size=u, timeout_s=model.timeout_s, calibrate=model.calibrate,
                                       stripe_size=stripe, doc_placement=placement, order=order)
    if order is not None and ALGOS[model.algo] == "striped":
        try:  # the plan's rule: mirrored stripes need an int stripe size
            settings.layout
        except ValueError as err:
            raise ValueError(f"{SECTION}.order={order!r} with {SECTION}.stripe_size={stripe!r}: {err}") from None
    return settings


def _striped_value(section: Mapping, key: str, default, check, rule: str):
    """A striped layout parameter of the section (JSON numbers, not strings, for integers)."""
    value = section.get(key, default)
    if value is None and key not in section:
        return None  # not given: the layout's default (get_layout)
    try:
        return check(value)
    except ValueError:
        raise ValueError(f"{SECTION}.{key}={value!r} must be {rule}") from None


def _doc_placement(section: Mapping, default=None):
    """``doc_placement``: ``"split"``, ``"auto"`` or an int >= 1 (a JSON number, not a string);
    ``default`` when absent (``None``: the layout's, see :func:`~striped_sp.plan.layouts.get_layout`)."""
    return _striped_value(section, "doc_placement", default, check_placement,
                          "'split', 'auto' or a positive integer (the longest document kept whole on one rank)")


def _check_striped_keys(algo: str, stripe_size: int, placement, order=None) -> None:
    """``stripe_size`` / ``doc_placement`` / ``order`` are parameters of the striped layout: refused with
    another algo (the plan's rule, :func:`striped_sp.plan.layouts.get_layout`)."""
    for key, value, neutral in (("stripe_size", stripe_size, 1), ("doc_placement", placement, "split"),
                                ("order", order, "round")):
        if value is None or (value == neutral and ALGOS[algo] != "striped"):  # not given, or what any layout does
            continue
        try:
            if key == "order":
                if ALGOS[algo] != "striped":
                    raise ValueError("only 'striped' takes stripe / place / window / order parameters")
                continue
            get_layout(ALGOS[algo], **{key: value})
        except ValueError as err:
            raise ValueError(f"{SECTION}.{key}={value!r} applies to {SECTION}.algo='striped' only, not "
                             f"{algo!r} ({err}): drop it or use algo 'striped'") from None
