"""Which torch device an engine (or one rank of it) runs on, and which collective backend goes with it.

EngineConfig.device is a string checked without torch (config.check_device); this turns it into a torch.device:
"auto" is CUDA when torch sees a GPU, else the CPU. A parallel engine on CUDA puts rank r on GPU r of its machine
(one GPU per rank) and talks NCCL; on the CPU it talks gloo."""
from __future__ import annotations

import torch


def resolve_device(device: str | torch.device = "auto", local_rank: int = 0,
                   cuda_available: bool | None = None) -> torch.device:
    """The torch.device for a setting: auto -> cuda when available else cpu; "cuda" on a parallel engine's rank ->
    that rank's GPU (cuda:<local_rank>); "cuda:N", "cpu" and "meta" as they are."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        available = torch.cuda.is_available() if cuda_available is None else cuda_available
        device = "cuda" if available else "cpu"
    if device == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(device)


def dist_backend(device: torch.device) -> str:
    """The collective backend for ranks on `device`: NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def check_gpu_count(world_size: int, num_gpus: int, device: str = "cuda") -> None:
    """Refuse a CUDA layout with more ranks on this machine than GPUs (one GPU per rank); a pinned device (cuda:N)
    for more than one rank too: each rank needs a GPU of its own."""
    if world_size > 1 and device.startswith("cuda:"):
        raise ValueError(f"device={device!r} pins one GPU, but a parallel engine of {world_size} ranks puts each rank "
                         "on a GPU of its own: use device='cuda' (rank r on GPU r)")
    if num_gpus < 1 and world_size == 1:
        raise ValueError(f"device={device!r} needs a CUDA GPU, but torch sees none (a CPU-only build of torch, or no "
                         "GPU here): use device='cpu', or 'auto' (cuda when there is one, else cpu)")
    if num_gpus < world_size:
        have = "no GPU" if num_gpus == 0 else f"{num_gpus} GPU{'s' if num_gpus != 1 else ''}"
        raise ValueError(f"{world_size} ranks on device {device!r} need {world_size} GPUs (one per rank), but torch "
                         f"sees {have}: lower tensor_parallel_size / pipeline_parallel_size, or use device='cpu' "
                         "(gloo)")
    if device.startswith("cuda:") and int(device[5:]) >= num_gpus:
        raise ValueError(f"device={device!r}, but torch sees {num_gpus} GPU{'s' if num_gpus != 1 else ''} "
                         f"(cuda:0 .. cuda:{num_gpus - 1})")


def engine_device(setting: str, model) -> torch.device:
    """The device of a one-process engine for EngineConfig.device: resolved, refused clearly where there is no such
    GPU, and `model` moved there (nothing happens to a model already in place: the CPU's usual case)."""
    device = resolve_device(setting)
    if device.type == "cuda":
        check_gpu_count(1, torch.cuda.device_count(), "cuda" if setting == "auto" else setting)
    if module_device(model) != device:
        model.to(device)
    return device


def module_device(module) -> torch.device:
    """Where a model's tensors are (its first parameter's or buffer's device; the CPU for one with neither, or for an
    object that is not a torch module)."""
    for tensors in (getattr(module, "parameters", None), getattr(module, "buffers", None)):
        for t in tensors() if callable(tensors) else ():
            return t.device
    return torch.device("cpu")
