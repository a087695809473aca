"""`raydecode generate`: one prompt through the in-process stock engine (TP=1)."""
from __future__ import annotations

import argparse
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset ('tiny') or checkpoint folder")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens at most (default 32)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k cut (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 (default float32)")
    p.add_argument("--spec", choices=["none", "dspark"], default="none",
                   help="speculative decoding method (dspark: see the DSpark issue)")


def run(args: argparse.Namespace) -> int:
    from raydecode.engine.loader import build_local_engine
    from raydecode.engine.request import SamplingParams

    if args.spec != "none":
        print(f"--spec {args.spec}: speculative decoding is not available in this build; "
              "accepted: none", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    engine = build_local_engine(args.model, dtype=args.dtype)
    t0 = time.perf_counter()
    req = engine.generate([args.prompt], params)[0]
    dt = time.perf_counter() - t0
    n = len(req.output_ids)
    print(req.output_text)
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tok/s; prompt {len(req.prompt_ids)} tokens; "
          f"finish: {req.finish_reason}]", file=sys.stderr)
    return 0
