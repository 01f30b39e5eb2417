"""Build an engine for any layout: one process, or tensor/pipeline-parallel ranks (spawned processes, threads, or
torchrun's processes on one or several machines). The caller gets an ordinary LLMEngine on rank 0."""
from __future__ import annotations

import pickle

import torch

from minillm.config import EngineConfig, torchrun_local_rank
from minillm.distributed.device import check_gpu_count, dist_backend, resolve_device
from minillm.distributed.sharding import check_pp_size, check_tp_size
from minillm.engine.llm_engine import LLMEngine
from minillm.executor.workers import (Workers, WorkerSpec, effective_quantization, env_rank, load_rank, rank_device,
                                     run_env_worker)
from minillm.loading.loader import load_model, peek_config


def resolve_backend(name: str) -> str:
    if name != "auto":
        return name
    return "env" if env_rank() is not None else "mp"


def start_engine(model: str, config: EngineConfig, rules=None, progress=None):
    """(LoadedModel of rank 0, LLMEngine). Bad layouts fail here, before any process starts. Under torchrun, a
    rank other than 0 serves steps until rank 0 closes the engine, then exits the process."""
    par = config.parallel
    world = par.world_size
    backend = resolve_backend(par.distributed_executor_backend)
    device = resolve_device(config.device)
    if device.type == "cuda":      # refused before anything loads or starts; torchrun's ranks span machines
        check_gpu_count(world if backend != "env" else 1, torch.cuda.device_count(),
                        "cuda" if config.device == "auto" else config.device)
    if world == 1 and backend != "env":
        loaded = load_model(model, config.dtype, rules=rules, quantization=effective_quantization(config, rules),
                            group_size=config.quantization_group_size, progress=progress, device=device)
        return loaded, LLMEngine(loaded.model, loaded.tokenizer, config)
    cfg = peek_config(model)
    check_tp_size(cfg, par.tensor_parallel_size)
    check_pp_size(cfg, par.pipeline_parallel_size)
    if rules is not None and backend != "thread":
        try:
            pickle.dumps(rules)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"tp_rules must reach the worker processes, but {type(rules).__name__} cannot be "
                             f"pickled ({e}): a class defined in a notebook cannot; use "
                             "distributed_executor_backend='thread'") from None
    threads = max(1, torch.get_num_threads() // world)
    spec = WorkerSpec(str(model), config, threads, rules, dist_backend=dist_backend(device))
    if backend == "env" and env_rank() not in (0, None):
        run_env_worker(spec)
        raise SystemExit(0)
    if backend != "thread":
        torch.set_num_threads(threads)   # rank 0 is one of `world` processes sharing the cores
    rank0_device = rank_device(spec, torchrun_local_rank() if backend == "env" else 0)
    workers = Workers(spec, backend)
    try:
        loaded = load_rank(spec, workers.comm, rank0_device)
        engine = LLMEngine(loaded.model, loaded.tokenizer, config, workers=workers)
    except BaseException:
        workers.close(graceful=False)
        raise
    return loaded, engine
