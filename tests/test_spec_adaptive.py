"""Adaptive speculation (num_speculative_tokens="auto"): the policy on fake cost tables, and the engine with it.

The policy (spec_decode/adaptive.py) is pure: acceptance estimates and a cost model in, k per sequence out. Checked
against brute force on small batches, on the cases that matter (expensive verification and poor drafts: k = 0;
cheap verification and good drafts: k_max), for recovery (a sequence at k = 0 wins drafts back), and in the engine:
greedy output with auto k is token-for-token plain greedy, whatever k the policy picks step to step."""
from __future__ import annotations

import argparse
import itertools
import random

import pytest
from hypothesis import given, settings, strategies as st

from minillm.cli_args import add_engine_args, engine_config
from minillm.config import AUTO_MAX_SPECULATIVE_TOKENS, EngineConfig, SpeculativeConfig
from minillm.sampling.params import SamplingParams
from minillm.spec_decode import adaptive
from minillm.spec_decode.adaptive import Acceptance, AdaptiveK, Costs, StepCosts, choose_ks
from minillm.spec_decode.expected import expected_tokens_per_step
from tests.test_engine import finish_all, run_engine
from tests.test_speculative import check_kv, drained, make_engine, request_sets

EXPENSIVE = Costs(plain=1.0, jump=0.8, per_row=0.3)          # a CPU at batch 1 on a bad day
CHEAP = Costs(plain=1.0, jump=0.0, per_row=0.01)             # verification about free (memory-bound GPU decode)


class FakeCosts(StepCosts):
    """A fixed cost model in plain steps (the same at every batch size); records nothing."""

    def __init__(self, costs: Costs) -> None:
        super().__init__()
        self.fixed = costs

    def record_step(self, num_seqs, num_rows, seconds):
        pass

    def record_draft(self, num_seqs, rounds, seconds):
        pass

    def knows_plain(self, batch):
        return True

    def plain(self, batch):
        return self.fixed.plain

    def draft(self, batch):
        return self.fixed.draft_round

    def verify_line(self, batch):
        return self.fixed.jump, self.fixed.per_row


class JitterCosts(FakeCosts):
    """A cost model that changes every step (seeded): the policy's k jumps around, which the engine must survive."""

    def __init__(self, seed: int) -> None:
        super().__init__(CHEAP)
        self.rng = random.Random(seed)

    def verify_line(self, batch):
        return self.rng.choice([0.0, 0.3, 3.0]), self.rng.choice([0.0, 0.05, 0.5])


# ---------------------------------------------------------------- the choice

def rate(acceptance, ks, costs: Costs) -> float:
    tokens = sum(expected_tokens_per_step(a, k) for a, k in zip(acceptance, ks))
    return tokens / costs.step(sum(ks), max(ks, default=0))


def test_expensive_verification_and_poor_drafts_draft_nothing():
    assert choose_ks([0.2] * 4, [8] * 4, EXPENSIVE) == [0] * 4
    assert choose_ks([0.3], [8], Costs(plain=1.0, jump=0.5, per_row=0.05)) == [0]   # the jump alone loses
    assert choose_ks([1.0], [8], Costs(plain=1.0, jump=0.0, per_row=1.5)) == [0]    # a row costs more than a token


def test_cheap_verification_and_good_drafts_draft_k_max():
    assert choose_ks([0.95], [8], CHEAP) == [8]
    assert choose_ks([0.9] * 16, [8] * 16, CHEAP) == [8] * 16


def test_at_a_batch_only_the_good_drafts_are_verified():
    ks = choose_ks([0.95, 0.1, 0.9, 0.0], [8] * 4, Costs(plain=1.0, jump=0.2, per_row=0.08))
    assert ks[1] == ks[3] == 0 and ks[0] >= ks[2] >= 1


def test_the_cost_of_drafting_counts():
    # drafting costs a forward per token (a draft model at half the target's cost): good drafts, and still a loss
    assert choose_ks([0.4], [8], Costs(plain=1.0, jump=0.0, per_row=0.01, draft_round=0.5)) == [0]
    assert choose_ks([0.4], [8], Costs(plain=1.0, jump=0.0, per_row=0.01, draft_round=0.0)) != [0]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(acc=st.lists(st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0]), min_size=1, max_size=3),
       caps=st.lists(st.integers(0, 3), min_size=3, max_size=3),
       jump=st.sampled_from([0.0, 0.2, 1.0]), per_row=st.sampled_from([0.0, 0.05, 0.3, 1.2]))
def test_the_choice_is_the_best_allocation_and_within_the_caps(acc, caps, jump, per_row):
    """Against brute force over every allocation (no draft cost: then ranking rows by gain is optimal)."""
    caps = caps[:len(acc)]
    costs = Costs(plain=1.0, jump=jump, per_row=per_row)
    ks = choose_ks(acc, caps, costs, margin=0.0)
    assert all(0 <= k <= c for k, c in zip(ks, caps))
    best = max(rate(acc, list(alloc), costs) for alloc in itertools.product(*[range(c + 1) for c in caps]))
    assert rate(acc, ks, costs) == pytest.approx(best)
    # with a margin, speculation is chosen only when it beats a plain step by that much
    ks = choose_ks(acc, caps, costs, margin=0.1)
    assert not any(ks) or rate(acc, ks, costs) > 1.1 * rate(acc, [0] * len(acc), costs)


# ---------------------------------------------------------------- acceptance and costs

def test_acceptance_counts_only_tried_drafts_and_forgets_slowly():
    a = Acceptance()
    a.observe(4, 4, decay=1.0)          # all four kept: 4 hits in 4 trials
    a.observe(4, 1, decay=1.0)          # the second rejected: 1 hit in 2 trials (3rd and 4th never tried)
    assert (a.hits, a.trials) == (5, 6)
    assert a.rate(prior=0.5, weight=0) == pytest.approx(5 / 6)
    assert Acceptance().rate(prior=0.4) == 0.4
    for _ in range(50):
        a.observe(2, 0)
    assert a.rate(0.5) < 0.1


def test_step_costs_learn_plain_steps_and_the_verification_line():
    c = StepCosts()
    assert c.plain(1) is None and not c.knows_plain(1)
    c.record_step(1, 1, 0.050)                    # a cold first step: the median of the recent ones ignores it
    for _ in range(2):
        c.record_step(1, 1, 0.010)
        c.record_step(8, 8, 0.020)
    assert c.knows_plain(1) and not c.knows_plain(8)          # three plain steps at a batch size before trusting it
    c.record_step(8, 8, 0.020)
    assert c.plain(1) == 0.010 and c.plain(4) == pytest.approx(0.010 + 0.010 * 3 / 7) and c.knows_plain(16)
    assert not c.knows_plain(17) and c.plain(64) == 0.020
    assert c.verify_line(1) == pytest.approx((adaptive.PRIOR_JUMP * 0.010, adaptive.PRIOR_PER_ROW * 0.010))
    for x in (1, 4, 8, 2):               # verifying x extra rows at batch 1: 6 ms more, plus 0.5 ms a row
        c.record_step(1, 1 + x, 0.010 + 0.006 + 0.0005 * x)
    jump, per_row = c.verify_line(1)
    assert jump == pytest.approx(0.006) and per_row == pytest.approx(0.0005)
    c.record_draft(2, 4, 0.004)
    assert c.draft(2) == pytest.approx(0.001) and c.draft(3) == pytest.approx(0.001)


# ---------------------------------------------------------------- the policy over steps

def test_a_fresh_batch_size_is_timed_plain_first_and_now_and_then_again():
    policy = AdaptiveK(8)
    for _ in range(adaptive.PLAIN_SAMPLES):
        assert policy.choose([1, 2], [8, 8]) == [0, 0]
        policy.costs.record_step(2, 2, 0.01)
    assert policy.choose([1, 2], [8, 8]) != [0, 0]           # the prior: worth trying
    ks = [policy.choose([1, 2], [8, 8]) for _ in range(adaptive.PLAIN_REFRESH + 1)]
    assert ks.count([0, 0]) == 1
    assert policy.choose([1, 2], [8, 3])[1] <= 3


def test_caps_bound_k_even_with_perfect_drafts():
    policy = AdaptiveK(5, FakeCosts(CHEAP))
    for _ in range(10):
        policy.observe(1, 5, 5)
    assert policy.choose([1], [5]) == [5]
    assert policy.choose([1], [2]) == [2] and policy.choose([1], [0]) == [0]


def test_poor_drafts_fall_to_zero_and_a_recovery_wins_k_back_through_shadow_guesses():
    """Drafting about free (n-gram): a sequence at k = 0 keeps a shadow guess, compared with the emitted token."""
    policy = AdaptiveK(8, FakeCosts(Costs(plain=1.0, jump=0.3, per_row=0.05)))
    assert policy.drafting_is_cheap(1)
    for _ in range(20):
        policy.observe(1, 4, 0)
    assert policy.choose([1], [8]) == [0]
    for _ in range(10):                      # the request starts copying: its shadow guesses come true
        policy.state(1).shadow = 42
        policy.observe_shadow(1, 42)
        policy.choose([1], [8])
    assert policy.choose([1], [8])[0] >= 4


def test_poor_drafts_fall_to_zero_and_a_probe_wins_k_back_when_drafting_costs_a_forward():
    policy = AdaptiveK(8, FakeCosts(Costs(plain=1.0, jump=0.1, per_row=0.02, draft_round=0.2)))
    assert not policy.drafting_is_cheap(1)
    for _ in range(20):
        policy.observe(1, 4, 0)
    ks = [policy.choose([1], [8])[0] for _ in range(adaptive.PROBE_EVERY + 1)]
    assert ks[:-1] == [0] * adaptive.PROBE_EVERY and ks[-1] == 1          # idle long enough: a k = 1 probe
    for _ in range(6):                                                      # the probes come true from now on
        policy.observe(1, 1, 1)
        while (k := policy.choose([1], [8])[0]) == 0:
            pass
    assert k >= 2


def test_a_failed_probe_waits_longer_and_a_hopeless_proposer_is_never_probed():
    policy = AdaptiveK(8, FakeCosts(Costs(plain=1.0, jump=0.1, per_row=0.02, draft_round=0.2)))
    for _ in range(20):
        policy.observe(1, 4, 0)
    for _ in range(adaptive.PROBE_EVERY + 1):
        policy.choose([1], [8])
    policy.observe(1, 1, 0)
    assert policy.state(1).probe_every == 2 * adaptive.PROBE_EVERY
    # a draft round costing more than a plain step: even perfect drafts would lose, so no probe is ever paid for
    hopeless = AdaptiveK(8, FakeCosts(Costs(plain=1.0, jump=0.5, per_row=0.05, draft_round=1.2)))
    for _ in range(3):
        hopeless.observe(1, 2, 0)
    assert not any(k for _ in range(300) for k in hopeless.choose([1], [8]))


def test_a_fresh_request_starts_from_what_the_engine_measured():
    policy = AdaptiveK(8, FakeCosts(Costs(plain=1.0, jump=0.3, per_row=0.05)))
    fresh = policy.choose([7], [8])[0]
    for _ in range(30):
        policy.observe(1, 4, 0)
    policy.forget(1)
    assert fresh > 0 and policy.choose([2], [8]) == [0]


# ---------------------------------------------------------------- configuration

def test_auto_is_the_default_and_an_integer_keeps_a_fixed_k():
    spec = SpeculativeConfig.parse({"method": "ngram"})
    assert spec.num_speculative_tokens == "auto" and spec.adaptive and spec.k_max == AUTO_MAX_SPECULATIVE_TOKENS
    fixed = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert not fixed.adaptive and fixed.k_max == 3
    assert make_engine("ngram", 3, num_blocks=16, block_size=4).spec.policy is None
    assert isinstance(make_engine("ngram", "auto", num_blocks=16, block_size=4).spec.policy, AdaptiveK)
    for bad in (0, "8", "Auto", 2.5, True):
        with pytest.raises(ValueError, match="positive integer or 'auto'"):
            SpeculativeConfig(method="ngram", num_speculative_tokens=bad)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    for argv, k in ((["--speculative", "ngram"], "auto"), (["--speculative", "ngram", "--num-speculative-tokens",
                                                            "auto"], "auto"),
                    (["--speculative", "ngram", "--num-speculative-tokens", "5"], 5)):
        assert engine_config(p.parse_args(argv)).speculative.num_speculative_tokens == k
    assert EngineConfig.from_kwargs(speculative_config={"method": "ngram"}).speculative.adaptive


# ---------------------------------------------------------------- the engine

@pytest.mark.parametrize("proposer", ["ngram", "layer_skip", "draft_model", "self_draft"])
@pytest.mark.parametrize("costs", ["measured", "jitter"])
@settings(max_examples=8, deadline=None, derandomize=True)
@given(reqs=request_sets, block_size=st.sampled_from([1, 4]), budget=st.integers(9, 40), seed=st.integers(0, 99))
def test_greedy_with_auto_k_is_token_for_token_plain_greedy(proposer, costs, reqs, block_size, budget, seed):
    requests = [(p, SamplingParams(temperature=0, max_tokens=m, n=n, stop_token_ids=list(stops)))
                for p, m, n, stops in reqs]
    longest = max(len(p) + m for p, m, _, _ in reqs)
    settings_ = dict(num_blocks=-(-longest // block_size) * 4 + 4, block_size=block_size, max_num_seqs=4,
                     max_num_batched_tokens=budget)
    plain = run_engine(make_engine(None, **settings_), requests)
    engine = make_engine(proposer, "auto", **settings_)
    if costs == "jitter":
        engine.spec.policy.costs = JitterCosts(seed)
    assert run_engine(engine, requests, check=check_kv) == plain
    assert drained(engine) and not engine.spec.policy.seqs          # every sequence's state was forgotten


def test_auto_speculates_where_drafts_are_right_and_never_past_max_tokens():
    """The target drafting for itself (always right) with verification about free: k_max drafts, up to the caps."""
    for m in (1, 2, 5, 11, 30):
        engine = make_engine("self_draft", "auto", num_blocks=64, block_size=4)
        engine.spec.policy.costs = FakeCosts(CHEAP)
        rid = engine.add_request([3, 4, 5], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        out = finish_all(engine, check=check_kv)[rid]
        assert len(out.token_ids) == m and out.outputs[0].finish_reason == "length"
        assert engine.spec.stats.acceptance_rate in (None, 1.0)
    s = engine.spec.stats                         # 30 tokens: 1 from the prefill, then steps of up to 9
    assert s.num_steps == 4 and max(len(s.drafted_per_position), 0) == AUTO_MAX_SPECULATIVE_TOKENS


def test_auto_with_poor_drafts_on_expensive_verification_stops_verifying():
    engine = make_engine("random", "auto", num_blocks=64, block_size=4)
    engine.spec.policy.costs = FakeCosts(EXPENSIVE)
    for i in range(2):
        engine.add_request([9, 10, 11 + i], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    finish_all(engine)
    assert engine.spec.stats.num_draft_tokens <= 16       # a prior-driven try, then (almost) nothing
