"""The continuous-batching engine against the one-request-at-a-time reference path (tiny random models)."""
from collections import Counter

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from minillm.engine.llm_engine import LLMEngine
from minillm.engine.simple import SimpleGenerator
from minillm.sampling.params import SamplingParams
from tests.tiny_models import random_model

MODEL = random_model(seed=0, heads=4, kv_heads=2, layers=2, vocab=128)
GQA_MODEL = random_model(seed=1, heads=6, kv_heads=1, layers=1, vocab=128)
MODELS = {"h4kv2": MODEL, "h6kv1": GQA_MODEL}          # by name: a failing example prints the name, not the model
_ref_cache: dict = {}


def reference(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy output of the one-request-at-a-time path (contiguous cache, prefill then decode). Greedy only: a
    sampled reference through the engine's own Sampler would check the sampler against itself (sampled_reference)."""
    assert params.greedy, "reference() is the greedy path; use sampled_reference for sampled requests"
    key = (id(model), tuple(prompt), params.max_tokens)
    if key not in _ref_cache:
        _ref_cache[key] = SimpleGenerator(model, None).generate(prompt, params)[1]
    return _ref_cache[key]


def sampled_reference(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """A seeded request's tokens from the definitions, sharing nothing with the engine but the model's forward pass:
    every step recomputes the logits of the whole sequence (no KV reuse), takes the distribution from
    tests/test_sampling.reference_probs (numpy: temperature, min-p, top-k, top-p) and draws as the sampler's
    contract says: argmax(p / E), E ~ Exp(1) over the vocabulary from the request's torch.Generator(seed)."""
    from tests.test_sampling import reference_probs
    from tests.tiny_models import minillm_logits
    assert params.seed is not None and not params.greedy and not params.has_penalties
    gen, tokens, out = torch.Generator().manual_seed(params.seed), list(prompt), []
    while len(out) < params.max_tokens:
        probs = reference_probs(minillm_logits(model, tokens)[-1], params)
        noise = torch.empty(len(probs)).exponential_(generator=gen)
        tok = int(torch.argmax(probs / noise.double()))
        tokens.append(tok)
        out.append(tok)
        if tok == model.cfg.eos_token_id and not params.ignore_eos:
            break
    return out


def finish_all(engine: LLMEngine, check=None) -> dict:
    """Step until no request is left: {request_id: its final RequestOutput}; check(engine) after every step."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            check(engine)
    return done


def run_engine(engine: LLMEngine, requests, arrivals=None, check=None) -> dict[str, list[int]]:
    """requests: list of (prompt, params); arrivals[i] = step at which request i is added (default 0)."""
    arrivals = arrivals or [0] * len(requests)
    done, step, pending = {}, 0, sorted(range(len(requests)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(requests[i][0], requests[i][1], request_id=str(i))
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
            if check:
                check(engine)
        step += 1
        assert step < 5000, "no progress: a request is starving"
    return done


request_sets = st.lists(st.tuples(st.lists(st.integers(3, 127), min_size=1, max_size=40), st.integers(1, 12)),
                        min_size=1, max_size=6)


# ---------------------------------------------------------------- what a run exercised, seen from the step observer

def watch(engine: LLMEngine) -> Counter:
    """Count, over the engine's steps from now on, the hard paths of the scheduler and the runner, from what the step
    observer shows (the scheduled (sequence, n) pairs, the preempted, the queues as each step began):
    chunk: a prefill chunk that stops short of the sequence's end (no token sampled from it);
    preemption: a running sequence sent back to the queue;
    prefix_hit: a sequence admitted with cached tokens already in the KV cache;
    recompute_across_prompt_end: after a preemption, one chunk that holds the prompt's last token and generated ones
    (_sampled: and reaches the sequence's end, so the next token comes from its last row);
    chunk_after_hit: a prefill chunk whose sequence started from cached blocks, cut short."""
    seen: Counter = Counter()
    hit_seqs: set[int] = set()

    def observe(info) -> None:
        waiting = {id(s.seq): s for s in info.waiting_before}
        before = {id(s.seq): s for s in info.running_before} | waiting
        seen["preemption"] += len(info.scheduler_output.preempted)
        for seq, n in info.scheduler_output.scheduled:
            start = seq.num_computed_tokens - n            # committed at the end of the step: start + n
            if id(seq) in waiting and start > 0:
                seen["prefix_hit"] += 1
                hit_seqs.add(id(seq))
            if start + n < before[id(seq)].num_tokens:
                seen["chunk"] += 1
                seen["chunk_after_hit"] += id(seq) in hit_seqs
            if start < seq.num_prompt_tokens < start + n:
                seen["recompute_across_prompt_end"] += 1
                seen["recompute_across_prompt_end_sampled"] += start + n == before[id(seq)].num_tokens
        seen["steps"] += 1

    engine.add_step_observer(observe)
    return seen


# Over every example the property below runs (explicit and generated): what they exercised, and how many examples
# exercised chunked prefill, preemption and prefix-cache hits all together.
PROPERTY_SEEN: Counter = Counter()

# Examples built to reach every hard path in one run (test_each_hard_example_exercises_what_it_was_built_for
# checks that each still does): found by a search over small pools, budgets and shared prefixes.
HARD_PATHS = ("chunk", "preemption", "prefix_hit", "chunk_after_hit", "recompute_across_prompt_end")
SAMPLED = "recompute_across_prompt_end_sampled"
HARD_EXAMPLES = {   # name: (the example, what it must exercise besides HARD_PATHS)
    # preempted while decoding, re-admitted on its own cached blocks (its system prompt evicted or not), then its
    # last prompt token and its generated tokens are recomputed in one chunk that ends the sequence
    "block1": (dict(reqs=[(True, [91, 27, 81, 51], 4), (True, [50, 82, 51], 2)], system=[122, 80, 30, 3],
                    block_size=1, budget=5, max_seqs=3, spare_blocks=0, prefix=True, arrival_gaps=[1, 1, 2, 0, 0, 0],
                    model="h4kv2"), (SAMPLED,)),
    "block2": (dict(reqs=[(True, [111, 80, 15, 68], 4), (True, [50, 87], 3)], system=[30, 50, 11, 68], block_size=2,
                    budget=3, max_seqs=2, spare_blocks=0, prefix=True, arrival_gaps=[2, 1, 0, 0, 0, 1],
                    model="h4kv2"), (SAMPLED,)),
    "block4": (dict(reqs=[(True, [60, 108, 3], 3), (True, [50], 7)], system=[65, 66, 12, 71, 42, 99, 33, 64],
                    block_size=4, budget=6, max_seqs=3, spare_blocks=1, prefix=True, arrival_gaps=[1, 2, 2, 0, 2, 2],
                    model="h6kv1"), (SAMPLED,)),
    # the recompute across the prompt's end is itself cut short by the budget: the next chunk ends it
    "block2_chunked_recompute": (dict(reqs=[(True, [101, 98], 8), (False, [111, 52, 123], 7)], system=[99, 29, 21, 75],
                                      block_size=2, budget=4, max_seqs=2, spare_blocks=1, prefix=True,
                                      arrival_gaps=[0, 0, 1, 0, 1, 0], model="h4kv2"), ()),
    "block8_chunked_recompute": (dict(reqs=[(True, [104], 6), (True, [77, 100, 98], 4)],
                                      system=[83, 7, 104, 89, 19, 58, 27, 117, 127, 75, 81, 25], block_size=8,
                                      budget=8, max_seqs=2, spare_blocks=0, prefix=True,
                                      arrival_gaps=[1, 0, 1, 1, 1, 0], model="h6kv1"), ()),
}


def check_engine_equals_one_at_a_time(reqs, system, block_size, budget, max_seqs, spare_blocks, prefix, arrival_gaps,
                                      model) -> Counter:
    """reqs: (starts with the shared `system` prefix?, own tokens, max_tokens). Runs the engine greedy with a pool of
    the longest request's blocks + spare_blocks and the given token budget, checks every request's output against
    the one-request-at-a-time reference and the pool against leaks; returns what the run exercised (watch())."""
    model = MODELS[model]
    requests = [((system if shared else []) + own, SamplingParams(temperature=0, max_tokens=m)) for shared, own, m in reqs]
    longest = max(len(p) + params.max_tokens for p, params in requests)
    # the pool holds the longest request plus a few blocks: small enough to force preemption
    num_blocks = -(-longest // block_size) + spare_blocks
    engine = LLMEngine.from_model(model, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_seqs,
                                  max_num_batched_tokens=budget, enable_prefix_caching=prefix)
    arrivals = [sum(arrival_gaps[:i]) for i in range(len(requests))]
    seen = watch(engine)

    def check(e: LLMEngine):
        e.block_manager.check_invariants()

    done = run_engine(engine, requests, arrivals, check)
    for i, (p, params) in enumerate(requests):
        assert done[str(i)] == reference(model, p, params), f"request {i} differs"
    assert engine.block_manager.num_free_blocks == num_blocks  # everything back in the pool
    assert seen["prefix_hit"] <= engine.block_manager.stats.hits  # each admission with cached tokens hit >= 1 block
    return seen


tokens = st.integers(3, 127)


def with_hard_examples(test):
    for kw, _ in HARD_EXAMPLES.values():
        test = example(**kw)(test)
    return test


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@with_hard_examples
# boundaries: a one-token prompt; a prompt exactly filling a block; a budget of 1 token; a pool of exactly the
# longest request's blocks, one sequence at a time
@example(reqs=[(False, [5], 1)], system=[], block_size=1, budget=1, max_seqs=1, spare_blocks=0, prefix=True,
         arrival_gaps=[0] * 6, model="h4kv2")
@example(reqs=[(True, [], 3), (True, [9], 2)], system=[5, 6, 7, 8], block_size=4, budget=4, max_seqs=2,
         spare_blocks=0, prefix=True, arrival_gaps=[0, 1, 0, 0, 0, 0], model="h4kv2")
@example(reqs=[(False, [5, 6, 7], 4), (False, [8, 9], 4)], system=[], block_size=2, budget=1, max_seqs=2,
         spare_blocks=0, prefix=False, arrival_gaps=[0] * 6, model="h6kv1")
@given(reqs=st.lists(st.tuples(st.sampled_from([True, True, False]), st.lists(tokens, min_size=1, max_size=14),
                               st.one_of(st.integers(4, 16), st.integers(1, 3))), min_size=2, max_size=6),
       system=st.one_of(st.lists(tokens, min_size=8, max_size=24), st.lists(tokens, max_size=3)),
       block_size=st.sampled_from([1, 2, 4, 8, 16]),
       budget=st.one_of(st.integers(1, 8), st.integers(9, 64)), max_seqs=st.integers(1, 8),
       spare_blocks=st.one_of(st.integers(0, 2), st.integers(3, 12)), prefix=st.sampled_from([True, True, False]),
       arrival_gaps=st.lists(st.integers(0, 3), min_size=6, max_size=6), model=st.sampled_from(list(MODELS)))
def test_engine_greedy_equals_one_at_a_time(reqs, system, block_size, budget, max_seqs, spare_blocks, prefix,
                                            arrival_gaps, model):
    seen = check_engine_equals_one_at_a_time(reqs, system, block_size, budget, max_seqs, spare_blocks, prefix,
                                             arrival_gaps, model)
    PROPERTY_SEEN.update(seen)
    PROPERTY_SEEN["examples"] += 1
    PROPERTY_SEEN["all_three"] += bool(seen["chunk"] and seen["preemption"] and seen["prefix_hit"])


def test_the_property_reached_chunks_preemptions_and_prefix_hits_together():
    """The property above is only as strong as the paths it reached: over its examples, prefill chunks,
    preemptions, prefix-cache hits, chunks after a hit and recomputes across the prompt's end all happened, and
    every hard example (at least) had chunks, preemptions and hits in the same run."""
    if not PROPERTY_SEEN["examples"]:
        test_engine_greedy_equals_one_at_a_time()          # selected alone: run the property here
    print(dict(PROPERTY_SEEN))
    for what in HARD_PATHS + (SAMPLED,):
        assert PROPERTY_SEEN[what] > 0, (what, PROPERTY_SEEN)
    assert PROPERTY_SEEN["all_three"] >= len(HARD_EXAMPLES), PROPERTY_SEEN


@pytest.mark.parametrize("name", list(HARD_EXAMPLES))
def test_each_hard_example_exercises_what_it_was_built_for(name):
    kw, more = HARD_EXAMPLES[name]
    seen = check_engine_equals_one_at_a_time(**kw)
    for what in HARD_PATHS + more:
        assert seen[what] > 0, (what, seen)


@settings(max_examples=25, deadline=None, derandomize=True)
# a budget of one token (every prompt chunked to single tokens); a prompt of exactly one block, budget = one block;
# one sequence at a time with a one-token prompt
@example(reqs=[([5, 6, 7], 2), ([8], 3)], budget=1, max_seqs=6, block_size=2)
@example(reqs=[([5, 6, 7, 8], 2), ([9, 10, 11, 12, 13], 2)], budget=4, max_seqs=2, block_size=4)
@example(reqs=[([5], 1), ([6], 1)], budget=48, max_seqs=1, block_size=8)
@given(reqs=request_sets, budget=st.integers(1, 48), max_seqs=st.integers(1, 6), block_size=st.sampled_from([2, 4, 8]))
def test_every_step_respects_budget_and_max_seqs(reqs, budget, max_seqs, block_size):
    engine = LLMEngine.from_model(MODEL, num_blocks=200, block_size=block_size, max_num_seqs=max_seqs,
                                  max_num_batched_tokens=budget)
    for p, m in reqs:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    schedule, decisions = engine.scheduler.schedule, []

    def recording_schedule():
        out = schedule()
        decisions.append((out.num_batched_tokens, len(engine.scheduler.running), len(out.scheduled),
                          len({id(s) for s, _ in out.scheduled})))
        return out

    engine.scheduler.schedule = recording_schedule
    total = sum(len(p) + m for p, m in reqs)
    while engine.has_unfinished_requests():
        engine.step()
        # every step computes at least one token, so the work bounds the number of steps
        assert len(decisions) <= total, "some request is starving"
    for tokens, running, n, distinct in decisions:
        assert 0 < tokens <= budget and running <= max_seqs and n == distinct


def test_chunked_prefill_mixes_with_decodes():
    engine = LLMEngine.from_model(MODEL, num_blocks=64, block_size=4, max_num_batched_tokens=8)
    engine.add_request([5] * 3, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()                                              # short prompt prefilled, now decoding
    engine.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    sched = engine.scheduler.schedule()
    sizes = sorted(n for _, n in sched.scheduled)
    assert sizes == [1, 7], sizes                              # one decode + a 7-token prefill chunk fill the budget


def test_preempted_request_resumes_with_same_output():
    prompts = [list(range(3, 30)), list(range(40, 70)), list(range(70, 90))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = LLMEngine.from_model(MODEL, num_blocks=14, block_size=4, max_num_seqs=3)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        engine.block_manager.check_invariants()
    assert sum(o.metrics.num_preemptions for o in outs.values()) > 0, "the pool was meant to force preemption"
    for i, p in enumerate(prompts):
        assert outs[str(i)].token_ids == reference(MODEL, p, params)


def test_preemption_happens_and_is_newest_first():
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine = LLMEngine.from_model(MODEL, num_blocks=12, block_size=4, max_num_seqs=4)
    for i in range(3):
        engine.add_request(list(range(3 + i, 15 + i)), params, request_id=str(i))
    preempted = []
    while engine.has_unfinished_requests():
        before = {s.request_id for s in engine.scheduler.running}
        engine.step()
        after_waiting = {s.request_id for s in engine.scheduler.waiting}
        preempted += sorted(before & after_waiting)
    assert preempted, "the pool was too small to need preemption: the test lost its point"
    assert "0" not in preempted            # the oldest request is never the victim while others run


@pytest.mark.parametrize("settings", [dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=5),
                                      dict(temperature=1.3, min_p=0.05, top_p=0.8)])
def test_seeded_sampling_through_the_engine_equals_the_definition(settings):
    """A seeded request gives the tokens of sampled_reference (numpy distributions, the documented draw), alone and
    batched with another request; an engine whose sampler ignores top-p / top-k / min-p gives other tokens."""
    from minillm.sampling.processors import process_logits
    from minillm.sampling.sampler import Sampler
    p = SamplingParams(max_tokens=12, seed=7, ignore_eos=True, **settings)
    prompt = list(range(3, 20))
    want = sampled_reference(MODEL, prompt, p)
    a = run_engine(LLMEngine.from_model(MODEL, num_blocks=32, block_size=4), [(prompt, p)])["0"]
    b = run_engine(LLMEngine.from_model(MODEL, num_blocks=32, block_size=4),
                   [(list(range(50, 90)), SamplingParams(temperature=1.0, max_tokens=12)), (prompt, p)])["1"]
    assert a == want and b == want
    wrong = LLMEngine.from_model(MODEL, num_blocks=32, block_size=4)
    wrong.plug(sampler=Sampler(process_fn=lambda x, t, k, top_p, m: process_logits(x, t, k * 0, top_p * 0 + 1, m * 0)))
    assert run_engine(wrong, [(prompt, p)])["0"] != want


def test_n_samples_fork_and_copy_on_write():
    """n=3 forks after the prompt; child k draws with seed+k: each gives sampled_reference's tokens for that seed."""
    prompt = list(range(3, 21))        # 18 tokens: the last block is partial and shared after the fork
    engine = LLMEngine.from_model(MODEL, num_blocks=40, block_size=4)
    rid = engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=10, seed=3, n=3, ignore_eos=True))
    outs, copies = {}, 0
    schedule = engine.scheduler.schedule

    def counting_schedule():
        nonlocal copies
        out = schedule()
        copies += len(out.block_copies)
        return out

    engine.scheduler.schedule = counting_schedule
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        engine.block_manager.check_invariants()
    out = outs[rid]
    assert len(out.outputs) == 3
    for k, c in enumerate(out.outputs):
        assert c.token_ids == sampled_reference(MODEL, prompt, SamplingParams(temperature=1.0, max_tokens=10,
                                                                            seed=3 + k, ignore_eos=True))
    assert engine.block_manager.num_free_blocks == 40
    assert copies >= 2, "each child's first write into the shared partial block must be copy-on-write"


def check_seeded_requests(reqs, block_size, budget, spare_blocks, prefix) -> Counter:
    """reqs: (prompt, max_tokens, sampling settings, seed, n). Every sample of every request gives sampled_reference's
    tokens for its seed (seed + k for the k-th of n), however the engine batched, chunked, preempted and
    recomputed it; returns what the run exercised (watch())."""
    requests = [(p, SamplingParams(max_tokens=m, seed=seed, n=n, ignore_eos=True, **kw)) for p, m, kw, seed, n in reqs]
    longest = max(len(p) + params.max_tokens for p, params in requests)
    engine = LLMEngine.from_model(MODEL, num_blocks=-(-longest // block_size) + spare_blocks, block_size=block_size,
                                  max_num_batched_tokens=budget, enable_prefix_caching=prefix, max_num_seqs=4)
    seen = watch(engine)
    for i, (p, params) in enumerate(requests):
        engine.add_request(p, params, request_id=str(i))
    outs = finish_all(engine)
    for i, (p, params) in enumerate(requests):
        for k, c in enumerate(outs[str(i)].outputs):
            own = SamplingParams(max_tokens=params.max_tokens, seed=params.seed + k, ignore_eos=True,
                                 temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                 min_p=params.min_p)
            assert c.token_ids == sampled_reference(MODEL, p, own), (i, k)
    return seen


# two requests sharing a prefix, one with n = 2, in a pool that preempts them: recompute across the prompt's end
SEEDED_UNDER_PRESSURE = dict(reqs=[([5, 6, 7, 8, 9, 10], 8, dict(temperature=1.0), 1, 2),
                                   ([5, 6, 7, 8, 13], 8, dict(temperature=0.8, top_p=0.9), 2, 1)],
                             block_size=2, budget=6, spare_blocks=0, prefix=True)
SETTINGS = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, top_k=5, min_p=0.05)]


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@example(**SEEDED_UNDER_PRESSURE)
@example(reqs=[([5], 1, SETTINGS[2], 0, 3)], block_size=1, budget=1, spare_blocks=0, prefix=False)   # one token
@given(reqs=st.lists(st.tuples(st.lists(tokens, min_size=1, max_size=20), st.integers(1, 10), st.sampled_from(SETTINGS),
                               st.integers(0, 1000), st.sampled_from([1, 1, 2])), min_size=1, max_size=4),
       block_size=st.sampled_from([1, 2, 4]), budget=st.integers(1, 16), spare_blocks=st.integers(0, 3),
       prefix=st.booleans())
def test_seeded_requests_equal_the_definition_under_memory_pressure(reqs, block_size, budget, spare_blocks, prefix):
    check_seeded_requests(reqs, block_size, budget, spare_blocks, prefix)


def test_the_seeded_example_under_pressure_preempts_and_recomputes():
    seen = check_seeded_requests(**SEEDED_UNDER_PRESSURE)
    assert seen["preemption"] and seen["prefix_hit"] and seen["recompute_across_prompt_end_sampled"], seen


def test_abort_frees_everything_and_unknown_is_noop():
    engine = LLMEngine.from_model(MODEL, num_blocks=30, block_size=4)
    a = engine.add_request(list(range(3, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    b = engine.add_request(list(range(3, 10)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < 30
    engine.abort(a)
    engine.abort("no-such-request")
    engine.abort(b)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 30
    engine.block_manager.check_invariants()


def test_prefix_cache_hit_keeps_outputs_and_counts_hits():
    system = list(range(3, 43))                # 40 shared tokens = 10 full blocks of 4
    reqs = [(system + [50 + i, 60 + i], SamplingParams(temperature=0, max_tokens=6)) for i in range(4)]
    on = LLMEngine.from_model(MODEL, num_blocks=80, block_size=4, enable_prefix_caching=True, max_num_seqs=1)
    off = LLMEngine.from_model(MODEL, num_blocks=80, block_size=4, enable_prefix_caching=False, max_num_seqs=1)
    assert run_engine(on, reqs) == run_engine(off, reqs)
    assert on.block_manager.stats.hits >= 3 * 10
    assert off.block_manager.stats.hits == 0


@pytest.mark.parametrize("prompt, params, words", [
    ([], {}, "empty"), (list(range(3, 100)) * 3, {}, "prompt has"),
    (list(range(3, 67)), {}, "64 tokens and needs room for at least one generated token"),   # exactly the pool
    ([3, 500], {}, "outside the vocabulary"),
    ([3, 4], {"stop_token_ids": [5, 10 ** 9]}, r"stop_token_ids \[1000000000\] are outside the vocabulary")])
def test_bad_prompts_rejected_without_holding_blocks(prompt, params, words):
    engine = LLMEngine.from_model(MODEL, num_blocks=16, block_size=4)   # pool: 64 tokens
    with pytest.raises(ValueError, match=words):
        engine.add_request(prompt, SamplingParams(**params))
    assert engine.block_manager.num_free_blocks == 16 and not engine.has_unfinished_requests()


def test_invalid_params_rejected_before_allocation():
    engine = LLMEngine.from_model(MODEL, num_blocks=16, block_size=4)
    params = SamplingParams()
    params.top_p = 0.0              # mutated after construction: add_request validates again
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request([3, 4, 5], params)
    assert engine.block_manager.num_free_blocks == 16 and not engine.has_unfinished_requests()


def test_context_window_finishes_with_length():
    engine = LLMEngine.from_model(MODEL, num_blocks=64, block_size=4, max_model_len=20)
    got = run_engine(engine, [(list(range(3, 18)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))])
    assert len(got["0"]) == 20 - 15


def test_triton_backend_matches_torch_backend_in_engine():
    reqs = [(list(range(3, 3 + n)), SamplingParams(temperature=0, max_tokens=4)) for n in (5, 11)]
    torch_out = run_engine(LLMEngine.from_model(MODEL, num_blocks=16, block_size=4, attention_backend="torch"), reqs)
    triton_out = run_engine(LLMEngine.from_model(MODEL, num_blocks=16, block_size=4, attention_backend="triton"), reqs)
    assert torch_out == triton_out


def test_bad_requests_arriving_mid_batch_leave_the_running_ones_untouched():
    """Poisoned requests offered between the steps of a running batch are each refused with an error, and the
    batch's outputs are exactly those of a clean run; no block is held by a refused request."""
    from minillm import StructuredOutputsParams
    good = [(list(range(3 + i, 20 + i)), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
            for i in range(4)]
    clean = run_engine(LLMEngine.from_model(MODEL, num_blocks=40, block_size=4), good)
    engine = LLMEngine.from_model(MODEL, num_blocks=40, block_size=4)
    for i, (p, params) in enumerate(good):
        engine.add_request(p, params, request_id=str(i))
    poison = [([3, 4], dict(temperature=float("nan"))), ([3, 4], dict(top_p=float("inf"))),
              ([3, 10 ** 6], {}), ([], {}), (list(range(3, 100)) * 3, {}), ([3, 4], dict(stop_token_ids=[-1])),
              ([3, 4], dict(seed="x")), ([3, 4], dict(max_tokens=0)),
              ("text without a tokenizer", {}),
              ([3, 4], dict(structured_outputs=StructuredOutputsParams(regex="(unclosed")))]
    refused, done = 0, {}
    while engine.has_unfinished_requests():
        if poison:
            prompt, kw = poison.pop()
            free_before = engine.block_manager.num_free_blocks
            with pytest.raises((ValueError, TypeError)):
                engine.add_request(prompt, SamplingParams(**kw) if "seed" not in kw else SamplingParams(seed=kw["seed"]))
            refused += 1
            assert engine.block_manager.num_free_blocks == free_before
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert refused == 10 and done == clean
    assert engine.block_manager.num_free_blocks == 40 and not engine.requests


def test_runner_positions_are_start_to_start_plus_n_and_rows_are_the_chunk_ends():
    """Chunked prefill of one prompt and decodes of others in one step: every sequence's positions are exactly
    num_computed_tokens ... num_computed_tokens + n - 1, and only chunks that reach a sequence's end yield a row."""
    from minillm.engine.inputs import prepare_inputs
    from minillm.engine.scheduler import SchedulerOutput
    from minillm.engine.sequence import Sequence
    from minillm.engine.stream import TextStream
    seqs = []
    for i, (prompt_len, computed) in enumerate([(10, 0), (10, 4), (7, 6)]):
        s = Sequence(str(i), list(range(3, 3 + prompt_len)), SamplingParams(),
                     TextStream(None, SamplingParams(), []), None, None)
        s.num_computed_tokens = computed
        seqs.append(s)
    out = SchedulerOutput(scheduled=[(seqs[0], 4), (seqs[1], 6), (seqs[2], 1)],
                          block_tables=[[0, 1, 2], [3, 4, 5], [6, 7]], slot_mapping=list(range(11)))
    inputs, rows, got = prepare_inputs(out)
    assert inputs.positions.tolist() == [0, 1, 2, 3] + list(range(4, 10)) + [6]
    assert inputs.input_ids.tolist() == list(range(3, 7)) + list(range(7, 13)) + [9]
    # batch rows 9 and 10 get logits; the runner returns just those, so the sequences read logits rows 0 and 1
    assert got == [seqs[1], seqs[2]] and inputs.sample_rows == [9, 10] and rows == [[0], [1]]


def test_rope_tables_at_large_positions_equal_the_closed_form():
    """cos/sin read from the cached table at and past its first edge (4096) equal cos/sin(position * inv_freq)
    computed directly in float64."""
    from minillm.layers.rotary import RotaryEmbedding
    rope = RotaryEmbedding(64, 100000.0, 8192, None)
    pos = torch.tensor([0, 1, 4095, 4096, 4097, 6000, 8191])
    cos, sin = rope.cos_sin(pos)
    inv = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    ang = pos.double()[:, None] * inv[None, :]
    want_cos, want_sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    assert (cos.double() - want_cos).abs().max() < 2e-3 and (sin.double() - want_sin).abs().max() < 2e-3
    assert torch.equal(rope.cos_sin(torch.tensor([8191]))[0], cos[-1:])     # the grown table keeps its values


def test_warm_up_builds_the_lazy_copies_and_leaves_no_trace():
    """warm_up() runs what the first real prompt past 64 rows would pay for (the quantized layers' int16 copy, and
    the tiles of the batched steps) and leaves the engine as it found it: same greedy tokens as a cold engine, no
    requests, no steps counted, every KV block free (the prefix cache dropped). On a busy engine it refuses first."""
    from minillm.quant.formats import QuantSpec
    from minillm.testing import tiny_tokenizer
    model = random_model(4, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=128).quantize_(QuantSpec("int4", 32))
    layers = [m.quant for n, m in model.quantizable() if "layers." in n]
    assert layers and not any(qw.cache for qw in layers)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = [([5, 9, 33, 2], params), ([100, 4, 4, 7] * 30, params), ([77], params)]
    cold = run_engine(LLMEngine(model, tiny_tokenizer()), requests)
    built = [set(qw.cache) for qw in layers]           # what the first long prompt and batched steps made
    assert all(built), built
    for qw in layers:
        qw.cache.clear()
    engine = LLMEngine(model, tiny_tokenizer())
    free = engine.block_manager.num_free_blocks
    engine.warm_up()
    assert [set(qw.cache) for qw in layers] == built
    assert engine.num_steps == 0 and not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == free and not engine.block_manager.cached_blocks
    assert run_engine(engine, requests) == cold
    steps = engine.num_steps
    engine.add_request([1, 2, 3], params)
    with pytest.raises(RuntimeError, match="needs an idle engine"):
        engine.warm_up()
    assert engine.has_unfinished_requests() and engine.num_steps == steps and len(engine.requests) == 1
