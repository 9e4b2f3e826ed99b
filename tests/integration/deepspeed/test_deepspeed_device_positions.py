"""DeepSpeed's rotary index (deepspeed/packed.py ``device_positions``): the layout's positions of a
rank, built once per batch and placed on the device the attention runs on (a CPU index on a GPU run
would fail in the rotary gather, or copy every layer).  The device here is ``meta`` (shapes only),
so a lost ``.to(device)`` shows without a GPU."""

from __future__ import annotations

import torch

import striped_sp
from striped_sp.deepspeed import packed


def test_device_positions_are_on_the_device_asked_for():
    packed.device_positions.cache_clear()
    try:
        bounds = (0, 8, 24)
        on_cpu = packed.device_positions(24, 2, 1, "zigzag", bounds, torch.device("cpu"))
        want = striped_sp.positions(24, 2, 1, "zigzag", list(bounds))
        assert on_cpu.device.type == "cpu" and on_cpu.dtype == torch.int64 and torch.equal(on_cpu, want)
        on_meta = packed.device_positions(24, 2, 1, "zigzag", bounds, torch.device("meta"))
        assert on_meta.device.type == "meta", on_meta.device
        assert on_meta.dtype == torch.int64 and on_meta.shape == want.shape
        # built once per (batch, rank, device): every layer of the batch gets the same tensor
        assert packed.device_positions(24, 2, 1, "zigzag", bounds, torch.device("meta")) is on_meta
    finally:
        packed.device_positions.cache_clear()
