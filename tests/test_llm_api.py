"""The public API on the real model: LLM.generate / LLM.chat, streaming text and stop strings."""
import pytest

from minillm import LLM, SamplingParams
from minillm.engine.prompt import build_prompt_ids
from minillm.engine.simple import SimpleGenerator

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM("default", max_num_seqs=4, block_size=16, kv_cache_memory="64MiB")


def test_generate_matches_reference_and_reports_metrics(llm):
    prompts = ["The three primary colors are", "def fibonacci(n):", "Paris is the capital of"]
    params = SamplingParams(temperature=0, max_tokens=16)
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen = SimpleGenerator(llm.engine.model, llm.tokenizer)
    for p, o in zip(prompts, outs):
        text, ids = gen.generate(llm.tokenizer.encode(p), params)
        assert o.token_ids == ids and o.text == text
        m = o.metrics
        assert m.ttft > 0 and m.e2e >= m.ttft and len(m.itl) == len(ids) - 1
        assert m.tpot is None or m.tpot > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.text


def test_stop_strings_are_cut_and_stream_is_consistent(llm):
    engine = llm.engine
    ids = build_prompt_ids(llm.tokenizer, "Write a short sentence about the sea.")
    full = llm.generate([ids], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].text
    assert len(full) > 20
    stop = full[12:16]                       # a stop string the greedy answer is known to contain
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=40, stop=[stop, "@@never@@"]))
    streamed, final = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            streamed.append(o.delta_text)
            final = o
    assert final.finished and final.outputs[0].finish_reason == "stop" and final.request_id == rid
    assert "".join(streamed) == final.text == full[: full.index(stop)]


def test_bad_prompt_in_a_batch_rejects_the_batch_cleanly(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_multibyte_text_streams_whole_characters(llm):
    engine = llm.engine
    engine.add_request("Écris trois mots français avec des accents : é, è, à. Réponse :",
                       SamplingParams(temperature=0, max_tokens=24))
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [o.delta_text for o in engine.step()]
    assert all("\ufffd" not in p for p in pieces)


def test_speculation_and_logprobs_through_the_public_api():
    """The issue's example: LLM(..., speculative_config=...) with sampled and greedy requests; per-request
    acceptance and vLLM-style logprobs."""
    spec = LLM("default", max_num_seqs=4, block_size=16, kv_cache_memory="64MiB",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompts = ["Repeat exactly: one two three four five, one two three four five, one two three four five.",
               "Write a haiku about the sea."]
    outs = spec.generate(prompts, SamplingParams(temperature=0.7, top_p=0.9, seed=1, logprobs=5, max_tokens=24),
                         use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) > 0
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and 5 <= len(entry) <= 6
            assert sorted(lp.rank for t, lp in entry.items() if t != tok or lp.rank <= 5)[:5] == [1, 2, 3, 4, 5]
            assert all(lp.logprob <= 0 and isinstance(lp.decoded_token, str) for lp in entry.values())
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)),
                                                     abs=1e-3)
    assert outs[0].metrics.spec_acceptance_rate is not None and outs[0].metrics.spec.num_draft_tokens > 0
    again = spec.generate(prompts, SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=24), use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]          # seeded: reproducible
    greedy = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM("default", max_num_seqs=4, block_size=16, kv_cache_memory="64MiB")
    assert [o.text for o in spec.generate(prompts, greedy, use_tqdm=False)] == \
        [o.text for o in plain.generate(prompts, greedy, use_tqdm=False)]
