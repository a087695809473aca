"""Scheduler policy, driven without a model: a step 'runs' by marking its tokens cached and
appending one token to every sequence whose chunk reached its end."""
from raydecode.engine.request import Request, SamplingParams, Status
from raydecode.engine.scheduler import Scheduler, SchedulerConfig


def run_step(s: Scheduler, next_tok: int = 5):
    plan = s.schedule()
    if plan is None:
        return None
    for req, seq in zip(s.requests_of(plan), plan.batch.seqs):
        assert plan.tokens[seq.start:seq.end] == req.all_ids[req.num_cached:req.num_cached + seq.length]
        assert seq.pos == req.num_cached
        req.num_cached += seq.length
        if req.num_cached == req.num_tokens:
            req.output_ids.append(next_tok)
    return plan


def req(n, max_tokens=8):
    return Request(prompt_ids=list(range(1, n + 1)), params=SamplingParams(max_tokens=max_tokens))


def test_long_prompt_is_chunked_and_decode_keeps_running():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, num_blocks=64, block_size=4))
    a = req(3)
    s.add(a)
    run_step(s)                       # a prefilled, sampled its first token
    b = req(20)
    s.add(b)
    lengths = []
    for _ in range(4):
        plan = run_step(s)
        lengths.append({rid: seq.length for rid, seq in zip(plan.request_ids, plan.batch.seqs)})
    # a decodes one token every step while b's prompt arrives in chunks within the budget
    assert all(l[a.request_id] == 1 for l in lengths)
    assert [l.get(b.request_id) for l in lengths[:3]] == [7, 7, 6]
    assert all(sum(l.values()) <= 8 for l in lengths)
    assert b.num_cached == 21 and len(b.output_ids) == 2


def test_block_tables_grow_and_new_slots_reset():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, num_blocks=16, block_size=4))
    a = req(5)
    s.add(a)
    plan = run_step(s)
    assert plan.reset_slots == [a.slot]
    assert len(plan.block_tables[a.slot]) == 2          # 5 tokens / 4 per block
    for _ in range(3):
        plan = run_step(s)
    assert len(s.blocks.tables[a.slot]) == 2            # 8 cached tokens fit 2 blocks
    plan = run_step(s)
    assert plan.block_tables[a.slot] == s.blocks.tables[a.slot]
    assert len(s.blocks.tables[a.slot]) == 3            # the 9th cached token opens a third


def test_preemption_frees_cache_and_recomputes_with_generated_prefix():
    # 6 blocks of 4 tokens: two sequences of 10 tokens fit at first, then the cache runs out
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, num_blocks=6, block_size=4))
    a, b = req(10), req(10)
    s.add(a); s.add(b)
    run_step(s)
    assert a.status is Status.RUNNING and b.status is Status.RUNNING
    for _ in range(6):
        run_step(s)
    assert s.num_preemptions >= 1 and b.num_preemptions >= 1
    # b lost nothing: its prompt and generated tokens are intact and it is re-queued or re-running
    assert b.all_ids[:10] == list(range(1, 11)) and all(t == 5 for t in b.output_ids)
    assert s.blocks.num_free + sum(len(t) for t in s.blocks.tables.values()) == 6


def test_finish_releases_slot_and_blocks():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=16, num_blocks=4, block_size=4))
    a, b = req(4), req(4)
    s.add(a); s.add(b)
    run_step(s)
    assert b.status is Status.WAITING                   # one slot only
    s.finish(a)
    assert s.blocks.num_free == 4 and s.slots.num_free == 1
    plan = run_step(s)
    assert plan.request_ids == [b.request_id]


def _is_decode_only(s: Scheduler, plan) -> bool:
    return all(seq.length == 1 for seq in plan.batch.seqs) and all(
        r.num_cached >= len(r.prompt_ids) for r in s.requests_of(plan))


def test_split_mixed_steps_alternate_and_never_mix_decodes_into_a_prefill():
    """split_mixed: while b's 20-token prompt prefills and a, c decode, every step is either
    decode tokens alone or b's chunk alone; the two alternate (a decode never waits two steps),
    and the prompt still arrives in budget-sized chunks."""
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, num_blocks=64,
                                  block_size=4, split_mixed=True))
    a, c = req(3, max_tokens=30), req(2, max_tokens=30)
    s.add(a)
    s.add(c)
    run_step(s)                               # both prefill together (nothing decodes yet)
    b = req(20)
    s.add(b)
    kinds, chunks = [], []
    while b.num_cached < 20:
        plan = run_step(s)
        ids = set(plan.request_ids)
        if b.request_id in ids:
            assert ids == {b.request_id}, ids          # a prefill step carries no decode
            chunks.append(plan.batch.seqs[0].length)
            kinds.append("prefill")
        else:
            assert ids == {a.request_id, c.request_id} and _is_decode_only(s, plan)
            kinds.append("decode")
    assert chunks == [8, 8, 4]
    assert kinds == ["prefill", "decode", "prefill", "decode", "prefill"]
    assert s.num_split_steps == 5
    plan = run_step(s)                        # b decodes with the others now: no split
    assert set(plan.request_ids) == {a.request_id, b.request_id, c.request_id}
    assert s.num_split_steps == 5


def test_prompt_chunks_shrink_while_others_decode():
    """prefill_tokens_while_decoding = 3: while a decodes, b's 20-token prompt (admission
    included) arrives 3 tokens per step in split and mixed steps alike; once a finishes, the
    rest comes in budget-sized chunks; a prompt that arrives when nothing decodes is not
    capped."""
    for split in (False, True):
        s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, num_blocks=64,
                                      block_size=4, split_mixed=split,
                                      prefill_tokens_while_decoding=3))
        first = req(16)
        s.add(first)
        plan = run_step(s)
        assert [q.length for q in plan.batch.seqs] == [8]      # nothing decodes: the budget
        run_step(s)                                            # first's last 8
        a = first
        a.params = SamplingParams(max_tokens=4)
        b = req(20)
        s.add(b)
        chunks = []
        while b.num_cached < 20:
            plan = run_step(s)
            got = {rid: q.length for rid, q in zip(plan.request_ids, plan.batch.seqs)}
            if b.request_id in got:
                chunks.append(got[b.request_id])
            if a in s.running and len(a.output_ids) >= a.params.max_tokens:
                s.finish(a)
        assert chunks[:2] == [3, 3], (split, chunks)
        assert max(chunks) == 8 and sum(chunks) == 20, (split, chunks)   # a gone: budget


def test_split_mixed_off_is_the_mixed_policy():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, num_blocks=64,
                                  block_size=4))
    a = req(3)
    s.add(a)
    run_step(s)
    b = req(20)
    s.add(b)
    plan = run_step(s)
    assert set(plan.request_ids) == {a.request_id, b.request_id} and s.num_split_steps == 0


def test_split_mixed_runs_decodes_when_the_prefill_half_cannot_run():
    """No blocks for the waiting prompt: the prefill half runs nothing, so the decodes run in
    that step rather than the replica idling."""
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, num_blocks=3,
                                  block_size=4, split_mixed=True))
    a = req(3, max_tokens=4)
    s.add(a)
    run_step(s)
    s.add(req(40))                            # a 12-token chunk: 3 blocks, 2 are free
    plan = run_step(s)
    assert plan is not None and plan.request_ids == [a.request_id]
