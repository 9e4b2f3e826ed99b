"""``striped-sp bench overhead``: the host work of a batch and of a layer, per layout, ring size,
row length and row kind: what the engine costs beside its attention kernels.

For every (layout, N, tokens, row) it measures rank 0 of N, with 1 head of dim 8 (kernels are
cheap or skipped) on one CPU thread:

* **per batch**: the plan: :meth:`~striped_sp.engine.request.RingRequest.prepare` (the mask, the
  placement of documents, the :class:`~striped_sp.plan.ring_plan.HostPlan` of rank 0) and
  :func:`~striped_sp.plan.ring_plan.compile_plan` for the path's kernel and device (programs, the
  arena's one copy); every cache of the planners emptied first, median of ``--reps``;
* **per layer**, forward + backward, after the batch's first layer (which compiles the plan): what
  :meth:`RingRequest.__call__ <striped_sp.engine.request.RingRequest.__call__>` runs once its
  arguments are checked: the plan from the plan cache and
  :class:`~striped_sp.engine.autograd.RingAttention` over a
  :class:`~striped_sp.engine.transport.TorchTransport` on PyTorch's fake process group (rank 0 of N;
  the other ranks are not run, a transfer returns empty buffers of the right shape).  A dispatch
  mode (:class:`HostWork`) counts the aten ops (attention kernel calls apart), host-to-device
  copies and synchronisations; the host time is the layer's time without it, on the CPU clock of
  the one thread (:func:`.common.clock_for`: other load does not inflate it; wall time on a GPU),
  less the time inside shape-only attention ops (median of ``--reps``).

Two paths:

* ``cpu``: PyTorch's CPU flash op on CPU tensors, as the ring runs on a CPU (``ScheduledCall``
  programs); the two attention ops return shape-only outputs (:class:`ShapeOnlyAttention`), so the
  time is everything but the attention compute;
* ``cuda``: the CUDA branch (PyTorch's flash op, the bf16 choice on sm80+: ``NativeCall`` varlen
  programs).  With CUDA (``--device cuda``) on the GPU itself: the host time is the wall time up
  to the return, before the device is synchronised.  Without it, the counts come from a dry run on
  meta tensors (where a copy to the device or a synchronisation shows as on a GPU), and the host
  time from the same branch on CPU tensors with shape-only attention ops (an upper bound: the other
  ops compute on 1 x 8 heads): meta tensors' own implementations of some ops (``logaddexp(out=)``,
  ``lerp_``) are Python decompositions a hundred times slower than a kernel launch, so their wall
  time would say nothing of the host.

Rows: ``dense`` (one causal document), ``packed`` (the web mix, lognormal median 1024 sigma 1.2,
:mod:`.docs`; zigzag pads every document to a multiple of 2N), ``window`` (one document, a window
``(W, 0)``).  :func:`targets` compares the records with the issue's targets.
"""

from __future__ import annotations

# the parts, one job a module; every name importable from here before the split stays importable from here
from .common import sync as _sync
from .cli_args import _sizes
from .host_work import KERNEL_OPS, SYNCING, HostWork, _host_to_device
from .kernel_standins import CudaBranch, ShapeOnlyAttention, _cuda_branch_on_cpu, _key, _meta_like, shape_only_attention
from .overhead_cli import COLUMNS, DESCRIPTION, _main, register
from .overhead_measure import (DEFAULT_LAYOUTS, PATH_OPS, ROWS, WEB_MIX, OverheadConfig, _clear_plans, _config,
                               _env, _fake_world, _Layer, _layer_counts, _layer_time, _Path, _paths, _plan_times,
                               _profile, _request, _window_groups, measure)
from .overhead_targets import CPU_TARGETS, GPU_OP_TARGETS, PLAN_TARGET, _target, _tok, targets

__all__ = ["OverheadConfig", "HostWork", "ShapeOnlyAttention", "shape_only_attention", "CudaBranch", "measure",
           "targets", "register", "ROWS", "DEFAULT_LAYOUTS", "WEB_MIX", "KERNEL_OPS", "SYNCING"]
