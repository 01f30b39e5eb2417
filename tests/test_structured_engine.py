"""Structured outputs inside the continuous-batching engine: a tiny random model (it wants to go anywhere, so only
the mask keeps it in the language) with a tiny byte-level tokenizer (multi-byte tokens, characters split across
tokens). Every completed output must fully match / validate; a cut one must be a live prefix."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from minillm import SamplingParams, StructuredOutputsParams as S
from minillm.engine.llm_engine import LLMEngine
from minillm.structured.automata import DEAD, RegexTooComplex
from minillm.structured.regex import RegexError
from minillm.structured.token_index import regex_token_index
from minillm.testing import random_model, tiny_tokenizer
from tests.test_engine import finish_all
from tests.tiny_models import minillm_logits

TOK = tiny_tokenizer()
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
USER = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                         "age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "age"]}


def model(seed: int = 0):
    return random_model(seed, vocab=TOK.vocab_size)


def engine(seed: int = 0, **settings) -> LLMEngine:
    settings.setdefault("num_blocks", 64)
    settings.setdefault("block_size", 4)
    return LLMEngine.from_model(model(seed), TOK, **settings)


def complete(out) -> bool:
    return out.finish_reason == "stop" and out.stop_reason is None


def check_output(so: S, out) -> bool:
    """A complete output is in the language; a cut one ("length") can still be completed. Returns complete."""
    pattern = so.to_regex()
    if complete(out):
        if so.json is not None:
            jsonschema.validate(json.loads(out.text), so.json)
        elif so.json_object:
            assert isinstance(json.loads(out.text), dict)
        else:
            assert re.fullmatch(pattern, out.text, re.ASCII), (pattern, out.text)
        return True
    assert out.finish_reason == "length", out
    dfa = regex_token_index(pattern, TOK).dfa
    assert dfa.step(dfa.start, out.text.encode()) != DEAD, (pattern, out.text)
    return False


CASES = [S(regex=PHONE), S(regex=r"(ab|é|中)+[0-9]?"), S(choice=["yes", "no", "maybe", "中文"]), S(json=USER),
         S(json={"type": "array", "items": {"enum": [1, "two", None, True]}, "minItems": 1, "maxItems": 3}),
         S(json_object=True)]


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_every_output_is_in_the_language(temperature):
    eng = engine(seed=1)
    ids = {}
    for i, so in enumerate(CASES):
        for seed in range(3):
            p = SamplingParams(temperature=temperature, seed=seed, max_tokens=48, n=2, structured_outputs=so)
            ids[eng.add_request(f"prompt {i} {seed}", p)] = so
    done = finish_all(eng)
    results = [check_output(ids[rid], c) for rid, out in done.items() for c in out.outputs]
    assert len(results) == len(CASES) * 3 * 2
    assert sum(results) >= 0.6 * len(results)           # most finish inside 48 tokens: the test is not vacuous
    bounded = [c for rid, out in done.items() if ids[rid].regex == PHONE or ids[rid].choice for c in out.outputs]
    assert all(complete(c) for c in bounded)             # finite languages always complete


def reference_greedy(m, prompt: list[int], pattern: str, max_tokens: int) -> list[int]:
    """One request, the dense model over the whole sequence each step, argmax over the allowed tokens only."""
    index = regex_token_index(pattern, TOK)
    state, out = index.dfa.start, []
    while len(out) < max_tokens:
        logits = minillm_logits(m, prompt + out)[-1]
        allowed = torch.as_tensor(index.allowed_token_ids(state).astype("int64"))
        tok = int(allowed[logits[allowed].argmax()])
        out.append(tok)
        if tok in TOK.stop_token_ids:
            break
        state = index.next_state(state, tok)
        if index.is_terminated(state):
            break
    return out


def test_greedy_matches_a_dense_reference_in_a_mixed_batch():
    eng = engine(seed=2)
    prompts = [TOK.encode(t) for t in ("call me at", "a JSON user:", "free text here")]
    patterns = [PHONE, S(json=USER).to_regex(), None]
    rids = []
    for p, pat in zip(prompts, patterns):
        so = S(regex=pat) if pat else None
        rids.append(eng.add_request(p, SamplingParams(temperature=0, max_tokens=30, structured_outputs=so)))
    done = finish_all(eng)
    for rid, p, pat in zip(rids, prompts, patterns):
        got = done[rid].outputs[0].token_ids
        if pat is None:   # the unconstrained row is untouched by its neighbours' masks
            solo = engine(seed=2)
            solo.add_request(p, SamplingParams(temperature=0, max_tokens=30))
            assert got == next(iter(finish_all(solo).values())).outputs[0].token_ids
        else:
            assert got == reference_greedy(eng.model, p, pat, 30)


def test_seeded_batch_equals_one_at_a_time():
    reqs = [(f"p{i}", SamplingParams(temperature=1.0, seed=10 + i, max_tokens=24,
                                     structured_outputs=CASES[i % len(CASES)] if i % 3 else None)) for i in range(9)]
    eng = engine(seed=3)
    for i, (p, sp) in enumerate(reqs):
        eng.add_request(p, sp, request_id=str(i))
    together = {rid: o.outputs[0].token_ids for rid, o in finish_all(eng).items()}
    for i, (p, sp) in enumerate(reqs):
        solo = engine(seed=3)
        solo.add_request(p, sp, request_id=str(i))
        assert finish_all(solo)[str(i)].outputs[0].token_ids == together[str(i)]


def test_preemption_recomputes_and_keeps_the_state():
    reqs = [(f"request number {i}", SamplingParams(temperature=0.9, seed=i, max_tokens=40,
                                                   structured_outputs=S(json=USER))) for i in range(6)]
    roomy = engine(seed=4)
    for i, (p, sp) in enumerate(reqs):
        roomy.add_request(p, sp, request_id=str(i))
    want = {rid: o.outputs[0].token_ids for rid, o in finish_all(roomy).items()}
    tight = engine(seed=4, num_blocks=24, block_size=4)
    for i, (p, sp) in enumerate(reqs):
        tight.add_request(p, sp, request_id=str(i))
    done = finish_all(tight)
    assert sum(o.metrics.num_preemptions for o in done.values()) > 0      # the pool really was too small
    assert {rid: o.outputs[0].token_ids for rid, o in done.items()} == want
    for rid, o in done.items():
        check_output(reqs[int(rid)][1].structured_outputs, o.outputs[0])


def test_speculative_ngram_greedy_equals_plain():
    prompt = "(555) 555-5555 (555) 555-55"
    so = S(regex=r"(\(\d{3}\) \d{3}-\d{4} ?){1,3}")
    plain = engine(seed=5)
    plain.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, structured_outputs=so), request_id="a")
    want = finish_all(plain)["a"].outputs[0]
    spec = engine(seed=5, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                              "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    spec.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, structured_outputs=so), request_id="a")
    got = finish_all(spec)["a"]
    assert got.outputs[0].token_ids == want.token_ids
    assert got.metrics.spec.num_draft_tokens > 0
    check_output(so, got.outputs[0])


def test_speculative_sampled_drafts_stay_in_the_language():
    """A layer-skip draft samples its guesses from its own (unmasked) q: forbidden guesses must be rejected by the
    rejection sampler against the masked p, never appended."""
    eng = engine(seed=6, speculative_config={"method": "layer_skip", "num_speculative_tokens": 3,
                                             "draft_layers": 1})
    ids = {}
    for i, so in enumerate(CASES[:5]):
        for seed in range(2):
            ids[eng.add_request(f"q{i}", SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                                                         structured_outputs=so))] = so
    done = finish_all(eng)
    assert sum(o.metrics.spec.num_draft_tokens for o in done.values()) > 0
    assert sum(check_output(ids[rid], o.outputs[0]) for rid, o in done.items()) >= len(done) // 2


def test_terminated_pattern_stops_without_eos_and_stop_strings_say_so():
    eng = engine(seed=7)
    a = eng.add_request("x", SamplingParams(temperature=0, structured_outputs=S(choice=["yes", "no"])))
    b = eng.add_request("y", SamplingParams(temperature=0, stop=["-"], structured_outputs=S(regex=PHONE)))
    done = finish_all(eng)
    out = done[a].outputs[0]
    assert out.text in ("yes", "no") and complete(out)
    assert not set(out.token_ids) & TOK.stop_token_ids          # finished on the automaton, no EOS step needed
    out = done[b].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "-" and re.fullmatch(r"\(\d{3}\) \d{3}", out.text)


@pytest.mark.parametrize("so, error, words", [
    (lambda: S(regex=r"a(?=b)"), RegexError, "lookahead"),
    (lambda: S(regex=r"[ab]*a[ab]{20}"), RegexTooComplex, "states"),
    (lambda: S(regex=r"[^\x00-\U0010ffff]"), ValueError, "no text"),
    (lambda: S(json={"type": "integer", "minimum": 3}), ValueError, "minimum"),
    (lambda: S(json={"type": "object", "properties": {"a": {"$ref": "#"}}}), ValueError, "recursive"),
    (lambda: S(json='{"type": '), ValueError, "not valid JSON"),
])
def test_bad_patterns_fail_before_any_block_and_hurt_no_one(so, error, words):
    eng = engine(seed=8)
    good = eng.add_request("fine", SamplingParams(temperature=0, max_tokens=5))
    free = eng.block_manager.num_free_blocks
    with pytest.raises(error, match=words):
        eng.add_request("bad", SamplingParams(structured_outputs=so()))
    assert eng.block_manager.num_free_blocks == free
    assert list(eng.requests) == [good]
    assert finish_all(eng)[good].outputs[0].finish_reason == "length"


def test_params_are_checked_on_construction():
    with pytest.raises(ValueError, match="exactly one"):
        S(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        S()
    with pytest.raises(ValueError, match="grammar"):
        S(grammar="root ::= 'a'")
    with pytest.raises(ValueError, match="non-empty list"):
        S(choice="yes")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=S(regex="a"))
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_needs_a_tokenizer():
    eng = LLMEngine.from_model(model(), None, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="tokenizer"):
        eng.add_request([1, 2, 3], SamplingParams(structured_outputs=S(regex="a")))


def test_plugged_pieces_are_used_and_checked():
    from minillm.structured.automata import compile_regex
    from minillm.structured.token_index import build_token_index
    calls = []

    def my_compile(pattern):
        calls.append(pattern)
        return compile_regex(pattern)

    eng = engine(seed=9)
    eng.plug(regex_compiler=my_compile, token_index_builder=build_token_index)
    rid = eng.add_request("x", SamplingParams(temperature=0, structured_outputs=S(regex=PHONE)))
    assert calls == [PHONE]
    assert complete(finish_all(eng)[rid].outputs[0])
    eng.plug(regex_compiler=lambda p: "not a DFA")
    with pytest.raises(TypeError, match="DFA"):
        eng.add_request("x", SamplingParams(structured_outputs=S(regex="b")))
    with pytest.raises(TypeError, match="function"):
        eng.plug(token_index_builder=42)


class CoinProposer:
    """Guesses one token for the next position: `good` or `bad` with probability 1/2 each (q says so). With
    truncate=True it plays the tempting mistake: a guess the automaton forbids is dropped before verification,
    so the target samples that position from p instead of from the residual (p - q)+."""

    def __init__(self, good: int, bad: int, truncate: bool) -> None:
        self.good, self.bad, self.truncate = good, bad, truncate
        self.gen = torch.Generator().manual_seed(123)

    def propose(self, seqs, num_tokens):
        from minillm.spec_decode.draft import Draft
        q = torch.zeros(1, TOK.vocab_size)
        q[0, [self.good, self.bad]] = 0.5
        out = []
        for seq in seqs:
            tok = self.good if torch.rand(1, generator=self.gen).item() < 0.5 else self.bad
            forbidden = seq.matcher is not None and not seq.matcher.allows(tok)
            out.append(Draft([], None) if self.truncate and forbidden else Draft([tok], q))
        return out

    def verified(self, seq, num_accepted):
        pass

    def free(self, seq):
        pass


@pytest.mark.parametrize("truncate", [False, True])
def test_masked_rejection_sampling_keeps_the_target_distribution(truncate):
    """Chi-square goodness of fit (n = 1500 requests, seeded, alpha = 0.001) of the second output token against
    the masked target distribution p computed directly from the model: the engine passes; a proposer that drops
    forbidden sampled guesses (known-wrong: it biases the output towards the guessed token) fails."""
    from minillm.testing import chi_square
    so = S(regex="x(yes|no|maybe)")
    abc, x = TOK.token_to_id("abc"), TOK.token_to_id("x")
    prompt = TOK.encode("answer:")
    m = model(seed=11)
    index = regex_token_index(so.to_regex(), TOK)
    allowed = torch.as_tensor(index.allowed_token_ids(index.next_state(index.dfa.start, x)).astype("int64"))
    logits = minillm_logits(m, prompt + [x])[-1]
    p = torch.zeros(TOK.vocab_size, dtype=torch.float64)
    p[allowed] = (logits[allowed].double() / 3.0).softmax(-1)    # temperature 3: a flatter p, more power
    good = int(allowed[(p[allowed] - 0.3).abs().argmin()])    # guess the allowed token nearest p = 0.3: power
    assert 0.1 < p[good] < 0.45 and p[abc] == 0, p[allowed]
    eng = LLMEngine.from_model(m, TOK, num_blocks=4096, block_size=4, max_num_seqs=512, max_num_batched_tokens=4096,
                               speculative_config={"method": "ngram", "num_speculative_tokens": 1})
    eng.plug(proposer=CoinProposer(good, abc, truncate))
    for i in range(1500):
        eng.add_request(prompt, SamplingParams(temperature=3.0, seed=i, max_tokens=3, structured_outputs=so))
    done = finish_all(eng)
    assert eng.spec.stats.num_draft_tokens >= (1000 if not truncate else 500)   # the guesses were verified
    second = [o.outputs[0].token_ids[1] for o in done.values()]
    counts = torch.bincount(torch.tensor(second), minlength=TOK.vocab_size)
    result = chi_square(counts, p)
    if truncate:
        assert result.p_value < 1e-3, result
    else:
        assert result.p_value > 1e-3, result
