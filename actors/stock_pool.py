"""Requests that leave a replica continue on the stock pool, an OpenAI-compatible endpoint (a Ray
Serve LLM / vLLM app in production, a stock-only raydecode replica in tests).

A request is re-submitted from its generated prefix: prompt = original prompt + output ids so
far, max_tokens = what is left. The pool returns token ids (`return_token_ids`, vLLM ≥ 0.10.2 and
raydecode), and `Continuation` runs them through LLMEngine's own finish rules and text hold-back
over the concatenated output, so the client's stream goes on exactly where it stopped: no token
lost, none repeated, a stop string across the hand-over still found.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import AsyncIterator

from raydecode.engine.engine import LLMEngine, StepOutput
from raydecode.engine.request import SamplingParams


class StockPoolError(RuntimeError):
    """The stock pool could not continue a request; the message names the endpoint."""


@dataclass
class PoolChunk:
    token_ids: list[int]
    finish_reason: str | None


class StockPoolClient:
    """`openai` async client against the pool's /v1/completions with token-id prompts."""

    def __init__(self, base_url: str, model: str, timeout_s: float = 600.0,
                 api_key_env: str | None = None):
        from openai import AsyncOpenAI

        key = (os.environ.get(api_key_env) if api_key_env else None) or "EMPTY"
        self.base_url, self.model = base_url, model
        self.client = AsyncOpenAI(base_url=base_url, api_key=key, timeout=timeout_s,
                                  max_retries=0)

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     max_tokens: int) -> AsyncIterator[PoolChunk]:
        import openai

        extra: dict = {"return_token_ids": True}
        if params.top_k:
            extra["top_k"] = params.top_k
        if params.stop_token_ids:
            extra["stop_token_ids"] = list(params.stop_token_ids)
        if params.ignore_eos:
            extra["ignore_eos"] = True
        try:
            stream = await self.client.completions.create(
                model=self.model, prompt=prompt_ids, max_tokens=max_tokens, stream=True,
                temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                stop=list(params.stop) or None, extra_body=extra)
            async with stream:
                async for chunk in stream:
                    for choice in chunk.choices:
                        ids = getattr(choice, "token_ids", None)
                        if ids is None and (choice.text or choice.finish_reason is None):
                            raise StockPoolError(
                                f"stock pool {self.base_url} returned no token_ids; it must "
                                "support return_token_ids (vLLM >= 0.10.2 or raydecode)")
                        yield PoolChunk(list(ids or ()), choice.finish_reason)
        except openai.APIError as e:
            raise StockPoolError(f"stock pool {self.base_url}: {type(e).__name__}: {e}") from None

    async def close(self) -> None:
        await self.client.close()


class Continuation:
    """A request's output continued from the ids and text its client already has, token by
    token, through `LLMEngine.append_token` (the same stop/EOS/length rules, detokenization
    and text hold-back), on an engine that never runs a step."""

    def __init__(self, engine: LLMEngine, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, ids: list[int], emitted: str):
        self.engine = engine
        self.req = engine.resume_request(request_id, prompt_ids, params, ids[:-1], len(emitted))
        self._pending = engine.append_token(self.req, ids[-1]) if ids else None  # rebuilds text

    @property
    def done(self) -> bool:
        return self.req.finished

    def push(self, tok: int) -> StepOutput:
        assert not self.done, "token after the request finished"
        return self._merge(self.engine.append_token(self.req, tok))

    def finish(self, reason: str) -> StepOutput:
        """The pool ended the request (its own stop or length) before the local rules did."""
        self.req.finish_reason = reason
        self.engine.finish_request(self.req)
        return self._merge(self.engine.delta(self.req, []))

    def _merge(self, out: StepOutput) -> StepOutput:
        first, self._pending = self._pending, None
        if first is not None:       # the replayed token was sent already: only its text counts
            out = StepOutput(out.request_id, out.new_token_ids, first.delta_text + out.delta_text,
                             out.finished, out.finish_reason)
        return out

    def close(self) -> None:
        if self.req.request_id in self.engine.requests:
            self.engine.pop_finished(self.req.request_id)


def merge(outs: list[StepOutput]) -> StepOutput:
    """Several deltas of one request as one."""
    last = outs[-1]
    return StepOutput(last.request_id, sum((o.new_token_ids for o in outs), []),
                      "".join(o.delta_text for o in outs), last.finished, last.finish_reason)


# ---- the production stock pool: a Ray Serve LLM (vLLM) app from the same deployment config ----
def stock_pool_app(cfg, min_replicas: int = 1, max_replicas: int = 1) -> dict:
    """Serve config (the `serve deploy` / KubeRay serveConfigV2 document) of a Ray Serve LLM app
    that serves the replica's model with vLLM: same checkpoint, TP, DCP, context and batch, under
    the name and at the URL the replica's `stock_pool` expects."""
    from urllib.parse import urlparse

    from raydecode.models.config import PRESETS

    from .config import DeployConfigError

    if cfg.model in PRESETS:
        raise DeployConfigError(f"model = {cfg.model!r} is a preset without published weights; "
                                "the stock pool (vLLM) needs a checkpoint folder or a Hugging "
                                "Face model id")
    if not 1 <= min_replicas <= max_replicas:
        raise DeployConfigError(f"min_replicas = {min_replicas}, max_replicas = {max_replicas}; "
                                "expected 1 <= min_replicas <= max_replicas")
    sp = cfg.stock_pool
    port, prefix, name = 8000, "/", cfg.model_name
    if sp is not None:
        url = urlparse(sp.base_url)
        port = url.port or port
        path = url.path.rstrip("/")
        prefix = path[: -len("/v1")] if path.endswith("/v1") else path
        prefix = prefix or "/"
        name = sp.model or name
    engine = {"tensor_parallel_size": cfg.tensor_parallel_size,
              "decode_context_parallel_size": cfg.decode_context_parallel_size,
              "max_num_seqs": cfg.max_num_seqs, "dtype": cfg.dtype, "trust_remote_code": True}
    if cfg.max_model_len is not None:
        engine["max_model_len"] = cfg.max_model_len
    llm = {"model_loading_config": {"model_id": name, "model_source": cfg.model},
           "engine_kwargs": engine,
           "deployment_config": {"autoscaling_config": {"min_replicas": min_replicas,
                                                        "max_replicas": max_replicas}}}
    return {"proxy_location": "EveryNode",
            "http_options": {"host": "0.0.0.0", "port": port},
            "applications": [{"name": "raydecode-stock-pool", "route_prefix": prefix,
                              "import_path": "ray.serve.llm:build_openai_app",
                              "args": {"llm_configs": [llm]}}]}
