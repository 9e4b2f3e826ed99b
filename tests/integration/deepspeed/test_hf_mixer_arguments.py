"""Per-token arguments of a hybrid's token mixer (``position_ids``, ``seq_idx``) follow its hidden states
into the gathered sequence (striped_sp/deepspeed/hybrid.py), passed as keywords or positionally.

No installed transformers family passes a per-token keyword to its mixer, so a mixer double does: a
module holding a recurrence parameter (``A_log``: what :mod:`striped_sp.deepspeed.mixers` recognises as
a mixer) that runs a decaying scan within the documents its ``seq_idx`` names and adds a feature of its
``position_ids``, wrapped by :func:`~striped_sp.deepspeed.hybrid.wrap_mixers`.  On 2 gloo ranks, under
dense and packed rows and several layouts, its output and every gradient (inputs, after summing the
parameters' over the group as DeepSpeed does) equal a float64 reference computed here on the whole row
with a masked matrix (not the double's loop); the double records the length of each per-token argument
it saw: the gathered row's, and a global tensor (``cu_seqlens``) and a number pass as they are."""

from __future__ import annotations

import os
import types

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import striped_sp  # noqa: E402
from case_tests import cases_test  # noqa: E402
from reference import rel_err  # noqa: E402
from seeds import seed_for  # noqa: E402

SEED = seed_for(__name__)
N, S, H = 2, 24, 6
PACKED = (0, 5, 6, 15, S)  # documents of 5, 1, 9 and 9 tokens


class MixerDouble(torch.nn.Module):
    """``out_t = sum over s <= t in t's document (seq_idx) of decay^(t-s) * W x_s + sin(pos_t * freq) * u``
    (``decay = sigmoid(A_log)`` per channel), scanned token by token; records what it was given."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(SEED)
        self.proj = torch.nn.Linear(H, H, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(H, H, generator=gen, dtype=torch.float64) / H ** 0.5)
        self.A_log = torch.nn.Parameter(torch.randn(H, generator=gen, dtype=torch.float64))
        self.u = torch.nn.Parameter(torch.randn(H, generator=gen, dtype=torch.float64))
        self.freq = torch.linspace(0.1, 1.3, H, dtype=torch.float64)
        self.seen = []

    def forward(self, hidden_states, position_ids=None, seq_idx=None, cu_seqlens=None, scale=1.0):
        self.seen.append({"hidden_states": hidden_states.size(1), "position_ids": position_ids.size(1),
                          "seq_idx": seq_idx.size(1), "cu_seqlens": None if cu_seqlens is None else cu_seqlens.tolist(),
                          "scale": scale})
        y, decay = self.proj(hidden_states), torch.sigmoid(self.A_log)
        state, out = torch.zeros_like(y[:, 0]), []
        for t in range(y.size(1)):
            same = (seq_idx[:, t] == seq_idx[:, t - 1]).unsqueeze(-1) if t else torch.zeros_like(seq_idx[:, :1], dtype=torch.bool)
            state = torch.where(same, decay * state, torch.zeros_like(state)) + y[:, t]
            out.append(state)
        pos = torch.sin(position_ids.to(y.dtype).unsqueeze(-1) * self.freq) * self.u
        return (torch.stack(out, dim=1) + pos) * scale


class TinyModel(torch.nn.Module):
    """One layer holding the mixer; ``mode`` says how the layer passes the per-token arguments."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=H)
        self.layers = torch.nn.ModuleList([MixerDouble()])

    def forward(self, x, position_ids, seq_idx, cu_seqlens, mode):
        mixer = self.layers[0]
        if mode == "keywords":
            return mixer(hidden_states=x, position_ids=position_ids, seq_idx=seq_idx, cu_seqlens=cu_seqlens, scale=0.5)
        if mode == "shared":  # one row of positions for the whole batch, as transformers builds them
            return mixer(hidden_states=x, position_ids=position_ids[:1], seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                         scale=0.5)
        if mode == "positional":
            return mixer(x, position_ids, seq_idx, cu_seqlens, 0.5)
        return mixer(x, position_ids, seq_idx=seq_idx, cu_seqlens=cu_seqlens, scale=0.5)  # mixed


def _reference(params, x, position_ids, seq_idx):
    """The double's output on the whole row, as a masked matrix: ``[b, t, s]`` weights decay^(t-s) where
    ``s <= t`` and no document starts in ``(s, t]`` (``seq_idx`` changes there)."""
    weight, a_log, u, freq = params
    y, decay = x @ weight.T, torch.sigmoid(a_log)
    t = torch.arange(x.size(1))
    starts = torch.cat([torch.ones_like(seq_idx[:, :1]), (seq_idx[:, 1:] != seq_idx[:, :-1]).long()], dim=1)
    seg = starts.cumsum(1)  # the scan's segment of each token
    visible = (t[:, None] >= t[None, :]) & (seg[:, :, None] == seg[:, None, :])  # [b, t, s]
    lag = (t[:, None] - t[None, :]).clamp(min=0).to(x.dtype)
    mix = torch.where(visible[..., None], decay ** lag[..., None], torch.zeros((), dtype=x.dtype))  # [b, t, s, h]
    scanned = torch.einsum("btsh,bsh->bth", mix, y)
    return (scanned + torch.sin(position_ids.to(x.dtype)[..., None] * freq) * u) * 0.5


def _row(bounds, b, seed):
    """Inputs of the whole row: hidden states, positions (within the documents of a packed row) and
    the documents' index of each token (drawn per row for a dense one: the mixer's own documents)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, S, H, generator=gen, dtype=torch.float64)
    if bounds is None:
        position_ids = torch.arange(S).expand(b, S).clone()
        seq_idx = (torch.rand(b, S, generator=gen) < 0.2).long().cumsum(1)
    else:
        lengths = [e - s for s, e in zip(bounds, bounds[1:])]
        position_ids = torch.cat([torch.arange(n) for n in lengths]).expand(b, S).clone()
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).expand(b, S).clone()
    return x, position_ids, seq_idx


def check_arguments_follow_the_tokens(layout, bounds):
    """Every call mode on this layout and row: output, input gradient and parameter gradients (summed
    over the group) equal the float64 reference; each per-token argument seen at the gathered length."""
    from striped_sp.deepspeed.hybrid import wrap_mixers

    rank = dist.get_rank()
    model = TinyModel()
    mixer = model.layers[0]
    params = [p.detach().clone().requires_grad_() for p in (mixer.proj.weight, mixer.A_log, mixer.u)] + [mixer.freq]
    settings = types.SimpleNamespace(group=None, layout=layout, cu_seqlens=bounds)
    assert wrap_mixers(model, lambda: settings) == []
    assert getattr(mixer.forward, "_striped_sp_mixer", None) == "layers.0", "the double is not wrapped as a mixer"
    cu = None if bounds is None else torch.tensor(bounds)
    for i, mode in enumerate(("keywords", "positional", "mixed", "shared")):
        x, position_ids, seq_idx = _row(bounds, 1 if bounds else 2, SEED + 10 * i)
        shard = lambda t: striped_sp.shard(t, N, rank, layout=layout, cu_seqlens=bounds)  # noqa: E731
        x_local = shard(x).requires_grad_()
        mixer.seen.clear()
        model.zero_grad()
        out = model(x_local, shard(position_ids), shard(seq_idx), cu, mode)
        dout = torch.randn(out.shape[0], S, H, generator=torch.Generator().manual_seed(SEED + 1), dtype=torch.float64)
        (out * shard(dout)).sum().backward()  # not out.backward(grad): that imports sympy (seconds per rank)
        assert mixer.seen == [{"hidden_states": S, "position_ids": S, "seq_idx": S, "scale": 0.5,
                               "cu_seqlens": None if bounds is None else list(bounds)}], (mode, mixer.seen)
        x_ref = x.clone().requires_grad_()
        ref = _reference(params, x_ref, position_ids, seq_idx)
        (ref * dout).sum().backward()
        what = f"{layout} {bounds} {mode}"
        assert rel_err(out.detach(), shard(ref.detach())) < 1e-12, what
        assert rel_err(x_local.grad, shard(x_ref.grad)) < 1e-12, what
        for name, p, want in zip(("proj.weight", "A_log", "u"), (mixer.proj.weight, mixer.A_log, mixer.u), params):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # DeepSpeed sums gradients over the SP group
            assert rel_err(grad, want.grad) < 1e-10, (what, name)
            want.grad = None


def check_double_equals_reference():
    """The double itself on the whole row (unwrapped, SP=1) equals the reference: the reference is right."""
    model = TinyModel()
    mixer = model.layers[0]
    for bounds in (None, PACKED):
        x, position_ids, seq_idx = _row(bounds, 2, SEED + 3)
        got = model(x, position_ids, seq_idx, None, "keywords")
        want = _reference([mixer.proj.weight, mixer.A_log, mixer.u, mixer.freq], x, position_ids, seq_idx)
        assert rel_err(got, want) < 1e-12


#: (layout, packed row or None): dense rows under every layout, packed ones where a hybrid runs them
ROWS = [("striped", None), ("striped:stripe=2", None), ("zigzag", None), ("contiguous", None),
        ("striped", PACKED), ("contiguous", PACKED)]
CASES = [("reference", check_double_equals_reference, ())]
CASES += [(f"{layout}-{'packed' if bounds else 'dense'}", check_arguments_follow_the_tokens, (layout, bounds))
          for layout, bounds in ROWS]
test_mixer_arguments = cases_test(N, CASES)
