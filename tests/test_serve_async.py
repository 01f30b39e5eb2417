"""The async engine loop (minillm/serve/async_engine.py): concurrent requests share one continuous batch and get
what they would get alone; a consumer that leaves aborts its request and frees its blocks within one step; a bad
request fails alone; a failing step ends every request with the error instead of hanging them."""
from __future__ import annotations

import asyncio

import pytest

from minillm.engine.llm_engine import LLMEngine
from minillm.sampling.params import SamplingParams
from minillm.serve.async_engine import AsyncEngine, EngineDead
from minillm.testing import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 30)), [3] * 9, [40, 41]]


def _engine(**kw) -> LLMEngine:
    return LLMEngine.from_model(tiny_model(), block_size=4, num_blocks=64, **kw)


def _alone(prompt, params=GREEDY) -> list[int]:
    engine = _engine()
    engine.add_request(prompt, params)
    out = []
    while engine.has_unfinished_requests():
        out = [o for o in engine.step() if o.finished] or out
    return out[0].outputs[0].token_ids


async def _collect(aengine: AsyncEngine, prompt, params=GREEDY) -> tuple[list[int], int]:
    tokens, updates = [], 0
    async for out in aengine.generate(prompt, params):
        tokens += out.delta_token_ids
        updates += 1
        last = out
    assert last.finished and last.outputs[0].token_ids == tokens
    return tokens, updates


def test_concurrent_requests_share_a_batch_and_get_their_own_outputs():
    engine = _engine()
    batch_sizes = []
    engine.add_step_observer(lambda info: batch_sizes.append(len(info.outputs)))
    aengine = AsyncEngine(engine)

    async def main():
        return await asyncio.gather(*(_collect(aengine, p) for p in PROMPTS))
    try:
        results = asyncio.run(main())
    finally:
        aengine.close()
    assert [t for t, _ in results] == [_alone(p) for p in PROMPTS]
    assert all(n == GREEDY.max_tokens for _, n in results)           # streamed: one update per token
    assert max(batch_sizes) == len(PROMPTS), batch_sizes             # they ran together, not one after another
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_consumer_that_leaves_aborts_its_request_within_one_step():
    engine = _engine()
    seen_after_leave: list[int] = []
    state = {"left": False, "steps_after": 0}

    def observe(info):
        if state["left"]:
            state["steps_after"] += 1
            seen_after_leave.extend(1 for o in info.outputs if o.request_id == "quitter")
    engine.add_step_observer(observe)
    aengine = AsyncEngine(engine)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def quitter():
        async for out in aengine.generate([5, 6, 7], long, request_id="quitter"):
            if len(out.outputs[0].token_ids) >= 3:
                state["left"] = True
                break                                   # the generator's finally sends the abort

    async def main():
        stayer = asyncio.create_task(_collect(aengine, [9, 10, 11], long))
        await quitter()
        return await stayer
    try:
        tokens, _ = asyncio.run(main())
    finally:
        aengine.close()
    assert tokens == _alone([9, 10, 11], long)                       # the other request is untouched
    assert len(seen_after_leave) <= 1, seen_after_leave              # at most the step already running
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_cancelled_task_aborts_too():
    engine = _engine()
    aengine = AsyncEngine(engine)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        task = asyncio.create_task(_collect(aengine, [5, 6, 7], long))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _collect(aengine, [1, 2, 3])                    # the loop goes on serving
    try:
        tokens, _ = asyncio.run(main())
    finally:
        aengine.close()
    assert tokens == _alone([1, 2, 3])
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_bad_request_fails_alone_with_the_engines_error():
    aengine = AsyncEngine(_engine())

    async def main():
        good = asyncio.create_task(_collect(aengine, [5, 6, 7]))
        with pytest.raises(ValueError, match="prompt is empty"):
            await _collect(aengine, [])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(aengine, [10**6])
        return await good
    try:
        tokens, _ = asyncio.run(main())
    finally:
        aengine.close()
    assert tokens == _alone([5, 6, 7])


def test_a_failing_step_ends_every_request_and_the_engine_refuses_new_ones():
    engine = _engine()

    def broken(info):
        if info.step == 3:
            raise RuntimeError("a rank went away")
    engine.add_step_observer(broken)
    aengine = AsyncEngine(engine)

    async def main():
        results = await asyncio.gather(*(_collect(aengine, p) for p in PROMPTS[:2]), return_exceptions=True)
        with pytest.raises(EngineDead, match="a rank went away"):
            await _collect(aengine, [5, 6, 7])
        return results
    results = asyncio.run(main())
    assert all(isinstance(r, EngineDead) and "a rank went away" in str(r) for r in results), results
    assert not aengine.is_running


def test_close_ends_requests_in_flight():
    aengine = AsyncEngine(_engine())
    long = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)

    async def main():
        task = asyncio.create_task(_collect(aengine, [5, 6, 7], long))
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, aengine.close)
        with pytest.raises(EngineDead, match="shutting down"):
            await task
    asyncio.run(main())


def test_a_tensor_parallel_engine_serves_the_same_tokens(tmp_path):
    """The loop drives whatever LLMEngine it is given: here rank 0 of TP=2 (thread ranks)."""
    from minillm import LLM
    from tests.tiny_models import tiny_model_dir
    path = tiny_model_dir(tmp_path / "model", context=64)
    want = [o.outputs[0].token_ids for o in LLM(str(path)).generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="thread") as llm:
        aengine = AsyncEngine(llm.engine)

        async def main():
            return await asyncio.gather(*(_collect(aengine, p) for p in PROMPTS))
        try:
            got = [t for t, _ in asyncio.run(main())]
        finally:
            aengine.close()
    assert got == want
