"""From one engine to a fleet (lab12): the serving cost estimator, the replica step-time model and the fleet
simulator.

`estimate(Deployment(...), Scenario(...))` turns model shapes (minillm.catalog) and accelerator
specs into memory, TTFT, TPOT, tokens/s and $ per million tokens; minillm.fleet.estimator says which
assumption each number makes. The question bank's design answers are checked against it.

step_model (a mixed step's time: overhead + max(compute, memory), fitted or from a roofline), calibrate (records the
real engine's steps and fits), validate (the simulator against the real engine on held-out workloads), replica (the
engine's own Scheduler and BlockManager on a simulated clock), routers, workloads, simulator (the discrete-event
fleet: disaggregated pools, autoscaling, failures), policies (the torch-free knobs: KV link, autoscaler, failure
plan, SLO), offload (a host KV tier), metrics; `minillm fleet calibrate | validate | simulate | plan` (cli, run,
planner). The modules that import the engine (calibrate, validate, replica, offload, simulator, run, planner) are
not imported here: this package's face stays torch-free.
"""
from minillm.catalog import KNOWN_HARDWARE, Hardware, hardware_spec
from minillm.fleet.estimator import (Deployment, Efficiency, Estimate, MemoryPlan, Scenario, StepTime, batch_for_tpot,
                                     decode_step, estimate, forward_flops, forward_time, memory_plan, mixed_step,
                                     prefill_devices, prefill_time, tp_comm_bytes_per_gpu, tp_comm_seconds)
from minillm.fleet.step_model import StepFeatures, StepModel, StepTrace, fit, from_roofline

__all__ = ["Deployment", "Efficiency", "Estimate", "Hardware", "KNOWN_HARDWARE", "MemoryPlan", "Scenario",
           "StepFeatures", "StepModel", "StepTime", "StepTrace", "batch_for_tpot", "decode_step", "estimate", "fit",
           "forward_flops", "forward_time", "from_roofline", "hardware_spec", "memory_plan", "mixed_step",
           "prefill_devices", "prefill_time", "tp_comm_bytes_per_gpu", "tp_comm_seconds"]
