"""DSpark's device sampler on CUDA (engine/spec_sampling.py): the 100,000-sequence chi-square of
tests/cpu/test_spec_sampling.py on the GPU, and the same drafts and emitted tokens as on the CPU
from the same logits (integer-hash noise). Not run in CI; needs a CUDA device."""
import pytest
import torch

from raydecode.engine import spec_sampling as S

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cpu_case():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "cpu" / "test_spec_sampling.py"
    spec = importlib.util.spec_from_file_location("cpu_spec_sampling", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_chi_square_on_the_gpu():
    m = _cpu_case()
    r = m.rows(m.N)
    drafts, qs = [], []
    for j in range(m.K):
        tok, q = S.draft_sample(m.Q[j].log().cuda().expand(m.N, m.V), r, j)
        drafts.append(tok)
        qs.append(q)
    emitted, lengths = S.verify(torch.stack(drafts, 1), torch.stack(qs, 1),
                                m.P.log().cuda().expand(m.N, m.K + 1, m.V), r)
    emitted, lengths = emitted.cpu(), lengths.cpu()
    assert m.chi2(emitted[:, 0], m.P[0]) < m.CHI2_DF5_P001
    assert m.chi2(emitted[lengths >= 2, 1], m.P[1]) < m.CHI2_DF5_P001


def test_gpu_draws_the_cpu_drafts_and_tokens():
    m = _cpu_case()
    g = torch.Generator().manual_seed(11)
    B, k, V = 32, 7, 4096
    r = m.rows(B, temperature=0.9, counter=5)
    base = torch.randn(B, k, V, generator=g) * 3
    target = torch.randn(B, k + 1, V, generator=g) * 3
    out = {}
    for dev in ("cpu", "cuda"):
        drafts, qs = [], []
        for j in range(k):
            t, q = S.draft_sample(base[:, j].to(dev), r, j)
            drafts.append(t)
            qs.append(q)
        e, n = S.verify(torch.stack(drafts, 1), torch.stack(qs, 1), target.to(dev), r)
        out[dev] = (torch.stack(drafts, 1).cpu(), e.cpu(), n.cpu())
    for a, b in zip(out["cpu"], out["cuda"]):
        assert torch.equal(a, b)
