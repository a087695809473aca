"""Fixtures shared by the CPU and GPU suites."""
import pytest


def _walk_k3_layers(stream, norms, outs, layers: int, block_size: int) -> list:
    """Drive an AttnResStream as K3DecoderLayer's specialized forward does for `layers`
    layers: per layer, a mix + norm (snapshot when the layer starts a block), the attention
    output deferred (a new block at i % block_size == 0), a second mix + norm, the FFN output
    deferred. norms: 2·layers (res_norm, out_norm, proj) triples; outs: 2·layers outputs.
    Returns the 2·layers normalised inputs h."""
    hs = []
    for i in range(layers):
        starts = i % block_size == 0
        res, out, proj = norms[2 * i]
        hs.append(stream.mix_norm(res, proj, out, snapshot=starts))
        stream.defer(outs[2 * i], new_block=starts)
        res, out, proj = norms[2 * i + 1]
        hs.append(stream.mix_norm(res, proj, out))
        stream.defer(outs[2 * i + 1], new_block=False)
    return hs


@pytest.fixture
def walk_k3_layers():
    return _walk_k3_layers
