"""megatron-core 0.18's packed gated delta net refusal (striped_sp/megatron/gdn.py) under the installed
megatron-core, whatever its version: the GDN modules of 0.18 (one ``gated_delta_net`` module with
``_unpack_sequence``, the packed path's per-document split) and of 0.19 (a package: ``common`` with the
order steps, ``gdn`` with ``_build_thd_cp_a2a_perm``) are faked in ``sys.modules``, the plugin's
``patch_context_parallel`` patches them, and the packed path runs under every algo.

0.18 refuses a packed row by name under every algo whose placement is not zigzag's (striped and its
forms, ring), and runs it as megatron-core does under zigzag and with no algo installed; dense rows
(the order steps) are not refused; 0.19 refuses nothing (its packed permutation follows the layout).
CI does not run 0.18: an inverted condition would pass everything else.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from striped_sp.megatron import gdn

_PACKAGE = "megatron.core.ssm.gated_delta_net"
REFUSING = ("striped", "striped:stripe=2", "striped:stripe=doc", "ring")  # algos without zigzag's placement
RUNNING = ("zigzag", None)  # zigzag's placement, and no algo installed (megatron-core's own path)


def _unpack_sequence(x, cu_seqlens, dim=1):
    """megatron-core 0.18's (gated_delta_net.py): the packed row split into its documents along ``dim``."""
    bounds = cu_seqlens.tolist()
    return [x[(slice(None),) * dim + (slice(a, b),)] for a, b in zip(bounds, bounds[1:])]


def _order_step(x, *args, **kwargs):
    return x


def _resolve_cu_seqlens(self, cu_seqlens_padded, cu_seqlens_actual, total_seq_len, name, cp_size=1):
    return cu_seqlens_padded, cp_size


_MEGATRONS_PERM = (torch.zeros(0), torch.zeros(0))


def _build_thd_cp_a2a_perm(cu_seqlens, cp_size, t):
    return _MEGATRONS_PERM  # megatron-core 0.19's zigzag permutation, as a sentinel


def _module(name, package=False, **attrs):
    module = types.ModuleType(name)
    if package:
        module.__path__ = []
    module.__dict__.update(attrs)
    return module


def _fake(version, monkeypatch):
    """The GDN modules of megatron-core ``version`` put in ``sys.modules``; returns them by short name."""
    steps = {"_undo_attention_load_balancing": _order_step, "_redo_attention_load_balancing": _order_step}
    if version == "0.18":
        cls = type("GatedDeltaNet", (), {"_resolve_cu_seqlens": _resolve_cu_seqlens})
        found = {"": _module(_PACKAGE, GatedDeltaNet=cls, _unpack_sequence=_unpack_sequence, **steps)}
    else:
        cls = type("_GDNBase", (), {"_resolve_cu_seqlens": _resolve_cu_seqlens})
        found = {"": _module(_PACKAGE, package=True), "common": _module(f"{_PACKAGE}.common", _GDNBase=cls, **steps),
                 "gdn": _module(f"{_PACKAGE}.gdn", _build_thd_cp_a2a_perm=_build_thd_cp_a2a_perm)}
    for short, module in found.items():
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return found


def _patched(version, monkeypatch):
    """Fake ``version``'s modules and patch them as ``striped_sp.megatron.install`` does; returns the
    modules and the setter of the installed algo."""
    modules, algo = _fake(version, monkeypatch), [None]
    gdn.patch_context_parallel(lambda owner, name, value: monkeypatch.setattr(owner, name, value), lambda: algo[0])
    return modules, lambda name: algo.__setitem__(0, name)


def _packed_row():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 24, 3, generator=gen), torch.tensor([0, 9, 10, 16, 24])


def _check_dense_rows_run(order_module):
    """Dense rows take the order steps (the layout's permutation under an algo): no refusal, and the
    redo step undoes the undo step."""
    x = torch.randn(24, 2, 3, generator=torch.Generator().manual_seed(1))  # [s, b, h]
    there = order_module._undo_attention_load_balancing(x, 2)
    assert there.shape == x.shape
    assert torch.equal(order_module._redo_attention_load_balancing(there, 2), x)


@pytest.mark.parametrize("algo", REFUSING)
def test_018_refuses_packed_rows_by_name(algo, monkeypatch):
    modules, use = _patched("0.18", monkeypatch)
    use(algo)
    x, cu = _packed_row()
    with pytest.raises(ValueError, match=rf"--context-parallel-algo {algo}: megatron-core 0\.18's gated delta net "
                                         r"\('G'\) context parallelism for packed \(THD\) rows.*"
                                         r"--context-parallel-algo zigzag"):
        modules[""]._unpack_sequence(x, cu, 1)
    _check_dense_rows_run(modules[""])


@pytest.mark.parametrize("algo", RUNNING)
def test_018_runs_packed_rows_under_zigzag(algo, monkeypatch):
    """zigzag's placement (and megatron-core's own path, no algo installed): megatron-core's split runs."""
    modules, use = _patched("0.18", monkeypatch)
    use(algo)
    x, cu = _packed_row()
    got = modules[""]._unpack_sequence(x, cu, 1)
    assert [t.shape[1] for t in got] == [9, 1, 6, 8]
    assert torch.equal(torch.cat(got, dim=1), x)
    _check_dense_rows_run(modules[""])


@pytest.mark.parametrize("algo", REFUSING + RUNNING)
def test_019_refuses_no_packed_row(algo, monkeypatch):
    """0.19: no packed split to refuse; its permutation is the layout's under a striped_sp algo, megatron-core's
    own with no algo."""
    modules, use = _patched("0.19", monkeypatch)
    use(algo)
    assert "_unpack_sequence" not in modules["common"].__dict__ and "_unpack_sequence" not in modules[""].__dict__
    cu, n, t = torch.tensor([0, 8, 12, 24]), 2, 24
    got = modules["gdn"]._build_thd_cp_a2a_perm(cu, n, t)
    if algo is None:
        assert got is _MEGATRONS_PERM
        return
    idx, inv = got
    assert torch.equal(torch.sort(idx).values, torch.arange(t)) and torch.equal(idx[inv], torch.arange(t))
    _check_dense_rows_run(modules["common"])
