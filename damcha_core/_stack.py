"""The stack format: encoder stacks with stack-wise metric sharing, and a small token model.

``damcha_core`` defines one layer in ``_reference``; this module defines how
layers compose into the stacks that every port's blocks convert to (their
``to_canonical()``) and that ``damcha_onnx`` exports, with a NumPy float64
reference (``encoder_forward``, ``token_model_forward``) that calls
``damcha_attention`` per layer, so every port and every exported graph is
checked against the spec rather than against itself.

Encoder layer (pre-norm by default, as in most current transformers)::

    h = h + DAMCHA(LN_1(h));  h = h + W_2 act(W_1 LN_2(h) + b_1) + b_2

optionally followed by a final LayerNorm.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._config import DamchaConfig
from ._errors import DamchaTypeError, DamchaValueError, describe, invalid_argument
from ._params import init_params, validate_params
from ._policy import check_token_shape
from ._reference import _as_float64, damcha_attention
from ._validators import check_bool, check_choice, check_int, check_real, check_seed

#: Name prefix of the stack-wise shared metric generator's parameters.
SHARED = "shared."
#: FFN activations: exact (erf) GELU, the tanh approximation, ReLU.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu")


def _generator_leaves(config: DamchaConfig) -> tuple[str, ...]:
    return ("kernel", "bias") if config.metric == "heads" else ("kernel", "bias", "u", "v")


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """A stack of DAMCHA encoder layers (pre-norm by default).

    Each layer is ``h + Attn(LN1(h))`` then ``h + FFN(LN2(h))`` (``norm_first``,
    the default), or ``LN1(h + Attn(h))`` then ``LN2(h + FFN(h))`` (post-norm,
    ``nn.TransformerEncoderLayer``'s and KerasHub's default); FFN is
    ``act(h W_in + b_in) W_out + b_out``.

    Args:
        attention: the (self-attention) layer config shared by every layer;
            needs context_dim == value_input_dim == output_dim == query_dim.
        num_layers: L, layers in the stack.
        ffn_dim: F, hidden size of each feed-forward block.
        share_metric: stack-wise sharing of the metric generator (W_A, b_A or
            W_u, b_u, U, V) by every layer; each layer keeps its own gate. The
            generator is then named ``shared.metric.*`` whatever num_layers is,
            1 included (the ports follow this name rule).
        norm_eps: LayerNorm epsilon.
        causal: causal self-attention in every layer.
        norm_first: pre-norm (True) or post-norm (False) layers.
        activation: "gelu" (exact, erf), "gelu_tanh" (the tanh
            approximation, JAX's default) or "relu".
        final_norm: a LayerNorm after the last layer (``final_norm.*`` params).
    """

    attention: DamchaConfig
    num_layers: int
    ffn_dim: int
    share_metric: bool = True
    norm_eps: float = 1e-5
    causal: bool = False
    norm_first: bool = True
    activation: str = "gelu"
    final_norm: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.attention, DamchaConfig):
            raise DamchaTypeError(
                invalid_argument("attention", "a DamchaConfig", f"attention={describe(self.attention)}")
            )
        a = self.attention
        if not (a.context_dim == a.value_input_dim == a.output_dim == a.query_dim):
            raise DamchaValueError(
                invalid_argument(
                    "attention",
                    "context_dim == value_input_dim == output_dim == query_dim "
                    "(an encoder layer is residual self-attention)",
                    f"query_dim={a.query_dim}, context_dim={a.context_dim}, "
                    f"value_input_dim={a.value_input_dim}, output_dim={a.output_dim}",
                )
            )
        object.__setattr__(self, "num_layers", check_int("num_layers", self.num_layers))
        object.__setattr__(self, "ffn_dim", check_int("ffn_dim", self.ffn_dim))
        for name in ("share_metric", "causal", "norm_first", "final_norm"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))
        check_choice("activation", self.activation, ACTIVATIONS)
        if not check_real("norm_eps", self.norm_eps) > 0:  # NaN fails too
            raise DamchaValueError(invalid_argument("norm_eps", "a number > 0", f"norm_eps={describe(self.norm_eps)}"))

    @property
    def width(self) -> int:
        """E, the residual stream's feature size."""
        return self.attention.query_dim

    def shared_names(self) -> list[str]:
        """Canonical layer names of the generator that ``share_metric`` stores once
        (``metric.<side>.kernel|bias`` and, for "lowrank", ``.u|.v``); gates are not shared."""
        a = self.attention
        return [f"metric.{side}.{leaf}" for side in a.metric_sides for leaf in _generator_leaves(a)]

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Stack parameter names and shapes.

        ``layers.{i}.attention.<canonical name>`` per layer, except that with
        ``share_metric`` the generator is stored once as
        ``shared.metric.<side>.<leaf>`` (gates stay per layer); then
        ``layers.{i}.norm1/norm2.scale|bias`` (E,), ``layers.{i}.ffn.in.kernel``
        (E, F), ``.ffn.in.bias`` (F,), ``.ffn.out.kernel`` (F, E), ``.ffn.out.bias``
        (E,), and ``final_norm.scale|bias`` (E,) with ``final_norm``.
        """
        E, F = self.width, self.ffn_dim
        layer = self.attention.param_shapes()
        shared_names = self.shared_names() if self.share_metric else []
        shapes: dict[str, tuple[int, ...]] = {SHARED + name: layer[name] for name in shared_names}
        for i in range(self.num_layers):
            pre = f"layers.{i}."
            shapes.update(
                {f"{pre}attention.{name}": shape for name, shape in layer.items() if name not in shared_names}
            )
            for norm in ("norm1", "norm2"):
                shapes[f"{pre}{norm}.scale"] = (E,)
                shapes[f"{pre}{norm}.bias"] = (E,)
            shapes[f"{pre}ffn.in.kernel"] = (E, F)
            shapes[f"{pre}ffn.in.bias"] = (F,)
            shapes[f"{pre}ffn.out.kernel"] = (F, E)
            shapes[f"{pre}ffn.out.bias"] = (E,)
        if self.final_norm:
            shapes["final_norm.scale"] = (E,)
            shapes["final_norm.bias"] = (E,)
        return shapes

    def layer_params(self, params: Mapping[str, np.ndarray], index: int) -> dict[str, np.ndarray]:
        """Canonical attention parameters of layer ``index`` (the shared generator filled in)."""
        index = check_int("index", index, minimum=0)
        if index >= self.num_layers:
            raise DamchaValueError(
                invalid_argument("index", f"an int < num_layers={self.num_layers}", f"index={index}")
            )
        shared = set(self.shared_names()) if self.share_metric else set()
        return {
            name: params[SHARED + name] if name in shared else params[f"layers.{index}.attention.{name}"]
            for name in self.attention.param_shapes()
        }


@dataclasses.dataclass(frozen=True)
class TokenModelConfig:
    """Embedding -> DAMCHA encoder -> per-token linear head.

    Params: ``embedding.table`` (V, E), ``position.table`` (P, E) (learned
    positions; inputs longer than P fail in the runtime), ``encoder.<stack
    name>``, ``head.kernel`` (E, C), ``head.bias`` (C,). Input token ids
    (B, N) int64, output logits (B, N, C).
    """

    encoder: EncoderConfig
    vocab_size: int
    max_len: int
    num_classes: int

    def __post_init__(self) -> None:
        if not isinstance(self.encoder, EncoderConfig):
            raise DamchaTypeError(invalid_argument("encoder", "an EncoderConfig", f"encoder={describe(self.encoder)}"))
        for name in ("vocab_size", "max_len", "num_classes"):
            object.__setattr__(self, name, check_int(name, getattr(self, name)))

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Model parameter names and shapes (the encoder's under ``encoder.``)."""
        E = self.encoder.width
        shapes: dict[str, tuple[int, ...]] = {
            "embedding.table": (self.vocab_size, E),
            "position.table": (self.max_len, E),
        }
        shapes.update({f"encoder.{k}": v for k, v in self.encoder.param_shapes().items()})
        shapes["head.kernel"] = (E, self.num_classes)
        shapes["head.bias"] = (self.num_classes,)
        return shapes


# ------------------------------------------------------------ params and checks


def validate_stack_params(params: Mapping[str, Any], config: EncoderConfig | TokenModelConfig) -> dict[str, np.ndarray]:
    """Names, shapes, dtypes and finiteness against ``config``; float64 copies
    (``validate_params``'s rules, on the stack's names)."""
    if not isinstance(config, (EncoderConfig, TokenModelConfig)):
        raise DamchaTypeError(
            invalid_argument("config", "an EncoderConfig or a TokenModelConfig", f"config={describe(config)}")
        )
    return validate_params(params, config)  # type: ignore[arg-type]  # duck-typed on param_shapes()


def init_encoder_params(config: EncoderConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Float64 stack params: each layer from ``init_params`` (gates 0),
    LayerNorm scale 1 / bias 0, Glorot-uniform FFN kernels, zero FFN biases."""
    if not isinstance(config, EncoderConfig):
        raise DamchaTypeError(invalid_argument("config", "an EncoderConfig", f"config={describe(config)}"))
    seed = check_seed("seed", seed, optional=False)
    rng = np.random.default_rng([seed, 7])
    params: dict[str, np.ndarray] = {}
    shared = set(config.shared_names()) if config.share_metric else set()
    for i in range(config.num_layers):
        for name, value in init_params(config.attention, seed + i).items():
            if name in shared:
                params.setdefault(SHARED + name, value)
            else:
                params[f"layers.{i}.attention.{name}"] = value
    E, F = config.width, config.ffn_dim
    limit = math.sqrt(6.0 / (E + F))
    for i in range(config.num_layers):
        pre = f"layers.{i}."
        for norm in ("norm1", "norm2"):
            params[f"{pre}{norm}.scale"] = np.ones(E)
            params[f"{pre}{norm}.bias"] = np.zeros(E)
        params[f"{pre}ffn.in.kernel"] = rng.uniform(-limit, limit, (E, F))
        params[f"{pre}ffn.in.bias"] = np.zeros(F)
        params[f"{pre}ffn.out.kernel"] = rng.uniform(-limit, limit, (F, E))
        params[f"{pre}ffn.out.bias"] = np.zeros(E)
    params["final_norm.scale"] = np.ones(E)
    params["final_norm.bias"] = np.zeros(E)
    return {name: params[name] for name in config.param_shapes()}  # final_norm.* only where configured


def init_token_model_params(config: TokenModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Float64 token-model params: N(0, 1) embeddings, N(0, 0.1) positions, the
    encoder from ``init_encoder_params``, a Glorot-uniform head with zero bias."""
    if not isinstance(config, TokenModelConfig):
        raise DamchaTypeError(invalid_argument("config", "a TokenModelConfig", f"config={describe(config)}"))
    seed = check_seed("seed", seed, optional=False)
    rng = np.random.default_rng([seed, 8])
    E, C = config.encoder.width, config.num_classes
    params = {
        "embedding.table": rng.normal(0.0, 1.0, (config.vocab_size, E)),
        "position.table": rng.normal(0.0, 0.1, (config.max_len, E)),
    }
    params.update({f"encoder.{k}": v for k, v in init_encoder_params(config.encoder, seed).items()})
    limit = math.sqrt(6.0 / (E + C))
    params["head.kernel"] = rng.uniform(-limit, limit, (E, C))
    params["head.bias"] = np.zeros(C)
    return params


# ------------------------------------------------------------ NumPy reference

_erf = np.vectorize(math.erf, otypes=[np.float64])


def layer_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis (biased variance, as every framework's)."""
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + bias


ACTIVATION_FNS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
    "relu": lambda x: np.maximum(x, 0.0),
}


def encoder_forward(
    params: Mapping[str, Any], config: EncoderConfig, x: Any, *, mask: Any = None, return_weights: bool = False
) -> np.ndarray | tuple[np.ndarray, list[np.ndarray]]:
    """The stack in float64 NumPy, each attention by ``damcha_attention``.

    Args:
        params: stack parameters (``config.param_shapes()``).
        config: the ``EncoderConfig``.
        x: tokens (B, N, E).
        mask: as for one layer (True = may attend, broadcastable to
            (B, H, N, N)), used by every layer.
        return_weights: also return each layer's attention probabilities
            (B, H, N, N), a list of L arrays.

    Returns:
        h (B, N, E) float64, or ``(h, weights)`` with ``return_weights``.
    """
    if not isinstance(config, EncoderConfig):
        raise DamchaTypeError(invalid_argument("config", "an EncoderConfig", f"config={describe(config)}"))
    return_weights = check_bool("return_weights", return_weights)
    p = validate_stack_params(params, config)
    # Tokens as damcha_attention takes them (real floating, (B, N, E)), checked
    # here so that a mistake is named `x`, not a LayerNorm broadcast error.
    h = _as_float64("x", x)
    check_token_shape("x", h.shape, config.attention.query_dim, "config.attention.query_dim")
    eps, act = config.norm_eps, ACTIVATION_FNS[config.activation]
    weights = []

    def norm(t: np.ndarray, name: str) -> np.ndarray:
        return layer_norm(t, p[f"{name}.scale"], p[f"{name}.bias"], eps)

    for i in range(config.num_layers):
        pre = f"layers.{i}."
        a_in = norm(h, f"{pre}norm1") if config.norm_first else h
        out = damcha_attention(
            config.layer_params(p, i),
            config.attention,
            a_in,
            mask=mask,
            causal=config.causal,
            return_weights=return_weights,
        )
        if return_weights:
            out, w = out
            weights.append(w)
        h = h + out
        if not config.norm_first:
            h = norm(h, f"{pre}norm1")
        f_in = norm(h, f"{pre}norm2") if config.norm_first else h
        hidden = act(f_in @ p[f"{pre}ffn.in.kernel"] + p[f"{pre}ffn.in.bias"])
        h = h + hidden @ p[f"{pre}ffn.out.kernel"] + p[f"{pre}ffn.out.bias"]
        if not config.norm_first:
            h = norm(h, f"{pre}norm2")
    h = norm(h, "final_norm") if config.final_norm else h
    return (h, weights) if return_weights else h


def check_tokens(tokens: Any, config: TokenModelConfig, *, offset: int = 0) -> np.ndarray:
    """Integer ids (B, N) inside the vocabulary whose positions offset .. offset+N-1 fit the position table."""
    array = np.asarray(tokens)
    if not np.issubdtype(array.dtype, np.integer) or array.ndim != 2:
        raise DamchaValueError(invalid_argument("tokens", "integer ids of shape (B, N)", f"tokens={describe(tokens)}"))
    if offset + array.shape[1] > config.max_len:
        raise DamchaValueError(
            invalid_argument("tokens", f"at most max_len={config.max_len} positions", f"tokens.shape={array.shape}")
        )
    if array.size and not (array.min() >= 0 and array.max() < config.vocab_size):
        # NumPy indexing would read -1 as the last row: a silent wrap, as Gather's.
        raise DamchaValueError(
            invalid_argument(
                "tokens",
                f"ids in [0, {config.vocab_size}) (the vocabulary)",
                f"tokens in [{array.min()}, {array.max()}]",
            )
        )
    return array


def token_model_forward(
    params: Mapping[str, Any], config: TokenModelConfig, tokens: Any, *, mask: Any = None, return_weights: bool = False
) -> np.ndarray | tuple[np.ndarray, list[np.ndarray]]:
    """Logits (B, N, C) of the token model for int token ids (B, N) (and each
    layer's attention weights with ``return_weights``, as ``encoder_forward``)."""
    if not isinstance(config, TokenModelConfig):
        raise DamchaTypeError(invalid_argument("config", "a TokenModelConfig", f"config={describe(config)}"))
    p = validate_stack_params(params, config)
    tokens = check_tokens(tokens, config)
    x = p["embedding.table"][tokens] + p["position.table"][: tokens.shape[1]]
    enc = {k[len("encoder.") :]: v for k, v in p.items() if k.startswith("encoder.")}
    out = encoder_forward(enc, config.encoder, x, mask=mask, return_weights=return_weights)
    if return_weights:
        h, weights = out
        return h @ p["head.kernel"] + p["head.bias"], weights
    return out @ p["head.kernel"] + p["head.bias"]
