"""The engine's seams and its one config path: EngineConfig holds every default and every entry point builds one;
components are swapped through plug() and checked against their Protocol; the step observer sees every step;
the scheduler alone talks to the block manager during a step."""
from __future__ import annotations

import argparse
import sys

import pytest

from minillm import interfaces
from minillm.cli_args import add_engine_args, engine_config
from minillm.config import CacheConfig, EngineConfig, SchedulerConfig, setting_names
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.scheduler import Scheduler
from minillm.kv.block_allocator import BlockAllocator
from minillm.kv.block_manager import BlockManager
from minillm.kv.prefix_cache import LRUEvictor
from minillm.layers.attention import TorchAttentionBackend
from minillm.sampling.params import SamplingParams
from minillm.sampling.sampler import Sampler
from minillm.testing import tiny_model


def run(engine, requests):
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           request_id=str(i))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    return outs


REQUESTS = [(list(range(3, 30)), 6), (list(range(40, 49)), 9), (list(range(3, 30)) + [7, 8], 4)]


# ---------------------------------------------------------------- one config path

def test_from_kwargs_routes_flat_settings_and_refuses_unknown_ones():
    c = EngineConfig.from_kwargs(block_size=8, max_num_seqs=3, kv_cache_memory="1MiB", dtype="bfloat16")
    assert (c.cache.block_size, c.scheduler.max_num_seqs, c.cache.kv_cache_memory_bytes, c.dtype) == \
        (8, 3, 2**20, "bfloat16")
    assert c.scheduler.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens    # the one default
    with pytest.raises(TypeError, match="unknown engine setting.*kv_cache_memory_bytes.*valid:.*block_size"):
        EngineConfig.from_kwargs(kv_cache_memory_bytes="1GiB")
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        EngineConfig.from_kwargs(block_size=0)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig.from_kwargs(kv_cache_memory="lots")
    assert EngineConfig.from_kwargs(**c.as_kwargs()) == c and c.replace(block_size=4).cache.block_size == 4


def test_every_entry_point_takes_its_defaults_from_engine_config():
    """LLM, LLMEngine.from_model and the CLI flags define no defaults of their own."""
    default = EngineConfig()
    assert default == EngineConfig.from_kwargs()
    engine = LLMEngine.from_model(tiny_model(), None)
    assert engine.config == default
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])) == default
    args = p.parse_args(["--block-size", "4", "--no-enable-prefix-caching", "--kv-cache-memory", "8MiB"])
    assert engine_config(args) == default.replace(block_size=4, enable_prefix_caching=False, kv_cache_memory="8MiB")
    assert {a.dest for a in p._actions} >= set(setting_names()) - {"speculative_config"}
    spec = engine_config(p.parse_args(["--speculative", "layer_skip", "--draft-layers", "3"])).speculative
    assert (spec.method, spec.draft_layers, spec.num_speculative_tokens) == ("layer_skip", 3, "auto")
    import inspect

    from minillm.llm import LLM
    # settings all go through EngineConfig; tp_rules is a plugged piece (lab09), not a setting
    assert [p.name for p in inspect.signature(LLM).parameters.values()] == ["model", "tp_rules", "settings"]
    assert list(inspect.signature(LLMEngine.from_model).parameters) == ["model", "tokenizer", "settings"]


def test_engine_config_fields_have_one_default_each():
    # the sections are plain dataclasses whose defaults the engine reads; nothing else redefines them
    assert CacheConfig().kv_cache_memory == "2GiB" and SchedulerConfig().max_num_seqs == 64
    assert set(setting_names()) == {"dtype", "device", "enforce_eager", "quantization", "quantization_group_size", "max_model_len",
                                    "attention_backend", "block_size", "num_blocks",
                                    "kv_cache_memory", "enable_prefix_caching", "kv_cache_dtype", "max_num_seqs",
                                    "max_num_batched_tokens", "enable_chunked_prefill", "speculative_config",
                                    "tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend",
                                    "pipeline_micro_batches", "decode_step", "qgemm", "qgemm_batched", "w8a8_kernel",
                                    "cpu_attention_kernel", "kernel_threads"}


def test_a_large_kv_budget_costs_no_memory_up_front():
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine = LLMEngine.from_model(tiny_model(), None, kv_cache_memory="4GiB")
    assert engine.kv_cache.nbytes >= 3.9 * 2**30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024    # KiB: far below 4 GiB
    assert run(engine, REQUESTS[:1])["0"]


# ---------------------------------------------------------------- plug and the protocols

def test_engine_parts_satisfy_their_protocols():
    engine = LLMEngine.from_model(tiny_model(), None, num_blocks=32, block_size=4)
    assert isinstance(engine.block_manager, interfaces.BlockManager)
    assert isinstance(engine.scheduler, interfaces.SchedulerPolicy)
    assert isinstance(engine.backend, interfaces.AttentionBackend)
    assert isinstance(engine.sampler, interfaces.Sampler)
    assert isinstance(BlockAllocator(4), interfaces.BlockAllocator)
    assert isinstance(LRUEvictor(), interfaces.Evictor)


def test_plug_refuses_what_does_not_fit_before_changing_anything():
    engine = LLMEngine.from_model(tiny_model(), None, num_blocks=32, block_size=4)
    bm = engine.block_manager
    with pytest.raises(TypeError, match="lacks .*allocate_prompt.*BlockManager"):
        engine.plug(block_manager=object())
    with pytest.raises(ValueError, match="pool's 32 blocks of 4 tokens"):
        engine.plug(block_manager=BlockManager(16, 4))
    with pytest.raises(TypeError, match="unknown seam"):
        engine.plug(hash=None)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.plug(backend=TorchAttentionBackend())
    assert engine.block_manager is bm


def test_every_seam_plugs_in_and_the_outputs_stay_the_same():
    calls = {"hash": 0, "lookup": 0, "evict": 0, "alloc": 0, "slots": 0, "sample": 0, "attend": 0}
    from minillm.kv.block_manager import slot_mapping
    from minillm.kv.prefix_cache import default_hash_fn, find_cached_prefix
    from minillm.layers.attention import causal_attend

    def count(key, fn):
        def wrapped(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return wrapped

    class CountingEvictor(LRUEvictor):
        def add(self, block):
            calls["evict"] += 1
            super().add(block)

    class CountingAllocator(BlockAllocator):
        def allocate(self):
            calls["alloc"] += 1
            return super().allocate()

    settings = dict(num_blocks=40, block_size=4, max_num_seqs=1)        # one at a time: the 3rd reuses the 1st
    base = run(LLMEngine.from_model(tiny_model(), None, **settings), REQUESTS)
    engine = LLMEngine.from_model(tiny_model(), None, **settings)
    engine.plug(hash_fn=count("hash", default_hash_fn), prefix_lookup=count("lookup", find_cached_prefix),
                evictor_cls=CountingEvictor, allocator_cls=CountingAllocator,
                slot_mapping_fn=count("slots", slot_mapping))
    class CountingSampler(Sampler):
        def __call__(self, logits, batch):
            calls["sample"] += 1
            return super().__call__(logits, batch)

    engine.plug(backend=TorchAttentionBackend(attend_fn=count("attend", causal_attend)), sampler=CountingSampler())
    engine.plug(scheduler=type("Mine", (Scheduler,), {})(engine.config.scheduler, engine.block_manager))
    assert run(engine, REQUESTS) == base
    assert all(calls.values()), calls
    assert engine.block_manager.stats.hits > 0        # the third prompt reuses the first one's blocks


# ---------------------------------------------------------------- the step observer

def test_step_observer_sees_every_step_with_the_queues_before_it():
    engine = LLMEngine.from_model(tiny_model(), None, num_blocks=40, block_size=4, max_num_seqs=2,
                                  max_num_batched_tokens=16)
    seen = []
    fn = engine.add_step_observer(seen.append)
    run(engine, REQUESTS)
    assert [s.step for s in seen] == list(range(1, engine.num_steps + 1))
    first = seen[0]
    assert [s.request_id for s in first.waiting_before] == ["0", "1", "2"] and not first.running_before
    assert [(seq.request_id, n) for seq, n in first.scheduler_output.scheduled] == [("0", 16)]   # budget: a chunk
    assert all(s.seconds > 0 for s in seen)
    assert sum(len(o.delta_token_ids) for s in seen for o in s.outputs) == 6 + 9 + 4
    for s in seen:
        computed = {snap.request_id: snap.num_computed_tokens for snap in s.running_before}
        for seq, n in s.scheduler_output.scheduled:          # a running sequence continues where it was
            if seq.request_id in computed:
                assert computed[seq.request_id] + n <= seq.num_tokens
    engine.remove_step_observer(fn)
    n = len(seen)
    run(engine, REQUESTS[:1])
    assert len(seen) == n
    with pytest.raises(TypeError, match="callable"):
        engine.add_step_observer(42)


def test_only_the_scheduler_talks_to_the_block_manager_during_a_step():
    engine = LLMEngine.from_model(tiny_model(), None, num_blocks=12, block_size=4, max_num_seqs=3)
    callers = []
    real = engine.block_manager

    class Recording:
        """The BlockManager protocol, forwarded, noting which module called."""

        def __getattr__(self, name):
            attr = getattr(real, name)
            if callable(attr):
                def call(*a, **k):
                    callers.append((sys._getframe(1).f_globals.get("__name__"), name))
                    return attr(*a, **k)
                return call
            return attr

        num_blocks, block_size = real.num_blocks, real.block_size
        num_free_blocks = property(lambda self: real.num_free_blocks)

    proxy = Recording()
    assert not interfaces.missing_members(proxy, interfaces.BlockManager)
    engine.plug(block_manager=proxy)
    callers.clear()
    reqs = [(list(range(3, 20)), 12), (list(range(30, 41)), 12), (list(range(50, 60)), 12)]
    for i, (p, m) in enumerate(reqs):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, n=2 if i == 0 else 1))
    while engine.has_unfinished_requests():
        engine.step()
    assert callers and {mod for mod, _ in callers} == {"minillm.engine.scheduler"}, set(callers)
    assert {"append_slots", "commit_computed", "fork", "free", "slot_mapping", "block_table"} <= {n for _, n in callers}


def test_config_lists_stay_in_step_with_what_they_name():
    """config.py names a few things other modules define (so validating a setting needs no torch): they agree."""
    from minillm import config
    from minillm.quant import formats
    from minillm.sampling.params import SamplingParams
    from minillm.spec_decode.proposers import PROPOSERS
    assert config.SAMPLING_SETTING_NAMES == tuple(SamplingParams.__dataclass_fields__)
    assert config.QUANT_BLOCK == formats.BLOCK
    assert set(config.METHODS) == set(PROPOSERS)


def test_kernel_settings_come_from_the_engine_config_or_the_environment(monkeypatch):
    """An engine built with a kernel setting applies it process-wide; otherwise the environment decides, and a bad
    value names both the setting and its environment variable."""
    from minillm import config
    monkeypatch.setenv("MINILLM_QGEMM", "torch")
    assert config.kernels().qgemm == "torch" and EngineConfig().kernels.qgemm == "torch"
    monkeypatch.delenv("MINILLM_QGEMM")
    assert config.kernels().qgemm == "c"
    with config.kernels_set(decode_step="layers"):
        assert config.kernels().decode_step == "layers"
    assert config.kernels().decode_step == "fused"
    engine = LLMEngine.from_model(tiny_model(), num_blocks=8, block_size=4, decode_step="layers")
    try:
        assert config.kernels().decode_step == "layers"
    finally:
        config.use_kernels(None)
    monkeypatch.setenv("MINILLM_DECODE_STEP", "fast")
    with pytest.raises(ValueError, match="decode_step.*MINILLM_DECODE_STEP"):
        config.kernels()
    del engine
