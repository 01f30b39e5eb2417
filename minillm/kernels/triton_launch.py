"""How minillm's Triton kernels run (triton_paged_attention.py, triton_qgemm.py): launched compiled on a CUDA GPU or
in Triton's CPU interpreter, and compiled ahead of time for an NVIDIA target (sm80, sm90, ...) without a GPU.

Whether a kernel is interpreted was settled by `triton.jit` when the kernel was decorated (it reads
TRITON_INTERPRET then), so the kernel object is asked, not the environment now. This module imports neither torch
(at import): an AOT-compile child process loads it and should not pay ~3 s for `import torch`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from minillm import config

try:
    import triton
except Exception:  # pragma: no cover - triton is an x86_64-only dependency
    triton = None

HAS_TRITON = triton is not None

_ELT = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
# The repository root: the compile child runs in a temporary directory and must still import minillm.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _interpreted(kernel) -> bool:
    return not isinstance(kernel, triton.runtime.jit.JITFunction)


def kernel_device(kernel) -> str | None:
    """Where `kernel`'s tensors must live: "cpu" when it is interpreted (TRITON_INTERPRET=1 when it was decorated),
    "cuda" when it is compiled and there is a GPU, None when it cannot run here (or triton is missing: kernel None)."""
    if kernel is None:
        return None
    if _interpreted(kernel):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else None


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), constexprs and launch options (num_warps) by name. An empty grid (a batch with
    no rows) launches nothing: CUDA rejects a zero-sized grid."""
    if kernel_device(kernel) is None:
        name = getattr(getattr(kernel, "fn", None), "__module__", "the kernel's module")
        raise RuntimeError(f"Triton kernel cannot run: need triton plus a CUDA GPU, or TRITON_INTERPRET=1 set before "
                           f"importing {name}")
    if 0 not in grid:
        kernel[grid](*args, **kwargs)


# ------------------------------------------------------------------ ahead-of-time compilation, no GPU needed
#
# triton.compile(ASTSource(JITFunction, signature, constexprs, attrs), target=GPUTarget) is the path
# triton/tools/compile.py uses: no driver, no GPU, and the nvidia backend runs the ptxas bundled in triton's wheel.
# It cannot run in a process whose kernels are interpreted: triton's own standard library (tl.cdiv, tl.max, ...) is
# then made of interpreter functions, and running an interpreted kernel leaves triton.language monkey-patched. There
# the compile runs in a child process without TRITON_INTERPRET (compile_in_child).

class KernelCompileError(RuntimeError):
    """The compile failed: `summary` is one line (with the offending source line when triton names it)."""

    def __init__(self, summary: str, detail: str = "") -> None:
        super().__init__(f"{summary}\n{detail}" if detail else summary)
        self.summary, self.detail = summary, detail

    @classmethod
    def from_log(cls, log: str) -> KernelCompileError:
        lines = [ln for ln in log.splitlines() if ln.strip()]
        summary = lines[-1].strip() if lines else "unknown error"
        caret = next((i for i in range(len(lines) - 1, 0, -1) if lines[i].strip() == "^"), None)
        if caret is not None:                   # triton points at the offending line of the kernel
            summary += f" — in `{lines[caret - 1].strip()}`"
        return cls(summary[:400], log.strip()[-3000:])


def pointer_type(dtype: str) -> str:
    """Triton's signature type of a pointer to `dtype` ("fp16", "bfloat16", "torch.float32", ...)."""
    return "*" + _ELT[str(dtype).replace("torch.", "")]


def in_process_compile_ok(kernel) -> bool:
    """An AOT compile can run in this process: `kernel` (one of this process's) is compiled, not interpreted."""
    return not _interpreted(kernel) and not config.triton_interpret()


def compile_for_target(fn, signature: dict, constexprs: dict, arch: int, num_warps: int) -> dict:
    """Compile `fn` (a kernel or its Python function) for GPUTarget("cuda", arch, 32). `signature`: the runtime
    parameters' types ("*fp16", "i32", ...), then `constexprs`' values, together in the kernel's parameter order.
    Returns triton's asm: ttir, ttgir, llir, ptx (str) and cubin (bytes)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    # The specialisation the runtime launcher makes for torch allocations: 16-byte aligned pointers.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(signature) if n.endswith("_ptr")}
    src = ASTSource(fn=JITFunction(getattr(fn, "fn", fn)), signature=signature, constexprs=constexprs, attrs=attrs)
    return dict(triton.compile(src, target=GPUTarget("cuda", int(arch), 32), options={"num_warps": num_warps}).asm)


_CHILD = """\
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location('_minillm_aot_child', sys.argv[1])
mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
with open(sys.argv[3]) as f:
    payload = json.load(f)
with open(sys.argv[4], 'w') as f:
    json.dump(getattr(mod, sys.argv[2])(payload), f)
"""


def compile_in_child(module_file: str, entry: str, payload, timeout: float = 300):
    """`entry(payload)` of the module at `module_file`, run in a child process without TRITON_INTERPRET (the module
    loaded by path under a private name); payload and result travel as JSON. Raises KernelCompileError."""
    env = config.gpu_compile_env()
    env["PYTHONPATH"] = os.pathsep.join([_ROOT, *config.python_path()])
    with tempfile.TemporaryDirectory() as tmp:
        in_path, out_path = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(in_path, "w") as f:
            json.dump(payload, f)
        try:
            proc = subprocess.run([sys.executable, "-c", _CHILD, os.path.abspath(module_file), entry, in_path,
                                   out_path], env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise KernelCompileError(f"the compile took more than {timeout:.0f} s") from None
        if proc.returncode != 0:
            raise KernelCompileError.from_log(proc.stderr)
        with open(out_path) as f:
            return json.load(f)
