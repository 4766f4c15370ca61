"""Canonical parameters in safetensors, with the config in the file's metadata."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np

from ._config import DamchaConfig
from ._errors import DamchaValueError
from ._params import validate_params

FORMAT = "damcha-v1"


def save_params(path: str | os.PathLike, params: Mapping[str, Any], config: DamchaConfig) -> None:
    """Write ``params`` (validated against ``config``) and the config to ``path``.

    Tensors keep their floating dtype; the config goes into the metadata as
    JSON under ``damcha_config`` with ``format = "damcha-v1"``.
    """
    from safetensors.numpy import save_file  # lazy: only I/O needs safetensors

    validate_params(params, config)
    tensors = {name: np.ascontiguousarray(np.asarray(params[name])) for name in config.param_shapes()}
    metadata = {"format": FORMAT, "damcha_config": json.dumps(config.to_dict(), sort_keys=True)}
    save_file(tensors, os.fspath(path), metadata=metadata)


def load_params(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], DamchaConfig]:
    """Read a file written by ``save_params``; returns ``(params, config)``.

    Raises:
        DamchaValueError: the file has no DAMCHA metadata, or its tensors are
            missing, extra or mis-shaped for the stored config.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != FORMAT or "damcha_config" not in metadata:
            raise DamchaValueError(
                f"`path` is not a DAMCHA parameter file: its metadata must have format={FORMAT!r} and "
                f"damcha_config. Received: path={path!r}, metadata keys={sorted(metadata)}"
            )
        config = DamchaConfig.from_dict(json.loads(metadata["damcha_config"]))
        params = {name: f.get_tensor(name) for name in f.keys()}
    validate_params(params, config, argument=f"tensors in {path!r}")
    return params, config
