"""Transformer layers and stacks with DAMCHA, with stack-wise metric sharing.

The layers subclass ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``
and swap their attention modules, so norms, feed-forward, dropout and mask
handling are torch's own; the encoder layer's ReLU or GELU runs in place when
no gradient is recorded (torch's native MHA encoder kernel, which DAMCHA
cannot use, never holds the feed-forward's intermediates either).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

import damcha_core as dc
import torch
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe
from damcha_core._validators import unknown_fields
from torch import Tensor, nn
from torch.nn import functional as F

from . import _functional as fn
from ._canonical import encoder_load_canonical, encoder_to_canonical
from ._generator import MetricGenerator, check_param_dtype
from ._layer import DamchaAttention

__all__ = [
    "DamchaTransformerDecoder",
    "DamchaTransformerDecoderLayer",
    "DamchaTransformerEncoder",
    "DamchaTransformerEncoderLayer",
    "build_decoder",
    "build_encoder",
    "metric_penalty",
    "shard_stack",
]

_ATTENTION_KEYS = ("metric", "metric_rank", "coupling", "num_kv_heads", "key_dim", "value_dim", "scale", "recompute")


# The blocks' own argument names, for the attention layers' errors.
_BLOCK_NAMES = {"query_dim": "d_model", "num_heads": "nhead"}


def _attention_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(kwargs) - set(_ATTENTION_KEYS))
    if unknown:
        # A TypeError, as Python raises for any unexpected keyword argument.
        raise DamchaTypeError(
            unknown_fields(unknown, _ATTENTION_KEYS, "DAMCHA attention arguments", "keyword argument")
        )
    return kwargs


def _torch_layer_args(
    d_model: Any,
    nhead: Any,
    dim_feedforward: Any,
    dropout: Any,
    activation: Any,
    layer_norm_eps: Any,
    batch_first: Any,
    norm_first: Any,
    bias: Any,
    device: Any,
    dtype: Any,
    key_dim: Any,
) -> tuple[Any, ...]:
    """nn.Transformer*Layer's arguments, checked with their names before torch
    builds anything (torch would raise an AssertionError from the
    nn.MultiheadAttention it builds first, or a RuntimeError from deep inside).
    Returns the positional arguments of torch's constructor (d_model, nhead,
    ..., device, dtype), with the nhead torch is to use (see below)."""
    E, H = dc.check_int("d_model", d_model), dc.check_int("nhead", nhead)
    if key_dim is None and E % H:
        raise DamchaValueError(
            dc.invalid_argument(
                "d_model", "a multiple of `nhead` when `key_dim` is not given", f"d_model={E}, nhead={H}"
            )
        )
    dc.check_int("dim_feedforward", dim_feedforward)
    dc.check_rate("dropout", dropout)
    if not (callable(activation) or activation in ("relu", "gelu")):
        raise DamchaValueError(
            dc.invalid_argument("activation", "'relu', 'gelu' or a callable", f"activation={describe(activation)}")
        )
    dc.check_finite_nonneg("layer_norm_eps", layer_norm_eps)
    for name, value in (("batch_first", batch_first), ("norm_first", norm_first), ("bias", bias)):
        dc.check_bool(name, value)
    check_param_dtype(dtype)
    # torch's layer builds an nn.MultiheadAttention(d_model, nhead) that is
    # replaced at once; with key_dim set, d_model need not divide by nhead, so
    # give torch one head (it only asserts divisibility and throws it away).
    torch_heads = H if E % H == 0 else 1
    return (
        d_model,  # as given (the DAMCHA layers get it as given too)
        torch_heads,
        dim_feedforward,
        dropout,
        activation,
        layer_norm_eps,
        batch_first,
        norm_first,
        bias,
        device,
        dtype,
    )


_MASK_KINDS = "boolean (True = masked out) or floating (additive)"


def _call_checks(base: type[nn.Module]) -> tuple[tuple[str, ...], dict[str, str]]:
    """(the parameter names of ``base.forward`` after self, name -> "flag" or
    "mask" for the arguments ``_leaf_forward`` checks)."""
    names = tuple(inspect.signature(base.forward).parameters)[1:]
    kinds = {n: "flag" for n in names if n.endswith("is_causal")}
    kinds.update((n, "mask") for n in names if n.endswith("mask"))
    return names, kinds


def _checked(name: str, kind: str, value: Any) -> Any:
    """A block's flag as a Python bool (the layer's rule: a bool or a NumPy
    bool; None, torch's "detect it", passes), or its mask, refused unless
    boolean or floating, naming the block's own argument."""
    if kind == "flag":
        return value if value is None or value.__class__ is bool else dc.check_bool(name, value)
    if isinstance(value, Tensor) and value.dtype != torch.bool and not value.is_floating_point():
        raise dc.mask_dtype_error(value, name, expected=_MASK_KINDS)
    return value


# The blocks' masks: attention masks as (its queries' tokens, its keys' tokens),
# key padding masks by the tokens they pad.
_ATTN_MASKS = {"src_mask": ("src", "src"), "mask": ("src", "src"), "tgt_mask": ("tgt", "tgt")}
_ATTN_MASKS["memory_mask"] = ("tgt", "memory")
_PADDING_MASKS = {"src_key_padding_mask": "src", "tgt_key_padding_mask": "tgt", "memory_key_padding_mask": "memory"}


def _unwrapped(attention: nn.Module) -> Any:
    """The attention layer a PEFT wrapper holds (``target_parameters``' ParamWrapper
    replaces ``self_attn`` and runs the layer as its ``base_layer``), else itself."""
    base = getattr(attention, "get_base_layer", None)
    return base() if callable(base) else attention


def _check_block_shapes(block: nn.Module, given: Mapping[str, Any]) -> None:
    """The tokens' and masks' shapes, checked with the block's argument names
    (``src``, ``memory``, ``src_key_padding_mask``, ...) before torch's forward
    runs: its norms would fail first on the wrong features (norm_first), and
    the attention layers name their own arguments (``query``, ``attn_mask``).
    The layouts are the attention layer's (a 2-D, (B*H, N, M) or broadcastable
    (B, H, N, M) attention mask; (B, M) padding, (M,) unbatched)."""
    layer: Any = block.layers[0] if isinstance(block, (nn.TransformerEncoder, nn.TransformerDecoder)) else block
    attention: DamchaAttention = _unwrapped(layer.self_attn)
    E, H, batch_first = int(attention.embed_dim), int(attention.num_heads), bool(attention.batch_first)
    tokens: dict[str, Tensor] = {}
    for name in ("src", "tgt", "memory"):
        t = given.get(name)
        if name not in given or not isinstance(t, Tensor):
            if name in given and not isinstance(t, torch.fx.Proxy):
                raise dc.float_dtype_error(name, t)
            continue
        if not t.is_floating_point():
            raise dc.float_dtype_error(name, t)
        if t.is_nested:
            continue  # the attention layers refuse nested tensors, naming them
        layout = "(B, L, E)" if batch_first else "(L, B, E)"
        if t.dim() not in (2, 3):
            raise DamchaValueError(
                dc.invalid_argument(
                    name, f"a batched {layout} or unbatched (L, E) tensor", f"{name}.shape={tuple(t.shape)}"
                )
            )
        features = E if name != "memory" else getattr(_unwrapped(layer.multihead_attn), "kdim", E)
        if t.shape[-1] != features:
            size = "d_model" if features == E else "the cross-attention's kdim"
            raise DamchaValueError(
                dc.invalid_argument(name, f"{features} features ({size})", f"{name}.shape={tuple(t.shape)}")
            )
        tokens[name] = t
    if "tgt" in tokens and "memory" in tokens:
        tgt, memory = tokens["tgt"], tokens["memory"]
        axis = 0 if batch_first else 1
        if tgt.dim() != memory.dim() or (tgt.dim() == 3 and tgt.shape[axis] != memory.shape[axis]):
            raise DamchaValueError(
                dc.invalid_argument(
                    "memory",
                    "the batch size of `tgt` (both batched, or both unbatched)",
                    f"tgt.shape={tuple(tgt.shape)}, memory.shape={tuple(memory.shape)}",
                )
            )

    def length_and_batch(name: str) -> tuple[int, int | None]:
        t = tokens[name]
        if t.dim() == 2:
            return t.shape[0], None
        return (t.shape[1], t.shape[0]) if batch_first else (t.shape[0], t.shape[1])

    for name, of in _PADDING_MASKS.items():
        mask = given.get(name)
        if isinstance(mask, Tensor) and of in tokens:
            M, B = length_and_batch(of)
            expected = (M,) if B is None else (B, M)
            if tuple(mask.shape) != expected:
                what = (
                    f"shape (M,) = {expected} with an unbatched `{of}`" if B is None else f"shape (B, M) = {expected}"
                )
                raise DamchaValueError(
                    dc.invalid_argument(
                        name, what, f"{name}.shape={tuple(mask.shape)}, {of}.shape={tuple(tokens[of].shape)}"
                    )
                )
    for name, (queries, keys) in _ATTN_MASKS.items():
        mask = given.get(name)
        if not (isinstance(mask, Tensor) and queries in tokens and keys in tokens):
            continue
        (N, B), M = length_and_batch(queries), length_and_batch(keys)[0]
        B = 1 if B is None else B
        shape = tuple(mask.shape)
        if mask.dim() == 3:
            ok, what = shape == (B * H, N, M), f"shape (B*H, N, M) = {(B * H, N, M)} for a 3-D mask"
        else:
            target = (B, H, N, M)
            ok = mask.dim() in (2, 4) and all(s in (1, t) for s, t in zip(shape[::-1], target[::-1]))
            what = f"shape (N, M) = {(N, M)}, (B*H, N, M) = {(B * H, N, M)} or one broadcastable to (B, H, N, M) = {target}"
        if not ok:
            raise DamchaValueError(
                dc.invalid_argument(
                    name,
                    what,
                    f"{name}.shape={shape}, {queries}.shape={tuple(tokens[queries].shape)}"
                    + ("" if keys == queries else f", {keys}.shape={tuple(tokens[keys].shape)}"),
                )
            )


def _leaf_forward(base: type[nn.Module]) -> Callable[..., Any]:
    """``base.forward`` (same signature and docstring), except that torch.fx
    records the call as one node, as it records ``base`` itself (see
    ``fn.traced_call``), and that the causal flags, masks and shapes are
    checked first with the layer's rules, under the block's own argument
    names: torch's forward tests ``is_causal is True`` (a NumPy ``True`` or a
    ``1`` would silently mean "not causal") and asserts a mask's dtype (a bare
    ``AssertionError``, gone under ``python -O``)."""
    names, kinds = _call_checks(base)

    @functools.wraps(base.forward)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if len(args) > 1 or kwargs:
            args = tuple(
                _checked(names[i], kinds[names[i]], a) if i < len(names) and names[i] in kinds else a
                for i, a in enumerate(args)
            )
            kwargs = {k: _checked(k, kinds[k], v) if k in kinds else v for k, v in kwargs.items()}
        traced = fn.traced_call(self, args, kwargs)
        if traced is not None:
            return traced
        _check_block_shapes(self, {**dict(zip(names, args)), **kwargs})
        return base.forward(self, *args, **kwargs)

    return forward


class DamchaTransformerEncoderLayer(nn.TransformerEncoderLayer):
    """``nn.TransformerEncoderLayer`` whose ``self_attn`` is a ``DamchaAttention``.

    Takes torch's arguments, plus ``metric_generator`` (share one across
    layers) and DAMCHA attention kwargs (metric, metric_rank, coupling,
    num_kv_heads, key_dim, value_dim, scale, recompute).
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        metric_generator: MetricGenerator | dict[str, MetricGenerator] | None = None,
        **attention: Any,
    ) -> None:
        attention = _attention_kwargs(attention)
        torch_args = _torch_layer_args(
            d_model,
            nhead,
            dim_feedforward,
            dropout,
            activation,
            layer_norm_eps,
            batch_first,
            norm_first,
            bias,
            device,
            dtype,
            attention.get("key_dim"),
        )
        super().__init__(*torch_args)
        self.self_attn = DamchaAttention(  # type: ignore[assignment]
            d_model,
            nhead,
            dropout=dropout,
            bias=bias,
            batch_first=batch_first,
            device=device,
            dtype=dtype,
            metric_generator=metric_generator,
            _arg_names=_BLOCK_NAMES,
            **attention,
        )

    forward = _leaf_forward(nn.TransformerEncoderLayer)

    def _ff_block(self, x: Tensor) -> Tensor:
        # With nn.MultiheadAttention, torch runs an encoder layer in inference as
        # one native kernel that never holds linear1's output and its activation's
        # at once; with DAMCHA the layer takes this Python path, whose
        # out-of-place activation kept both (a 6-layer encoder's inference peak at
        # N=256, B=4, FFN 2048: 1.23x the MHA model's; in place 0.89x). Recording
        # gradients, the activation runs as torch's: GELU's backward reads its input.
        # Only over a plain nn.Linear's fresh output that no hook has seen: a hook
        # keeping it, or a linear1 whose output aliases its input (a subclass, a
        # wrapper), would see it overwritten.
        in_place = None
        if not torch.is_grad_enabled() and type(self.linear1) is nn.Linear and fn.no_hooks(self.linear1):
            in_place = _in_place_activation(self.activation)
        if in_place is None:
            return super()._ff_block(x)
        return self.dropout2(self.linear2(self.dropout(in_place(self.linear1(x)))))


def _in_place_activation(activation: Any) -> Callable[[Tensor], Tensor] | None:
    """The in-place form of an encoder layer's ReLU or GELU (torch's own
    activations, as functions or plain modules without hooks: a hooked module
    stays a module call), else None."""
    if isinstance(activation, nn.Module):
        if type(activation) not in (nn.ReLU, nn.GELU) or not fn.no_hooks(activation):
            return None
        if type(activation) is nn.GELU:
            return functools.partial(torch.ops.aten.gelu_, approximate=activation.approximate)
        return torch.relu_
    if activation is F.relu:
        return torch.relu_
    if activation is F.gelu:
        return torch.ops.aten.gelu_
    return None


class DamchaTransformerDecoderLayer(nn.TransformerDecoderLayer):
    """``nn.TransformerDecoderLayer`` with DAMCHA self- and cross-attention.

    ``metric_generator`` is shared by self-attention, ``cross_metric_generator``
    by cross-attention (queries from the target, keys from the memory);
    ``cross_coupling`` defaults to the self-attention coupling.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        metric_generator: MetricGenerator | dict[str, MetricGenerator] | None = None,
        cross_metric_generator: MetricGenerator | dict[str, MetricGenerator] | None = None,
        cross_coupling: str | None = None,
        **attention: Any,
    ) -> None:
        attention = _attention_kwargs(attention)
        torch_args = _torch_layer_args(
            d_model,
            nhead,
            dim_feedforward,
            dropout,
            activation,
            layer_norm_eps,
            batch_first,
            norm_first,
            bias,
            device,
            dtype,
            attention.get("key_dim"),
        )
        super().__init__(*torch_args)
        common: dict[str, Any] = dict(dropout=dropout, bias=bias, batch_first=batch_first, device=device, dtype=dtype)
        self.self_attn = DamchaAttention(  # type: ignore[assignment]
            d_model, nhead, metric_generator=metric_generator, _arg_names=_BLOCK_NAMES, **common, **attention
        )
        cross = dict(attention)
        names = dict(_BLOCK_NAMES, metric_generator="cross_metric_generator")
        if cross_coupling is not None:
            cross["coupling"] = cross_coupling
            names["coupling"] = "cross_coupling"
        self.multihead_attn = DamchaAttention(  # type: ignore[assignment]
            d_model, nhead, metric_generator=cross_metric_generator, _arg_names=names, **common, **cross
        )

    forward = _leaf_forward(nn.TransformerDecoderLayer)


def _check_num_layers(num_layers: Any) -> None:
    # torch's stacks index layers[0] (and sharing points every layer at it). The
    # core's rule: 2.0 is a DamchaNotIntegerError, "2" a DamchaTypeError, 0 a DamchaValueError.
    dc.check_int("num_layers", num_layers)


def _check_norm(norm: Any) -> None:
    if norm is not None and not isinstance(norm, nn.Module):
        raise DamchaTypeError(
            dc.invalid_argument("norm", "a torch.nn.Module (e.g. nn.LayerNorm) or None", f"norm={describe(norm)}")
        )


def _share(layers: nn.ModuleList, attr: str) -> nn.ModuleDict:
    """Make every layer's ``attr`` attention use layer 0's generators (gates stay
    per layer); returns them, for the stack to register as its own children."""
    first = getattr(layers[0], attr)
    for layer in layers[1:]:
        attn = getattr(layer, attr)
        for side, gen in first.metric_generators.items():
            attn.metric_generators[side] = gen
    # The stack holds the shared generators directly too: then they belong to
    # the stack, not to one layer, in module-tree walks such as FSDP's (see
    # shard_stack), and their state_dict entries appear under this name as well.
    return nn.ModuleDict(dict(first.metric_generators.items()))


class DamchaTransformerEncoder(nn.TransformerEncoder):
    """``nn.TransformerEncoder`` of DAMCHA layers; ``share_metric=True`` ties the
    metric generator of every layer to the first one's (stack-wise sharing)."""

    def __init__(
        self,
        encoder_layer: nn.TransformerEncoderLayer,
        num_layers: int,
        norm: nn.Module | None = None,
        *,
        share_metric: bool = True,
    ) -> None:
        if not isinstance(getattr(encoder_layer, "self_attn", None), DamchaAttention):
            raise DamchaTypeError(
                dc.invalid_argument(
                    "encoder_layer",
                    "a layer with a DamchaAttention self_attn (e.g. DamchaTransformerEncoderLayer)",
                    f"encoder_layer={describe(encoder_layer)}",
                )
            )
        _check_num_layers(num_layers)
        _check_norm(norm)
        # Nested tensors are MHA's fused inference path; DAMCHA never takes it.
        super().__init__(encoder_layer, num_layers, norm=norm, enable_nested_tensor=False)
        self.share_metric = dc.check_bool("share_metric", share_metric)
        self.metric_generators = _share(self.layers, "self_attn") if self.share_metric else nn.ModuleDict()

    forward = _leaf_forward(nn.TransformerEncoder)

    # ------------------------------------------------------- canonical I/O

    def to_canonical(self, *, causal: bool = False) -> tuple[dict[str, np.ndarray], dc.EncoderConfig]:
        """The stack in damcha_core's format: ``(params, EncoderConfig)``, float64.

        ``causal`` is recorded in the config (torch passes it per call, as
        ``is_causal``). A shared generator is stored once. The weights are
        the effective ones, the ones the forward uses (under a weight tool,
        or PEFT LoRA, as the layer's ``to_canonical`` reads them). Raises a
        DamchaValueError naming what does not fit the format (mixed
        activations, norms or attention configs, an activation other than
        ReLU/GELU, a feed-forward layer or LayerNorm without its weight or
        bias, a quantized feed-forward layer).
        """
        return encoder_to_canonical(self, causal=causal)

    def load_canonical(self, params: Mapping[str, Any]) -> DamchaTransformerEncoder:
        """Copy stack params (validated against this stack's config) in; returns self.

        Under a weight tool the values go through the tool, as the layer's ``load_canonical``
        writes them; a PEFT layer is refused by name (``merge_and_unload()`` first). Everything
        is checked before anything is written: a refused load leaves the stack as it was.
        """
        return encoder_load_canonical(self, params)

    @classmethod
    def from_canonical(
        cls,
        params: Mapping[str, Any],
        config: dc.EncoderConfig,
        *,
        batch_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        recompute: bool = True,
    ) -> DamchaTransformerEncoder:
        """An encoder built for ``config`` (a ``damcha_core.EncoderConfig``) holding ``params``.

        The feed-forward and norms have biases, as the stack format stores them; the attention has
        them where ``config.attention.use_bias`` says (False: none, as in the other ports).
        """
        if not isinstance(config, dc.EncoderConfig):
            raise DamchaTypeError(
                dc.invalid_argument("config", "a damcha_core.EncoderConfig", f"config={describe(config)}")
            )
        a = config.attention
        activation: Any = nn.GELU(approximate="tanh") if config.activation == "gelu_tanh" else config.activation
        layer = DamchaTransformerEncoderLayer(
            a.query_dim,
            a.num_heads,
            config.ffn_dim,
            a.dropout,
            activation,
            config.norm_eps,
            batch_first,
            config.norm_first,
            True,  # the format's feed-forward and norms always have biases; the attention's follow use_bias
            device,
            dtype,
            key_dim=a.key_dim,
            value_dim=a.value_dim,
            num_kv_heads=a.num_kv_heads,
            metric=a.metric,
            metric_rank=a.metric_rank,
            coupling=a.coupling,
            scale=a.scale,
            recompute=recompute,
        )
        if not a.use_bias:  # torch's bias=False would take the feed-forward's and norms' too
            layer.self_attn = DamchaAttention._from_config(  # type: ignore[assignment]
                a, batch_first=batch_first, device=device, dtype=dtype, recompute=recompute
            )
        norm = nn.LayerNorm(a.query_dim, eps=config.norm_eps, device=device, dtype=dtype) if config.final_norm else None
        return cls(layer, config.num_layers, norm, share_metric=config.share_metric).load_canonical(params)


class DamchaTransformerDecoder(nn.TransformerDecoder):
    """``nn.TransformerDecoder`` of DAMCHA layers; ``share_metric=True`` shares the
    self-attention generator across layers, and the cross-attention one."""

    def __init__(
        self,
        decoder_layer: nn.TransformerDecoderLayer,
        num_layers: int,
        norm: nn.Module | None = None,
        *,
        share_metric: bool = True,
    ) -> None:
        if not isinstance(getattr(decoder_layer, "self_attn", None), DamchaAttention):
            raise DamchaTypeError(
                dc.invalid_argument(
                    "decoder_layer",
                    "a layer with DamchaAttention attention (e.g. DamchaTransformerDecoderLayer)",
                    f"decoder_layer={describe(decoder_layer)}",
                )
            )
        _check_num_layers(num_layers)
        _check_norm(norm)
        super().__init__(decoder_layer, num_layers, norm=norm)
        self.share_metric = dc.check_bool("share_metric", share_metric)
        self.metric_generators = _share(self.layers, "self_attn") if self.share_metric else nn.ModuleDict()
        cross = self.share_metric and isinstance(getattr(decoder_layer, "multihead_attn", None), DamchaAttention)
        self.cross_metric_generators = _share(self.layers, "multihead_attn") if cross else nn.ModuleDict()

    forward = _leaf_forward(nn.TransformerDecoder)


def build_encoder(
    d_model: int,
    nhead: int,
    num_layers: int,
    *,
    dim_feedforward: int = 2048,
    dropout: float = 0.1,
    activation: str | Callable[[Tensor], Tensor] = "relu",
    batch_first: bool = True,
    norm_first: bool = False,
    final_norm: bool = False,
    share_metric: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **attention: Any,
) -> DamchaTransformerEncoder:
    """A stack of ``num_layers`` DAMCHA encoder layers (``batch_first`` by default).

    With ``share_metric=True`` the stack holds one generator (E*H^2 + H^2
    parameters for metric "heads", tied coupling) plus H gates per layer;
    with False, every layer has its own generator.
    """
    _check_num_layers(num_layers)
    dc.check_bool("final_norm", final_norm)
    dc.check_bool("share_metric", share_metric)
    layer = DamchaTransformerEncoderLayer(
        d_model,
        nhead,
        dim_feedforward,
        dropout,
        activation,
        batch_first=batch_first,
        norm_first=norm_first,
        device=device,
        dtype=dtype,
        **attention,
    )
    norm = nn.LayerNorm(d_model, device=device, dtype=dtype) if final_norm else None
    return DamchaTransformerEncoder(layer, num_layers, norm, share_metric=share_metric)


def build_decoder(
    d_model: int,
    nhead: int,
    num_layers: int,
    *,
    dim_feedforward: int = 2048,
    dropout: float = 0.1,
    activation: str | Callable[[Tensor], Tensor] = "relu",
    batch_first: bool = True,
    norm_first: bool = False,
    final_norm: bool = False,
    share_metric: bool = True,
    cross_coupling: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **attention: Any,
) -> DamchaTransformerDecoder:
    """A stack of ``num_layers`` DAMCHA decoder layers (self- and cross-attention)."""
    _check_num_layers(num_layers)
    dc.check_bool("final_norm", final_norm)
    dc.check_bool("share_metric", share_metric)
    layer = DamchaTransformerDecoderLayer(
        d_model,
        nhead,
        dim_feedforward,
        dropout,
        activation,
        batch_first=batch_first,
        norm_first=norm_first,
        device=device,
        dtype=dtype,
        cross_coupling=cross_coupling,
        **attention,
    )
    norm = nn.LayerNorm(d_model, device=device, dtype=dtype) if final_norm else None
    return DamchaTransformerDecoder(layer, num_layers, norm, share_metric=share_metric)


def shard_stack(stack: nn.Module, **fsdp_kwargs: Any) -> nn.Module:
    """Apply FSDP2 (``torch.distributed.fsdp.fully_shard``) per layer, then to the stack.

    Per-layer sharding is the usual FSDP recipe, but a generator shared by all
    layers must not belong to any one layer's unit: the next layer would find
    it already sharded. Here each layer's unit ignores the shared generators
    and the stack's own unit (which holds them, ``stack.metric_generators``)
    shards them once and all-gathers them for the whole forward, so their
    gradients from every layer are reduced together. Without sharing this is
    plain per-layer ``fully_shard``.

    Args:
        stack: a ``DamchaTransformerEncoder``/``DamchaTransformerDecoder``
            (``build_encoder``/``build_decoder``).
        **fsdp_kwargs: passed to every ``fully_shard`` call (``mesh``,
            ``reshard_after_forward``, ``mp_policy``, ...).

    Returns:
        ``stack``, sharded in place (build the optimizer afterwards).
    """
    from torch.distributed.fsdp import fully_shard

    if not isinstance(stack, (DamchaTransformerEncoder, DamchaTransformerDecoder)):
        raise DamchaTypeError(
            dc.invalid_argument(
                "stack",
                "a DamchaTransformerEncoder or DamchaTransformerDecoder (build_encoder/build_decoder)",
                f"stack={describe(stack)}",
            )
        )
    if "ignored_params" in fsdp_kwargs:
        raise DamchaValueError(
            dc.invalid_argument(
                "ignored_params", "no ignored_params: shard_stack sets them (the shared generators)", "ignored_params"
            )
        )
    shared = set(stack.metric_generators.parameters())
    shared |= set(getattr(stack, "cross_metric_generators", nn.ModuleDict()).parameters())
    for layer in stack.layers:
        fully_shard(layer, ignored_params=shared or None, **fsdp_kwargs)
    fully_shard(stack, **fsdp_kwargs)
    return stack


def metric_penalty(
    model: nn.Module | Mapping[str, Tensor],
    config: DamchaConfig | None = None,
    query: Tensor | None = None,
    context: Tensor | None = None,
) -> Tensor:
    """The metric penalty of a model's layers, or of canonical params (the reference's form).

    ``metric_penalty(model)``: the mean of every ``DamchaAttention`` (and layer converted by ``convert``) in
    ``model`` over its last forward. Set ``track_metric_penalty = True`` on the
    layers (``model.apply(...)`` or this function's caller) before the
    forward; layers that did not record one are skipped. Returns a 0-d tensor
    (0.0, on the model's device, when none recorded).

    ``metric_penalty(params, config, query, context=None)``: as
    ``damcha_core.metric_penalty``, on canonical params as torch tensors
    (differentiable): mean over adapted roles of mean_t ||L(t) - I||_F^2 / (S*d).
    """
    if isinstance(model, Mapping):
        return fn.metric_penalty(model, config, query, context)  # type: ignore[arg-type]
    if not isinstance(model, nn.Module):
        raise DamchaTypeError(
            dc.invalid_argument(
                "model", "a torch.nn.Module (or canonical params with a config)", f"model={describe(model)}"
            )
        )
    if config is not None or query is not None or context is not None:
        raise DamchaValueError(
            dc.invalid_argument(
                "config" if config is not None else ("query" if query is not None else "context"),
                "None with a model (`config`, `query` and `context` are for canonical params)",
                f"model={describe(model)}, config={describe(config)}",
            )
        )
    # Any DAMCHA layer that records one: DamchaAttention, and the maps of
    # layers converted by damcha_torch.convert (DamchaMaps).
    values = [v for m in model.modules() if isinstance(v := getattr(m, "last_metric_penalty", None), Tensor)]
    if not values:
        # On the model's device, so `loss + coef * metric_penalty(model)` never mixes devices.
        ref = next(model.parameters(), None)
        return torch.zeros(
            (),
            device=None if ref is None else ref.device,
            dtype=None if ref is None or not ref.is_floating_point() else ref.dtype,
        )
    return torch.stack(values).mean()
