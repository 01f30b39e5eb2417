"""Prometheus metrics under vLLM's names and meanings, so dashboards built for vLLM read minillm too.

A step observer (it runs on the engine thread, after every step) sets the gauges from the engine's own state and
counts tokens, preemptions and prefix-cache lookups; each finished request adds its latencies (from the
RequestMetrics the engine recorded) to the histograms. Each server has a registry of its own, so two servers in one
process (tests, a notebook) never mix their numbers.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minillm.engine.llm_engine import LLMEngine
from minillm.engine.outputs import RequestOutput, StepInfo

# seconds: vLLM's buckets for the request latencies (finer at the low end, where interactive serving lives)
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineMetrics:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine, self.registry = engine, CollectorRegistry()
        label, r = {"model_name": model_name}, self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(label), registry=r).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(label), registry=r).labels(**label)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, list(label), buckets=buckets, registry=r).labels(**label)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch (each of n samples "
                                                          "counts).")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of the KV pool's blocks in use (0-1).")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted (their KV freed, recomputed "
                                                           "later).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of the requests started.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first output token.", _TTFT)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Gaps between consecutive output tokens.", _ITL)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to the request's end.", _E2E)
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled (time waiting).", _E2E)
        self.drafts = counter("vllm:spec_decode_num_draft_tokens", "Speculative tokens drafted.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Speculative tokens accepted.")
        self.model_name = model_name
        self._prefix_seen = (0, 0)
        self._prompts_seen: set[str] = set()
        engine.add_step_observer(self.on_step)

    def close(self) -> None:
        self.engine.remove_step_observer(self.on_step)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ the engine thread
    def on_step(self, info: StepInfo) -> None:
        engine, bm = self.engine, self.engine.block_manager
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        self.kv_usage.set(1 - bm.num_free_blocks / bm.num_blocks)
        self.preemptions.inc(len(info.scheduler_output.preempted))
        hits, misses = bm.stats.hits, bm.stats.misses
        seen_hits, seen_misses = self._prefix_seen
        self.prefix_hits.inc(bm.block_size * (hits - seen_hits))
        self.prefix_queries.inc(bm.block_size * (hits - seen_hits + misses - seen_misses))
        self._prefix_seen = (hits, misses)
        for out in info.outputs:
            self._count(out)
        if len(self._prompts_seen) > 2 * len(engine.requests) + 64:   # aborted requests never finish: forget them
            self._prompts_seen &= set(engine.requests)

    def _count(self, out: RequestOutput) -> None:
        if out.request_id not in self._prompts_seen:
            self._prompts_seen.add(out.request_id)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.delta_token_ids) if len(out.outputs) == 1 else 0)
        if not out.finished:
            return
        self._prompts_seen.discard(out.request_id)
        if len(out.outputs) > 1:                        # n > 1: the deltas above are the first sample's only
            self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        m = out.metrics
        for c in out.outputs:
            self.success.labels(self.model_name, c.finish_reason or "stop").inc()
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.itl:
            self.itl.observe(gap)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        self.drafts.inc(m.spec.num_draft_tokens)
        self.accepted.inc(m.spec.num_accepted_tokens)
