"""n > 1 over HTTP: one admitted request whose StepOutputs carry their sample `index`
(0..n-1, the coordinator's group: one prefill, n samples with their own seeds) is split into n
single-choice runs — the n = 1 formatting of actors/serve.py, each with its own ChoiceOutput
(actors/outputs.py), so every per-choice rule (token ids, logprobs, K3's reasoning / content /
tool-call channels) holds for each choice — and merged back:

    body    choices [0..n-1] with their indices, one usage (the prompt once, the completion
            tokens of all n, the prompt's cached tokens);
    stream  every choice's chunks as they come, each with its index; one usage chunk
            (stream_options.include_usage) and one [DONE] at the end; a failure is one error
            event that ends the stream.

Metrics count the request once: its first token over all choices, its last, and all tokens.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from raydecode.engine.engine import StepOutput

from . import openai_api as oa
from .serve import CLIENT_CLOSED


class _Split:
    """One pump reading the group's stream into a queue per index."""

    def __init__(self, gen: AsyncIterator[StepOutput], n: int):
        self.gen, self.queues = gen, [asyncio.Queue() for _ in range(n)]
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        try:
            async for out in self.gen:
                self.queues[out.index].put_nowait(out)
        except BaseException as e:  # noqa: BLE001 — every choice sees the group's failure
            for q in self.queues:
                q.put_nowait(e if isinstance(e, Exception) else RuntimeError("stream closed"))
            if not isinstance(e, Exception):
                raise

    async def stream(self, i: int) -> AsyncIterator[StepOutput]:
        self.start()
        while True:
            out = await self.queues[i].get()
            if isinstance(out, BaseException):
                raise out
            yield out
            if out.finished:
                return

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()           # the group's generator closes inside (its finally)
            try:
                await self.task
            except BaseException:  # noqa: BLE001 — cancelled, or the failure already sent
                pass
        await self.gen.aclose()


class _Quiet:
    """Metrics sink of the per-choice runs (the group records once)."""

    class _Label:
        def labels(self, *a):
            return self

        def inc(self, *a):
            pass

    requests = _Label()

    def observe_request(self, *a) -> None:
        pass


class Choices:
    """The `_Run` interface (first / abandon / collect / sse) over n per-choice runs."""

    def __init__(self, run_cls, endpoint, rid, req, ids, gen, backend, metrics, t0, model,
                 outputs: list, warning=None, timeout_s: float = 600.0):
        """outputs: one ChoiceOutput per choice (its parser and logprob state)."""
        assert len(outputs) == req.n, (len(outputs), req.n)
        self.req, self.rid, self.backend, self.metrics = req, rid, backend, metrics
        self.endpoint, self.t0, self.n_prompt, self.model = endpoint, t0, len(ids), model
        self.split = _Split(gen, req.n)
        self.runs = [run_cls(endpoint, rid, req, ids, self.split.stream(i), backend, _Quiet(),
                             t0, model, outputs[i], warning, timeout_s)
                     for i in range(req.n)]
        self.created = self.runs[0].created
        for r in self.runs:
            r.created = self.created
        self._recorded = False

    @property
    def finish(self) -> str | None:
        """Set once every choice has finished (the group needs no abort then)."""
        fins = [r.finish for r in self.runs]
        return None if None in fins else fins[0]

    async def first(self) -> None:
        await asyncio.gather(*(r.first() for r in self.runs))

    def abandon(self, status: int) -> None:
        if self.finish is None:
            self.backend.abort(self.rid)         # the coordinator aborts the whole group
        self._done(status)

    def _done(self, status: int) -> None:
        if self._recorded:
            return
        self._recorded = True
        m, runs = self.metrics, self.runs
        m.requests.labels(self.endpoint, str(status)).inc()
        firsts = [r.t_first for r in runs if r.t_first is not None]
        lasts = [r.t_last for r in runs if r.t_last is not None]
        m.observe_request(self.endpoint, self.t0, min(firsts, default=None),
                          max(lasts, default=None), sum(len(r.ids) for r in runs),
                          self.n_prompt)

    def _usage(self) -> dict:
        return oa.usage(self.n_prompt, sum(len(r.ids) for r in self.runs),
                        max(r.cached for r in self.runs))

    async def collect(self):
        try:
            bodies = await asyncio.gather(*(r.collect() for r in self.runs))
        except asyncio.CancelledError:           # the client went away
            self._done(CLIENT_CLOSED)
            raise
        finally:
            await self.split.close()
        bad = next((b for b in bodies if not isinstance(b, dict)), None)
        if bad is not None:                      # an error response: the whole request's
            self._done(bad.status_code)
            return bad
        self._done(200)
        out = dict(bodies[0])
        out["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
        out["usage"] = self._usage()
        return out

    async def sse(self):
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, run) -> None:
            it = run.chunks(False)
            try:
                async for obj in it:
                    q.put_nowait((i, obj))
            finally:
                await it.aclose()
                q.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(self.runs)]
        status, left = CLIENT_CLOSED, len(tasks)       # stays so if the client goes away
        try:
            while left:
                i, obj = await q.get()
                if obj is None:
                    left -= 1
                    continue
                if "error" in obj:               # one error event ends the whole stream
                    status = 503 if obj["error"].get("code") == "service_unavailable" else 500
                    yield oa.sse(obj)
                    yield oa.SSE_DONE
                    return
                for ch in obj.get("choices", ()):
                    ch["index"] = i
                yield oa.sse(obj)
            status = 200
            if self.req.include_usage:
                kind = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
                yield oa.sse(oa.usage_chunk(self.rid, kind, self.model, self.created,
                                            self._usage()))
            yield oa.SSE_DONE
        finally:
            for t in tasks:
                t.cancel()
            if self.finish is None:
                self.backend.abort(self.rid)
            await self.split.close()
            self._done(status)


__all__ = ["Choices"]
