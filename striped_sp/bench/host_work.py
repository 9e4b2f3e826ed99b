"""Counting a layer's host work, op by op: :class:`HostWork`, a dispatch mode that counts the aten ops
(attention kernel calls apart), views, host-to-device copies and synchronisations that would cost the
host on a GPU (``striped-sp bench overhead``; the tests' dry runs on meta tensors count with it too).
"""

from __future__ import annotations

import collections

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostWork", "KERNEL_OPS", "SYNCING"]

#: aten ops that are attention kernels (a kernel launch each on a GPU)
KERNEL_OPS = ("_scaled_dot_product_", "_flash_attention_", "_efficient_attention_")
#: aten ops that read a device value on the host or have a data-dependent shape: a synchronisation on a GPU
SYNCING = ("aten._local_scalar_dense", "aten.nonzero", "aten.unique", "aten.masked_select",
           "aten.repeat_interleave.Tensor", "aten._unique2", "aten.item")


class HostWork(TorchDispatchMode):
    """Counts, per aten op, what would cost the host on a GPU: every op (attention kernels apart,
    per pass), views, copies from host memory to a device, synchronisations (an op of
    :data:`SYNCING` on a device tensor: a device value read on the host, a data-dependent shape)
    and every op of :data:`SYNCING` on any tensor (``data_dependent``).  ``phase``: the pass being
    counted (set by the caller).  A tensor made from host data straight on a device
    (``torch.tensor(values, device=...)``, ``as_tensor``, ``asarray``) is a copy too: its copy runs
    below Python dispatch, so a function mode beside this one counts it (``host_data``)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.kernels = collections.Counter()  # per phase
        self.views = 0
        self.copies = 0
        self.syncs = collections.Counter()
        self.data_dependent = 0
        self.host_data = 0
        self.phase = "forward"
        self._made = _HostData(self)

    def __enter__(self) -> "HostWork":
        self._made.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._made.__exit__(*exc)

    @property
    def total(self) -> int:
        """aten ops (the process group's own ``c10d`` ops apart: :attr:`comm`)."""
        return sum(c for name, c in self.ops.items() if name.startswith("aten."))

    @property
    def comm(self) -> int:
        return sum(c for name, c in self.ops.items() if name.startswith("c10d."))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        self.ops[name] += 1
        if any(k in name for k in KERNEL_OPS):
            self.kernels[self.phase] += 1
        if func.is_view:
            self.views += 1
        if _host_to_device(name, args, kwargs):
            self.copies += 1
        if name.startswith(SYNCING):
            self.data_dependent += 1
            if any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in (*args, *kwargs.values())):
                self.syncs[name] += 1
        return func(*args, **kwargs)


class _HostData(TorchFunctionMode):
    """Counts, in ``work``, the tensors made from host data (not a tensor) on a device that is not the host's."""

    MAKERS = (torch.tensor, torch.as_tensor, torch.asarray)

    def __init__(self, work: HostWork):
        super().__init__()
        self.work = work

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.MAKERS and args and not isinstance(args[0], torch.Tensor):
            device = kwargs.get("device")  # keyword-only in all three
            if device is not None and torch.device(device).type != "cpu":
                self.work.copies += 1
                self.work.host_data += 1
        return func(*args, **kwargs)


def _host_to_device(name: str, args, kwargs) -> bool:
    if name.startswith("aten._to_copy"):
        target = kwargs.get("device")
        return target is not None and torch.device(target).type != "cpu" and args[0].device.type == "cpu"
    if name.startswith("aten.copy_"):
        return args[0].device.type != "cpu" and args[1].device.type == "cpu"
    return False
