"""Build, load and call the C PagedAttention decode kernel (csrc/paged_decode.c).

The C file is compiled on first use with the machine's C compiler and -march=native, and the shared
library is cached under ~/.cache/minillm/kernels (MINILLM_CACHE_DIR overrides), keyed by the source, the
flags, the compiler and the CPU, so a changed file or another machine rebuilds. No compiler, or a failed
build, is not an error: the numba kernel runs instead (one warning says why). MINILLM_CPU_KERNEL=numba
forces the numba kernel, for A/B runs.

Threads: the kernel spreads its (sequence, kv head) tasks over an OpenMP team. Built with -fopenmp it needs
libgomp.so.1, and in a process that imported torch that is torch's copy, so the team is torch's own
intra-op pool (a Python thread pool here cost ~130 us per call in wake-ups: 4 ms a step over 30 layers).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from minillm import config
from minillm.kernels import cpu_threads

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")
# builds without AVX-512 (without or with AVX-VNNI) of a kernel, for tests that its AVX2 code gives the native build's
# bits on a machine that has AVX-512 (cpu_qgemm.load, cpu_int16.load)
WITHOUT_AVX512 = {"avx2": ("-mno-avx512f", "-mno-avxvnni"), "avx2-vnni": ("-mno-avx512f",)}

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _I, _I, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _I, _I, ctypes.c_int]
_ARGTYPES_INT8 = [*_ARGTYPES[:7], _P, _P, *_ARGTYPES[7:]]     # k, v int8, then their fp16 scales


def cache_dir() -> Path:
    return config.cache_root() / "kernels"


def _cpu_signature() -> str:
    try:  # -march=native output depends on the CPU: its model and flags are part of the cache key
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "|".join(next((ln for ln in lines if ln.startswith(k)), "") for k in ("model name", "flags"))
    except OSError:
        return platform.processor()


def open_library(source: Path | tuple[Path, ...], what: str, instead: str,
                 extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """build() then load `source`; on failure warn "`what` unavailable, `instead`" and return None (the caller
    falls back)."""
    try:
        return ctypes.CDLL(str(build(source=source, extra_flags=extra_flags)))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"{what} unavailable, {instead}: {e}", RuntimeWarning)
        return None


def build(compiler: str | None = None, out_dir: Path | None = None, source: Path | tuple[Path, ...] = SOURCE,
          extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile C files beside this module (the attention kernel by default; several files link into one library)
    into a shared library, or reuse the cached build. Raises RuntimeError with the compiler's message."""
    cc = compiler or config.c_compiler()
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH (install gcc, or set CC)")
    sources = (source,) if isinstance(source, Path) else tuple(source)
    flags = (*FLAGS, *extra_flags)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([*(s.read_text() for s in sources), " ".join(flags), version, _cpu_signature(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    target = out_dir / f"{sources[0].stem}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)  # build beside the target, then rename: atomic
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {', '.join(s.name for s in sources)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load(variant: str = "native") -> ctypes.CDLL | None:
    """The compiled kernel, or None (numba kernel instead) when it is switched off or cannot be built.
    variant "portable": the int8 loads through gcc's generic vector code instead of AVX2 intrinsics (for tests)."""
    if config.kernels().cpu_attention_kernel == "numba":
        return None
    lib = open_library(SOURCE, "C PagedAttention kernel", "using the numba kernel",
                       ("-DMINILLM_PAGED_DECODE_PORTABLE",) if variant == "portable" else ())
    if lib is None:
        return None
    lib.minillm_paged_decode.argtypes = _ARGTYPES
    lib.minillm_paged_decode.restype = None
    lib.minillm_paged_decode_int8.argtypes = _ARGTYPES_INT8
    lib.minillm_paged_decode_int8.restype = None
    lib.minillm_paged_decode_supports.argtypes = [_I, _I]
    lib.minillm_paged_decode_supports.restype = ctypes.c_int
    return lib


def supports(q: torch.Tensor, out: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> bool:
    """Whether the C kernel is built and takes these operands (d contiguous in q and out, pools contiguous; an int8
    pool with contiguous float16 scales [KVH, slots])."""
    lib = load()
    if (lib is None or q.stride(-1) != 1 or out.stride(-1) != 1 or not k_slots.is_contiguous()
            or not v_slots.is_contiguous()):
        return False
    if k_slots.dtype == torch.int8 and not all(
            s is not None and s.dtype == torch.float16 and s.is_contiguous() and s.shape == k_slots.shape[:2]
            for s in (k_scale, v_scale)):
        return False
    return bool(lib.minillm_paged_decode_supports(q.shape[1] // k_slots.shape[0], q.shape[2]))


def paged_decode(q: torch.Tensor, rows: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, scale: float,
                 out: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 lib: ctypes.CDLL | None = None) -> None:
    """Same contract as cpu_paged_attention.paged_attention_decode_cpu with rows given; call supports() first.
    An int8 pool (k_slots int8) needs k_scale / v_scale and runs minillm_paged_decode_int8. lib: another build
    (load("portable")), default load()."""
    rows, block_tables, seq_lens = rows.contiguous(), block_tables.contiguous(), seq_lens.contiguous()
    num_kv_heads, num_slots, head_dim = k_slots.shape
    lib = lib or load()
    pools = (k_slots.data_ptr(), v_slots.data_ptr())
    fn = lib.minillm_paged_decode
    if k_slots.dtype == torch.int8:
        pools, fn = (*pools, k_scale.data_ptr(), v_scale.data_ptr()), lib.minillm_paged_decode_int8
    fn(q.data_ptr(), q.stride(0), q.stride(1), rows.data_ptr(), rows.shape[0], *pools, block_tables.data_ptr(),
       seq_lens.data_ptr(), q.shape[1], num_kv_heads, head_dim, num_slots, block_tables.shape[1], block_size,
       float(scale), out.data_ptr(), out.stride(0), out.stride(1), cpu_threads.team_size())
