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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minillm.kernels.triton_launch import (HAS_TRITON, compile_for_target, compile_in_child, in_process_compile_ok,
                                           kernel_device, launch, pointer_type)
from minillm.quant.formats import QuantizedWeight

if HAS_TRITON:
    import triton
    import triton.language as tl

KERNEL_NAME = "qgemm_kernel"

if HAS_TRITON:
    @triton.jit
    def _per_block(q, s, mn, HAS_MIN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """q [BLOCK_N, BLOCK_K / 2] (a half-tile: 16 columns per quantization block) times its blocks' scales s
        [BLOCK_N, BLOCK_K / 32] (+ their minimums mn), each broadcast over its block's 16 columns: one load per
        block, not per element."""
        w3 = tl.reshape(q, (BLOCK_N, BLOCK_K // 32, 16)) * s[:, :, None]
        if HAS_MIN:
            w3 = w3 + mn[:, :, None]
        return tl.reshape(w3, (BLOCK_N, BLOCK_K // 2))

    @triton.jit
    def qgemm_kernel(x_ptr, w_ptr, scales_ptr, mins_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                     GROUP: tl.constexpr, INT4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        # A tile of BLOCK_K columns is BLOCK_K / 32 quantization blocks. Column j of a half-tile is lane j % 16 of
        # block j // 16: its low half (int4: the byte's low nibble) is element lo[j], its high half element lo[j] + 16.
        j = tl.arange(0, BLOCK_K // 2)
        lo = (j // 16) * 32 + j % 16
        blk = tl.arange(0, BLOCK_K // 32)
        ng = K // GROUP
        # dequantize in the activations' dtype for fp16 (the tensor cores take fp16 anyway), else in float32
        cdt = tl.float16 if x_ptr.dtype.element_ty == tl.float16 else tl.float32
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(tl.program_id(2), tl.cdiv(K, BLOCK_K), SPLIT_K):   # split-K: every SPLIT_K-th tile
            k_lo = t * BLOCK_K + lo
            k_ok = k_lo < K
            wmask = n_ok[:, None] & k_ok[None, :]
            xs = x_ptr + rm[:, None] * stride_xm + k_lo[None, :]
            xmask = m_ok[:, None] & k_ok[None, :]
            x_lo = tl.load(xs, mask=xmask, other=0.0)
            x_hi = tl.load(xs + 16, mask=xmask, other=0.0)
            k_blk = t * BLOCK_K + blk * 32
            smask = n_ok[:, None] & (k_blk < K)[None, :]
            gs = rn[:, None] * ng + (k_blk // GROUP)[None, :]     # [BLOCK_N, BLOCK_K / 32]: each block's group
            s = tl.load(scales_ptr + gs, mask=smask, other=0.0).to(cdt)
            if INT4:
                byte = tl.load(w_ptr + rn[:, None] * (K // 2) + t * (BLOCK_K // 2) + j[None, :], mask=wmask, other=0)
                mn = tl.load(mins_ptr + gs, mask=smask, other=0.0).to(cdt)
                w_lo = _per_block((byte & 0xF).to(cdt), s, mn, True, BLOCK_N, BLOCK_K)
                w_hi = _per_block((byte >> 4).to(cdt), s, mn, True, BLOCK_N, BLOCK_K)
            else:
                ws = w_ptr + rn[:, None] * K + k_lo[None, :]
                w_lo = _per_block(tl.load(ws, mask=wmask, other=0).to(cdt), s, s, False, BLOCK_N, BLOCK_K)
                w_hi = _per_block(tl.load(ws + 16, mask=wmask, other=0).to(cdt), s, s, False, BLOCK_N, BLOCK_K)
            if IEEE:   # float32 activations: full-precision products, not TF32's 10-bit mantissas
                acc += tl.dot(x_lo, tl.trans(w_lo), input_precision="ieee")
                acc += tl.dot(x_hi, tl.trans(w_hi), input_precision="ieee")
            else:
                acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)))
                acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)))
        ys = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        ymask = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(ys, acc.to(y_ptr.dtype.element_ty), mask=ymask)
        else:   # y is a zeroed float32 buffer the K-slices add into
            tl.atomic_add(ys, acc, mask=ymask)
else:  # pragma: no cover
    qgemm_kernel = None


def triton_available() -> bool:
    """The kernel can run here: triton with a CUDA GPU, or the interpreter (TRITON_INTERPRET=1 set before import)."""
    return kernel_device(qgemm_kernel) is not None


@dataclass(frozen=True)
class TileConfig:
    """One launch of the kernel: tile sizes (BLOCK_K a multiple of 32, the quantization block) and how many programs
    share the K dimension (split_k > 1 adds their partial sums into a float32 buffer with atomics)."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4


def tile_config(m: int, n: int, k: int, num_sms: int) -> TileConfig:
    """The launch for an [m, k] x [n, k]^T product. Few rows (decode) are bound by streaming W: small row tiles and
    enough K-slices for ~8 programs per SM (n / 64 tiles alone leave most of an H100's 132 SMs idle on a 4096-wide
    layer; on an H200, 6144x4096 int4 at 1 row: 2 slices 94 us, 16 slices 33 us). Many rows (prefill) are bound by
    the tensor cores' work: bigger tiles, no split."""
    if m <= 16:
        tiles = -(-n // 64)
        split = max(1, min(-(-k // 128), (8 * num_sms) // tiles))
        return TileConfig(16, 64, 128, split)
    if m <= 64:
        return TileConfig(32 if m <= 32 else 64, 64, 64)
    return TileConfig(64, 128, 64, num_warps=8)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4   # the interpreter: a few K-slices, so split-K runs in the tests too


def qlinear_triton(x: torch.Tensor, qw: QuantizedWeight, config: TileConfig | None = None) -> torch.Tensor:
    """x [..., K] times the quantized [N, K] matrix -> [..., N] in x's dtype, through the Triton kernel (`config`
    overrides tile_config's choice: tests and tools/bench_gpu_qgemm.py)."""
    n, k = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the quantized weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    c = config or tile_config(m, n, k, _num_sms(x.device))
    if c.block_k % 32 or c.block_m < 16 or c.block_n < 16 or c.split_k < 1:
        raise ValueError(f"{c}: block_k must be a multiple of 32, block_m and block_n at least 16, split_k >= 1")
    split = c.split_k > 1
    y = (torch.zeros if split else torch.empty)(m, n, dtype=torch.float32 if split else x.dtype, device=x.device)
    launch(qgemm_kernel, (-(-m // c.block_m), -(-n // c.block_n), c.split_k),
           x2, qw.qweight, qw.scales, qw.mins if qw.mins is not None else qw.scales, y,
           m, n, k, x2.stride(0), y.stride(0), GROUP=qw.group_size, INT4=qw.kind == "int4",
           BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=c.split_k,
           IEEE=x2.dtype == torch.float32, num_warps=c.num_warps)
    return y.to(x.dtype).view(*lead, n)


def qlinear_cuda(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The GPU path: the Triton kernel when triton is installed, else dequantize then matmul (same numbers up to
    accumulation order)."""
    if HAS_TRITON and x.is_cuda:
        return qlinear_triton(x, qw)
    return F.linear(x, qw.dequantize(x.dtype))


# Ahead-of-time compilation for a GPU target without a GPU (triton_launch.py).

def _compile(arch: int, dtype: str, kind: str, rows: int = 1) -> dict:
    signature = {"x_ptr": pointer_type(dtype), "w_ptr": "*u8" if kind == "int4" else "*i8", "scales_ptr": "*fp16",
                 "mins_ptr": "*fp16", "y_ptr": pointer_type(dtype), "M": "i32", "N": "i32", "K": "i32",
                 "stride_xm": "i32", "stride_ym": "i32"}
    c = tile_config(rows, 4096, 4096, 132)     # the launch a 4096-wide layer gets on an H100 at `rows` rows
    if c.split_k > 1:   # the split-K launch adds into a float32 buffer
        signature["y_ptr"] = "*fp32"
    constexprs = {"GROUP": 32, "INT4": kind == "int4", "BLOCK_M": c.block_m, "BLOCK_N": c.block_n,
                  "BLOCK_K": c.block_k, "SPLIT_K": c.split_k, "IEEE": dtype == "fp32"}
    asm = compile_for_target(qgemm_kernel, signature, constexprs, arch, c.num_warps)
    return {"ptx": asm["ptx"], "cubin_bytes": len(asm["cubin"])}


def _compile_all(jobs: list) -> list:
    return [_compile(*job) for job in jobs]


def aot_compile(jobs: list[tuple[int, str, str]]) -> dict:
    """Compile the kernel for each (arch, activation dtype, weight kind[, rows]), e.g. (90, "bf16", "int4", 1), with
    the launch tile_config gives a 4096-wide layer at that many rows (1: split-K decode; 256: prefill tiles):
    {job: {"ptx": str, "cubin_bytes": int}}. In a process that runs the interpreter, one child process without
    TRITON_INTERPRET compiles them all. Raises KernelCompileError (a RuntimeError) when the child fails."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    jobs = [(int(j[0]), str(j[1]), str(j[2]), int(j[3]) if len(j) > 3 else 1) for j in jobs]
    if in_process_compile_ok(qgemm_kernel):
        return dict(zip(jobs, _compile_all(jobs)))
    return dict(zip(jobs, compile_in_child(__file__, "_compile_all", jobs)))
