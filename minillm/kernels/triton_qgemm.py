"""Quantized linear layers on a GPU: a Triton kernel that reads int4/int8 weights (minillm/quant/formats.py) and
dequantizes them tile by tile on the way into tensor-core matmuls, so W crosses memory packed.

    y[M, N] = x[M, K] W[N, K]^T,  W[n, k] = scale[n, k // G] * q[n, k] (+ min[n, k // G] for int4)

Each program owns a BLOCK_M x BLOCK_N tile of y and walks K one quantization block (32 values) at a time: int4
bytes hold element j in the low nibble and j + 16 in the high one (GGUF's order), so a block is two 16-wide halves,
each dequantized in registers and multiplied with the matching half of x. Accumulation is fp32.

On CUDA, Quantizable.linear calls `qlinear_cuda`: this kernel when triton is installed, else dequantize-then-matmul.
Without a GPU the kernel runs under TRITON_INTERPRET=1 (tests compare it with the reference) and compiles for
sm80/sm90 ahead of time (`aot_compile`), which catches code that only the interpreter accepts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from minillm.quant.formats import QuantizedWeight

try:
    import triton
    import triton.language as tl
    _HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships with the project's requirements
    _HAS_TRITON = False

KERNEL_NAME = "qgemm_kernel"
BLOCK_M, BLOCK_N = 16, 32

if _HAS_TRITON:
    @triton.jit
    def qgemm_kernel(x_ptr, w_ptr, scales_ptr, mins_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                     GROUP: tl.constexpr, INT4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        half = tl.arange(0, 16)
        m_ok, n_ok = rm < M, rn < N
        ng = K // GROUP
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for b in range(0, K // 32):
            k0 = b * 32
            g = k0 // GROUP
            xs = x_ptr + rm[:, None] * stride_xm + k0 + half[None, :]
            x_lo = tl.load(xs, mask=m_ok[:, None], other=0.0)
            x_hi = tl.load(xs + 16, mask=m_ok[:, None], other=0.0)
            s = tl.load(scales_ptr + rn * ng + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            if INT4:
                byte = tl.load(w_ptr + rn[:, None] * (K // 2) + b * 16 + half[None, :], mask=n_ok[:, None], other=0)
                mn = tl.load(mins_ptr + rn * ng + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
                w_lo = (byte & 0xF).to(tl.float32) * s + mn
                w_hi = (byte >> 4).to(tl.float32) * s + mn
            else:
                ws = w_ptr + rn[:, None] * K + k0 + half[None, :]
                w_lo = tl.load(ws, mask=n_ok[:, None], other=0).to(tl.float32) * s
                w_hi = tl.load(ws + 16, mask=n_ok[:, None], other=0).to(tl.float32) * s
            acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)))
            acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)))
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def triton_available() -> bool:
    """The kernel can run here: triton with a CUDA GPU, or the interpreter (TRITON_INTERPRET=1 set before import)."""
    return _HAS_TRITON and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def qlinear_triton(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x [..., K] times the quantized [N, K] matrix -> [..., N] in x's dtype, through the Triton kernel."""
    n, k = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the quantized weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        grid = (triton.cdiv(x2.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
        qgemm_kernel[grid](x2, qw.qweight, qw.scales, qw.mins if qw.mins is not None else qw.scales, y,
                           x2.shape[0], n, k, x2.stride(0), y.stride(0), GROUP=qw.group_size,
                           INT4=qw.kind == "int4", BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return y.view(*lead, n)


def qlinear_cuda(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The GPU path: the Triton kernel when triton is installed, else dequantize then matmul (same numbers up to
    accumulation order)."""
    if _HAS_TRITON and x.is_cuda:
        return qlinear_triton(x, qw)
    return F.linear(x, qw.dequantize(x.dtype))


# Ahead-of-time compilation for a GPU target without a GPU (see triton_paged_attention.py for why it needs a child
# process when this one runs the interpreter).
_ELT = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}


def _compile(arch: int, dtype: str, kind: str) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    elt = _ELT[dtype]
    signature = {"x_ptr": f"*{elt}", "w_ptr": "*u8" if kind == "int4" else "*i8", "scales_ptr": "*fp16",
                 "mins_ptr": "*fp16", "y_ptr": f"*{elt}", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
                 "stride_ym": "i32", "GROUP": "constexpr", "INT4": "constexpr", "BLOCK_M": "constexpr",
                 "BLOCK_N": "constexpr"}
    constexprs = {"GROUP": 32, "INT4": kind == "int4", "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N}
    attrs = {(list(signature).index(n),): [["tt.divisibility", 16]] for n in signature if n.endswith("_ptr")}
    src = ASTSource(fn=qgemm_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    asm = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4}).asm
    return {"ptx": asm["ptx"], "cubin_bytes": len(asm["cubin"])}


def aot_compile(jobs: list[tuple[int, str, str]]) -> dict:
    """Compile the kernel for each (arch, activation dtype, weight kind), e.g. (90, "bf16", "int4"):
    {job: {"ptx": str, "cubin_bytes": int}}. In a process that runs the interpreter, one child process without
    TRITON_INTERPRET compiles them all."""
    if not _HAS_TRITON:
        raise RuntimeError("triton is not installed")
    jobs = [(int(a), str(d), str(k)) for a, d, k in jobs]
    if os.environ.get("TRITON_INTERPRET") != "1":
        return {job: _compile(*job) for job in jobs}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "minillm.kernels.triton_qgemm", json.dumps(jobs)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {KERNEL_NAME} failed:\n{done.stderr.strip()[-2000:]}")
    return dict(zip(jobs, json.loads(done.stdout)))


if __name__ == "__main__":   # the child process of aot_compile
    print(json.dumps([_compile(*job) for job in json.loads(sys.argv[1])]))
