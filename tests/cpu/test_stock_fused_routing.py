"""Routing of the stock path's fused forms that do not need a GPU to check (models/layers.py):
`adjacent_rows` finds gate ‖ up as one weight only where `pack_rows_` put them side by side,
and GatedMLP.partial with the fused forms forced on (`stock_fused` patched; on the CPU the
SiTU op runs its PyTorch reference) runs one GEMM over the packed gate ‖ up and an fp32-out
down GEMM where asked, giving the two-GEMM chain's result."""
from __future__ import annotations

import torch

from raydecode.models import layers as layers_mod
from raydecode.models.layers import GatedMLP, adjacent_rows, pack_rows_
from raydecode.models.parallel import Parallel

torch.set_num_threads(1)


def test_adjacent_rows_only_for_packed_neighbours():
    a, b = torch.randn(4, 8), torch.randn(3, 8)
    assert adjacent_rows(a, b) is None                       # separate storages
    buf = torch.cat([a, b])
    v = adjacent_rows(buf[:4], buf[4:])
    assert v is not None and v.data_ptr() == buf.data_ptr() and torch.equal(v, buf)
    assert adjacent_rows(buf[:3], buf[4:]) is None           # a row between them
    assert adjacent_rows(buf[4:], buf[:4]) is None           # wrong order
    assert adjacent_rows(buf[:4, :4], buf[4:, :4]) is None   # column slices: not row-major


def test_partial_with_packed_gate_up_equals_the_two_gemms(monkeypatch):
    torch.manual_seed(0)
    mlp = GatedMLP(16, 24, 2.0, 25.0, Parallel(), dtype=torch.float32)
    for p in mlp.parameters():
        p.data.normal_()
    x = torch.randn(5, 16)
    want = mlp.partial(x)                                    # chains, two GEMMs
    calls = []
    monkeypatch.setattr(layers_mod, "stock_fused", lambda t: True)
    gemm = layers_mod.linear_for("stock")
    monkeypatch.setattr(layers_mod, "linear_for",
                        lambda path, o=None: lambda a, w: (calls.append(tuple(w.shape)),
                                                           gemm(a, w))[1])
    assert mlp.partial(x).shape == want.shape and calls == [(24, 16), (24, 16), (16, 24)]
    pack_rows_([mlp.gate_proj.weight, mlp.up_proj.weight])   # the storage moves into a buffer
    calls.clear()
    got = mlp.partial(x, down=lambda a, w: torch.nn.functional.linear(a.double(), w.double()))
    assert calls == [(48, 16)]                               # one GEMM, the down one given
    assert got.dtype == torch.float64
    assert torch.allclose(got.float(), want, rtol=1e-5, atol=1e-5)
