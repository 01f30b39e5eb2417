"""Engine settings on the command line, generated from EngineConfig so the CLI has no defaults of its own.

Every flat EngineConfig setting becomes a flag (`block_size` -> `--block-size`, booleans as `--x/--no-x`) whose
default is None: only what the user typed reaches EngineConfig.from_kwargs, everything else keeps the dataclass's
default (shown in --help)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from contextlib import contextmanager

from minillm.config import METHODS, EngineConfig, ServeConfig, SpeculativeConfig, int_or_auto

_HELP = {
    "dtype": "weight and activation dtype: float32 or bfloat16 (bfloat16 is faster for prefill on AMX CPUs)",
    "device": "where the engine runs: auto (cuda when torch sees a GPU, else cpu) | cpu | cuda | cuda:N | meta (a "
              "dry run that only places tensors)",
    "enforce_eager": "CUDA: run decode steps eagerly instead of replaying CUDA graphs (no effect on a CPU)",
    "quantization": "weight format: auto (keep the checkpoint's: the default GGUF runs int4) | none (dequantize to "
                    "--dtype) | int8 (per output channel) | int4 (groups of --quantization-group-size) | w8a8 (int8 "
                    "weights per channel and int8 activations per token)",
    "quantization_group_size": "int4 group size when quantizing a float checkpoint (a multiple of 32)",
    "max_model_len": "longest sequence (prompt + output) in tokens; default: the model's context window",
    "attention_backend": "auto | torch | cpu | triton (auto: the compiled CPU kernel, Triton on CUDA)",
    "block_size": "KV block size in tokens",
    "num_blocks": "fix the KV pool's number of blocks (instead of sizing it from --kv-cache-memory)",
    "kv_cache_memory": "KV pool budget, e.g. 512MiB or 2GiB (pages are committed only when used)",
    "kv_cache_dtype": "what the KV pool stores: auto (the model's dtype) | int8 (per token and KV head scales: "
                      "~1.94x the tokens of fp16 in the same --kv-cache-memory, a small perplexity cost)",
    "enable_prefix_caching": "reuse the KV blocks of a shared prompt prefix",
    "max_num_seqs": "most sequences running at once",
    "max_num_batched_tokens": "token budget of one step (prefill chunks + decodes)",
    "enable_chunked_prefill": "split prompts longer than the step's token budget across steps",
    "tensor_parallel_size": "shard every layer over this many ranks (processes; heads, KV heads and the MLP must "
                            "split evenly: SmolLM2 takes 1 or 3)",
    "pipeline_parallel_size": "split the layers into this many stages, one rank each",
    "distributed_executor_backend": "how the other ranks run: mp (local processes) | thread | env (started by "
                                    "torchrun, one or several machines) | auto (env under torchrun, else mp)",
    "pipeline_micro_batches": "pipeline parallelism: micro-batches per step (default: one per stage)",
    "kernel_threads": "the C kernels' threads: adaptive (torch's thread count, or one thread while the decode step "
                      "measures one faster: on a busy machine a team waits at its barriers) | fixed (always torch's)",
}

# speculative_config's fields as flags (vLLM's names where it has them); method and model get clearer ones.
_SPEC_FLAGS = {
    "method": ("--speculative", f"turn speculative decoding on with this proposer: {' | '.join(METHODS)}"),
    "num_speculative_tokens": ("--num-speculative-tokens", "tokens drafted per sequence per step: k, or auto (0-8 "
                               "per sequence each step, from its acceptance and the measured step costs)"),
    "model": ("--draft-model", "draft_model: 'default', a .gguf file or a Hugging Face directory (same vocabulary)"),
    "draft_layers": ("--draft-layers", "layer_skip: the target's first N layers draft"),
    "prompt_lookup_min": ("--prompt-lookup-min", "ngram: shortest suffix looked up"),
    "prompt_lookup_max": ("--prompt-lookup-max", "ngram: longest suffix looked up"),
}


def add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    g = p.add_argument_group("engine settings (minillm.config.EngineConfig)")
    for name, default in EngineConfig().as_kwargs().items():
        if name in skip or name == "speculative_config":
            continue
        flag = "--" + name.replace("_", "-")
        help_ = f"{_HELP.get(name, name)} (default: {default})"
        if isinstance(default, bool):
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            kind = str if isinstance(default, str) or name == "kv_cache_memory" else int
            g.add_argument(flag, dest=name, type=kind, default=None, help=help_)
    if "speculative_config" in skip:
        return
    g = p.add_argument_group("speculative decoding (minillm.config.SpeculativeConfig)")
    for f in dataclasses.fields(SpeculativeConfig):
        flag, text = _SPEC_FLAGS[f.name]
        default = "" if f.default is dataclasses.MISSING or f.default is None else f" (default: {f.default})"
        kind = int_or_auto if f.name == "num_speculative_tokens" else str if f.type in ("str", "Optional[str]") else int
        g.add_argument(flag, dest="spec_" + f.name, type=kind,
                       choices=METHODS if f.name == "method" else None, default=None, help=text + default)


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig the user asked for: the flags they gave, then `overrides` (a command's own choices)."""
    given = {name: getattr(args, name) for name in EngineConfig().as_kwargs() if getattr(args, name, None) is not None}
    spec = {f.name: getattr(args, "spec_" + f.name) for f in dataclasses.fields(SpeculativeConfig)
            if getattr(args, "spec_" + f.name, None) is not None}
    if spec:
        if "method" not in spec:
            flags = ", ".join(_SPEC_FLAGS[name][0] for name in spec)
            verb = "matters" if len(spec) == 1 else "matter"
            raise ValueError(f"{flags} only {verb} with speculative decoding on: add --speculative "
                             f"{{{','.join(METHODS)}}}")
        given["speculative_config"] = spec
    return EngineConfig.from_kwargs(**{**given, **overrides})


@contextmanager
def status(text: str):
    """A '[text ...]' line on stderr while something slow runs (model loading), erased when it is done; only on a
    terminal, so piped output and logs stay clean."""
    tty = sys.stderr.isatty()
    if tty:
        print(f"[{text} ...]", end="", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        if tty:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


def progress_line(text: str) -> None:
    """Overwrite the current stderr line with `text` (a terminal only); progress_line('') erases it."""
    if sys.stderr.isatty():
        print("\r\033[K" + (f"[{text}]" if text else ""), end="", file=sys.stderr, flush=True)


_SERVE_HELP = {
    "host": "address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface)",
    "port": "TCP port (0: any free one)",
    "api_key": "require `Authorization: Bearer KEY` on every /v1 route",
    "served_model_name": "the model name clients send and the server reports (default: the --model argument)",
    "max_waiting_requests": "requests accepted but not started past which new ones get 429 + Retry-After",
    "max_waiting_tokens": "the same limit in prompt tokens",
    "max_body_bytes": "largest request body accepted (413 past it)",
}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server settings (minillm.config.ServeConfig)")
    for f in dataclasses.fields(ServeConfig):
        kind = int if isinstance(f.default, int) else str
        g.add_argument("--" + f.name.replace("_", "-"), dest="serve_" + f.name, type=kind, default=None,
                       metavar=f.name.upper(),
                       help=f"{_SERVE_HELP[f.name]} (default: {f.default})")


def serve_config(args: argparse.Namespace) -> ServeConfig:
    given = {f.name: getattr(args, "serve_" + f.name) for f in dataclasses.fields(ServeConfig)
             if getattr(args, "serve_" + f.name, None) is not None}
    return ServeConfig(**given)
