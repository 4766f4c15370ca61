"""damcha_core: the NumPy float64 reference that *is* the DAMCHA v1 specification.

Only NumPy is imported here; ``save_params``/``load_params`` import
safetensors when called. No deep-learning framework is ever imported.
"""

from __future__ import annotations

from ._config import DamchaConfig, config_sizes
from ._convert import fold_static_metric, params_from_mha, projection_names
from ._errors import (
    DamchaError,
    DamchaNotIntegerError,
    DamchaTypeError,
    DamchaValueError,
    describe,
    invalid_argument,
)
from ._io import load_params, save_params
from ._metrics import METRIC_STRUCTURES, GeneratorSpec, MetricLeaf, MetricStructure
from ._params import check_params, check_params_fit, init_params, validate_params
from ._policy import (
    check_bool,
    check_choice,
    check_config,
    check_finite_nonneg,
    check_generator_arg,
    check_int,
    check_keys,
    check_layer_args,
    check_offset,
    check_rate,
    check_real,
    check_seed,
    check_shapes,
    make_config,
    resolve_coupling,
    resolve_generators,
)
from ._reference import (
    RMS_EPS,
    damcha_attention,
    float_dtype_error,
    mask_dtype_error,
    metric_penalty,
    rms_normalise,
    role_penalty,
    side_of,
)
from ._rotary import Rotary, apply_rotary
from ._stack import (
    EncoderConfig,
    TokenModelConfig,
    encoder_forward,
    init_encoder_params,
    init_token_model_params,
    token_model_forward,
    validate_stack_params,
)
from ._validators import COUPLINGS, METRICS

__version__ = "0.1.0"

__all__ = [
    "COUPLINGS",
    "DamchaConfig",
    "DamchaError",
    "DamchaNotIntegerError",
    "DamchaTypeError",
    "DamchaValueError",
    "EncoderConfig",
    "GeneratorSpec",
    "METRICS",
    "METRIC_STRUCTURES",
    "MetricLeaf",
    "MetricStructure",
    "RMS_EPS",
    "Rotary",
    "TokenModelConfig",
    "__version__",
    "apply_rotary",
    "check_bool",
    "check_choice",
    "check_config",
    "check_finite_nonneg",
    "check_generator_arg",
    "check_int",
    "check_keys",
    "check_layer_args",
    "check_offset",
    "check_params",
    "check_params_fit",
    "check_rate",
    "check_real",
    "check_seed",
    "check_shapes",
    "config_sizes",
    "damcha_attention",
    "describe",
    "encoder_forward",
    "float_dtype_error",
    "fold_static_metric",
    "init_encoder_params",
    "init_params",
    "init_token_model_params",
    "invalid_argument",
    "load_params",
    "make_config",
    "mask_dtype_error",
    "metric_penalty",
    "params_from_mha",
    "projection_names",
    "resolve_coupling",
    "resolve_generators",
    "rms_normalise",
    "role_penalty",
    "save_params",
    "side_of",
    "token_model_forward",
    "validate_params",
    "validate_stack_params",
]
