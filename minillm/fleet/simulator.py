"""A discrete-event simulation of a serving fleet: replicas behind a router, on one event queue.

Events (a heapq ordered by time, then kind): a replica's step ends (tokens appear, finished requests leave, the
replica starts its next step at once), a prompt's KV lands on a decode replica, a replica fails, a replica becomes
routable (cold start or repair over), the autoscaler looks at its signal, a request arrives (the router picks a
replica; an idle one starts a step). Only the next arrival is on the queue: the workload is a generator, finished
requests are folded into LatencyStats and dropped, so memory grows with the requests in flight, not with the run.

What a fleet can be (each optional, see policies.py for the rules):
* disaggregated: `decode_replicas` form a second pool; the router places a request on a prefill replica, which
  computes its prompt and first token (TTFT) and frees it; its KV then crosses `kv_link` (queued per prefill
  replica) and a decode replica (least outstanding tokens) admits it with the prompt already computed;
* autoscaled: `autoscaler` adds replicas made by `new_replica` (routable after the cold start) and drains them
  (no new requests; gone, and no longer billed, once empty);
* failing: `failures` kills replicas; what they held is retried on the others (resuming after the tokens already
  streamed), at most `retries` times, then counted failed; the KV positions they had computed are the lost work;
* judged: `slo` counts the requests that met it.
A replica's identity for the router is its position among the routable replicas, in the order they were created.

Time per event is dominated by the real Scheduler's schedule() and commit() (per scheduled sequence, in Python):
the cost of a simulated request is about (its output tokens) x (one sequence's share of a step). `FleetResult`
reports how fast the run went (simulated requests per wall second), so the scale limit is measured, not assumed.
"""
from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from minillm import interfaces
from minillm.fleet.metrics import LatencyStats
from minillm.fleet.policies import Autoscaler, FailurePlan, KVLink, Slo
from minillm.fleet.replica import Finished, InFlight, Replica, output_token
from minillm.fleet.routers import LeastTokens
from minillm.fleet.workloads import SimRequest
from minillm.interfaces import Router

# Event kinds, in the order they apply at equal times: a step's tokens land before anything else looks at the
# replica, and a new request is routed last (after replicas became routable or died at that instant).
STEP_END, KV_READY, FAIL, READY, SCALE, ARRIVAL = range(6)
BACKGROUND = (FAIL, SCALE)    # recurring events that do not keep the simulation alive on their own

UNIFIED, PREFILL, DECODE = "unified", "prefill", "decode"
STARTING, UP, DRAINING, DOWN, GONE = "starting", "up", "draining", "down", "gone"
BILLED = (STARTING, UP, DRAINING, DOWN)     # a repairing replica's GPUs are still rented


@dataclass(eq=False)
class Slot:
    """One replica's place in the fleet: its role, its life-cycle state, and per-slot accounting."""
    replica: Replica
    role: str
    state: str
    index: int
    epoch: int = 0                 # bumped when the replica dies: its pending step end is void
    link_free: float = 0.0         # prefill: when its KV link is free again
    kv_area: float = 0.0           # integral of used KV blocks over time
    kv_since: float = 0.0
    kv_used: int = 0
    alive_since: float = 0.0
    alive_s: float = 0.0           # billed seconds, for the time-weighted KV usage


@dataclass
class _Retry:
    """A request that lost a replica: what the client already has, across attempts."""
    arrival: float
    prompt_len: int
    emitted: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    cached_tokens: int | None = None
    preemptions: int = 0
    attempts: int = 0


@dataclass
class FleetResult:
    router: str
    num_replicas: int
    finished: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    first_arrival: float = math.inf
    last_finish: float = 0.0
    ttft: LatencyStats = field(default_factory=LatencyStats)
    tpot: LatencyStats = field(default_factory=LatencyStats)
    e2e: LatencyStats = field(default_factory=LatencyStats)
    queueing: LatencyStats = field(default_factory=LatencyStats)
    kv_usage_mean: float = 0.0     # time-weighted share of the KV pool in use, over replicas
    kv_usage_peak: float = 0.0
    steps: int = 0
    wall_s: float = 0.0
    # the fleet features (zero / empty when unused)
    layout: str = ""                          # "4" or "2P:2D"
    dynamic: bool = False                     # autoscaled or failing: the fleet's size changes
    prefill_tokens: int = 0                   # computed, every replica (recompute included)
    decode_tokens: int = 0
    decode_pool_prefill_tokens: int = 0       # disaggregated: prefill the decode pool had to run (preemption)
    kv_transfer: LatencyStats = field(default_factory=LatencyStats)   # first token -> KV on a decode replica
    replica_failures: int = 0
    drained: int = 0                          # replicas the autoscaler drained
    drained_in_flight: int = 0                # requests they still held when draining began (all finish there)
    retried: int = 0                          # retry attempts
    lost_tokens: int = 0                      # KV positions failed replicas had computed for requests in flight
    slo: Slo | None = None
    slo_met: int = 0
    replica_seconds: float = 0.0              # billed replica time (cost): starting, up, draining, down
    timeline: list[tuple[float, int, int]] = field(default_factory=list)   # (t, routable, billed) on change
    host_loaded_blocks: int = 0               # KV offload: blocks copied back from host memory (hits)
    host_stored_blocks: int = 0
    host_seconds: float = 0.0                 # PCIe time charged for the loads
    block_size: int = 0

    def add(self, f: Finished) -> None:
        self.first_arrival = min(self.first_arrival, f.arrival)
        if f.failed:
            self.failed += 1
            return
        self.finished += 1
        self.prompt_tokens += f.prompt_len
        self.cached_tokens += f.cached_tokens
        self.output_tokens += f.output_len
        self.preemptions += f.preemptions
        self.last_finish = max(self.last_finish, f.finished)
        ttft = f.first_token - f.arrival
        self.ttft.add(ttft)
        self.e2e.add(f.finished - f.arrival)
        self.queueing.add(f.first_scheduled - f.arrival)
        tpot = None
        if f.output_len > 1:
            tpot = (f.finished - f.first_token) / (f.output_len - 1)
            self.tpot.add(tpot)
        if self.slo is not None and self.slo.met(ttft, tpot):
            self.slo_met += 1

    def add_many(self, arrival: np.ndarray, first_scheduled: np.ndarray, first_token: np.ndarray,
                 finished: np.ndarray, output_len: np.ndarray, prompt_len: np.ndarray, cached_tokens: np.ndarray,
                 preemptions: np.ndarray) -> None:
        """add() for finished requests given as columns (the aggregate simulator's finishes of one round)."""
        if not len(arrival):
            return
        self.finished += len(arrival)
        self.first_arrival = min(self.first_arrival, float(arrival.min()))
        self.last_finish = max(self.last_finish, float(finished.max()))
        self.prompt_tokens += int(prompt_len.sum())
        self.cached_tokens += int(cached_tokens.sum())
        self.output_tokens += int(output_len.sum())
        self.preemptions += int(preemptions.sum())
        ttft = first_token - arrival
        self.ttft.add_many(ttft)
        self.e2e.add_many(finished - arrival)
        self.queueing.add_many(first_scheduled - arrival)
        many = output_len > 1
        tpot = (finished - first_token)[many] / (output_len[many] - 1)
        self.tpot.add_many(tpot)
        if self.slo is not None:
            ok = np.full(len(ttft), True) if self.slo.ttft_s is None else ttft <= self.slo.ttft_s
            if self.slo.tpot_s is not None:
                ok[many] &= tpot <= self.slo.tpot_s
            self.slo_met += int(ok.sum())

    @property
    def makespan(self) -> float:
        return max(0.0, self.last_finish - self.first_arrival) if self.finished else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache (host-tier loads included)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan if self.makespan else 0.0

    @property
    def requests_per_wall_s(self) -> float:
        return (self.finished + self.failed) / self.wall_s if self.wall_s else math.inf

    @property
    def slo_attainment(self) -> float:
        """Share of all requests (failed ones miss) that met the SLO; nan without one."""
        n = self.finished + self.failed
        return self.slo_met / n if self.slo is not None and n else math.nan

    @property
    def cost_per_m_output_tokens(self) -> float:
        """Replica-hours per million output tokens (multiply by a replica's $/hour for dollars)."""
        return self.replica_seconds / 3600 / (self.output_tokens / 1e6) if self.output_tokens else math.nan

    def row(self) -> dict[str, float | int | str]:
        """The summary a results table shows (seconds as ms)."""
        ms = 1e3
        return {"router": self.router, "replicas": self.num_replicas, "layout": self.layout or str(self.num_replicas),
                "finished": self.finished, "failed": self.failed, "ttft_p50_ms": self.ttft.quantile(.5) * ms,
                "ttft_p90_ms": self.ttft.quantile(.9) * ms, "ttft_p99_ms": self.ttft.quantile(.99) * ms,
                "tpot_p50_ms": self.tpot.quantile(.5) * ms, "tpot_p90_ms": self.tpot.quantile(.9) * ms,
                "tpot_p99_ms": self.tpot.quantile(.99) * ms, "e2e_p50_s": self.e2e.quantile(.5),
                "e2e_p99_s": self.e2e.quantile(.99), "queue_p99_ms": self.queueing.quantile(.99) * ms,
                "out_tok_s": self.output_tokens_per_s, "prefix_hit": self.prefix_hit_rate,
                "kv_mean": self.kv_usage_mean, "kv_peak": self.kv_usage_peak, "preemptions": self.preemptions,
                "sim_req_per_wall_s": self.requests_per_wall_s,
                "kv_transfer_p50_ms": self.kv_transfer.quantile(.5) * ms,
                "kv_transfer_p99_ms": self.kv_transfer.quantile(.99) * ms,
                "decode_pool_prefill_tokens": self.decode_pool_prefill_tokens,
                "replica_failures": self.replica_failures, "retried": self.retried, "lost_tokens": self.lost_tokens,
                "slo": str(self.slo) if self.slo else "", "slo_attainment": self.slo_attainment,
                "replica_seconds": self.replica_seconds, "replica_hours_per_m_tokens": self.cost_per_m_output_tokens,
                "peak_replicas": max((b for _, _, b in self.timeline), default=self.num_replicas),
                "drained": self.drained, "drained_in_flight": self.drained_in_flight,
                "host_hit_tokens": self.host_loaded_blocks * self.block_size, "host_seconds": self.host_seconds}


def simulate(requests: Iterable[SimRequest], replicas: Sequence[Replica], router: Router, name: str = "",
             progress: bool = False, horizon: float | None = None,
             on_finish: Callable[[Finished], None] | None = None, *,
             decode_replicas: Sequence[Replica] = (), kv_link: KVLink | None = None,
             autoscaler: Autoscaler | None = None, new_replica: Callable[[], Replica] | None = None,
             failures: FailurePlan | None = None, retries: int = 0, slo: Slo | None = None) -> FleetResult:
    """Run the requests (in arrival order) through the fleet until every one has finished or failed.
    `horizon` (simulated seconds) only sizes the progress bar. With `decode_replicas`, `replicas` is the prefill
    pool and `kv_link` says how fast KV moves between them."""
    if not isinstance(router, Router):
        raise TypeError(f"a {type(router).__name__} lacks {', '.join(interfaces.missing_members(router, Router))} of "
                        "minillm.interfaces.Router")
    if decode_replicas and kv_link is None:
        raise ValueError("a disaggregated fleet needs a kv_link (KV bytes per token and the link's bandwidth)")
    if decode_replicas and (autoscaler or (failures and failures.active)):
        raise ValueError("autoscaling and failures are simulated for a unified pool only, not with disaggregation")
    if autoscaler is not None and new_replica is None:
        raise ValueError("an autoscaled fleet needs new_replica (how to build a replica)")
    return _Fleet(replicas, decode_replicas, router, name, kv_link, autoscaler, new_replica, failures, retries,
                  slo, on_finish).run(requests, progress, horizon)


class _Fleet:
    def __init__(self, replicas, decode_replicas, router, name, kv_link, autoscaler, new_replica, failures, retries,
                 slo, on_finish) -> None:
        if not replicas:
            raise ValueError("a fleet needs at least one replica")
        self.entry = PREFILL if decode_replicas else UNIFIED     # the pool the router places requests on
        self.slots = [Slot(r, self.entry, UP, i) for i, r in enumerate(replicas)]
        self.slots += [Slot(r, DECODE, UP, len(self.slots) + i) for i, r in enumerate(decode_replicas)]
        self.router, self.decode_router = router, LeastTokens()
        self.kv_link, self.autoscaler, self.new_replica = kv_link, autoscaler, new_replica
        self.failures = failures if failures is not None and failures.active else None
        self.rng = self.failures.rng() if self.failures else None
        self.retries, self.on_finish = retries, on_finish
        layout = f"{len(replicas)}P:{len(decode_replicas)}D" if decode_replicas else str(len(replicas))
        self.res = FleetResult(name or type(router).__name__, len(self.slots), slo=slo, layout=layout,
                               dynamic=autoscaler is not None or self.failures is not None,
                               block_size=replicas[0].config.block_size if replicas else 0)
        self.queue: list[tuple] = []
        self.order = 0                 # ties broken by insertion: the queue never compares payloads
        self.live = 0                  # events on the queue that are not BACKGROUND
        self.now = 0.0
        self._routable: dict[str, list[Slot]] = {}
        self.prefilling: dict[int, SimRequest] = {}     # disaggregated: the full request while its prompt runs
        self.retrying: dict[int, _Retry] = {}
        self.arrived_tokens = 0                         # since the last autoscaler look (the token-rate signal)
        self.billed_since = 0.0

    # ------------------------------------------------------------------ the event queue
    def push(self, t: float, kind: int, slot: int = -1, payload=None) -> None:
        epoch = self.slots[slot].epoch if slot >= 0 else 0
        heapq.heappush(self.queue, (t, kind, self.order, slot, epoch, payload))
        self.order += 1
        self.live += kind not in BACKGROUND

    def run(self, requests: Iterable[SimRequest], progress: bool, horizon: float | None) -> FleetResult:
        res = self.res
        arrivals = iter(requests)

        def push_next_arrival() -> None:
            req = next(arrivals, None)
            if req is not None:
                self.push(req.arrival, ARRIVAL, payload=req)

        if self.failures:
            for t, i in self.failures.at:
                if not 0 <= i < len(self.slots):
                    raise ValueError(f"--fail-at names replica {i}; the fleet starts with replicas 0.."
                                     f"{len(self.slots) - 1}")
                self.push(t, FAIL, i)
            for i in range(len(self.slots)):
                self._schedule_random_failure(i)
        if self.autoscaler:
            self.push(self.autoscaler.interval_s, SCALE)
        t0, events = time.perf_counter(), 0
        bar = tqdm(total=horizon, unit="sim s", disable=not progress or horizon is None, mininterval=0.5,
                   bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} simulated s [{elapsed}<{remaining}]")
        shown = 0.0
        push_next_arrival()
        while self.live:
            t, kind, _, i, epoch, payload = heapq.heappop(self.queue)
            self.live -= kind not in BACKGROUND
            if t < self.now:
                raise AssertionError(f"the simulated clock went back from {self.now} to {t}")
            self.now = t
            events += 1
            if kind == ARRIVAL:
                push_next_arrival()
                self.arrived_tokens += payload.prompt_len + payload.output_len
                if res.first_arrival == math.inf:
                    res.first_arrival = t
                    for s in self.slots:
                        s.kv_since = s.alive_since = t
                    self._timeline()          # billing (and the timeline) start with the first request
                self.route(payload)
            elif kind == STEP_END:
                if epoch == self.slots[i].epoch:     # else the replica died during the pass
                    self.step_end(i)
            elif kind == KV_READY:
                self.kv_ready(*payload)
            elif kind == FAIL:
                if epoch == self.slots[i].epoch and self.slots[i].state in (UP, DRAINING):
                    self.fail(i)
            elif kind == READY:
                if epoch == self.slots[i].epoch:
                    self.ready(i)
            elif kind == SCALE:
                self.scale()
                if self.live:
                    self.push(t + self.autoscaler.interval_s, SCALE)
            if progress and events % 2048 == 0 and horizon:
                step = min(self.now, horizon) - shown
                if step > 0:
                    bar.update(step)
                    shown += step
        bar.close()
        res.wall_s = time.perf_counter() - t0
        self._finish_accounting()
        return res

    # ------------------------------------------------------------------ pools
    def routable(self, role: str) -> list[Slot]:
        pool = self._routable.get(role)
        if pool is None:
            pool = self._routable[role] = [s for s in self.slots if s.state == UP and s.role == role]
        return pool

    def _changed(self) -> None:
        self._routable.clear()
        self._timeline()

    def _timeline(self, end: bool = False) -> None:
        """Record (now, routable, billed) when it changed (and at the end, to close the last interval)."""
        up = sum(s.state == UP for s in self.slots)
        billed = sum(s.state in BILLED for s in self.slots)
        tl = self.res.timeline
        if tl and tl[-1][1:] == (up, billed) and not (end and tl[-1][0] < self.now):
            return
        if tl and tl[-1][0] == self.now:
            tl.pop()
        tl.append((self.now, up, billed))

    def _set_state(self, i: int, state: str) -> None:
        s = self.slots[i]
        was_billed, billed = s.state in BILLED, state in BILLED
        if was_billed and not billed:
            self._close_slot(s)
        if billed and not was_billed:
            s.alive_since = s.kv_since = self.now
        s.state = state
        self._changed()

    def _close_slot(self, s: Slot) -> None:
        s.kv_area += s.kv_used * (self.now - s.kv_since)
        s.kv_since, s.kv_used = self.now, 0
        s.alive_s += self.now - max(s.alive_since, self.res.first_arrival if self.res.first_arrival < math.inf
                                    else self.now)
        s.alive_since = self.now

    # ------------------------------------------------------------------ requests
    def route(self, req: SimRequest) -> None:
        role = self.entry
        pool = self.routable(role)
        if not pool:              # every replica is down or still starting: the request is refused
            self.final(Finished(req.request_id, req.arrival, req.arrival, req.arrival, self.now, 0, req.prompt_len,
                                0, 0, failed=True))
            return
        slot = pool[self.router.route(req, [s.replica for s in pool])]
        # A prompt one token short of the context limit stops at its first token, as on a unified replica.
        if role == PREFILL and req.output_len > 1 and req.prompt_len + 1 < slot.replica.max_model_len:
            self.prefilling[req.request_id] = req
            req = SimRequest(req.request_id, req.arrival, req.prompt, 1, [output_token(req, 0)])
        refused = slot.replica.add(req)
        if refused is not None:
            self.prefilling.pop(req.request_id, None)
            self.final(refused)
        else:
            self.kick(slot.index)

    def kick(self, i: int) -> None:
        if not self.slots[i].replica.busy:
            self.start(i)

    def start(self, i: int) -> None:
        s = self.slots[i]
        rep = s.replica
        dt = rep.begin_step()
        if dt is not None:
            self.push(self.now + dt, STEP_END, i)
        used = rep.block_manager.num_used_blocks
        s.kv_area += s.kv_used * (self.now - s.kv_since)
        s.kv_since, s.kv_used = self.now, used
        self.res.kv_usage_peak = max(self.res.kv_usage_peak, used / rep.config.num_blocks)

    def step_end(self, i: int) -> None:
        s = self.slots[i]
        for f in s.replica.end_step(self.now):
            if s.role == PREFILL and not f.failed and f.request_id in self.prefilling:
                self.ship(i, self.prefilling.pop(f.request_id), f)
            else:
                self.final(f)
        self.res.steps += 1
        self.start(i)
        if s.state == DRAINING and not s.replica.has_work():
            self._set_state(i, GONE)

    def ship(self, i: int, req: SimRequest, prefilled: Finished) -> None:
        """Disaggregated: the prompt's KV leaves prefill replica i over its link (after what is queued on it)."""
        s = self.slots[i]
        begin = max(self.now, s.link_free)
        s.link_free = begin + self.kv_link.seconds(req.prompt_len)
        self.push(s.link_free, KV_READY, payload=(req, prefilled))

    def kv_ready(self, req: SimRequest, prefilled: Finished) -> None:
        self.res.kv_transfer.add(self.now - prefilled.first_token)
        pool = self.routable(DECODE)
        slot = pool[self.decode_router.route(req, [s.replica for s in pool])]
        slot.replica.add_prefilled(req, prefilled.first_scheduled, prefilled.first_token, prefilled.cached_tokens,
                                   prefilled.preemptions)
        self.kick(slot.index)

    def final(self, f: Finished) -> None:
        """A request's last word (finished or failed), merged with its earlier attempts if it was retried."""
        r = self.retrying.pop(f.request_id, None)
        if r is not None:
            if f.failed:
                f = Finished(f.request_id, r.arrival, f.first_scheduled, f.first_token, f.finished, 0, r.prompt_len,
                             0, 0, failed=True)
            else:
                f = Finished(f.request_id, r.arrival, _first(r.first_scheduled, f.first_scheduled),
                             _first(r.first_token, f.first_token), f.finished, r.emitted + f.output_len,
                             r.prompt_len, f.cached_tokens if r.cached_tokens is None else r.cached_tokens,
                             r.preemptions + f.preemptions)
        self.res.add(f)
        if self.on_finish is not None:
            self.on_finish(f)

    # ------------------------------------------------------------------ failures
    def _schedule_random_failure(self, i: int) -> None:
        if self.failures and self.failures.mtbf_s is not None:
            self.push(self.now + self.rng.expovariate(1 / self.failures.mtbf_s), FAIL, i)

    def fail(self, i: int) -> None:
        s = self.slots[i]
        lost = s.replica.fail()
        s.epoch += 1
        self.res.replica_failures += 1
        repair = self.failures.repair_s if s.state == UP else None     # a draining replica is not repaired
        self._set_state(i, DOWN if repair is not None else GONE)
        if repair is not None:
            self.push(self.now + repair, READY, i)
        for x in sorted(lost, key=lambda x: x.request.arrival):
            self.res.lost_tokens += x.computed_tokens
            self.retry(x)

    def retry(self, x: InFlight) -> None:
        req = x.request
        r = self.retrying.get(req.request_id)
        if r is None:
            r = self.retrying[req.request_id] = _Retry(req.arrival, req.prompt_len)
        r.emitted += len(x.emitted)
        r.first_scheduled = _first(r.first_scheduled, x.first_scheduled)
        r.first_token = _first(r.first_token, x.first_token)
        if r.cached_tokens is None and x.first_scheduled is not None:
            r.cached_tokens = x.cached_tokens
        r.preemptions += x.preemptions
        r.attempts += 1
        if r.attempts > self.retries:
            self.final(Finished(req.request_id, req.arrival, req.arrival, req.arrival, self.now, 0, req.prompt_len,
                                0, 0, failed=True))
            return
        self.res.retried += 1
        left = req.output_len - len(x.emitted)
        self.route(SimRequest(req.request_id, req.arrival, req.prompt + x.emitted, left,
                              [output_token(req, len(x.emitted) + j) for j in range(left)]))

    # ------------------------------------------------------------------ replicas coming and going
    def ready(self, i: int) -> None:
        s = self.slots[i]
        if s.state == DOWN:            # repaired: a fresh replica, empty caches
            self._collect(s)
            s.replica = (self.new_replica or _like(s.replica))()
        self._set_state(i, UP)
        self._schedule_random_failure(i)

    def scale(self) -> None:
        a = self.autoscaler
        up = self.routable(UNIFIED)
        starting = sum(s.state == STARTING or s.state == DOWN for s in self.slots)   # DOWN: being repaired
        if a.signal == "queue":
            value = sum(s.replica.num_waiting for s in up) / len(up) if up else math.inf
        elif a.signal == "kv":
            value = sum(s.replica.block_manager.num_used_blocks / s.replica.config.num_blocks for s in up) / \
                len(up) if up else math.inf
        else:
            value = self.arrived_tokens / a.interval_s / len(up) if up else math.inf
        self.arrived_tokens = 0
        n = a.decide(value, len(up), starting)
        for _ in range(n):
            self.slots.append(Slot(self.new_replica(), UNIFIED, GONE, len(self.slots)))
            self._set_state(len(self.slots) - 1, STARTING)
            self.push(self.now + a.cold_start_s, READY, len(self.slots) - 1)
        if n < 0:
            i = up[-1].index                      # the newest: consistent hashing keeps the older ones' keys
            self.res.drained += 1
            self.res.drained_in_flight += self.slots[i].replica.num_requests
            self._set_state(i, DRAINING)
            if not self.slots[i].replica.has_work():
                self._set_state(i, GONE)

    # ------------------------------------------------------------------ the end
    def _finish_accounting(self) -> None:
        res = self.res
        if res.first_arrival == math.inf:
            return
        for s in self.slots:
            if s.state in BILLED:
                self._close_slot(s)
        self._timeline(end=True)
        res.replica_seconds = sum(s.alive_s for s in self.slots)
        if res.replica_seconds > 0:
            res.kv_usage_mean = sum(s.kv_area / s.replica.config.num_blocks for s in self.slots) / \
                res.replica_seconds
        for s in self.slots:
            self._collect(s)

    def _collect(self, s: Slot) -> None:
        """Fold a replica's counters into the result (at the end, or before a repair replaces it)."""
        res, rep = self.res, s.replica
        res.prefill_tokens += rep.prefill_tokens
        res.decode_tokens += rep.decode_tokens
        if s.role == DECODE:
            res.decode_pool_prefill_tokens += rep.prefill_tokens
        if rep.host is not None:
            res.host_loaded_blocks += rep.host.loaded
            res.host_stored_blocks += rep.host.stored
            res.host_seconds += rep.host.seconds


def _first(a: float | None, b: float | None) -> float | None:
    return b if a is None else a


def _like(rep: Replica) -> Callable[[], Replica]:
    """A fresh replica with the same settings (empty pool, empty host tier)."""
    return lambda: Replica(rep.step_model, rep.config, rep.on_step, None if rep.host is None else rep.host.empty())
