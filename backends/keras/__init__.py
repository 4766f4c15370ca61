"""damcha_keras: DAMCHA for Keras 3, on the TensorFlow, JAX and PyTorch backends.

``DamchaAttention`` is a drop-in for ``keras.layers.MultiHeadAttention``
written with ``keras.ops`` only; ``MetricGenerator`` is the shareable,
data-adaptive part; ``TransformerEncoder``/``TransformerDecoder`` are
KerasHub-style blocks. ``ConformanceAdapter`` (imported on first use, as it
pulls in the conformance suite) runs the catalogue on the current backend.
"""

from __future__ import annotations

from typing import Any

from ._blocks import TransformerDecoder, TransformerEncoder
from ._generator import MetricGenerator, rms_normalise
from ._layer import DamchaAttention

__all__ = [
    "ConformanceAdapter",
    "DamchaAttention",
    "MetricGenerator",
    "TransformerDecoder",
    "TransformerEncoder",
    "rms_normalise",
]


def __getattr__(name: str) -> Any:
    if name == "ConformanceAdapter":
        from ._conformance import ConformanceAdapter

        return ConformanceAdapter
    raise AttributeError(f"module 'damcha_keras' has no attribute {name!r}")
