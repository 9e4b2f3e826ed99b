"""striped_sp: exact striped ring attention (context parallelism) for causal transformer training."""

from .engine.request import RingRequest, prepare_plans, ring_attention, striped_attention
from .plan.layouts import LAYOUTS, BlockCall, get_layout, positions, shard, unshard
from .plan.packing import PaddedDocuments, document_positions, pad_documents
from .engine.ulysses import ulysses_ring_groups
from .engine.calibration import calibrate_cost_model

__version__ = "0.1.0"

__all__ = [
    "ring_attention",
    "RingRequest",
    "prepare_plans",
    "striped_attention",
    "positions",
    "shard",
    "unshard",
    "get_layout",
    "LAYOUTS",
    "BlockCall",
    "pad_documents",
    "document_positions",
    "PaddedDocuments",
    "ulysses_ring_groups",
    "calibrate_cost_model",
]
