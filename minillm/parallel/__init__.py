"""Tensor and pipeline parallelism on torch.distributed (gloo on CPU, NCCL on CUDA): parallel layers, sharding
rules, the communicator that counts what is sent, and the workers of a multi-rank engine."""
