"""torch's thread count for a block of a test.

    with torch_threads(2): ...   the native kernels' OpenMP regions use 2 threads inside
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """`torch.set_num_threads(count)` inside the block, the previous count restored after
    (also when the block raises)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
