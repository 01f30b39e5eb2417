"""Quantization: weight-only int8 / int4 and the memory arithmetic around it."""
