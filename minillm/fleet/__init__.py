"""From one engine to a fleet (lab12): the serving cost estimator the capacity planner grows from.

`estimate(Deployment(...), Scenario(...))` turns model shapes (minillm.catalog) and accelerator
specs into memory, TTFT, TPOT, tokens/s and $ per million tokens; minillm.fleet.estimator says which
assumption each number makes. The question bank's design answers are checked against it.
"""
from minillm.catalog import KNOWN_HARDWARE, Hardware, hardware_spec
from minillm.fleet.estimator import (Deployment, Efficiency, Estimate, MemoryPlan, Scenario, StepTime, batch_for_tpot,
                                     decode_step, estimate, forward_flops, forward_time, memory_plan, prefill_devices,
                                     prefill_time, tp_comm_bytes_per_gpu, tp_comm_seconds)

__all__ = ["Deployment", "Efficiency", "Estimate", "Hardware", "KNOWN_HARDWARE", "MemoryPlan", "Scenario",
           "StepTime", "batch_for_tpot", "decode_step", "estimate", "forward_flops", "forward_time", "hardware_spec",
           "memory_plan", "prefill_devices", "prefill_time", "tp_comm_bytes_per_gpu", "tp_comm_seconds"]
