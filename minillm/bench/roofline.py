"""FLOPs, bytes and the roofline: how long a piece of work must take at least on a given machine (lab00).

A matmul Y[T, d_out] = X[T, d_in] @ W[d_out, d_in]^T does one multiply and one add per weight per token, and at
best reads W and X once and writes Y once. A forward pass is the sum over its matmuls; minillm fuses Q, K and V
into one matmul (and gate/up into another), and computes the LM head only for the rows it samples from.
The roofline bound: the work cannot run faster than the compute peak nor move bytes faster than memory, and
at best the two overlap completely."""
from __future__ import annotations


def linear_flops_bytes(num_tokens: int, d_in: int, d_out: int, dtype_bytes: float) -> tuple[int, float]:
    weights, inputs, outputs = d_in * d_out, num_tokens * d_in, num_tokens * d_out
    return 2 * num_tokens * weights, dtype_bytes * (weights + inputs + outputs)


def model_matmuls(cfg, num_tokens: int, num_logits: int) -> list[tuple[int, int, int]]:
    """(tokens, d_in, d_out) of every matmul of one forward pass, in execution order."""
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    layer = [(num_tokens, h, q + 2 * kv), (num_tokens, q, h),
             (num_tokens, h, 2 * cfg.intermediate_size), (num_tokens, cfg.intermediate_size, h)]
    return layer * cfg.num_layers + [(num_logits, h, cfg.vocab_size)]


def model_flops_bytes(cfg, num_tokens: int, num_logits: int, dtype_bytes: float) -> tuple[int, float]:
    totals = [linear_flops_bytes(t, i, o, dtype_bytes) for t, i, o in model_matmuls(cfg, num_tokens, num_logits)]
    return sum(f for f, _ in totals), sum(b for _, b in totals)


def roofline_time(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> float:
    compute_s, memory_s = flops / peak_flops, nbytes / bandwidth
    return compute_s if compute_s > memory_s else memory_s
