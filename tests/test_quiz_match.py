"""Key-point matching on answers written to be right and answers written to be wrong.

Each case is a real bank entry's key points (copied from questions/ on 2026-11-25, synonyms as the bank has them
for the prefix-caching and structured-output entries), a hand-written good answer in a candidate's own words (not
the key points reworded term by term) and a plausible wrong answer that uses the topic's vocabulary. Thresholds:
a good answer ticks every key point but at most one; a wrong answer ticks at most one; over all cases at least
85% of the good answers' points are ticked and at most 10% of the wrong answers'. The matcher is a keyword
match: these numbers say it rewards saying the points, not that it can judge correctness.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minillm.quiz.bank import Question, read_yaml
from minillm.quiz.match import ABBREVIATIONS, FILLER, _units, explain, match_key_points, says, tokens

REPO = Path(__file__).resolve().parents[1]

CASES = [
    dict(id="kv-cache-what-why", key_points=[
        "Past tokens' K and V never change in causal attention, so compute them once",
        "Each decode step computes K/V for one new token and reads the rest from cache",
        "Turns O(n^2) projection work into O(n) over a generation (attention O(n^3) to O(n^2))",
        "Memory grows linearly with tokens x live sequences",
        "KV, not weights, is the resource a server schedules around"],
        good="In causal attention the keys and values of earlier tokens never change once computed, so we compute "
             "them once and store them per layer. At each decode step only the new token's K and V are computed; "
             "the rest are read from the cache. Without it every step recomputes the whole prefix, so generating n "
             "tokens costs O(n^2) projection work instead of O(n). The memory grows linearly with the number of "
             "tokens times live sequences, and in a server the KV cache, not the weights, is the resource the "
             "scheduler budgets around.",
        wrong="The KV cache keeps the model's weight matrices for the key and value projections in GPU memory so "
              "a request does not reload them. Its size depends on the hidden size and the vocabulary, not on the "
              "number of tokens, so it stays fixed during generation. Attention is still recomputed over the "
              "whole prompt at every step; the cache only saves loading time."),
    dict(id="continuous-batching", key_points=[
        "Batch membership changes every step; finished sequences leave, waiting ones join",
        "Static batching wastes slots on padding and on rows waiting for the batch's longest output",
        "New requests' prefill and running requests' decode share one step under a token budget",
        "Needs per-sequence KV management; paged KV makes admission cheap and fragmentation-free",
        "Gain scales with length variance (minillm CPU 21.1 vs 14.7 tok/s; up to 23x reported on GPU)"],
        good="Continuous batching re-forms the batch at every decode step: when a sequence finishes it leaves at "
             "once and a waiting request joins in its slot. Static batching pads every row and keeps finished rows "
             "stepping until the longest output in the batch is done, so slots are wasted. The scheduler mixes "
             "prefill for new requests with decode for running ones in the same step, bounded by a token budget. "
             "It needs per-sequence KV cache management, which paged KV makes cheap and free of fragmentation. The "
             "gain grows with the variance of output lengths.",
        wrong="Continuous batching groups requests of similar prompt length into a fixed batch, pads them to the "
              "same length and runs the batch until every sequence has finished before admitting the next group. "
              "Padding keeps the matrix shapes regular, which is what makes the GPU fast, and bigger batches always "
              "mean lower latency."),
    dict(id="paged-attention", key_points=[
        "Contiguous max-length reservation wasted 60-80% of KV memory (vLLM paper)",
        "Fixed-size blocks allocated on demand, mapped by a per-sequence block table",
        "Waste limited to the partly filled last block (<4%)",
        "More sequences per GPU, hence 2-4x throughput",
        "Enables sharing (parallel sampling, beams, prefixes) with ref counts and copy-on-write",
        "A memory-management technique; attention math is unchanged"],
        good="Before PagedAttention, engines reserved one contiguous region per request for its maximum length, and "
             "the vLLM paper measured 60-80% of KV memory wasted that way. PagedAttention splits the KV cache into "
             "fixed-size blocks allocated on demand, and each sequence has a block table mapping its logical blocks "
             "to physical ones. Only the last, partly filled block wastes space, under 4%. So more sequences fit on "
             "a GPU and throughput rises 2-4x. Blocks can also be shared between sequences, for parallel sampling, "
             "beam search or common prefixes, using reference counts and copy-on-write. The attention math is the "
             "same; it is a memory management technique.",
        wrong="PagedAttention is an approximate attention kernel: it splits the prompt into pages and attends only "
              "to the pages most similar to the query, so the cost of attention becomes linear. Memory use is the "
              "same as before, since each sequence still reserves its maximum length in one contiguous buffer; the "
              "win is purely compute."),
    dict(id="speculative-decoding", key_points=[
        "Decode is bandwidth-bound, so verifying k+1 positions costs about one decode step",
        "A draft proposes k tokens; the target checks all of them in a single forward pass",
        "Tokens per target pass = (1−α^(k+1))/(1−α), between 1 and k+1",
        "Speedup = tokens per pass / (1 + k·draft_cost); typically 2-3x at small batch",
        "Lossless by construction when the rejection-sampling rule is used"],
        good="A small draft model proposes k tokens cheaply, and the big target model verifies all of them in a "
             "single forward pass. Because decode is memory-bandwidth bound, checking k+1 positions costs about the "
             "same as one normal decode step. With acceptance rate alpha the expected number of tokens per target "
             "pass is (1 - alpha^(k+1)) / (1 - alpha), between 1 and k+1, and the speedup is that divided by 1 + k "
             "times the draft cost, typically 2-3x at small batch sizes. With the rejection sampling rule the "
             "output distribution is exactly the target's, so it is lossless by construction.",
        wrong="Speculative decoding lets the target model guess several future tokens at once from its own hidden "
              "states and keeps them when they look plausible, skipping a separate verification. It trades a "
              "little accuracy for speed, so the output distribution shifts slightly, and it works best at large "
              "batch sizes where the GPU is compute-bound."),
    dict(id="prefix-caching", key_points=[
        {"point": "A token's KV depends only on earlier tokens, so identical prefixes have identical KV",
         "synonyms": ["same prefix tokens give the same keys and values"]},
        {"point": "Chained block hash h_i = hash(h_{i-1}, tokens_i): only full blocks, ref-counted and shared",
         "synonyms": ["each full block hashed together with the previous block's hash",
                      "reference-counted blocks shared between requests"]},
        {"point": "Unreferenced cached blocks linger until LRU eviction; a hit revives them",
         "synonyms": ["unused blocks stay cached until evicted least recently used first"]},
        {"point": "Saves prefill FLOPs and TTFT (and memory for concurrent sharers); decode is unchanged",
         "synonyms": ["saves prefill compute and time to first token"]},
        {"point": "Exact match from token 0 required; put variable content at the end of the prompt",
         "synonyms": ["must match exactly from the first token",
                      "static system prompt first and user-specific content last"]}],
        good="Prefix caching reuses the KV computed for a prompt prefix that an earlier request already processed. "
             "A token's keys and values depend only on the tokens before it, so the same prefix gives the same keys "
             "and values. The engine hashes each full block together with the previous block's hash, so a key "
             "names the whole prefix, and matching blocks are reference-counted and shared between requests. "
             "Blocks nobody uses stay cached until they are evicted, least recently used first. It saves prefill "
             "compute and time to first token, but decode is unchanged, and the prompt must match exactly from the "
             "first token, so put the static system prompt first and user-specific content last.",
        wrong="Prefix caching stores the model's previous answers keyed by the prompt text, and when a similar "
              "question arrives it returns the cached answer without running the model. It uses semantic "
              "similarity, so prompts only need to be roughly the same, and its main benefit is faster decoding of "
              "long outputs."),
    dict(id="constrained-decoding", key_points=[
        {"point": "Mask logits of grammar-violating tokens to −inf before sampling, every step",
         "synonyms": ["set the logits of disallowed tokens to minus infinity at each step"]},
        {"point": "Regex → DFA → per-state allowed-token index over the vocabulary",
         "synonyms": ["compile the regex to an automaton and precompute allowed tokens per state"]},
        "Walk each token's full string through the automaton (tokens span symbols)",
        {"point": "Nested JSON / CFGs need a pushdown automaton (XGrammar, llguidance)",
         "synonyms": ["a context-free grammar needs a pushdown automaton with a stack"]},
        {"point": "Costs: schema compile time (cache it) and per-step mask, overlappable with the GPU",
         "synonyms": ["compile the schema once and cache it", "build the mask each step while the GPU runs"]},
        {"point": "Guarantees syntax, not semantics; can degrade answer quality",
         "synonyms": ["valid format but not correct content"]}],
        good="At each step the engine sets the logits of disallowed tokens to minus infinity before sampling, so "
             "only tokens that keep the output inside the grammar can be drawn. A regex is compiled to an automaton "
             "and we precompute the allowed tokens per state, walking each token's full string through the "
             "automaton because one token can span several symbols. Nested JSON, or any context-free grammar, needs "
             "a pushdown automaton with a stack, as XGrammar and llguidance do. You compile the schema once and "
             "cache it, and build the mask each step while the GPU runs the forward pass. It gives a valid format "
             "but not correct content, and forcing the format can lower answer quality.",
        wrong="Constrained decoding generates the answer normally and then checks it with a JSON parser; if the "
              "parse fails it retries the request with a stricter prompt until the output validates. It runs "
              "outside the model, costs nothing per token, and makes sure the answer is semantically right."),
]

GOOD_MIN_SHARE, WRONG_MAX_SHARE = 0.85, 0.10


def _question(case: dict) -> Question:
    return Question.from_dict({"id": case["id"], "topic": "t", "level": "medium", "question": "q?", "answer": "a",
                               "key_points": case["key_points"], "common_mistake": "m", "follow_ups": ["f"],
                               "labs": ["lab01"], "evidence": [], "sources": ["CURRICULUM.md"]})


def _ticks(q: Question, typed: str) -> list[bool]:
    return match_key_points(typed, q.key_points, synonyms=q.synonyms)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_good_answer_ticks_all_points_but_one_and_wrong_answer_at_most_one(case):
    q = _question(case)
    good, wrong = _ticks(q, case["good"]), _ticks(q, case["wrong"])
    n = len(q.key_points)
    assert sum(good) >= n - 1, [kp for kp, hit in zip(q.key_points, good) if not hit]
    assert sum(wrong) <= 1, [kp for kp, hit in zip(q.key_points, wrong) if hit]


def test_good_and_wrong_answers_over_the_whole_fixture():
    good = [hit for c in CASES for hit in _ticks(_question(c), c["good"])]
    wrong = [hit for c in CASES for hit in _ticks(_question(c), c["wrong"])]
    assert sum(good) / len(good) >= GOOD_MIN_SHARE and sum(wrong) / len(wrong) <= WRONG_MAX_SHARE, \
        (sum(good), sum(wrong), len(good))


def test_synonyms_tick_points_that_the_points_own_words_miss():
    """The paraphrases in the prefix-caching good answer say what two points say in other words: without the
    synonyms those points stay unticked, with them they are ticked, and the explanation names the synonym."""
    case = next(c for c in CASES if c["id"] == "prefix-caching")
    q = _question(case)
    plain = match_key_points(case["good"], q.key_points)
    with_synonyms = _ticks(q, case["good"])
    gained = [i for i, (a, b) in enumerate(zip(plain, with_synonyms)) if b and not a]
    assert len(gained) >= 2 and not any(a and not b for a, b in zip(plain, with_synonyms))
    why = explain(case["good"], q.key_points[gained[0]], q.synonyms[gained[0]])
    assert why.hit and why.via in q.synonyms[gained[0]] and why.reason().startswith(f'matched via "{why.via}": ')


def test_the_banks_synonyms_load_from_yaml():
    """The two topic files that carry synonyms load into Question.synonyms aligned with the key points, and the
    texts match this fixture (a changed synonym in the bank shows up here)."""
    entries = {e["id"]: e for f in ("prefix-caching", "structured-output")
               for e in read_yaml(REPO / "questions" / f"{f}.yaml")["questions"]}
    for case in (c for c in CASES if c["id"] in entries):
        q, fixture = Question.from_dict(entries[case["id"]]), _question(case)
        assert q.key_points == fixture.key_points and q.synonyms == fixture.synonyms


def test_explain_names_the_words_that_matched():
    m = explain("we keep K and V of the past tokens for every layer", "Stores K and V of past tokens per layer")
    assert m.hit and m.via is None and m.matched == ("k", "v", "past", "tokens", "layer")
    assert m.missing == ("stores",) and m.reason() == "matched: k, v, past, tokens, layer"
    assert not explain("", "Stores K and V").hit and explain("", "Stores K and V").reason() == ""


@pytest.mark.parametrize("answer, point, hit", [
    ("the KV-cache grows", "kv cache grows", True),           # hyphen and space variants
    ("the kv cache grows", "KV-cache grows", True),
    ("the kvcache grows", "KV-cache grows", True),
    ("requests are batched", "batching requests", True),      # stems
    ("weights quantized to 4 bits", "4-bit quantization of weights", True),    # 4 bits = 4-bit
    ("copy then write", "copy-on-write", False),              # a hyphenated term is one unit, matched whole
    ("copy on write", "copy-on-write", True),
    ("we summed the tokens", "sum of tokens", True),
    ("allocated on demand", "allocation on demand", True),
    ("the of and to a", "the cache", False),                  # stopwords alone never match
    ("it cuts the time to first token", "lower TTFT", False),  # 1 of 2 units: "lower" is missing
    ("it lowers the time to first token", "lower TTFT", True),     # an abbreviation matches its words ...
    ("prefix hits lower TTFT", "lower time to first token", True),  # ... either way round
    ("the first token took some time", "TTFT", True),         # (a keyword match: word order is not checked)
])
def test_variants_that_are_the_same_term(answer, point, hit):
    assert match_key_points(answer, [point]) == [hit]


WORDS = st.sampled_from(["cache", "caches", "caching", "cached", "batch", "batches", "batching", "batched",
                         "token", "tokens", "the", "of", "kv-cache", "prefill", "decode", "decoding"])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(WORDS, min_size=1, max_size=8))
@example(["kv-cache", "batching"])
def test_a_key_point_always_matches_its_own_text_and_case_does_not_matter(words):
    point = " ".join(words)
    if not [t for t in tokens(point) if t not in {"the", "of"}]:
        assert match_key_points(point, [point]) == [False]        # nothing to match on
        return
    assert match_key_points(point, [point]) == [True]
    assert match_key_points(point.upper(), [point]) == [True]
    assert match_key_points(point.replace("-", " "), [point]) == [True]


# --- negative cues, the polarity check, filler words and abbreviations (issue 32) -----------------------------------

def test_the_issue_32_example_no_longer_ticks_the_point_that_refutes_it():
    """Typing the mistake that speculative-decoding-distribution's last key point refutes ticks none of its points."""
    from minillm.quiz.bank import load_bank
    q = load_bank(REPO / "questions").questions["speculative-decoding-distribution"]
    typed = "draft and target must use identical sampling settings"
    marks = [explain(typed, kp, q.key_point_synonyms(i), cues=q.key_point_cues(i)) for i, kp in enumerate(q.key_points)]
    assert not any(m.hit for m in marks)
    refuted = [m for m in marks if m.refuted_by]
    assert refuted and "your answer says" in refuted[0].reason()
    right = ("q must be the distribution the draft actually sampled from, p the target's under the request's own "
             "sampling settings; the settings may differ, the draft need not use identical sampling settings")
    last = len(q.key_points) - 1
    assert explain(right, q.key_points[last], q.key_point_synonyms(last), cues=q.key_point_cues(last)).hit


@pytest.mark.parametrize("typed, cue, asserted", [
    ("the draft must use identical sampling settings", "identical sampling settings", True),
    ("The draft must use the identical sampling setting", "identical sampling settings", True),   # stems, articles
    ("the draft does not need identical sampling settings", "identical sampling settings", False),
    ("never offload the KV of sequences that are still decoding", "offload the KV of sequences", False),
    ("you should avoid offloading the KV of sequences still decoding", "offloading the KV of sequences", False),
    ("offloading the KV of sequences still decoding saves memory", "offloading the KV of sequences", True),
    ("sampling settings that are identical", "identical sampling settings", False),     # order matters
    ("", "identical sampling settings", False),
])
def test_says_finds_an_asserted_phrase_and_not_a_denied_one(typed, cue, asserted):
    assert says(typed, cue) is asserted


def test_a_cue_blocks_the_tick_and_match_key_points_takes_cues():
    point = "Accept drafted token x with probability min(1, p(x)/q(x))"
    typed = "accept each drafted token x with probability min(1, p/q); keep the longest prefix the target agrees with"
    assert explain(typed, point).hit
    assert not explain(typed, point, cues=["longest prefix the target agrees with"]).hit
    cues = [["longest prefix the target agrees with"], []]
    assert match_key_points(typed, [point, point], cues=cues) == [False, True]


def test_filler_words_are_never_required():
    assert {"use", "shrink", "roughly"} <= FILLER
    point = "Use KV heads, not query heads, so GQA/MQA shrink it roughly 4x"
    assert all(u.shown.lower() not in FILLER for u in _units(point))
    assert explain("count KV heads rather than query heads; GQA and MQA cut it 4x", point).hit


@pytest.mark.parametrize("short, spelled", [
    ("TP", "tensor parallelism"), ("PP", "pipeline parallelism"), ("EP", "expert parallelism"),
    ("DP", "data parallelism"), ("MoE", "mixture of experts"), ("MLA", "multi-head latent attention"),
    ("MTP", "multi-token prediction"),
])
def test_new_abbreviations_match_either_way(short, spelled):
    assert short.lower() in ABBREVIATIONS
    assert explain(f"we run {spelled} inside the node", f"{short} inside the node").hit
    assert explain(f"we run {short} inside the node", f"{spelled} inside the node").hit
    assert not explain("we run it inside the node", f"{spelled} inside the node").hit
