"""Configuration dataclasses. They flow one way: loader -> ModelConfig; user -> EngineConfig.

This is the one module that reads the environment: every environment variable minillm knows is read by a function
or a default below (docs/layout.md, "Settings", lists them).

EngineConfig is the one path every entry point takes (LLM(**kwargs), LLMEngine.from_model, the CLI, the benches,
the demo), and the dataclass fields below are the one place each default lives. Callers pass flat keyword
arguments (`block_size=16, max_num_seqs=8`); `EngineConfig.from_kwargs` routes them to the section that owns them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import difflib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face style: {"rope_type": "linear"|"dynamic"|"llama3"|"yarn", "factor": ..., ...} or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """K and V, every layer: 2 * layers * kv_heads * head_dim * bytes."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h
        return L * per_layer + emb * (1 if self.tie_word_embeddings else 2) + h


# The names minillm.loading.loader.DTYPES maps to torch dtypes (here so validating a config needs no torch import;
# a test keeps the two in step).
DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


def parse_bytes(x: int | float | str) -> int:
    """512MiB, 1GiB, 2e9, 1073741824 -> bytes."""
    if isinstance(x, (int, float)):
        return int(x)
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    s = x.strip().lower().replace(" ", "")
    for u, mult in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * mult)
    return int(float(s))


@dataclass
class CacheConfig:
    block_size: int = 16
    # The pool holds as many blocks as fit in kv_cache_memory, unless num_blocks fixes the count. The budget is
    # reserved lazily (the pages of an untouched block are never committed), so a generous default costs nothing.
    num_blocks: int | None = None
    kv_cache_memory: int | str = "2GiB"
    enable_prefix_caching: bool = True
    # What the pool stores K/V as: "auto" (the model's dtype) or "int8" (per token and KV head scales, kv/int8.py):
    # ~1.94x the tokens of fp16 in the same budget at head_dim 64.
    kv_cache_dtype: str = "auto"

    @property
    def kv_cache_memory_bytes(self) -> int:
        return parse_bytes(self.kv_cache_memory)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True


KV_CACHE_DTYPES = ("auto", "int8")

# quant/policy.py applies these; they are validated here so a bad setting fails before torch is imported.
QUANTIZATIONS = ("auto", "none", "int8", "int4", "w8a8")
QUANT_BLOCK = 32   # = quant.formats.BLOCK (a test keeps the two in step)


def check_quantization(quantization: str, group_size: int, rules: Any = None) -> None:
    """Raise ValueError for a setting that cannot work, before anything is read."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
    if (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < QUANT_BLOCK
            or group_size % QUANT_BLOCK or group_size > 2**16):
        raise ValueError(f"quantization_group_size must be a multiple of {QUANT_BLOCK} up to 65536 (32, 64, 128, "
                         f"...), got {group_size!r}")
    if rules is not None and quantization != "none":
        raise ValueError("tp_rules (a learner's tensor-parallel rules) run float weights only: pass "
                         "quantization='none' with them")


def _env(name: str, default: str) -> str:
    return os.environ.get(name, "").strip().lower() or default


def _choice(setting: str, env: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{setting}={value!r} (environment {env}): use one of {', '.join(allowed)}")


DECODE_STEPS = ("fused", "layers")
QGEMMS = ("c", "scalar", "torch")
QGEMM_BATCHED_PATHS = ("int16", "fp16", "bf16", "float", "w8a8")
W8A8_KERNELS = ("auto", "fbgemm", "float", "int_mm")
CPU_ATTENTION_KERNELS = ("c", "numba")
KERNEL_THREADS = ("adaptive", "fixed")

# Each kernel setting once: its environment variable, its default, the values it takes.
KERNEL_SETTINGS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "decode_step": ("MINILLM_DECODE_STEP", "fused", DECODE_STEPS),
    "qgemm": ("MINILLM_QGEMM", "c", QGEMMS),
    "qgemm_batched": ("MINILLM_QGEMM_BATCHED", "int16", QGEMM_BATCHED_PATHS),
    "w8a8_kernel": ("MINILLM_W8A8", "auto", W8A8_KERNELS),
    "cpu_attention_kernel": ("MINILLM_CPU_KERNEL", "c", CPU_ATTENTION_KERNELS),
    "kernel_threads": ("MINILLM_KERNEL_THREADS", "adaptive", KERNEL_THREADS),
}
KERNEL_ENV = tuple(env for env, _, _ in KERNEL_SETTINGS.values())


def _kernel_default(name: str) -> Any:
    env, default, _ = KERNEL_SETTINGS[name]
    return field(default_factory=lambda: _env(env, default))


@dataclass
class KernelConfig:
    """Which CPU kernels run: for A/B runs and tests (the defaults are the fast, exact paths). The kernels are
    process-wide (shared C libraries and their packed weight copies), so the setting is too: an engine applies its
    own when it is built (`use_kernels`), and the environment gives the defaults (docs/layout.md, "Settings")."""
    # fused: a decode step of a quantized model in one C call (kernels/cpu_decode.py) | layers: layer by layer
    decode_step: str = _kernel_default("decode_step")
    # c: the integer kernel | scalar: the same built without SIMD | torch: dequantize + float matmul (reference)
    qgemm: str = _kernel_default("qgemm")
    # weight-only layers' product past kernels.cpu_qgemm.TILES_MAX_ROWS rows (kernels/cpu_qgemm.py's table)
    qgemm_batched: str = _kernel_default("qgemm_batched")
    # W8A8 layers: fbgemm | float | int_mm; auto: fbgemm where it works, else float
    w8a8_kernel: str = _kernel_default("w8a8_kernel")
    # the CPU attention backend's decode kernel: c (csrc/paged_decode.c) | numba
    cpu_attention_kernel: str = _kernel_default("cpu_attention_kernel")
    # the C kernels' team: adaptive: torch's thread count, or one thread while the fused decode step measures one
    # faster (a busy machine; kernels/cpu_threads.py) | fixed: always torch's thread count
    kernel_threads: str = _kernel_default("kernel_threads")

    def __post_init__(self) -> None:
        for name, (env, _, allowed) in KERNEL_SETTINGS.items():
            _choice(name, env, getattr(self, name), allowed)


_from_env: tuple[tuple, KernelConfig] | None = None
_chosen: KernelConfig | None = None


def kernels() -> KernelConfig:
    """The kernel settings in force in this process: those an engine or `use_kernels` chose where they differ from
    the environment's, else the environment's (read again when it changes: a few dict lookups a call)."""
    if _chosen is not None:
        return _chosen
    global _from_env
    key = tuple(os.environ.get(name) for name in KERNEL_ENV)
    if _from_env is None or _from_env[0] != key:
        _from_env = (key, KernelConfig())
    return _from_env[1]


def use_kernels(settings: KernelConfig | None) -> None:
    """Make `settings` the process's kernel settings (None, or the environment's own: follow the environment)."""
    global _chosen
    _chosen = None
    if settings is not None and settings != kernels():
        _chosen = settings


@contextlib.contextmanager
def kernels_set(**changes: str) -> Iterator[KernelConfig]:
    """Run a block under other kernel settings (A/B runs, tests), then restore the ones before."""
    before = _chosen
    use_kernels(dataclasses.replace(kernels(), **changes))
    try:
        yield kernels()
    finally:
        use_kernels(before)


def cache_root() -> Path:
    """Where minillm keeps what it builds once per machine (compiled kernels, calibration factors):
    MINILLM_CACHE_DIR, else $XDG_CACHE_HOME/minillm, else ~/.cache/minillm."""
    if os.environ.get("MINILLM_CACHE_DIR"):
        return Path(os.environ["MINILLM_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minillm"


def c_compiler() -> str:
    return os.environ.get("CC") or "cc"


def prefer_numba_workqueue() -> None:
    """numba's default threading layer may be OpenMP's, which fights torch's own OpenMP pool for the cores."""
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")


def dist_timeout() -> datetime.timedelta:
    """How long ranks wait for each other (start-up, a collective): MINILLM_DIST_TIMEOUT seconds, default 120."""
    return datetime.timedelta(seconds=float(os.environ.get("MINILLM_DIST_TIMEOUT", "120")))


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started it (RANK, WORLD_SIZE and MASTER_ADDR set), else None."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return int(os.environ["RANK"])
    return None


def torchrun_local_rank() -> int:
    """This process's rank on its own machine under torchrun (LOCAL_RANK; 0 when unset): its GPU on CUDA."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run in its interpreter on the CPU (triton reads it when a kernel is
    decorated, so it is set before the kernel modules are imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def time_limit_scale() -> str:
    """MINILLM_TIME_LIMIT_SCALE as written (the graders parse it and say what is wrong with it): multiplies every
    check's time limit."""
    return os.environ.get("MINILLM_TIME_LIMIT_SCALE", "").strip()


def keep_hypothesis_out_of_the_notebook(directory: str) -> None:
    """Hypothesis writes `.hypothesis/` into the working directory (even with database=None): inside a notebook,
    the lab folder. Point it at `directory` unless the user chose one (hypothesis reads this lazily)."""
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", directory)


def child_env(**changes: str) -> dict[str, str]:
    """This process's environment with `changes`, for a child process (a compile, a grader's sandbox)."""
    return {**os.environ, **changes}


def gpu_compile_env() -> dict[str, str]:
    """The environment for a child process that compiles Triton kernels for a GPU target: this one's, without
    TRITON_INTERPRET (triton would otherwise hand back the interpreter's kernels)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default; silences a warning
    return env


def python_path() -> list[str]:
    """PYTHONPATH's entries (for a child process that must import what this one does)."""
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def questions_dir() -> Path | None:
    """MINILLM_QUESTIONS: a question bank directory to use instead of the repository's questions/."""
    v = os.environ.get("MINILLM_QUESTIONS")
    return Path(v) if v else None


def quiz_data_dir() -> Path:
    """Where `minillm quiz` keeps its progress: MINILLM_DATA_DIR, else $XDG_DATA_HOME/minillm, else
    ~/.local/share/minillm."""
    if os.environ.get("MINILLM_DATA_DIR"):
        return Path(os.environ["MINILLM_DATA_DIR"])
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "minillm"


def no_color() -> bool:
    return bool(os.environ.get("NO_COLOR"))

EXECUTORS = ("auto", "mp", "thread", "env")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # How the other ranks run: "mp" spawns local processes, "thread" runs them as threads of this process (for
    # notebooks: a class defined in a cell cannot be sent to a spawned process), "env" joins ranks started by
    # torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment, one or several machines). "auto": "env" under
    # torchrun, else "mp".
    distributed_executor_backend: str = "auto"
    # pipeline parallelism: how many micro-batches a step's batch is cut into (None: one per stage)
    pipeline_micro_batches: Optional[int] = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class ServeConfig:
    """`minillm serve`'s own settings (the engine's are EngineConfig's)."""
    host: str = "127.0.0.1"              # loopback only: serving other machines is a choice (--host 0.0.0.0)
    port: int = 8000
    api_key: Optional[str] = None        # when set, every /v1 route wants `Authorization: Bearer <key>`
    served_model_name: Optional[str] = None   # the `model` clients name (default: the --model argument)
    # Admission: requests not yet started (accepted, no token yet) past these limits get 429 + Retry-After instead
    # of an unbounded queue; a burst is absorbed up to them.
    max_waiting_requests: int = 256
    max_waiting_tokens: int = 262_144
    max_body_bytes: int = 8 * 2**20      # a request body past this is refused (413) before it is parsed

    def __post_init__(self) -> None:
        for name in ("port", "max_waiting_requests", "max_waiting_tokens", "max_body_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "port" else 1) or \
                    (name == "port" and v > 65535):
                raise ValueError(f"{name} must be " + ("a port number in [0, 65535]" if name == "port" else
                                                       "a positive integer") + f", got {v!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty: give a key, or leave --api-key out for an open server")


METHODS = ("ngram", "draft_model", "layer_skip")
MAX_SPECULATIVE_TOKENS = 32
AUTO_MAX_SPECULATIVE_TOKENS = 8        # num_speculative_tokens="auto": each step's k per sequence is in 0..8


@dataclass
class SpeculativeConfig:
    method: str
    # tokens drafted per sequence per step: a fixed k, or "auto" (spec_decode/adaptive.py picks 0..k_max per
    # sequence each step from its acceptance so far and the engine's measured step costs)
    num_speculative_tokens: int | str = "auto"
    model: Optional[str] = None              # draft_model: "default", a .gguf file or a Hugging Face directory
    draft_layers: Optional[int] = None       # layer_skip: how many of the target's first layers draft
    prompt_lookup_min: int = 1               # ngram: the shortest and longest suffix to look up
    prompt_lookup_max: int = 3

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}: use one of {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if name == "num_speculative_tokens" and v == "auto":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                also = " or 'auto'" if name == "num_speculative_tokens" else ""
                raise ValueError(f"speculative {name} must be a positive integer{also}, got {v!r}")
        if self.k_max > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} is more than "
                             f"{MAX_SPECULATIVE_TOKENS}: a whole k-token draft survives with the product of the "
                             "per-token acceptance rates, so the tail of a long draft is almost never kept while every "
                             "drafted token costs a row of verification; 3-8 is the useful range")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative model must be 'default', a .gguf file or a Hugging Face directory (a str), "
                             f"got {self.model!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("the draft_model method needs `model`: 'default', a .gguf file or a Hugging Face "
                             "directory with the target's vocabulary")
        if self.method == "layer_skip" and (isinstance(self.draft_layers, bool) or not isinstance(self.draft_layers, int)
                                            or self.draft_layers < 1):
            raise ValueError(f"the layer_skip method needs draft_layers, a positive integer (fewer than the target's "
                             f"layers), got {self.draft_layers!r}")

    @classmethod
    def parse(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """None, a SpeculativeConfig, or a dict like {"method": "ngram", "num_speculative_tokens": 4}."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                            f"'num_speculative_tokens': 4}}, got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = set(value) - known
        if unknown:
            raise TypeError(f"unknown speculative_config key(s) {sorted(unknown)}; valid: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a method: one of {', '.join(METHODS)}")
        return cls(**value)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def adaptive(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def k_max(self) -> int:
        """The most tokens one step drafts for one sequence: the fixed k, or auto's ceiling."""
        return AUTO_MAX_SPECULATIVE_TOKENS if self.adaptive else self.num_speculative_tokens


def int_or_auto(text: str) -> int | str:
    """A command-line k: 'auto' or an integer (range checks come later, with the flag's name)."""
    return "auto" if text.strip().lower() == "auto" else int(text)


DEVICE_KINDS = ("auto", "cpu", "cuda", "cuda:N", "meta")


def check_device(device: Any) -> None:
    """Raise ValueError for a device setting that is not one of DEVICE_KINDS (checked without importing torch)."""
    ok = isinstance(device, str) and (device in ("auto", "cpu", "cuda", "meta") or (
        device.startswith("cuda:") and device[5:].isdigit() and device[5:] == str(int(device[5:]))))
    if not ok:
        env = " (the environment's MINILLM_DEVICE)" if device == _env("MINILLM_DEVICE", "") != "" else ""
        raise ValueError(f"unknown device {device!r}{env}: use one of {', '.join(DEVICE_KINDS)} (auto: cuda when a GPU "
                         "is available, else cpu; N a GPU index; meta: a dry run that places tensors without data)")


def default_device() -> str:
    """EngineConfig.device's default: MINILLM_DEVICE, else auto (tests/conftest.py sets cpu: the suite runs on the CPU
    even where there is a GPU, and tests/test_cuda_engine.py asks for CUDA itself)."""
    return _env("MINILLM_DEVICE", "auto")


@dataclass
class EngineConfig:
    dtype: str = "float32"              # what LLM and the CLI load the weights in
    # where the weights, the KV pool and every step's tensors live: auto (cuda when torch sees a GPU, else cpu) |
    # cpu | cuda | cuda:N | meta (placement only: a dry run, nothing computes)
    device: str = field(default_factory=default_device)
    # CUDA only: run every step eagerly (no CUDA graphs for decode steps); ignored on a CPU
    enforce_eager: bool = False
    # auto: keep a quantized checkpoint's format (the default GGUF runs int4) | none | int8 | int4 | w8a8
    # (quant/policy.py)
    quantization: str = "auto"
    quantization_group_size: int = 32   # int4's group size when quantizing a float checkpoint
    max_model_len: int | None = None    # None: the model's context window (capped by the KV pool)
    attention_backend: str = "auto"     # "torch" | "cpu" | "triton" | "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: Optional[SpeculativeConfig] = None   # given as speculative_config={...} (vLLM's name)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernels: KernelConfig = field(default_factory=kernels)

    def __post_init__(self) -> None:
        self.speculative = SpeculativeConfig.parse(self.speculative)
        self.validate()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Flat keyword arguments -> an EngineConfig: `block_size=16` goes to .cache, `max_num_seqs=8` to
        .scheduler. Unknown names raise TypeError listing the valid ones. Omitted names keep the defaults."""
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        if "speculative_config" in kwargs:
            kwargs["speculative"] = kwargs.pop("speculative_config")
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in sections and k not in SECTIONS}
        parts: dict[str, Any] = {}
        for name, sub in SECTIONS.items():
            names = {f.name for f in dataclasses.fields(sub)}
            parts[name] = sub(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise TypeError(f"unknown engine setting(s) {'; '.join(_unknown_setting(k) for k in sorted(kwargs))}; "
                            f"valid: {', '.join(setting_names())}")
        return cls(**own, **parts)

    def validate(self) -> None:
        c, s = self.cache, self.scheduler

        def positive(name: str, v: Any) -> None:
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        def flag(name: str, v: Any) -> None:
            if not isinstance(v, bool):      # "no" or 0 would otherwise pass for True / False by truthiness
                raise ValueError(f"{name} must be True or False, got {v!r}")
        if not (isinstance(self.dtype, str) and self.dtype in DTYPE_NAMES) and type(self.dtype).__module__ != "torch":
            raise ValueError(f"unknown dtype {self.dtype!r}: use float32 or bfloat16 (or float16)")
        positive("block_size", c.block_size)
        positive("max_num_seqs", s.max_num_seqs)
        positive("max_num_batched_tokens", s.max_num_batched_tokens)
        if c.num_blocks is not None:
            positive("num_blocks", c.num_blocks)
        if self.max_model_len is not None:
            positive("max_model_len", self.max_model_len)
        flag("enable_prefix_caching", c.enable_prefix_caching)
        flag("enforce_eager", self.enforce_eager)
        check_device(self.device)
        flag("enable_chunked_prefill", s.enable_chunked_prefill)
        try:
            if isinstance(c.kv_cache_memory, bool) or not isinstance(c.kv_cache_memory, (int, float, str)):
                raise TypeError
            budget = c.kv_cache_memory_bytes
        except (TypeError, ValueError, OverflowError):      # OverflowError: inf, 1e400
            raise ValueError(f"kv_cache_memory must be bytes or a size in KiB/MiB/GiB (or kB/MB/GB) like '512MiB' / "
                             f"'2GiB', got {c.kv_cache_memory!r}") from None
        if budget <= 0:
            raise ValueError(f"kv_cache_memory must be a positive size (the KV pool's budget, e.g. '2GiB'), got "
                             f"{c.kv_cache_memory!r}")
        if not isinstance(c.kv_cache_dtype, str) or c.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {c.kv_cache_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)} "
                             "(auto: the model's dtype)")
        p = self.parallel
        positive("tensor_parallel_size", p.tensor_parallel_size)
        positive("pipeline_parallel_size", p.pipeline_parallel_size)
        if p.pipeline_micro_batches is not None:
            positive("pipeline_micro_batches", p.pipeline_micro_batches)
        if p.tensor_parallel_size > 1 and p.pipeline_parallel_size > 1:
            raise ValueError("tensor and pipeline parallelism together are not supported: set one of "
                             "tensor_parallel_size / pipeline_parallel_size to 1")
        if p.distributed_executor_backend not in EXECUTORS:
            raise ValueError(f"unknown distributed_executor_backend {p.distributed_executor_backend!r}: use one of "
                             f"{', '.join(EXECUTORS)}")
        if self.speculative is not None and self.speculative.method == "layer_skip" and p.world_size > 1:
            raise ValueError("layer_skip speculation drafts with the target's own first layers, which a parallel "
                             "engine has spread over several ranks: use ngram or draft_model with "
                             "tensor/pipeline parallelism")
        check_quantization(self.quantization, self.quantization_group_size)
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}: use 'torch', 'cpu', "
                             "'triton' or 'auto'")
        if self.attention_backend == "triton" and c.block_size & (c.block_size - 1):
            raise ValueError(f"the triton attention backend needs a power-of-two block_size (its kernel splits blocks "
                             f"in powers of two), got {c.block_size}: use 16, or another backend")

    def as_kwargs(self) -> dict[str, Any]:
        """The flat view from_kwargs takes (for printing and for copies with a change)."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("cache", "scheduler", "speculative", "parallel", "kernels")}
        flat.update(dataclasses.asdict(self.cache))
        flat.update(dataclasses.asdict(self.scheduler))
        flat.update(dataclasses.asdict(self.parallel))
        flat.update(dataclasses.asdict(self.kernels))
        flat["speculative_config"] = self.speculative.as_dict() if self.speculative else None
        return flat

    def replace(self, **changes: Any) -> "EngineConfig":
        return EngineConfig.from_kwargs(**{**self.as_kwargs(), **changes})


SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig, "kernels": KernelConfig}

# SamplingParams' fields (sampling/params.py; a test keeps the two in step): an engine setting by one of these names
# is a per-request setting passed to the wrong place.
SAMPLING_SETTING_NAMES = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                          "frequency_penalty", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "n",
                          "logprobs", "skip_special_tokens", "structured_outputs")


def _unknown_setting(name: str) -> str:
    """`name` with what it was probably meant to be: a misspelt setting, or a per-request sampling field."""
    if name in SAMPLING_SETTING_NAMES:
        return f"{name} (a sampling setting: pass SamplingParams({name}=...) to generate)"
    close = difflib.get_close_matches(name.lower().replace("-", "_"), setting_names(), n=3, cutoff=0.6)
    return f"{name} (did you mean {' or '.join(close)}?)" if close else name


def setting_names() -> list[str]:
    """Every flat engine setting, in declaration order."""
    return list(EngineConfig().as_kwargs())
