"""Force a product path by its row name (kernels/cpu/products.py), never by editing a
layer's state: a fresh `Linear` over a layer's weight and bias, on the named row."""

from __future__ import annotations

from plait.engine.models.linear import Linear
from plait.kernels.cpu.products import row


def on_row(src: Linear, name: str) -> Linear:
    """A new layer over `src`'s weight (the same Parameter, or the same kept blocks) and
    bias, computing through row `name` (prepared here)."""
    if src.qweight is not None:
        layer = Linear.kept(src.qweight, src.bias)
    else:
        layer = Linear(src.in_features, src.out_features, bias=src.bias is not None)
        layer.weight, layer.bias = src.weight, src.bias
    layer.select(row(name))
    return layer
