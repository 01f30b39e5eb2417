"""`minillm serve` through the official `openai` client, over a real HTTP server on loopback (a tiny random model):
the shapes the client parses, streaming, n, stop, seeds, logprobs, structured outputs, errors as the client's typed
exceptions, and what the server leaves behind (no request, no KV block) after disconnects and bursts."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from minillm import LLM, SamplingParams
from minillm.config import ServeConfig
from minillm.serve.server import BackgroundServer
from tests.tiny_models import tiny_model_dir

MESSAGES = [{"role": "user", "content": "ab ab"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", context=256)


@pytest.fixture(scope="module")
def llm(model_dir):
    """The engine behind the servers: only their loop steps it (tests read its state, never call it)."""
    with LLM(str(model_dir), num_blocks=96, block_size=4) as llm:
        yield llm


@pytest.fixture(scope="module")
def ref(model_dir):
    """Another engine on the same weights, for the answers the server must give."""
    with LLM(str(model_dir)) as ref:
        yield ref


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(llm.engine, name="tiny") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def _idle(llm) -> bool:
    bm = llm.engine.block_manager
    return not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


def _wait_idle(llm, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout           # a hang guard, not a budget: the engine frees within a step or two
    while not _idle(llm) and time.monotonic() < end:
        time.sleep(0.02)
    return _idle(llm)


def test_greedy_chat_through_the_server_equals_llm_chat(client, ref):
    want = ref.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=16)
    assert got.object == "chat.completion" and got.model == "tiny"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_a_stream_adds_up_to_the_whole_answer_and_reports_usage(client):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=20)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len(chunks) > 3                                          # streamed token by token, not in one piece


def test_a_body_sent_as_curl_sends_it_is_read_as_json(server):
    """`curl -d '{...}'` labels the body a form; the README's example must work all the same."""
    r = httpx.post(server.url + "/chat/completions", content=json.dumps({"model": "tiny", "messages": MESSAGES,
                                                                       "max_tokens": 3}),
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text


def test_the_stream_is_server_sent_events_ending_with_done(server):
    """What curl -N shows: `data: {json}` events, a blank line after each, `data: [DONE]` last."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", server.url + "/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") and json.loads(e[6:])["object"] == "chat.completion.chunk"
               for e in events[:-2])


def test_completions_take_text_token_ids_and_several_prompts(client, ref):
    ids = ref.tokenizer.encode("ab ab ab")
    want = ref.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    for prompt in ("ab ab ab", ids):
        got = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=8)
        assert got.object == "text_completion" and got.choices[0].text == want
    two = client.completions.create(model="tiny", prompt=["ab ab ab", "b a"], temperature=0, max_tokens=8, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text == want       # greedy: both samples the same
    streamed = list(client.completions.create(model="tiny", prompt=["ab ab ab", "b a"], temperature=0,
                                              max_tokens=8, n=2, stream=True))
    by_index: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert by_index == {c.index: c.text for c in two.choices}


def test_n_seeds_and_stop(client):
    kw = dict(model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=12, n=3, seed=7)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    text = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=30)
    content = text.choices[0].message.content
    stop = content[len(content) // 2:len(content) // 2 + 2]
    if stop.strip():
        cut = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=30,
                                             stop=[stop])
        assert cut.choices[0].message.content == content[:content.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_logprobs_in_both_shapes(client):
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=6,
                                          logprobs=True, top_logprobs=3)
    items = chat.choices[0].logprobs.content
    assert len(items) == chat.usage.completion_tokens
    for item in items:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.logprob == max(t.logprob for t in item.top_logprobs)        # greedy: the top token
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs),
                                                                reverse=True)
    comp = client.completions.create(model="tiny", prompt="ab ab", temperature=0, max_tokens=5, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == comp.usage.completion_tokens
    assert "".join(lp.tokens) == comp.choices[0].text
    # keyed by text, as OpenAI's legacy shape is: two tokens that decode alike (a partial UTF-8 byte) share a key
    assert all(1 <= len(t) <= 2 and max(t.values()) == x for t, x in zip(lp.top_logprobs, lp.token_logprobs))


def test_response_format_json_schema_outputs_validate(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer"}}, "required": ["name", "n"]}
    for seed in range(3):
        got = client.chat.completions.create(
            model="tiny", messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
        if got.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(got.choices[0].message.content), schema)
    obj = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=40,
                                         extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert obj.choices[0].message.content in ("yes", "no")


def test_errors_arrive_as_the_clients_typed_exceptions(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=-1)
    assert e.value.body["param"] == "temperature" and "temperature" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=-5)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert "'tiny'" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="ab " * 400, max_tokens=4)
    assert e.value.body["param"] == "prompt" and "tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "hi"}])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3}}})
    assert e.value.body["param"] == "response_format" and "minimum" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, logit_bias={"5": 10})
    assert e.value.body["param"] == "logit_bias"
    for body, needle in ((b"{not json", "not valid JSON"), (b"\xff\xfe{}", "not valid JSON"),
                         (b'{"messages": "hi"}', "messages")):
        r = httpx.post(server.url + "/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/chat/completions", content=b"x" * (9 * 2**20),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]


def test_models_tokenize_detokenize_health(client, server, ref):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    ids = httpx.post(server.base + "/tokenize", json={"prompt": "ab ab"}).json()
    assert ids["tokens"] == ref.tokenizer.encode("ab ab") and ids["count"] == len(ids["tokens"])
    chat = httpx.post(server.base + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > ids["count"]                                       # the template's tokens too
    text = httpx.post(server.base + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text.endswith("ab ab")
    assert httpx.post(server.base + "/detokenize", json={"tokens": [10**7]}).status_code == 400
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}


def test_a_client_that_disconnects_mid_stream_frees_its_request(server, llm):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/chat/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]                  # a few chunks, then hang up
    assert any(line.startswith("data: {") for line in got)
    assert _wait_idle(llm), "the aborted request still holds the engine"


@pytest.mark.parametrize("route, body", [
    ("/chat/completions", {"messages": MESSAGES}), ("/completions", {"prompt": ["ab", "ab ab"], "n": 2})])
def test_a_client_that_hangs_up_on_a_whole_answer_frees_its_request(server, llm, route, body):
    """Not streamed: the server looks for the client while the answer is made, and one that left is aborted."""
    steps = []
    slow = llm.engine.add_step_observer(lambda info: steps.append(time.sleep(0.02)))    # 200 tokens: >= 4 s
    body = {"model": "tiny", "max_tokens": 200, "ignore_eos": True, **body}
    try:
        host, port = server.base.split("//")[1].split(":")
        with socket.create_connection((host, int(port))) as sock:
            data = json.dumps(body).encode()
            sock.sendall(f"POST /v1{route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            while len(steps) < 5:                              # it runs: hang up
                time.sleep(0.01)
        hung_up_at = len(steps)
        assert _wait_idle(llm), "the abandoned request still holds the engine"
    finally:
        llm.engine.remove_step_observer(slow)
    assert len(steps) - hung_up_at < 50, f"{len(steps) - hung_up_at} steps after the client left (200 to finish)"


def test_an_api_key_protects_the_v1_routes(llm):
    with BackgroundServer(llm.engine, name="tiny", config=ServeConfig(port=0, api_key="sesame")) as s:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url, api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=s.url, api_key="sesame", max_retries=0).models.list().data[0].id == "tiny"
        assert httpx.get(s.base + "/health").status_code == 200             # not under /v1: no key needed


def test_a_burst_past_the_waiting_limit_gets_429_and_nothing_leaks(llm):
    config = ServeConfig(port=0, max_waiting_requests=2)
    results: list = []
    with BackgroundServer(llm.engine, name="tiny", config=config) as s:
        c = openai.OpenAI(base_url=s.url, api_key="x", max_retries=0)

        def one() -> None:
            try:
                r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0,
                                              extra_body={"ignore_eos": True})
                results.append(r.usage.completion_tokens)
            except openai.RateLimitError as e:
                results.append(e)
        threads = [threading.Thread(target=one) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(results) == 16 and refused and len(refused) < 16, results
    assert all(r.response.headers.get("retry-after") == "1" for r in refused)
    assert all(r == 24 for r in results if not isinstance(r, Exception))
    assert _wait_idle(llm)


def test_the_server_answers_503_while_the_model_loads():
    from fastapi.testclient import TestClient

    from minillm.serve.app import Serving, build_app
    with TestClient(build_app(Serving())) as c:
        r = c.post("/v1/chat/completions", json={"model": "x", "messages": MESSAGES})
        assert r.status_code == 503 and r.headers["retry-after"] == "5" and "loading" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 503


@pytest.mark.parametrize("stop, layout", [("SIGINT", []), ("SIGTERM", ["--tensor-parallel-size", "2"]),
                                         ("SIGINT", ["--pipeline-parallel-size", "2"])])
def test_minillm_serve_runs_answers_and_stops_cleanly(model_dir, ref, stop, layout):
    """The command itself: listens, loads, serves the openai client (greedy answers as LLM.chat's, also with the
    model sharded over worker processes), and exits 0 on Ctrl-C or SIGTERM."""
    import os
    import re
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--model", str(model_dir), "--port", "0",
                             "--served-model-name", "tiny", "--max-num-seqs", "4", *layout],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        for line in proc.stderr:                            # ends if the process dies (the test fails below)
            m = re.search(r"ready on (http://127\.0\.0\.1:\d+/v1)", line)
            if m:
                url = m.group(1)
                break
        assert url, "minillm serve never said it was ready"
        c = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        want = ref.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
        got = c.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=12)
        assert got.choices[0].message.content == want
        lines: list[str] = []
        started = threading.Event()

        def in_flight() -> None:                            # a long answer, streaming when the signal comes
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 150, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", url + "/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()
        t = threading.Thread(target=in_flight)
        t.start()
        assert started.wait(60)
        proc.send_signal(getattr(signal, stop))
        t.join(120)
        events = [x for x in lines if x]
        assert events[-1] == "data: [DONE]", events[-3:]     # the request in flight was finished, not cut
        finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in events if x.startswith("data: {")]
        assert finish[-1] == "length"
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_metrics_use_vllms_names_and_agree_with_the_engines_records(llm):
    from prometheus_client.parser import text_string_to_metric_families
    finished: list = []
    record = llm.engine.add_step_observer(lambda info: finished.extend(o for o in info.outputs if o.finished))
    try:
        with BackgroundServer(llm.engine, name="tiny") as s:
            c = openai.OpenAI(base_url=s.url, api_key="x", max_retries=0)
            usages = [c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ab " * k}],
                                                max_tokens=6 + k, temperature=0,
                                                extra_body={"ignore_eos": True}).usage for k in range(3)]
            text = httpx.get(s.base + "/metrics").text
    finally:
        llm.engine.remove_step_observer(record)
    samples = {(x.name, x.labels.get("finished_reason")): x.value
               for f in text_string_to_metric_families(text) for x in f.samples}

    def value(name, reason=None):
        return samples[(name, reason)]
    assert value("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert value("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert value("vllm:request_success_total", "length") == 3
    assert value("vllm:num_requests_running") == value("vllm:num_requests_waiting") == 0
    assert value("vllm:kv_cache_usage_perc") == 0
    assert value("vllm:time_to_first_token_seconds_count") == value("vllm:e2e_request_latency_seconds_count") == 3
    assert value("vllm:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    assert value("vllm:time_to_first_token_seconds_sum") == pytest.approx(sum(o.metrics.ttft for o in finished))
    assert value("vllm:e2e_request_latency_seconds_sum") == pytest.approx(sum(o.metrics.e2e for o in finished))
    assert value("vllm:prefix_cache_hits_total") <= value("vllm:prefix_cache_queries_total")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        import os
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def _soak_round(url: str, seed: int) -> dict[str, int]:
    """200 requests from 32 concurrent clients: a quarter hang up mid-stream, the rest read to the end."""
    import asyncio
    import random
    rnd = random.Random(seed)
    counts = {"done": 0, "429": 0, "left": 0}
    sem = asyncio.Semaphore(32)

    async def one(i: int, http: httpx.AsyncClient) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "ab " * rnd.randint(1, 30)}],
                "max_tokens": rnd.randint(1, 40), "stream": True, "temperature": 1.0, "seed": i}
        leave_after = rnd.randint(1, 5) if rnd.random() < 0.25 else None
        async with sem:
            async with http.stream("POST", url + "/chat/completions", json=body) as r:
                if r.status_code == 429:
                    counts["429"] += 1
                    return
                assert r.status_code == 200, await r.aread()
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if leave_after is not None and n >= leave_after:
                        counts["left"] += 1
                        return
                    if line == "data: [DONE]":
                        counts["done"] += 1
                        return
    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(one(i, http) for i in range(200)))
    return counts


@pytest.mark.slow
def test_a_soak_with_disconnects_and_a_burst_leaks_nothing(llm):
    import asyncio
    config = ServeConfig(port=0, max_waiting_requests=12)
    with BackgroundServer(llm.engine, name="tiny", config=config) as s:
        rss = []
        for seed in range(3):                                  # round 0 warms up allocators and caches
            counts = asyncio.run(_soak_round(s.url, seed))
            assert sum(counts.values()) == 200, counts           # every request ended one of the three ways
            assert counts["429"] and counts["left"] and counts["done"], counts
            assert _wait_idle(llm)
            rss.append(_rss_mb())
        text = httpx.get(s.base + "/metrics").text
    assert "vllm:num_requests_running{model_name=\"tiny\"} 0.0" in text
    assert "vllm:num_requests_waiting{model_name=\"tiny\"} 0.0" in text
    print(f"RSS after rounds: {', '.join(f'{x:.0f} MB' for x in rss)}")
    assert rss[2] - rss[1] < 32, rss                           # no growth per round beyond allocator noise


def test_the_admission_policy_is_a_seam(llm):
    """A policy of one's own decides (here: nobody waits behind a request of more than 8 prompt tokens)."""
    class Small:
        def admit(self, waiting_requests, waiting_tokens, prompt_tokens):
            return prompt_tokens <= 8
    with pytest.raises(TypeError, match="lacks admit"):
        BackgroundServer(llm.engine, admission=object())
    with BackgroundServer(llm.engine, name="tiny", admission=Small()) as s:
        c = openai.OpenAI(base_url=s.url, api_key="x", max_retries=0)
        assert c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2).choices[0].text is not None
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model="tiny", prompt=list(range(5, 20)), max_tokens=2)
    assert _wait_idle(llm)


def test_token_budget_admission_rule():
    from minillm.serve.app import TokenBudgetAdmission
    rule = TokenBudgetAdmission(max_waiting_requests=3, max_waiting_tokens=100)
    assert rule.admit(0, 0, 500)                       # alone, a big request still runs (else it never could)
    assert rule.admit(1, 60, 40) and not rule.admit(1, 60, 41)      # the token budget, inclusive
    assert rule.admit(2, 0, 1) and not rule.admit(3, 0, 1)          # the request count, inclusive
