"""Attention kernels: the torch reference and the Triton PagedAttention decode kernel."""
