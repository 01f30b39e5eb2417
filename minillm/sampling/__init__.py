"""Sampling: SamplingParams and the batched sampler."""
