"""The fast (aggregate) fleet simulator: the same fleet as fleet.simulator, for fleets too large to run each
replica's real Scheduler and BlockManager (10K requests/s for minutes).

columns (requests as numpy columns, nodes for the prefix cache), streams (the named workloads in columns), pool
(the requests in flight), prefix (every replica's prefix cache as nodes), state (per-replica aggregates and the
block bookkeeping), schedule (the engine's policy for every stepping replica at once), commit (the end of a step),
routing (the routers over a batch of arrivals), fleet (the rounds). docs/fleet.md says what it keeps, what it
approximates and how far it is from the exact simulator.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from minillm.fleet.aggregate.columns import RequestBatch, from_requests
from minillm.fleet.aggregate.commit import OnFinish
from minillm.fleet.aggregate.fleet import AggregateFleet
from minillm.fleet.aggregate.routing import make_batch_router
from minillm.fleet.aggregate.streams import batches
from minillm.fleet.policies import Slo
from minillm.fleet.replica import ReplicaConfig
from minillm.fleet.routers import PrefixAware
from minillm.fleet.simulator import FleetResult
from minillm.fleet.step_model import StepModel


def simulate_aggregate(requests: Iterable[RequestBatch], step_model: StepModel, cfg: ReplicaConfig,
                       num_replicas: int, router: str = "least-tokens", name: str = "", prefix_blocks: int = 4,
                       epsilon: float = 0.25, slo: Slo | None = None, progress: bool = False,
                       horizon: float | None = None, on_finish: OnFinish | None = None,
                       on_round: Callable[[AggregateFleet], None] | None = None, window: float | None = None,
                       fleet_cls: type[AggregateFleet] = AggregateFleet) -> FleetResult:
    """Run request batches through `num_replicas` aggregate replicas behind the named router (round-robin,
    least-tokens, prefix-aware, as in routers.py) until every request finished or failed."""
    ring = PrefixAware(num_replicas, cfg.block_size, prefix_blocks, epsilon) if router == "prefix-aware" else None
    fleet = fleet_cls(step_model, cfg, num_replicas, make_batch_router(router, num_replicas, ring), name or router,
                      slo, on_finish, on_round, window)
    return fleet.run(requests, progress, horizon)


__all__ = ["AggregateFleet", "RequestBatch", "batches", "from_requests", "simulate_aggregate"]
