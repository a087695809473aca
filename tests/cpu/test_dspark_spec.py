"""DSpark speculative decoding through the real loop on the tiny model: greedy output equals
non-speculative output, KDA rollback equals decoding only the accepted tokens, probabilistic
mode keeps the target distribution (and a broken rule is caught), synthetic mode hits its
acceptance length, TP=2 / DCP=2 over gloo, and the CLI.

Drafters: `random` is the tiny preset (random weights: low acceptance). `matched` is a real
DSpark module whose weights are constructed from the target's own greedy continuation: its
backbone output is zeroed (final_norm = 0, so the base logits are 0) and its Markov head is
the bigram table of that continuation (rank = vocab, w1 = I, w2[next, prev] = 20), so it
proposes what the target will say wherever the previous token determines it (high acceptance,
with partial rejections where it does not).
"""
import copy
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raydecode.cli import main
from raydecode.engine.engine import EngineConfig, LLMEngine, LocalExecutor
from raydecode.engine.loader import load_tokenizer
from raydecode.engine.request import SamplingParams
from raydecode.engine.runner import ModelRunner
from raydecode.engine.sampling import filter_logits
from raydecode.engine.spec_engine import SpecConfig, SpecEngine, verify_in_envelope
from raydecode.engine.spec_runner import SpecRunner, SpecSeq, SpecStepPlan
from raydecode.engine.scheduler import StepPlan
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import ConfigError
from raydecode.models.dspark import load_dspark_config, parse_dspark_config
from raydecode.models.dspark_checkpoint import build_drafter, load_drafter
from raydecode.models.k3 import make_caches
from raydecode.models.parallel import Parallel, TorchComm
from raydecode.models.weights import load_model

from _net import free_port

torch.set_num_threads(1)
PROMPT = "The river ran past the old mill"
GREEDY = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
CHI2_DF3_P001 = 16.266          # chi-square critical value, 3 degrees of freedom, alpha = 0.001


@pytest.fixture(scope="module")
def target():
    return load_model("tiny", dtype=torch.float32)[1]     # the tiny checkpoint's weights


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def engine_cfg(**kw):
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_model_len", 512)
    kw.setdefault("block_size", 8)
    return EngineConfig(**kw)


def spec_engine(target, drafter, tok, k=4, synthetic=None, **kw):
    ecfg = engine_cfg(**kw)
    caches = make_caches(target.cfg, target.par, ecfg.max_num_seqs, ecfg.blocks, ecfg.block_size,
                         target.dtype, extra_mla_layers=drafter.cfg.num_layers)
    runner = SpecRunner(ModelRunner(target, caches), drafter)
    return SpecEngine(LocalExecutor(runner), tok, ecfg, (target.cfg.eos_token_id,),
                      SpecConfig(k, synthetic))


def stock_engine(target, tok, **kw):
    ecfg = engine_cfg(**kw)
    caches = make_caches(target.cfg, target.par, ecfg.max_num_seqs, ecfg.blocks, ecfg.block_size,
                         target.dtype)
    return LLMEngine(LocalExecutor(ModelRunner(target, caches)), tok, ecfg,
                     (target.cfg.eos_token_id,))


def markov_drafter(target, w1, w2, **kw):
    """A DSpark drafter (tiny layout, rank = w1's width) whose base logits are 0 and whose
    Markov head is (w1, w2)."""
    raw = load_dspark_config("tiny").raw | {"markov_rank": w1.shape[1]}
    dcfg = parse_dspark_config(raw, name="tiny-markov")
    kw.setdefault("dtype", target.dtype)
    return build_drafter(dcfg, target, tensors={
        "final_norm.weight": torch.zeros(dcfg.hidden_size),
        "markov_head.markov_w1.weight": w1, "markov_head.markov_w2.weight": w2}, **kw)


def bigram_drafter(target, ids: list[int], **kw):
    V = target.cfg.vocab_size
    w2 = torch.zeros(V, V)
    for prev, nxt in zip(ids, ids[1:]):
        w2[:, prev] = 0.0
        w2[nxt, prev] = 20.0
    return markov_drafter(target, torch.eye(V), w2, **kw)


@pytest.fixture(scope="module")
def reference(target, tok):
    return stock_engine(target, tok).generate([PROMPT], GREEDY)[0].output_ids


# ---- greedy: speculative == non-speculative ---------------------------------------------------

def test_greedy_random_drafter_equals_stock(target, tok, reference):
    eng = spec_engine(target, load_drafter("tiny", target), tok, k=4)
    out = eng.generate([PROMPT], GREEDY)[0]
    assert out.output_ids == reference and len(reference) == 128
    m = eng.metrics()
    assert 1.0 <= m["mean_acceptance_length"] < 1.3          # random drafts: almost all rejected
    assert len(m["acceptance_rate_per_position"]) == 4


def test_greedy_matched_drafter_equals_stock(target, tok, reference):
    ids = tok.encode(PROMPT) + reference
    eng = spec_engine(target, bigram_drafter(target, ids), tok, k=7)
    out = eng.generate([PROMPT], GREEDY)[0]
    assert out.output_ids == reference and out.finish_reason == "length"
    a = eng.acceptance
    assert a.mean_length > 3.0                               # most blocks largely accepted
    assert a.steps < 128 / 3
    rates = a.position_rates
    assert all(x >= y for x, y in zip(rates, rates[1:])) and rates[0] > 0.5


def test_mixed_batches_with_chunked_prefill_equal_stock(target, tok):
    """Prefill chunks, plain decodes and verify slices share steps; outputs unchanged."""
    prompts = [PROMPT, "Questions people ask: What time is it? How far is the station?", "hi"]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ref = [r.output_ids for r in stock_engine(target, tok).generate(prompts, params)]
    eng = spec_engine(target, load_drafter("tiny", target), tok, k=3,
                      max_num_batched_tokens=12)
    assert [r.output_ids for r in eng.generate(prompts, params)] == ref
    assert eng.acceptance.steps > 0


# ---- KDA rollback ------------------------------------------------------------------------------

def test_kda_state_after_rejections_equals_decoding_only_accepted_tokens(tok, reference):
    """After every speculative step the slot's conv tail and fp32 state equal those obtained
    by decoding, one token at a time from the pre-step caches, only the tokens the engine now
    counts as cached (< 1e-5). The activations run in float64 (the KDA state stays fp32): the
    verify pushes k+1 tokens through chunked KDA and batched matmuls, the reference one at a
    time, and in float32 that alone differs by up to ~1e-5 with no rollback involved."""
    target = load_model("tiny", dtype=torch.float64)[1]
    ids = tok.encode(PROMPT) + reference
    # a bigram table with a hole: full, partial and zero acceptance all occur
    eng = spec_engine(target, bigram_drafter(target, ids[:20] + ids[40:]), tok, k=5)
    req = eng.add_request(PROMPT, SamplingParams(max_tokens=60, temperature=0.0,
                                                 ignore_eos=True))
    caches = eng.executor.runner.caches
    seen = set()
    with torch.inference_mode():
        while not req.finished:
            before, n0 = copy.deepcopy(caches), req.num_cached
            eng.step()
            if req.finished or n0 == 0:
                continue
            seen.add(eng.last_acceptance[req.request_id])
            before.mla.block_tables.update(caches.mla.block_tables)
            for t in range(n0, req.num_cached):
                target(torch.tensor(req.all_ids[t:t + 1]), StepBatch.decode([req.slot], [t]),
                       before)
            for a, b in ((caches.kda.conv, before.kda.conv), (caches.kda.rec, before.kda.rec)):
                err = (a[:, req.slot] - b[:, req.slot]).abs().max().item()
                assert err < 1e-5, (req.num_cached, err)
    assert {1, 6} <= seen and any(1 < x < 6 for x in seen), seen     # none, all and partial


# ---- probabilistic: the emitted distribution is the target's -----------------------------------

def _first_token_counts(target, tok, runner_cls, rounds=8, B=64, k=3):
    """B copies of one prefilled sequence; each round restores their KDA state and runs ONE
    speculative step with fresh seeds. The drafter proposes from q = (.01, .01, .01, .97) on the
    target's top-4 tokens ranked by p (far from p, overlapping it). Returns (counts of the
    first emitted token over the support, p over the support)."""
    params = SamplingParams(temperature=1.0, top_k=4)
    prompt = tok.encode(PROMPT)
    anchor = 200
    P = len(prompt)
    with torch.inference_mode():
        logits = target.compute_logits(target(torch.tensor(prompt + [anchor]))[-1:])[0]
    p = torch.softmax(filter_logits(logits, params), -1)
    support = p.argsort(descending=True)[:4]
    V, r = target.cfg.vocab_size, 4
    w1 = torch.zeros(V, r)
    w1[anchor, 0] = 1.0
    w2 = torch.full((V, r), 0.0)
    w2[:, 0] = -30.0
    w2[support, 0] = torch.tensor([0.01, 0.01, 0.01, 0.97]).log()
    drafter = markov_drafter(target, w1, w2)
    caches = make_caches(target.cfg, target.par, B, B, 32, extra_mla_layers=drafter.cfg.num_layers)
    runner = runner_cls(ModelRunner(target, caches), drafter)
    tables = {i: [i] for i in range(B)}
    runner.run(StepPlan(0, StepBatch([SeqSlice(i, i * P, P, 0) for i in range(B)]), prompt * B,
                        [i * P + P - 1 for i in range(B)], tables, list(range(B))))
    conv, rec = caches.kda.conv.clone(), caches.kda.rec.clone()
    counts = torch.zeros(V)
    for rnd in range(rounds):
        caches.kda.conv.copy_(conv)
        caches.kda.rec.copy_(rec)
        spec = [SpecSeq(f"{rnd}-{i}", i, i * (k + 1), P, params, seed=rnd * B + i)
                for i in range(B)]
        plan = SpecStepPlan(rnd + 1, StepBatch([SeqSlice(i, i * (k + 1), k + 1, P)
                                                for i in range(B)]),
                            [anchor] + [0] * k, [], {}, [], spec=spec, num_drafts=k,
                            release_ids=[f"{rnd - 1}-{i}" for i in range(B)])
        plan.tokens = plan.tokens * B
        for e in runner.run(plan).emitted:
            counts[e[0]] += 1
    assert counts.sum() == counts[support].sum()            # nothing outside top-4 is emitted
    return counts[support], p[support]


def _chi2(counts, probs):
    exp = probs * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum())


def test_rejection_sampling_through_the_loop_keeps_the_target_distribution(target, tok):
    counts, p = _first_token_counts(target, tok, SpecRunner)
    assert _chi2(counts, p) < CHI2_DF3_P001


def test_broken_acceptance_rule_fails_the_same_test(target, tok, monkeypatch):
    """A classic bug: on rejection, sample the target distribution p instead of the residual
    norm(max(0, p - q))."""
    from raydecode.engine import spec_sampling
    monkeypatch.setattr(spec_sampling, "residual", lambda p, q: p)
    counts, p = _first_token_counts(target, tok, SpecRunner)
    assert _chi2(counts, p) > CHI2_DF3_P001


# ---- synthetic acceptance (benchmarks) ---------------------------------------------------------

def test_synthetic_mean_acceptance_length_over_1000_steps(target, tok):
    L, k = 4.3, 7
    eng = spec_engine(target, load_drafter("tiny", target), tok, k=k, synthetic=L,
                      max_num_seqs=20, max_model_len=400)
    params = SamplingParams(max_tokens=380, temperature=0.0, ignore_eos=True)
    for i in range(20):
        eng.add_request(f"prompt {i}", params)
    while eng.acceptance.steps < 1000:
        eng.step()
    m = eng.metrics()
    assert abs(m["mean_acceptance_length"] - L) <= 0.05
    assert m["synthetic"] and eng.outputs_meaningless
    rates = m["acceptance_rate_per_position"]
    assert all(x >= y for x, y in zip(rates, rates[1:]))
    assert rates[2] == 1.0 and rates[4] == 0.0          # ⌊L-1⌋ = 3 always, never 5


# ---- envelope and config checks ----------------------------------------------------------------

def test_envelope_and_config_checks():
    assert verify_in_envelope(8, 7) and verify_in_envelope(16, 3)
    assert not verify_in_envelope(9, 7)          # 9·8 = 72 > 64
    assert not verify_in_envelope(1, 2) and not verify_in_envelope(1, 8)
    with pytest.raises(ConfigError, match="1 <= L <= k\\+1"):
        SpecConfig(3, synthetic_length=5.0)
    with pytest.raises(ConfigError, match="num_drafts"):
        SpecConfig(0)
    from raydecode.engine.spec_engine import build_local_spec_engine
    with pytest.raises(ConfigError, match="blocks of 7"):
        build_local_spec_engine("tiny", 8)
    plan = SpecStepPlan(1, StepBatch([SeqSlice(0, 0, 5, 9), SeqSlice(1, 5, 1, 3)]), [0] * 6,
                        [5], {}, [], spec=[SpecSeq("a", 0, 0, 9, SamplingParams(), 1)],
                        num_drafts=4)
    assert plan.spec_k == 4 and plan.verify_tokens == 5 and plan.decode_only


# ---- TP = 2 and DCP = 2 over gloo --------------------------------------------------------------

def _tp_worker(rank, world, port, prompt_ids, ref):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        tok = load_tokenizer("tiny")
        for dcp in (1, 2):
            par = Parallel(rank, world, dcp)
            comm = TorchComm(par)
            model = load_model("tiny", par, comm, torch.float32)[1]
            eng = spec_engine(model, load_drafter("tiny", model, par, comm), tok, k=3)
            greedy = SamplingParams(max_tokens=len(ref), temperature=0.0, ignore_eos=True)
            assert eng.generate([prompt_ids], greedy)[0].output_ids == ref, dcp
            sampled = eng.generate([prompt_ids], SamplingParams(max_tokens=8, temperature=0.9,
                                                                seed=5, ignore_eos=True))
            mine = torch.tensor(sampled[0].output_ids)
            both = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(both, mine)
            assert torch.equal(both[0], both[1]), dcp      # ranks agree on every token
    finally:
        dist.destroy_process_group()


def test_tp2_and_dcp2_speculative_greedy_equals_tp1_stock(tok, reference):
    mp.spawn(_tp_worker, args=(2, free_port(), tok.encode(PROMPT), reference[:16]), nprocs=2,
             join=True)


# ---- CLI ---------------------------------------------------------------------------------------

def test_cli_generate_with_dspark(capsys):
    r = subprocess.run([sys.executable, "-m", "raydecode.cli", "generate", "--model", "tiny",
                        "--prompt", "Hello there", "--max-tokens", "8", "--spec", "dspark",
                        "--num-draft", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr and "mean acceptance length" in r.stderr and r.stdout.strip()
    assert main(["generate", "--model", "tiny", "--prompt", "Hi", "--max-tokens", "16",
                 "--spec", "dspark", "--num-draft", "7", "--synthetic-acceptance", "6"]) == 0
    err = capsys.readouterr().err
    assert "meaningless" in err and "mean acceptance length 6.00" in err
    assert main(["generate", "--model", "tiny", "--prompt", "Hi", "--spec", "dspark",
                 "--num-draft", "8"]) == 2
    assert "--num-draft 8" in (err := capsys.readouterr().err) and "accepted 1..7" in err
    assert main(["generate", "--model", "tiny", "--prompt", "Hi", "--num-draft", "3"]) == 2
    assert "only with --spec dspark" in capsys.readouterr().err


# ---- the same test on the spec graphs (engine/spec_graph.py, sampling mode) -----------------------

def _first_token_counts_graphed(tok, rounds=32, B=16, k=3):
    """`_first_token_counts` through the graphed speculative step (bf16 target, the spec
    graphs' statics path run eagerly on the CPU, the sampling-mode graph D: counter-based
    draft sampling on device tensors, then `verify`): B ≤ 64 / (k+1) sequences per step."""
    from raydecode.engine.spec_runner import graphed_spec_runner
    from raydecode.engine.step_graph import graph_cache_sizes

    target = load_model("tiny", dtype=torch.bfloat16)[1]
    params = SamplingParams(temperature=1.0, top_k=4)
    prompt, anchor = tok.encode(PROMPT), 200
    P, V, r = len(prompt), target.cfg.vocab_size, 4
    w1 = torch.zeros(V, r)
    w1[anchor, 0] = 1.0
    w2 = torch.full((V, r), 0.0)
    drafter = markov_drafter(target, w1, w2)
    ns, nb = graph_cache_sizes(B, B)
    caches = make_caches(target.cfg, target.par, ns, nb, 32, torch.bfloat16,
                         extra_mla_layers=drafter.cfg.num_layers)
    runner = graphed_spec_runner(target, caches, drafter, "cpu", B, B, auto=False,
                                 capture=False)
    tables = {i: [i] for i in range(B)}
    runner.run(StepPlan(0, StepBatch([SeqSlice(i, i * P, P, 0) for i in range(B)]), prompt * B,
                        [i * P + P - 1 for i in range(B)], tables, list(range(B))))
    conv, rec = caches.kda.conv.clone(), caches.kda.rec.clone()

    def plan(rnd):
        spec = [SpecSeq(f"{rnd}-{i}", i, i * (k + 1), P, params, seed=rnd * B + i)
                for i in range(B)]
        return SpecStepPlan(rnd + 1, StepBatch([SeqSlice(i, i * (k + 1), k + 1, P)
                                                for i in range(B)]),
                            ([anchor] + [0] * k) * B, [], {}, [], "specialized", spec=spec,
                            num_drafts=k)
    # p: the target distribution of the first emitted token, from the verify step's own row 0
    # (causal: it does not depend on the drafts; bf16, so not the stock path's logits)
    g, _ = runner.graphs.prepare(plan(-1), runner._rows(plan(-1)), False)
    runner.graphs.draft(g)
    logits = runner.graphs.verify_logits(g)[0, 0]
    p = torch.softmax(filter_logits(logits.float(), params), -1)
    support = p.argsort(descending=True)[:4]
    with torch.no_grad():                         # the drafter's q on the support, as above
        drafter.markov_head.markov_w2.weight[:, 0] = -30.0
        drafter.markov_head.markov_w2.weight[support, 0] = torch.tensor(
            [0.01, 0.01, 0.01, 0.97]).log().to(torch.bfloat16)
    counts = torch.zeros(V)
    for rnd in range(rounds):
        caches.kda.conv.copy_(conv)
        caches.kda.rec.copy_(rec)
        for e in runner.run(plan(rnd)).emitted:
            counts[e[0]] += 1
    assert runner.counts == {"graphed": rounds, "eager": 0}
    assert set(runner.graphs.graphs) == {(B, k, False)}      # the sampling-mode graphs
    assert counts.sum() == counts[support].sum()
    return counts[support], p[support]


def test_rejection_sampling_on_the_spec_graphs_keeps_the_target_distribution(tok):
    counts, p = _first_token_counts_graphed(tok)
    assert _chi2(counts, p) < CHI2_DF3_P001


def test_broken_acceptance_rule_fails_the_same_test_on_the_spec_graphs(tok, monkeypatch):
    from raydecode.engine import spec_sampling
    monkeypatch.setattr(spec_sampling, "residual", lambda p, q: p)
    counts, p = _first_token_counts_graphed(tok)
    assert _chi2(counts, p) > CHI2_DF3_P001
