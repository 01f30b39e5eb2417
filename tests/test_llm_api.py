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
