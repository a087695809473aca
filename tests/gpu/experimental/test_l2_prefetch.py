"""L2 prefetch on the GPU: the launch runs eagerly and inside a captured CUDA graph as a side
branch, changes no value, and the work after the join sees every write before the fork.
Timing is measured in scripts/explore/l2_prefetch.py, never asserted here."""
import pytest
import torch

from raydecode.kernels.experimental import l2_prefetch as P

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or P.triton is None
    or torch.cuda.get_device_capability()[0] < 9, reason="needs an sm_90+ GPU and Triton")


@pytest.mark.parametrize("nbytes", [16, 40_000, 26 * 2**20])
def test_eager_prefetch_changes_nothing(nbytes):
    w = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    other = torch.randn(4096, device="cuda")
    before, other_before = w.clone(), other.clone()
    P.l2_prefetch(P.prefetch_table([w, other[100:]]))
    torch.cuda.synchronize()
    assert torch.equal(w, before) and torch.equal(other, other_before)


def test_side_branch_in_a_graph_keeps_stream_order():
    w = torch.randn(3584, 7168, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16)
    table = P.prefetch_table([w])
    side = P.SidePrefetch()
    out = torch.empty(1, 3584, device="cuda", dtype=torch.bfloat16)

    def step():
        x.mul_(1.5)                       # written before the fork, read after the join
        side.issue(table)
        y = x + 1
        side.join()
        torch.matmul(y, w.t(), out=out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                            # warm-up (eager, side launch included)
    torch.cuda.current_stream().wait_stream(s)
    x0 = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    assert side.launches == 0             # joined inside the capture
    x.copy_(x0)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(x, x0 * 1.5 ** 3)     # three bf16 roundings: bf16 tolerance
    ref = (x + 1).float() @ w.float().t()             # the last replay's y, from its x
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=1e-2 * ref.abs().max().item())
