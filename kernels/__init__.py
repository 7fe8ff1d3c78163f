"""Plait's kernels, and the ops table the model calls (`ops.py`).

* `ops.py`: `select_ops` picks one table per engine (`TorchOps`, `CpuNativeOps`,
  `TritonOps`): add_rms_norm, rope_write_kv, silu_mul, attention, and the per-step `plan`.
* `metadata.py`: `AttentionMetadata`, built once per step by the runner.
* `reference.py`: the plain-torch paged attention and KV write, the ground truth.
* `cpu/`: the native C kernels (`build.py` compiles and loads them, `native.py` calls them)
  and the CPU attention backend (`attention.py`).
* `cuda/`: the Triton paged attention and KV write.
"""

from plait.kernels.metadata import AttentionMetadata, rows_metadata
from plait.kernels.ops import (
    AttentionShape,
    CpuNativeOps,
    TorchOps,
    TritonOps,
    select_ops,
)

__all__ = ["AttentionMetadata", "AttentionShape", "CpuNativeOps", "TorchOps", "TritonOps",
           "rows_metadata", "select_ops"]
