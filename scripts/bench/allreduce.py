"""One-/two-shot all-reduce + residual + RMSNorm vs NCCL all-reduce + separate residual add /
RMSNorm (needs ≥ 2 GPUs of one host; TP = every visible GPU, one spawned process per GPU).

    python -m raydecode.scripts.bench.allreduce [--out OUT.json] [--ts 1,2,4,8,16,32,64]
        [--commit SHA]

Method: for each T, rank 0..N−1 hold random (T, 7168) bf16 partials; the one-shot results are
first checked against the references (all partials gathered, fp32 sum in rank order: the plain
sum and the new residual bit for bit, normed ≤ 4e-3 relative; both forms) on every rank, then
each variant
runs inside a CUDA graph of CALLS back-to-back calls; µs per call = median over replays / CALLS
(ranks start each replay after a barrier, so only the first call of a replay absorbs their
skew). Variants:
  oneshot            the fused kernel (kernels/allreduce_oneshot_triton.py), PDL on
  oneshot_allreduce  the same kernel without residual and norm (OneShotComm.all_reduce, what the
                     model's TP all-reduces run below 32 rows)
  twoshot            the two-shot fused kernel (kernels/allreduce_twoshot_triton.py: reduce-
                     scatter + all-gather through peer writes, two barriers)
  twoshot_allreduce  the same without residual and norm (what 32 rows and more run)
  nccl               dist.all_reduce alone (in place)
  nccl_add_rmsnorm   dist.all_reduce + residual add + F.rms_norm (the stock sequence)
Bytes: one-shot pulls (N−1)·T·H·2 bytes per rank over NVLink; the two-shot and the ring move
2(N−1)/N·T·H·2. GB/s = those bytes / time. NVLS / multicast stay off (NCCL_NVLS_ENABLE=0).
Writes JSON (GPU, commit, date, NCCL version, shapes, µs, bytes, GB/s) to bench/results/.
Teardown: every graph is destroyed where it was timed, then PeerBuffers.close (collective:
unmap the peers, barrier, free) runs before destroy_process_group.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import sys

import torch
import torch.nn.functional as F

from raydecode.scripts.bench.report_io import default_out, git_commit

H = 7168
EPS = 1e-6
CALLS = 20
REPLAYS = 30
VARIANTS = ("oneshot", "oneshot_allreduce", "twoshot", "twoshot_allreduce", "nccl",
            "nccl_add_rmsnorm")
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1"}


def _graph_us(fn, dist, calls: int = CALLS, replays: int = REPLAYS) -> list[float]:
    """Per-call µs of each replay of a graph holding `calls` calls of fn (all ranks)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        out = []
        for _ in range(replays):
            dist.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) * 1e3 / calls)
    finally:            # the graph holds the one-shot kernel's pointers: gone before close()
        torch.cuda.synchronize()
        g.reset()
        del g
    return out


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _bench_T(T: int, rank: int, world: int, pb, dist) -> dict:
    from raydecode.kernels import allreduce_oneshot as AR

    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(1000 * T + rank)
    partial = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    residual = (4 * torch.randn(T, H, generator=g, device=dev)).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(H, generator=g, device=dev)).to(torch.bfloat16)
    dist.broadcast(residual, 0)          # one residual stream, replicated as in the model
    dist.broadcast(w, 0)
    parts = [torch.empty_like(partial) for _ in range(world)]
    dist.all_gather(parts, partial)
    ref_new, ref_h = AR.allreduce_residual_norm_reference(parts, residual, w, EPS)
    for two in (False, True):
        form = "two-shot" if two else "one-shot"
        new, h = pb.all_reduce_residual_norm(partial, residual, w, EPS, two_shot=two)
        summed = pb.all_reduce(partial, two_shot=two)
        torch.cuda.synchronize()
        pb.check_timeouts()
        if not torch.equal(new, ref_new) or _rel(h, ref_h) > 4e-3:
            raise RuntimeError(f"rank {rank} T={T}: {form} result differs from the reference "
                               f"(normed rel {_rel(h, ref_h):.2e})")
        if not torch.equal(summed, AR.allreduce_reference(parts)):
            raise RuntimeError(f"rank {rank} T={T}: {form} all-reduce differs from the "
                               "reference")

    new_o, h_o, s_o = (torch.empty_like(residual) for _ in range(3))
    x = partial.clone()

    def oneshot(two=False):
        pb.all_reduce_residual_norm(partial, residual, w, EPS, new_residual=new_o, out=h_o,
                                    two_shot=two)

    def oneshot_allreduce(two=False):
        pb.all_reduce(partial, out=s_o, two_shot=two)

    def nccl():
        dist.all_reduce(x)

    def nccl_add_rmsnorm():
        dist.all_reduce(x)
        y = x + residual
        F.rms_norm(y, (H,), w, EPS)

    times = {k: _graph_us(fn, dist) for k, fn in
             (("oneshot", oneshot), ("oneshot_allreduce", oneshot_allreduce),
              ("twoshot", lambda: oneshot(True)),
              ("twoshot_allreduce", lambda: oneshot_allreduce(True)), ("nccl", nccl),
              ("nccl_add_rmsnorm", nccl_add_rmsnorm))}
    pb.check_timeouts()
    size = T * H * 2
    moved = {"oneshot": (world - 1) * size, "oneshot_allreduce": (world - 1) * size,
             "twoshot": 2 * (world - 1) * size // world,
             "twoshot_allreduce": 2 * (world - 1) * size // world,
             "nccl": 2 * (world - 1) * size // world,
             "nccl_add_rmsnorm": 2 * (world - 1) * size // world}
    row = {"T": T, "H": H, "bytes_per_rank_activation": size, "checked": True}
    for k, ts in times.items():
        med = statistics.median(ts)
        row[k] = {"us_median": med, "us_min": min(ts), "bytes_moved_per_rank": moved[k],
                  "GBps": moved[k] / (med * 1e-6) / 1e9}
    row["speedup_vs_nccl_add_rmsnorm"] = row["nccl_add_rmsnorm"]["us_median"] / \
        row["oneshot"]["us_median"]
    row["twoshot_speedup_vs_nccl_add_rmsnorm"] = row["nccl_add_rmsnorm"]["us_median"] / \
        row["twoshot"]["us_median"]
    return row


def _worker(rank: int, world: int, port: int, args) -> None:
    import torch.distributed as dist

    from raydecode.kernels import allreduce_oneshot as AR

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    ts = [int(t) for t in args.ts.split(",")]
    pb = AR.PeerBuffers.create(None, max(ts), H, torch.device("cuda", rank))
    rows = [_bench_T(T, rank, world, pb, dist) for T in ts]
    every = [None] * world
    dist.all_gather_object(every, rows)
    if rank == 0:
        for row, *others in zip(rows, *every[1:]):
            for k in VARIANTS:
                row[k]["us_median_max_over_ranks"] = max(
                    [row[k]["us_median"]] + [o[k]["us_median"] for o in others])
        report = {
            "bench": "allreduce_oneshot", "gpu": torch.cuda.get_device_name(),
            "tp": world, "commit": args.commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "torch": torch.__version__,
            "env": {k: os.environ.get(k) for k in ENV}, "calls_per_graph": CALLS,
            "replays": REPLAYS, "results": rows,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        for r in rows:
            print(f"T={r['T']:3d}  oneshot {r['oneshot']['us_median']:7.2f} µs  "
                  f"oneshot-ar {r['oneshot_allreduce']['us_median']:7.2f} µs  "
                  f"twoshot {r['twoshot']['us_median']:7.2f} µs  nccl "
                  f"{r['nccl']['us_median']:7.2f} µs  nccl+add+norm "
                  f"{r['nccl_add_rmsnorm']['us_median']:7.2f} µs  "
                  f"({r['speedup_vs_nccl_add_rmsnorm']:.2f}×)")
        print(f"wrote {args.out}")
    # teardown: the graphs died in _graph_us and _bench_T's tensors with its frame; close is
    # collective (unmap peers, barrier, free own), so no rank frees memory a peer still maps
    rows = every = None
    gc.collect()
    torch.cuda.synchronize()
    pb.close()
    pb = None
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="", help="JSON file (default bench/results/"
                    "allreduce-<gpu>-tp<N>-<date>.json)")
    ap.add_argument("--ts", default="1,2,4,8,16,32,64", help="comma-separated token counts T "
                    "(T·7168·2 bytes: 14 KB to 917 KB)")
    ap.add_argument("--commit", default="", help="git commit of the benchmarked tree "
                    "(default: git rev-parse HEAD)")
    args = ap.parse_args(argv)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        print(f"allreduce benchmark: needs >= 2 GPUs of one host, found {n}; nothing to "
              "compare (TP = every visible GPU)", file=sys.stderr)
        return 2
    bad = [t for t in args.ts.split(",") if not t.strip().isdigit() or int(t) < 1]
    if bad:
        print(f"--ts {args.ts!r}: expected comma-separated positive integers", file=sys.stderr)
        return 2
    for k, v in ENV.items():
        os.environ[k] = v                         # inherited by the spawned ranks
    args.commit = args.commit or git_commit()
    args.out = args.out or default_out("allreduce", f"-tp{n}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(n, port, args), nprocs=n, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
