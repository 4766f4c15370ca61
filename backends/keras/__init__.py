"""damcha_keras: DAMCHA for Keras 3, on the TensorFlow, JAX and PyTorch backends.

``DamchaAttention`` is a drop-in for ``keras.layers.MultiHeadAttention``
written with ``keras.ops`` only; ``MetricGenerator`` is the shareable,
data-adaptive part; ``TransformerEncoder``/``TransformerDecoder`` are
KerasHub-style blocks. The conformance adapter is
``damcha_conformance.adapters.KerasAdapter``.
"""

from __future__ import annotations

from damcha_core._deprecation import moved_names as _moved_names
from damcha_core._imports import require as _require

_require("keras", "keras", "damcha_keras")  # one-line ImportError naming the extra

from ._blocks import TransformerDecoder, TransformerEncoder, gelu_tanh
from ._canonical import stack_from_canonical, stack_load_canonical, stack_to_canonical
from ._functional import rms_normalise
from ._generator import MetricGenerator
from ._layer import DamchaAttention
from ._models import (
    AttentionLayout,
    DamchaMaps,
    ModelAdapter,
    ProjectionSite,
    convert,
    converted_layers,
    damcha_variables,
    metric_penalty,
    register_adapter,
    supported_layouts,
    track_metric_penalty,
)

__all__ = [
    "AttentionLayout",
    "DamchaAttention",
    "DamchaMaps",
    "MetricGenerator",
    "ModelAdapter",
    "ProjectionSite",
    "TransformerDecoder",
    "TransformerEncoder",
    "convert",
    "converted_layers",
    "damcha_variables",
    "gelu_tanh",
    "metric_penalty",
    "register_adapter",
    "rms_normalise",
    "stack_from_canonical",
    "stack_load_canonical",
    "stack_to_canonical",
    "supported_layouts",
    "track_metric_penalty",
]


# Deprecated for one release: the adapter moved to the conformance suite.
__getattr__ = _moved_names(__name__, {"ConformanceAdapter": "damcha_conformance.adapters.KerasAdapter"})
