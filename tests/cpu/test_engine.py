"""The stock engine end to end on the tiny checkpoint (real files, real tokenizer)."""
import pytest
import torch

from raydecode.engine.engine import EngineConfig, LLMEngine, LocalExecutor
from raydecode.engine.loader import load_shard, load_tokenizer
from raydecode.engine.request import RequestError, SamplingParams
from raydecode.engine.runner import ModelRunner
from raydecode.models.cache import SeqSlice, StepBatch


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    torch.set_num_threads(1)
    return load_shard("tiny", num_slots=8, num_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def make_engine(shard, tok, **kw):
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("block_size", 4)
    cfg = EngineConfig(**kw)
    for s in range(shard.caches.kda.rec.shape[1]):
        shard.caches.kda.reset(s)
    shard.caches.mla.block_tables.clear()
    return LLMEngine(LocalExecutor(ModelRunner(shard.model, shard.caches)), tok, cfg,
                     eos_ids=(shard.cfg.eos_token_id,))


def greedy_reference(model, ids: list[int], n: int) -> list[int]:
    """Recompute the whole sequence without caches for every new token."""
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            batch = StepBatch([SeqSlice(slot=0, start=0, length=len(out), pos=0)])
            h = model(torch.tensor(out), batch, None)
            out.append(int(model.compute_logits(h[-1:]).argmax(-1)))
    return out[len(ids):]


def test_greedy_engine_equals_cacheless_recompute(shard, tok):
    eng = make_engine(shard, tok, num_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["The quick brown fox", "Ray actors pin ranks to GPUs", "hello"]
    reqs = eng.generate(prompts, params)
    for p, r in zip(prompts, reqs):
        assert r.output_ids == greedy_reference(shard.model, tok.encode(p), 12)
        assert r.finish_reason == "length"


def test_chunked_prefill_and_preemption_do_not_change_tokens(shard, tok):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = ["a fairly long prompt that will be cut into several prefill chunks " * 2,
               "second prompt", "third prompt here", "fourth"]
    roomy = make_engine(shard, tok).generate(prompts, params)
    # a step budget of 8 tokens chunks the prompts; 24 blocks of 4 forces preemptions
    tight_eng = make_engine(shard, tok, max_num_batched_tokens=8, num_blocks=24)
    tight = tight_eng.generate(prompts, params)
    assert tight_eng.scheduler.num_preemptions > 0
    assert [r.output_ids for r in tight] == [r.output_ids for r in roomy]


def test_seeded_sampling_survives_chunking_and_preemption(shard, tok):
    """A seeded sampled request draws token n from (seed, n): recomputed after a preemption,
    chunked differently, batched with others, it produces the same tokens."""
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=s,
                             ignore_eos=True) for s in (1, 2, 3, 4)]
    prompts = ["a fairly long prompt that will be cut into several prefill chunks " * 2,
               "second prompt", "third prompt here", "fourth"]

    def run(eng):
        reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        while eng.has_unfinished():
            eng.step()
        return [r.output_ids for r in reqs]

    roomy = run(make_engine(shard, tok))
    tight_eng = make_engine(shard, tok, max_num_batched_tokens=8, num_blocks=24)
    assert run(tight_eng) == roomy and tight_eng.scheduler.num_preemptions > 0


def test_seeded_sampling_reproducible_and_stop_strings_cut(shard, tok):
    p = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    a = make_engine(shard, tok).generate(["once upon"], p)[0]
    b = make_engine(shard, tok).generate(["once upon", "noise in the batch"], p)[0]
    assert a.output_ids == b.output_ids
    text = a.output_text
    assert len(text) > 2
    stop = text[len(text) // 2: len(text) // 2 + 2]
    c = make_engine(shard, tok).generate(["once upon"], SamplingParams(
        max_tokens=16, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True, stop=(stop,)))[0]
    assert c.finish_reason == "stop" and stop not in c.output_text
    assert text.startswith(c.output_text)


def test_streamed_deltas_concatenate_to_the_final_text(shard, tok):
    eng = make_engine(shard, tok)
    req = eng.add_request("stream me", SamplingParams(max_tokens=10, temperature=0.0,
                                                      ignore_eos=True))
    pieces = []
    while eng.has_unfinished():
        for out in eng.step():
            pieces.append(out.delta_text)
    assert "".join(pieces) == req.output_text


def test_prompt_beyond_context_is_rejected_without_disturbing_others(shard, tok):
    eng = make_engine(shard, tok, max_model_len=32)
    ok = eng.add_request("short", SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(RequestError, match="max_model_len"):
        eng.add_request(list(range(5, 45)), SamplingParams(max_tokens=4))
    while eng.has_unfinished():
        eng.step()
    assert ok.finished and len(ok.output_ids) >= 1


def test_a_request_whose_sampling_raises_fails_alone(shard, tok, monkeypatch):
    """If a request's row cannot be sampled on the device, only that request ends (with an
    error); the others in the same steps get their undisturbed tokens."""
    from raydecode.engine import sampling

    prompts = ["alpha beta", "gamma delta", "epsilon"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng = make_engine(shard, tok)
    want = [r.output_ids for r in eng.generate(prompts, greedy)]
    real, cursed = sampling.gumbel, 424242

    def gumbel(seed, counter, V, device):
        if bool((seed == cursed).any()):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(seed, counter, V, device)

    monkeypatch.setattr(sampling, "gumbel", gumbel)
    eng = make_engine(shard, tok)
    a = eng.add_request(prompts[0], greedy)
    bad = eng.add_request(prompts[1], SamplingParams(max_tokens=8, temperature=0.9,
                                                     seed=cursed, ignore_eos=True))
    c = eng.add_request(prompts[2], greedy)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert a.output_ids == want[0] and c.output_ids == want[2]
    assert bad.finish_reason == "error" and bad.output_ids == []
    errs = [o for o in outs if o.error]
    assert len(errs) == 1 and errs[0].request_id == bad.request_id
    assert "probability tensor" in errs[0].error


def test_seeded_requests_draw_the_same_tokens_alone_or_batched(shard, tok):
    """Counter-based sampling: a seeded request's tokens do not depend on its batch."""
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    alone = make_engine(shard, tok).generate(["the same prompt"], p)[0].output_ids
    eng = make_engine(shard, tok)
    batched = eng.generate(["other words", "the same prompt", "third one here"],
                           SamplingParams(max_tokens=12, temperature=1.0, seed=99,
                                          ignore_eos=True))
    assert batched[1].output_ids == alone
    assert len(set(alone)) > 2


def test_split_mixed_steps_do_not_change_tokens(shard, tok):
    """Decode tokens kept out of prefill steps (split_mixed) give the same greedy tokens as the
    mixed policy: prompts chunked at 8 tokens arriving while others decode."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = ["short", "a fairly long prompt that is cut into several prefill chunks " * 2,
               "third prompt here", "x"]
    outs = {}
    for split in (False, True):
        eng = make_engine(shard, tok, max_num_batched_tokens=8, split_mixed=split)
        reqs = [eng.add_request(prompts[0], params)]
        eng.step()                                  # the first decodes while the rest arrive
        reqs += [eng.add_request(p, params) for p in prompts[1:]]
        while eng.has_unfinished():
            eng.step()
        outs[split] = [r.output_ids for r in reqs]
        assert (eng.scheduler.num_split_steps > 0) == split
    assert outs[True] == outs[False]
