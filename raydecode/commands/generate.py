"""`raydecode generate`: one prompt through the in-process engine (TP=1), stock or with DSpark
speculative decoding (`--spec dspark --num-draft K [--draft PATH|tiny]
[--synthetic-acceptance L]`)."""
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
                   help="speculative decoding method (default none)")
    p.add_argument("--num-draft", type=int, default=None,
                   help="with --spec dspark: drafts per step, 1..the drafter's block size "
                        "(7 for K3's DSpark); the specialized path needs 3..7")
    p.add_argument("--draft", default=None,
                   help="with --spec dspark: DSpark checkpoint folder or 'tiny' (default: 'tiny' "
                        "for the tiny model, else <model>/dspark)")
    p.add_argument("--synthetic-acceptance", type=float, default=None, metavar="L",
                   help="with --spec dspark, benchmarks only: accept the earliest drafts to a "
                        "mean acceptance length L in [1, K+1]; the text is meaningless")


def _check_num_draft(k: int, draft: str | None, model: str) -> None:
    """--num-draft within 1..the drafter's block size (DESIGN §6), named as the flag."""
    from raydecode.engine.spec_runner import resolve_drafter
    from raydecode.models.dspark import load_dspark_config

    spec = resolve_drafter(draft, model)
    bs = load_dspark_config(spec).block_size
    if not 1 <= k <= bs:
        raise ValueError(f"--num-draft {k}: the drafter {spec!r} drafts blocks of {bs} tokens; "
                         f"accepted 1..{bs} (the specialized path needs 3..{min(bs, 7)})")


def run(args: argparse.Namespace) -> int:
    from raydecode.engine.request import SamplingParams

    spec_only = {"--num-draft": args.num_draft, "--draft": args.draft,
                 "--synthetic-acceptance": args.synthetic_acceptance}
    if args.spec == "none":
        given = [k for k, v in spec_only.items() if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: only with --spec dspark")
    elif args.num_draft is None:
        raise ValueError("--spec dspark needs --num-draft K (drafts per step, e.g. 7)")
    else:
        _check_num_draft(args.num_draft, args.draft, args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if args.spec == "dspark":
        from raydecode.engine.spec_engine import build_local_spec_engine

        engine = build_local_spec_engine(args.model, args.num_draft, draft=args.draft,
                                         synthetic_length=args.synthetic_acceptance,
                                         dtype=args.dtype)
    else:
        from raydecode.engine.loader import build_local_engine

        engine = build_local_engine(args.model, dtype=args.dtype)
    t0 = time.perf_counter()
    req = engine.generate([args.prompt], params)[0]
    dt = time.perf_counter() - t0
    n = len(req.output_ids)
    print(req.output_text)
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tok/s; prompt {len(req.prompt_ids)} tokens; "
          f"finish: {req.finish_reason}]", file=sys.stderr)
    if args.spec == "dspark":
        m = engine.metrics()
        rates = " ".join(f"{r:.2f}" for r in m["acceptance_rate_per_position"])
        print(f"[dspark: {m['num_drafts']} drafts, mean acceptance length "
              f"{m['mean_acceptance_length']:.2f} over {m['spec_steps']} steps; per-position "
              f"acceptance {rates}]", file=sys.stderr)
        if engine.outputs_meaningless:
            print(f"[synthetic acceptance L = {args.synthetic_acceptance}: benchmark mode, the "
                  "text above is meaningless]", file=sys.stderr)
    return 0
