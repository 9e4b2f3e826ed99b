"""A state-passing mixer layer on the CUDA dry run (issue 55), as test_split_mixer_dry_run.py does for the
head all-to-all: after the batch's first layer, a layer does no host-to-device copy, no synchronisation
and reads no device value on the host; its only collectives are its own: the re-layout's all-to-all each
way and the halo / summary all-gathers, forward, and their mirrors backward.

``$STRIPED_SP_MIXER_MODE=state`` runs state passing where the heads divide too.  Seen failing with the
chunk plan's device tensors made per layer (``ContiguousChunks.on`` without its per-device cache): 16 to 32
copies per layer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from striped_sp.bench.host_work import HostWork  # noqa: E402
from test_split_mixer_dry_run import _layer, _wrapped, fake_group  # noqa: E402,F401 - the fixture too

#: kind -> all-gathers per forward (the convolution's halo, then the fold's summaries)
GATHERS = {"gated_delta": 2, "mamba2": 2, "short_conv": 1}


@pytest.mark.parametrize("kind", sorted(GATHERS))
def test_a_later_state_passing_layer_copies_and_syncs_nothing(fake_group, kind, monkeypatch):  # noqa: F811
    from striped_sp.deepspeed.hybrid import MODE_ENV
    from striped_sp.engine import state_passing

    monkeypatch.setenv(MODE_ENV, "state")
    calls = []
    exchange, gather = state_passing._exchange, state_passing._all_gather_flat
    monkeypatch.setattr(state_passing, "_exchange", lambda x, *a: calls.append(("all_to_all", x.device.type))
                        or exchange(x, *a))
    monkeypatch.setattr(state_passing, "_all_gather_flat", lambda out, x, group=None: calls.append(
        ("all_gather", x.device.type)) or gather(out, x, group=group))
    _, forward = _wrapped(kind, fake_group)
    with HostWork():
        _layer(forward)  # the batch's first layer: the plan's tensors reach the device here
    calls.clear()
    with HostWork() as later:
        grad = _layer(forward)
    assert grad is not None and grad.shape[-1] == 128
    gathers = GATHERS[kind]
    # forward: to chunks, the gathers, back to the layout; backward: the all-to-alls again (mirrored)
    assert sorted(calls) == sorted([("all_to_all", "meta")] * 4 + [("all_gather", "meta")] * gathers), calls
    assert later.copies == 0, later.copies
    assert dict(later.syncs) == {}, later.syncs
    assert later.data_dependent == 0, later.data_dependent
    # c10d ops: 4 all-to-alls, the all-gathers forward and their all-reduces backward (no reduce-scatter here)
    assert later.comm == 4 + 2 * gathers, later.comm
