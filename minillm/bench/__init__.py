"""Benchmarks: decode roofline, throughput vs transformers, KV waste."""
