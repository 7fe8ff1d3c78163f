"""The CUDA backend: Triton kernels for paged attention and the KV-cache write."""
