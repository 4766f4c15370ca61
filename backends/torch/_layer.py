"""DamchaAttention: a drop-in for ``nn.MultiheadAttention`` computing DAMCHA v1.

The module holds the parameters (in nn.MultiheadAttention's layout), checks
its arguments with torch's names and conventions, converts torch's masks to
the functional core's (``_masks``), and hands the math to ``_functional``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import damcha_core as dc
import torch
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, describe
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from . import _functional as fn
from ._cache import DamchaKVCache
from ._canonical import CanonicalIO, check_config_rebuilt
from ._generator import MetricGenerator, check_param_dtype
from ._masks import merge_masks
from ._weight_tools import write_initial

__all__ = ["DamchaAttention"]


_SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight")


class _SeparateWeight:
    """``DamchaAttention.q_proj_weight`` (``k_``, ``v_``): the registered
    parameter, else a view of the packed ``in_proj_weight`` (of its effective
    value when that is parametrized or pruned).

    A non-data descriptor (no ``__set__``/``__delete__``), not a property:
    torch's weight tools must see these names as they see MHA's parameters.
    Pruning and the old ``weight_norm`` set the effective tensor as an instance
    attribute, which outranks a non-data descriptor (a property's missing
    setter or deleter refuses it), and parametrize puts its own property on a
    subclass. With neither a parameter nor a packed weight to view it raises
    AttributeError, so ``hasattr`` is False where a tool has just removed the
    parameter: ``register_parameter``, ``parametrize`` and ``prune.remove``
    check that before registering the name again.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.name = _SEPARATE[index]

    def __get__(self, layer: Any, owner: type | None = None) -> Any:
        if layer is None:
            return self
        own = layer._parameters.get(self.name)
        if own is not None:
            return own
        packed = fn.param_entry(layer, "in_proj_weight")
        if packed is None:
            # Python then asks nn.Module.__getattr__, whose error is MHA's.
            raise AttributeError(self.name)
        return packed.split(layer._sizes)[self.index]


def _check_float(name: str, value: Any) -> None:
    if not isinstance(value, Tensor) or not value.is_floating_point():
        raise dc.float_dtype_error(name, value)


def _add_batch_dim(
    query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Any
) -> tuple[Tensor, Tensor, Tensor, Any]:
    """Unbatched inputs, as nn.MultiheadAttention takes them: query (N, E_q),
    key/value (M, E_kv), key_padding_mask (M,); returned batch-first with B = 1."""
    if key.dim() != 2 or value.dim() != 2:
        raise DamchaValueError(
            dc.invalid_argument(
                "key" if key.dim() != 2 else "value",
                "a 2-D (unbatched) tensor with an unbatched (2-D) `query`: `query`, `key` and `value` all 2-D",
                f"query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}",
            )
        )
    if isinstance(key_padding_mask, Tensor):
        if key_padding_mask.dim() != 1:
            raise DamchaValueError(
                dc.invalid_argument(
                    "key_padding_mask",
                    f"shape (M,) = ({key.shape[0]},) with unbatched inputs",
                    f"key_padding_mask.shape={tuple(key_padding_mask.shape)}",
                )
            )
        if key_padding_mask.shape[0] != key.shape[0]:
            # Checked here: the batched rule would print the (1, M) view made below.
            raise DamchaValueError(
                dc.invalid_argument(
                    "key_padding_mask",
                    f"shape (M,) = ({key.shape[0]},) with unbatched inputs",
                    f"key_padding_mask.shape={tuple(key_padding_mask.shape)}, key.shape={tuple(key.shape)}",
                )
            )
        key_padding_mask = key_padding_mask.unsqueeze(0)
    return query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), key_padding_mask


def _is_hint_mask(attn_mask: Any, N: Any, M: Any) -> bool:
    """Whether ``attn_mask``, given with ``is_causal`` to a decoding step of N
    new tokens after M - N cached ones, is nn.MultiheadAttention's causal
    hint that the flat step takes: a 2-D (N, M) bool or float tensor. It is
    not read (see _masks.merge_masks: with ``is_causal`` a 2-D mask is taken
    to be the causal mask), so its values never matter. Called by the eager
    and the traced step only when a mask is given: the step without one
    makes no call (tests/test_torch_ops.py counts its Python calls)."""
    return (
        type(attn_mask) is Tensor
        and attn_mask.dim() == 2
        and attn_mask.shape[0] == N
        and attn_mask.shape[1] == M
        and (attn_mask.dtype is torch.bool or attn_mask.is_floating_point())
    )


# damcha_core names things as DamchaConfig and the reference do; the errors
# speak of the arguments the caller passed.
_CONSTRUCTOR_NAMES = {"query_dim": "embed_dim", "context_dim": "kdim", "value_input_dim": "vdim", "use_bias": "bias"}
_FORWARD_NAMES = {
    "context": "key",
    "mask": "attn_mask",
    "query_dim": "embed_dim",
    "context_dim": "kdim",
    "value_input_dim": "vdim",
}


def _check_shapes(
    config: DamchaConfig, query_shape: tuple, key_shape: tuple, value_shape: tuple, mask_shape: tuple | None = None
) -> tuple[Any, Any, Any]:
    """``dc.check_shapes`` with this module's argument names; returns (B, N, M)
    as torch gives them (SymInts under ``torch.export``)."""
    return dc.check_shapes(config, query_shape, key_shape, mask_shape, value_shape=value_shape, names=_FORWARD_NAMES)


def _as_passed(error: DamchaValueError, names: tuple[str, ...], seen: tuple, passed: tuple) -> DamchaValueError:
    """``error`` of the shape rules, which ran on batch-first views, with each
    tensor's shape as the caller passed it (sequence-first or unbatched), as
    the JAX and Keras layers report them."""
    message = str(error)
    for name, s, p in zip(names, seen, passed):
        message = message.replace(f"{name}.shape={tuple(s.shape)}", f"{name}.shape={tuple(p.shape)}")
    return DamchaValueError(message)


def _linear_params(module: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """(weight, bias) of a module whose call is exactly ``F.linear`` with them
    (an ``nn.Linear`` with no hooks, not wrapped or overridden on its class or
    on the instance), else None."""
    # fn.no_hooks' test spelled out: this runs in every decode step, whose
    # Python frames are held to a hand-written MHA step's (tests/test_torch_ops.py).
    if (
        type(module).forward is not nn.Linear.forward
        or "forward" in module.__dict__
        or module._forward_hooks
        or module._forward_pre_hooks
        or nn.modules.module._global_forward_hooks
        or nn.modules.module._global_forward_pre_hooks
    ):
        return None
    weight = module._parameters.get("weight")
    if weight is None:
        return None
    return weight, module._parameters.get("bias")


class DamchaAttention(CanonicalIO, nn.Module):
    """Data-Adaptive Mahalanobis Cross-Head Attention, a drop-in for ``nn.MultiheadAttention``.

    Each token's query heads (and key heads) are mixed by a per-token
    cross-head map q~ = L_q(x) q, k~ = L_k(c) k, then one fused
    ``scaled_dot_product_attention`` call runs on (q~, k~, v). With the gates
    at 0 (a fresh layer, or ``from_mha``) it computes exactly MHA.

    Args:
        embed_dim: E_q, query feature size (and, by default, output size).
        num_heads: H, number of query heads.
        dropout: attention-probability dropout, training only.
        bias: biases on the four projections.
        add_bias_kv: append a learned key ``bias_k`` and value ``bias_v``
            (1, 1, G*d) / (1, 1, G*d_v) to the keys and values, as
            nn.MultiheadAttention does. The bias key is a key of the
            transformed space (k~), not mapped by L_k: it has no token to
            drive a map. Every query sees it (masks and the causal rule
            cover the real keys only).
        add_zero_attn: append a zero key and value after them (the same in
            any space), as nn.MultiheadAttention does.
        kdim, vdim: E_kv and E_v, feature sizes of the key and value inputs;
            default ``embed_dim`` (each, as in nn.MultiheadAttention).
        batch_first: inputs/outputs are (B, N, E) instead of (N, B, E).
        device, dtype: factory kwargs for the parameters.
        key_dim: d, per-head query/key size; default ``embed_dim // num_heads``.
        value_dim: d_v, per-head value size; default ``key_dim``.
        num_kv_heads: G, key/value heads (GQA/MQA); default ``num_heads``.
        output_dim: E_o; default ``embed_dim``.
        metric: "heads" (default), "lowrank" or "none" (exactly MHA).
        metric_rank: r for "lowrank".
        coupling: "tied", "separate", "query", or None/"auto" (default):
            "tied" when queries and keys have the same size and head count
            (kdim == embed_dim, num_kv_heads == num_heads), else "separate".
        scale: logit scale; default 1/sqrt(key_dim).
        metric_generator: a ``MetricGenerator`` to share with other layers
            (tied/query coupling), or a mapping ``{"q": ..., "k": ...}``
            (separate); the layer keeps its own gates.
        recompute: in training, store no more activations than MHA: q~ and
            k~ are made again in backward (on CPU from the kept projection
            outputs, by the small map alone; elsewhere, or under the
            caller's saved-tensor hooks, by projecting the q/k rows again),
            instead of storing q/k and q~/k~ both (default True). See docs/torch.md.

    Parameters (``nn.MultiheadAttention`` layout, so ``from_mha`` is a copy):
    ``in_proj_weight`` (H*d + G*d + G*d_v, E) when ``kdim == vdim == embed_dim``,
    else ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``;
    ``in_proj_bias``; ``out_proj`` (``nn.Linear``); ``metric_gates[side]``
    (S,); ``metric_generators[side]`` (``MetricGenerator``).
    """

    __constants__ = ["batch_first"]
    # Registered as None when absent (as nn.MultiheadAttention does), so typed so.
    in_proj_weight: nn.Parameter | None
    in_proj_bias: nn.Parameter | None
    bias_k: nn.Parameter | None
    bias_v: nn.Parameter | None
    # Why: nn.TransformerEncoder(Layer) run a fused native kernel that reads
    # in_proj_weight directly when this flag is True, which would skip the
    # cross-head map. False keeps them on the path that calls forward().
    _qkv_same_embed_dim = False

    # Code written for nn.MultiheadAttention picks its weights by that flag:
    # ``in_proj_weight`` when True, else these three. As the flag is always
    # False here, a packed layer gives views of ``in_proj_weight`` (MHA gives
    # None); a layer with separate weights gives its parameters (see
    # _SeparateWeight for why these are not properties).
    q_proj_weight = _SeparateWeight(0)
    k_proj_weight = _SeparateWeight(1)
    v_proj_weight = _SeparateWeight(2)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        key_dim: int | None = None,
        value_dim: int | None = None,
        num_kv_heads: int | None = None,
        output_dim: int | None = None,
        metric: str = "heads",
        metric_rank: int | None = None,
        coupling: str | None = None,
        scale: float | None = None,
        metric_generator: MetricGenerator | Mapping[str, MetricGenerator] | None = None,
        recompute: bool = True,
        _arg_names: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        # A block that builds this layer passes its own argument names (e.g.
        # d_model for embed_dim), so errors speak of what its caller passed.
        names = {**_CONSTRUCTOR_NAMES, **(_arg_names or {})}
        add_bias_kv = dc.check_bool("add_bias_kv", add_bias_kv)
        add_zero_attn = dc.check_bool("add_zero_attn", add_zero_attn)
        embed_dim = dc.check_int(names["query_dim"], embed_dim)
        num_heads = dc.check_int(names.get("num_heads", "num_heads"), num_heads)
        if key_dim is None:
            if embed_dim % num_heads:
                e, h = names["query_dim"], names.get("num_heads", "num_heads")
                raise DamchaValueError(
                    dc.invalid_argument(
                        e, f"a multiple of `{h}` when `key_dim` is not given", f"{e}={embed_dim}, {h}={num_heads}"
                    )
                )
            key_dim = embed_dim // num_heads
        batch_first = dc.check_bool("batch_first", batch_first)
        recompute = dc.check_bool("recompute", recompute)
        check_param_dtype(dtype)
        # As in nn.MultiheadAttention, an omitted kdim or vdim means embed_dim.
        cfg = dc.make_config(
            names=names,
            query_dim=embed_dim,
            num_heads=num_heads,
            key_dim=key_dim,
            value_dim=value_dim,
            num_kv_heads=num_kv_heads,
            context_dim=embed_dim if kdim is None else kdim,
            value_input_dim=embed_dim if vdim is None else vdim,
            output_dim=output_dim,
            use_bias=bias,
            metric=metric,
            metric_rank=metric_rank,
            coupling=coupling,
            scale=scale,
            dropout=dropout,
        )
        self._init_from_config(
            cfg,
            batch_first,
            device,
            dtype,
            metric_generator,
            recompute,
            names,
            coupling_was_auto=coupling in (None, "auto"),
        )
        self.add_zero_attn = add_zero_attn
        if add_bias_kv:
            d, (G, dv) = cfg.key_dim, fn.config_sizes(cfg)[3:]
            self.bias_k = nn.Parameter(torch.empty(1, 1, G * d, device=device, dtype=dtype))
            self.bias_v = nn.Parameter(torch.empty(1, 1, G * dv, device=device, dtype=dtype))
            # Drawn here: _init_from_config's reset ran before they existed (reset_parameters
            # draws them again, as MHA's own initialiser does).
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)
        else:
            self.bias_k = self.bias_v = None
        if add_bias_kv or add_zero_attn:
            self._few_tokens_ok = False

    def _init_from_config(
        self,
        cfg: DamchaConfig,
        batch_first: bool,
        device: Any,
        dtype: Any,
        metric_generator: Any,
        recompute: bool,
        names: Mapping[str, str],
        coupling_was_auto: bool = False,
    ) -> None:
        self.config = cfg
        shared = dc.resolve_generators(
            metric_generator,
            cfg,
            generator_type=MetricGenerator,
            spec_of=lambda g: g.spec,
            names=names,
            coupling_was_auto=coupling_was_auto,
        )
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        E, H, d = cfg.query_dim, cfg.num_heads, cfg.key_dim
        Ekv, Ev, Eo, G, dv = fn.config_sizes(cfg)
        # The nn.MultiheadAttention attribute names, for code that inspects them.
        self.embed_dim, self.kdim, self.vdim = E, Ekv, Ev
        self.num_heads, self.head_dim, self.dropout = H, d, cfg.dropout
        self.batch_first, self.recompute = batch_first, recompute
        # Opt-in: forward stores its metric penalty for damcha_torch.metric_penalty(model).
        self.track_metric_penalty = False
        self.last_metric_penalty: Tensor | None = None
        self._sizes = (H * d, G * d, G * dv)
        if Ekv == E and Ev == E:
            self.in_proj_weight = nn.Parameter(torch.empty(sum(self._sizes), E, **kw))
            for name in _SEPARATE:
                self._parameters[name] = None  # registered empty, as nn.MultiheadAttention does
        else:
            self.register_parameter("in_proj_weight", None)
            for name, shape in zip(_SEPARATE, ((H * d, E), (G * d, Ekv), (G * dv, Ev))):
                self.register_parameter(name, nn.Parameter(torch.empty(shape, **kw)))
        if cfg.use_bias:
            self.in_proj_bias = nn.Parameter(torch.empty(sum(self._sizes), **kw))
        else:
            self.register_parameter("in_proj_bias", None)
        # nn.MultiheadAttention's class for it: quantize_dynamic leaves it as
        # it is (the layer reads its weight, as MHA's fused kernel does).
        self.out_proj = NonDynamicallyQuantizableLinear(H * dv, Eo, bias=cfg.use_bias, **kw)
        self.metric_gates = nn.ParameterDict()
        self.metric_generators = nn.ModuleDict()
        for side in cfg.metric_sides:
            spec = cfg.generator_spec(side)
            self.metric_gates[side] = nn.Parameter(torch.zeros(spec.heads, **kw))
            gen = shared.get(side)
            if gen is None:
                gen = MetricGenerator(spec.features, spec.heads, d, cfg.metric, cfg.metric_rank, **kw)
            self.metric_generators[side] = gen
        # Which generator maps queries and keys, and whether a decoding step
        # may take the flat path (fn.few_tokens_step): see _few_tokens_step.
        self._map_sides = (dc.side_of(cfg, "q"), dc.side_of(cfg, "k"))
        # The config's sizes the flat step reads, in one tuple: a compiled step
        # guards one constant rather than each config field it reads.
        self._flat_sizes = (H, G, d, dv, cfg.scale)
        self._few_tokens_ok = cfg.metric in ("none", "heads") and Ekv == E and Ev == E
        self._reset_projections()

    def _reset_projections(self) -> None:
        """Canonical initialisers: Glorot per projection, zero biases, zero gates.

        Each fresh value goes where a weight tool (parametrize, weight_norm,
        spectral_norm, pruning, their old hook-based forms) keeps the trained
        tensor, through ``write_initial``: nn.MultiheadAttention's reset writes
        into the tool's computed weight, a temporary, and so changes nothing.
        """
        with torch.no_grad():
            if self.in_proj_weight is not None:
                packed = torch.empty_like(self.in_proj_weight)
                for part in packed.split(self._sizes):  # Glorot per projection, not over the packed (3E, E)
                    nn.init.xavier_uniform_(part)
                write_initial(self, "in_proj_weight", packed)
            else:
                for name in _SEPARATE:
                    write_initial(self, name, nn.init.xavier_uniform_(torch.empty_like(getattr(self, name))))
            write_initial(self.out_proj, "weight", nn.init.xavier_uniform_(torch.empty_like(self.out_proj.weight)))
            if self.in_proj_bias is not None:
                write_initial(self, "in_proj_bias", torch.zeros_like(self.in_proj_bias))
                write_initial(self.out_proj, "bias", torch.zeros_like(self.out_proj.bias))
            for name in ("bias_k", "bias_v"):
                # add_bias_kv: MHA's own initialiser, as at construction. Left out, a
                # layer built on the meta device kept to_empty's memory here.
                if getattr(self, name, None) is not None:
                    write_initial(self, name, nn.init.xavier_normal_(torch.empty_like(getattr(self, name))))
            for name, gate in self.metric_gates.items():
                write_initial(self.metric_gates, name, torch.zeros_like(gate))

    def reset_parameters(self) -> None:
        """Fresh projections (``bias_k``/``bias_v`` too, with ``add_bias_kv``) and
        zero gates (a fresh layer is exactly MHA). The metric generators are left
        alone: they may be shared with other layers (call their own
        ``reset_parameters``)."""
        self._reset_projections()

    def __getstate__(self) -> dict[str, Any]:
        # The recorded penalty belongs to the last forward's autograd graph: a
        # non-leaf tensor that copy.deepcopy refuses (and pickle would save).
        # A copy or a loaded module has not run a forward yet.
        state = super().__getstate__()
        state["last_metric_penalty"] = None
        state.pop("_gate_columns", None)  # views of this layer's gates, remade by the next step
        return state

    # The kept gate views (``_gate_column``) are dropped before torch replaces or
    # refills parameters: with swap_module_params_on_conversion (forced for
    # tensor subclasses such as DTensor) ``.to()``, ``to_empty`` and
    # ``load_state_dict`` swap each parameter with torch.utils.swap_tensors,
    # which refuses a tensor that a view still uses. The next step remakes them.
    def _apply(self, fn: Any, recurse: bool = True) -> DamchaAttention:
        self.__dict__.pop("_gate_columns", None)
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__.pop("_gate_columns", None)
        super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        c = self.config
        parts = [f"embed_dim={c.query_dim}", f"num_heads={c.num_heads}", f"key_dim={c.key_dim}"]
        if c.num_kv_heads != c.num_heads:
            parts.append(f"num_kv_heads={c.num_kv_heads}")
        if c.context_dim != c.query_dim:
            parts.append(f"kdim={c.context_dim}")
        parts += [f"metric={c.metric!r}", f"coupling={c.coupling!r}", f"batch_first={self.batch_first}"]
        return ", ".join(parts)

    # ------------------------------------------------------------- weights

    def _proj_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        if self.in_proj_weight is not None:
            q, k, v = self.in_proj_weight.split(self._sizes)
            return q, k, v
        p = self._parameters
        q, k, v = p["q_proj_weight"], p["k_proj_weight"], p["v_proj_weight"]
        assert q is not None and k is not None and v is not None  # registered when in_proj_weight is None
        return q, k, v

    def _weights(self) -> fn.LayerWeights:
        """This layer's parameters as the functional core takes them: the
        Parameter objects themselves (no view or copy is made per call)."""
        # Read straight from the registries (no nn.Module.__getattr__ walks):
        # this runs once per call, which matters when decoding token by token.
        p = self._parameters
        m = self._modules
        gens, gate_dict, out_proj = m["metric_generators"], m["metric_gates"], m["out_proj"]
        assert gens is not None and gate_dict is not None and out_proj is not None  # registered in _init_from_config
        gates = gate_dict._parameters
        sides = {}
        for side in self.config.metric_sides:
            # (A gate under a weight tool is no registry entry: its effective tensor, fn.tool_entry.)
            gen, gate = gens._modules[side], gates[side] if side in gates else fn.tool_entry(gate_dict, side)
            if not isinstance(gen, MetricGenerator):
                # A module put in its place (PEFT's target_parameters wraps the generator's owner).
                raise DamchaTypeError(
                    dc.invalid_argument(
                        f"metric_generators.{side}",
                        "the layer's MetricGenerator (it reads the generator's weights itself: a wrapper in its "
                        "place, such as PEFT's target_parameters, is not applied; train the generator directly)",
                        f"metric_generators.{side}={describe(gen)}",
                    )
                )
            assert gate is not None  # one per metric side
            sides[side] = gen.side(gate)
        bias: Tensor | None = fn.param_entry(self, "in_proj_bias")
        packed = fn.param_entry(self, "in_proj_weight")
        q = k = v = None
        if packed is None:
            q, k, v = (fn.param_entry(self, n) for n in _SEPARATE)
        weight = packed if packed is not None else q
        assert weight is not None  # q_proj_weight is registered when in_proj_weight is None
        if bias is not None and bias.dtype != weight.dtype:
            # A bias loaded in another dtype (load_state_dict(assign=True), a
            # checkpoint edited by hand): the projection computes in the
            # weight's dtype, as nn.MultiheadAttention's output does.
            bias = bias.to(weight.dtype)
        return fn.LayerWeights(
            self._sizes,
            packed,
            q,
            k,
            v,
            bias,
            out_proj,
            sides,
            p.get("bias_k"),
            p.get("bias_v"),
            self.add_zero_attn,
            _linear_params(out_proj),
        )

    def _native_ok(self, query: Tensor) -> bool:
        """Whether this call is nn.MultiheadAttention's fast-path case: metric
        "none" in MHA's exact layout, batch-first, inference, no autograd."""
        c = self.config
        structural = (
            c.metric == "none"
            and self.in_proj_weight is not None
            and self.in_proj_bias is not None
            and c.num_kv_heads == c.num_heads
            and c.key_dim * c.num_heads == c.query_dim
            and c.value_dim == c.key_dim
            and c.output_dim == c.query_dim
            and c.scale in (None, 1 / c.key_dim**0.5)
            and self.bias_k is None
            and not self.add_zero_attn
            and c.num_heads % 2 == 0
        )
        if not structural or self.training or not self.batch_first or query.device.type not in ("cpu", "cuda"):
            return False
        if torch.is_grad_enabled() and (query.requires_grad or any(p.requires_grad for p in self.parameters())):
            return False
        device = query.device.type
        if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
            return False
        weight, bias = self.in_proj_weight, self.in_proj_bias
        assert weight is not None and bias is not None  # checked by `structural`
        return query.dtype == weight.dtype == bias.dtype and not query.is_nested

    def _check_dtypes(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        """Inputs in the parameters' dtype, or autocast on (it casts them).

        F.linear would fail with "mat1 and mat2 must have the same dtype"; a
        silent cast would hide a float64 pipeline feeding a float32 model.
        """
        out_proj = self._modules["out_proj"]
        assert out_proj is not None  # registered in _init_from_config
        # The registered tensor, not fn.param_entry's attribute: reading a parametrized
        # weight computes it, and spectral_norm's computation in training is a
        # power-iteration step, which the out_proj call takes once (as MHA's).
        registered = out_proj._parameters
        out_weight = registered["weight"] if "weight" in registered else next(out_proj.parameters(), None)
        assert out_weight is not None
        dtype = out_weight.dtype
        if query.dtype == dtype and key.dtype == dtype and value.dtype == dtype:
            return  # the common case, before asking about autocast
        inputs = (query.dtype, key.dtype, value.dtype)
        device = query.device.type
        if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
            # autocast casts the float32 and 16-bit inputs of each GEMM, not float64 ones.
            if torch.float64 not in inputs or dtype == torch.float64:
                return
        elif all(d == dtype for d in inputs):
            return
        bad = next((n for n, t in (("query", query), ("key", key), ("value", value)) if t.dtype != dtype), "query")
        raise DamchaTypeError(
            dc.invalid_argument(
                bad,
                f"the dtype of this layer's parameters ({dtype}) for `query`, `key` and `value`, as "
                "nn.MultiheadAttention needs; convert them, move the layer (layer.to(dtype)), or run under "
                "torch.autocast, which casts float32 and 16-bit inputs (not float64)",
                f"query.dtype={query.dtype}, key.dtype={key.dtype}, value.dtype={value.dtype}",
            )
        )

    # ------------------------------------------------------------- forward

    def _few_tokens_step(self, query: Tensor, is_causal: bool, kv_cache: Any, attn_mask: Any = None) -> Tensor | None:
        """A decoding step on the flat path (``fn.few_tokens_step``), or None
        when this call is not one it covers (then ``forward`` goes on as usual).

        Every condition is a cheap check, and together they imply that the
        general path would accept the call without an error and run the same
        operations: shapes already validated by an earlier call (the memo of
        ``_sizes_of``), dtypes equal to the parameters', no autocast, no
        compilation, tracing or torch.func transform. They are read afresh
        every step (attributes, dict entries, dtypes: no tensor is made), so
        a parameter replaced, retyped or moved between steps is seen.
        """
        if torch.compiler.is_compiling():
            # First: a compiled step reads none of the memos below (no guard on them).
            return self._traced_few_tokens_step(query, is_causal, kv_cache, attn_mask)
        if type(query) is not Tensor or type(kv_cache) is not DamchaKVCache or query.is_nested or query.dim() != 3:
            return None
        x = query if self.batch_first else query.transpose(0, 1)
        shape = x.shape  # read once: each .shape makes a new torch.Size
        if shape not in self.__dict__.get("_flat_shapes", ()):
            return None  # shapes not validated yet, or more than fn._FEW_TOKENS tokens
        p = self._parameters
        if "in_proj_weight" not in p or "in_proj_bias" not in p:
            return None  # parametrized or pruned: the general path reads the computed tensor
        weight, bias = p["in_proj_weight"], p["in_proj_bias"]
        dtype = x.dtype
        if (
            weight is None  # _few_tokens_ok (the caller's condition) implies the packed layout
            or weight.dtype is not dtype
            or (bias is not None and bias.dtype is not dtype)
            # 16-bit maps run in float32 on the general path.
            or (dtype is not torch.float32 and dtype is not torch.float64)
            or self.track_metric_penalty
            or (self.training and self.dropout > 0.0)
            or self.add_zero_attn
            or p.get("bias_k") is not None
            # Autocast on any device (one call, where asking for x's device
            # parses a device string), tracing, torch.func transforms.
            or torch._C._is_any_autocast_enabled()
            or torch._C._is_tracing()
            or torch._C._are_functorch_transforms_active()
        ):
            return None
        if not x.is_cpu and (
            not x.is_cuda
            # A captured graph must not record the length: the fixed-shape read.
            or (kv_cache._fixed and torch.cuda.is_current_stream_capturing())
        ):
            return None
        N = shape[1]
        if is_causal and N > 1 and len(kv_cache) > 0:
            return None  # a chunk after cached tokens needs the bottom-right mask: the general path builds it
        if attn_mask is not None and not _is_hint_mask(attn_mask, N, len(kv_cache) + N):
            return None
        modules = self._modules
        out_proj = modules["out_proj"]
        assert out_proj is not None  # registered in _init_from_config
        sq, sk = self._map_sides
        mq = mk = None
        if sq is not None or sk is not None:
            gens = modules["metric_generators"]._modules  # type: ignore[union-attr]  # registered with out_proj
            gates = modules["metric_gates"]._parameters  # type: ignore[union-attr]
            # The kept gate views (see _gate_column), their check written out here: this
            # runs once per decoded token (tests/test_torch_ops.py counts its Python calls).
            columns = self.__dict__.get("_gate_columns") or {}
            flat: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
            for side in (sq, sk):
                if side is None or side in flat:
                    continue  # no map on this side, or tied: one tuple, one generator GEMM
                g, kept = gens[side]._parameters, columns.get(side)  # type: ignore[union-attr]
                # (in and [], not .get: no builtin call per step, tests/test_torch_ops.py counts them)
                if "weight" not in g or "bias" not in g or side not in gates:
                    return None  # under a weight tool, no registry entry (see fn.tool_entry)
                gate = gates[side]
                column = (
                    kept[2]
                    if kept is not None
                    and kept[0] is gate
                    and kept[1] == gate.data_ptr()
                    and kept[2].dtype is gate.dtype
                    else self._gate_column(side, gate)  # type: ignore[arg-type]
                )
                if g["weight"].dtype is not dtype or g["bias"].dtype is not dtype or column.dtype is not dtype:  # type: ignore[union-attr]
                    return None
                flat[side] = (g["weight"], g["bias"], column)  # type: ignore[assignment]
            mq = None if sq is None else flat[sq]
            mk = None if sk is None else flat[sk]
        # out_proj as F.linear on its parameters when its call is exactly that
        # (no hooks, not wrapped): one module call fewer per step.
        linear = _linear_params(out_proj)
        maps = (mq, mk)
        out = fn.few_tokens_step(
            self._flat_sizes,
            x,
            weight,
            bias,
            maps,
            out_proj if linear is None else linear,
            kv_cache,
            is_causal,
        )
        return out if self.batch_first else out.transpose(0, 1)

    def _traced_few_tokens_step(
        self, query: Tensor, is_causal: bool, kv_cache: Any, attn_mask: Any = None
    ) -> Tensor | None:
        """``_few_tokens_step`` inside ``torch.compile``: the same flat step, so
        the compiled graph holds its few ops (one generator GEMM, one batched
        product for tied q and k, the guard on o) rather than the general
        path's. Its conditions are read while tracing, so dynamo guards each
        of them (no memo: the shape rules run at trace time, as on the general
        path); a fixed_shape cache keeps the general path (its read of the
        whole capacity)."""
        if type(kv_cache) is not DamchaKVCache or kv_cache._fixed or query.dim() != 3 or query.is_nested:
            return None
        if not query.is_floating_point():
            return None  # the general path raises its error
        x = query if self.batch_first else query.transpose(0, 1)
        p = self._parameters
        if "in_proj_weight" not in p or "in_proj_bias" not in p:
            return None  # parametrized or pruned: the general path reads the computed tensor
        weight, bias = p["in_proj_weight"], p["in_proj_bias"]
        if weight is None:
            return None
        # damcha_core's shape rules for this call, written out: with the packed
        # projection (query_dim = context_dim = value_input_dim) they ask a
        # (B, N, query_dim), and query_dim is the weight's input size, which
        # the weight's own guard fixes. Calling the rules would guard every
        # config field and function they read (about 40 guards, checked on
        # every compiled call); a call they reject goes on to the general
        # path, which raises their error, and so does an empty one (B or
        # N = 0), which returns the empty output there.
        B, N, E = x.shape
        if weight.shape[1] != E or B == 0 or N == 0 or B * N > fn._FEW_TOKENS:
            return None
        dtype = x.dtype
        device = x.device.type
        if (
            weight.dtype != dtype
            or (bias is not None and bias.dtype != dtype)
            or dtype not in (torch.float32, torch.float64)
            or self.track_metric_penalty
            or (self.training and self.dropout > 0.0)
            or self.add_zero_attn
            or p.get("bias_k") is not None
            or device not in ("cpu", "cuda")
            or torch.is_autocast_enabled(device)
            or (is_causal and N > 1 and len(kv_cache) > 0)
        ):
            return None
        if attn_mask is not None and not _is_hint_mask(attn_mask, N, len(kv_cache) + N):
            return None
        modules = self._modules
        out_proj = modules["out_proj"]
        assert out_proj is not None  # registered in _init_from_config
        sq, sk = self._map_sides
        maps: list[tuple[Tensor, Tensor, Tensor] | None] = [None, None]
        if sq is not None or sk is not None:
            gens = modules["metric_generators"]._modules  # type: ignore[union-attr]  # registered with out_proj
            gates = modules["metric_gates"]._parameters  # type: ignore[union-attr]
            for i, side in enumerate((sq, sk)):
                if side is None:
                    continue
                if i == 1 and side == sq:
                    maps[1] = maps[0]  # tied: the same tuple, one generator GEMM
                    continue
                # (.get, not in and []: one guard fewer, tests/test_torch_kv_cache.py counts them)
                g, gate = gens[side]._parameters, gates.get(side)  # type: ignore[union-attr]
                if "weight" not in g or "bias" not in g or gate is None:
                    return None  # under a weight tool, no registry entry (see fn.tool_entry)
                w_g, b_g = g["weight"], g["bias"]
                if w_g.dtype != dtype or b_g.dtype != dtype or gate.dtype != dtype:  # type: ignore[union-attr]
                    return None
                maps[i] = (w_g, b_g, gate.view(-1, 1))  # type: ignore[assignment]
        # The module itself: traced, its call is the same F.linear in the graph,
        # and dynamo checks its hooks as it does for any module call
        # (_linear_params' reads would be guarded besides).
        out = fn.few_tokens_step(
            self._flat_sizes,
            x,
            weight,
            bias,
            (maps[0], maps[1]),
            out_proj,
            kv_cache,
            is_causal,
            traced=True,
        )
        return out if self.batch_first else out.transpose(0, 1)

    def _gate_column(self, side: str, gate: Tensor) -> Tensor:
        """``gate.view(S, 1)`` for the flat step, kept between steps.

        A view shares the gate's storage, so writes in place (``.data``,
        ``copy_``, ``load_state_dict``, an optimiser) reach it with no check;
        it is remade when the gate is another object (``assign=True``, a
        replaced Parameter) or has other storage (``.data = ...``, ``.to()``).
        """
        memo = self.__dict__.get("_gate_columns")
        entry = None if memo is None else memo.get(side)
        if entry is not None and entry[0] is gate and entry[1] == gate.data_ptr() and entry[2].dtype is gate.dtype:
            return entry[2]
        column = gate.view(-1, 1)
        if memo is None:
            memo = self.__dict__["_gate_columns"] = {}
        memo[side] = (gate, gate.data_ptr(), column)
        return column

    def _sizes_of(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Any, Any, Any]:
        """(B, N, M) of batch-first inputs, checked by damcha_core's shape rules.

        The last shapes that passed are remembered: a decoding loop calls with
        the same shapes every step and skips the rules (plain ints only; while
        compiling or exporting, sizes may be symbolic and are always checked).
        """
        if torch.compiler.is_compiling():
            return _check_shapes(self.config, tuple(query.shape), tuple(key.shape), tuple(value.shape))
        shapes = (query.shape, key.shape, value.shape)
        seen = self.__dict__.get("_shapes_seen")
        if seen is not None and seen[0] == shapes:
            return seen[1]
        sizes = _check_shapes(self.config, tuple(query.shape), tuple(key.shape), tuple(value.shape))
        if all(type(n) is int for n in sizes):
            self.__dict__["_shapes_seen"] = (shapes, sizes)
            # The flat decoding path looks its shape up here: self-attention's,
            # of few tokens. A few such shapes are kept (the rules depend on the
            # config alone), so a prompt, or a short chunk, between sequences
            # does not send the next sequence's first token step down the
            # general path again.
            if query.shape == key.shape == value.shape and sizes[0] * sizes[1] <= fn._FEW_TOKENS:
                flat = self.__dict__.get("_flat_shapes")
                if flat is None or len(flat) >= 8:
                    flat = self.__dict__["_flat_shapes"] = set()
                flat.add(query.shape)
        return sizes

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        kv_cache: DamchaKVCache | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend ``query`` to ``key``/``value`` with the cross-head maps.

        Args:
            query: (N, B, E_q), or (B, N, E_q) with ``batch_first``, or
                unbatched (N, E_q) as in nn.MultiheadAttention.
            key, value: (M, B, E_kv), (B, M, E_kv) or unbatched (M, E_kv). Pass
                the same tensor object three times for self-attention (one
                packed projection).
            key_padding_mask: (B, M), or (M,) when unbatched; bool True = ignore
                that key, or additive float.
                With ``kv_cache``, M counts the cached keys too (P + new).
            need_weights: also return attention weights; this takes the explicit
                path that builds the (B, H, N, M) probabilities. Pass ``False``
                for the fused SDPA path (as ``nn.TransformerEncoderLayer`` does).
            attn_mask: (N, M), (B*H, N, M) (H, N, M when unbatched) or
                (B|1, H|1, N|1, M); bool True =
                masked out, or additive float. Combined with ``key_padding_mask``
                and ``is_causal``.
            average_attn_weights: average the returned weights over heads.
            is_causal: apply the causal rule (query i sees keys j <= i, or
                j <= P + i after P cached tokens). Unlike nn.MultiheadAttention,
                it needs no ``attn_mask``. With a 2-D (N, M) ``attn_mask`` it is
                nn.MultiheadAttention's hint: the mask is taken to be the causal
                mask and is not read (so SDPA's fused causal kernel runs); a
                mask of another shape applies together with the causal rule.
            kv_cache: a ``DamchaKVCache``; the new keys/values are appended and
                queries attend over the whole cache.

        Returns:
            ``(output, weights)``: output (N, B, E_o) or (B, N, E_o); weights
            (B, N, M) averaged, (B, H, N, M) per head, or ``None``. Unbatched
            inputs drop the B dim from both. A query that
            sees no key gets output ``out_proj.bias`` (attention output 0), never NaN.

        Raises:
            DamchaTypeError: ``need_weights``, ``average_attn_weights`` or
                ``is_causal`` not a bool (a NumPy bool is taken, and ``None``
                reads as False, as in nn.MultiheadAttention); a string such as
                ``"False"`` is truthy and would silently pick the other path.
        """
        # Three identity tests on the decode hot path (no tensor op); the check runs only off it.
        if (
            need_weights.__class__ is not bool
            or average_attn_weights.__class__ is not bool
            or is_causal.__class__ is not bool
        ):
            # None reads as False, as nn.MultiheadAttention's truth tests read it:
            # code that passes an optional flag on keeps working.
            need_weights = need_weights is not None and dc.check_bool("need_weights", need_weights)
            average_attn_weights = average_attn_weights is not None and dc.check_bool(
                "average_attn_weights", average_attn_weights
            )
            is_causal = is_causal is not None and dc.check_bool("is_causal", is_causal)
        if (
            kv_cache is not None
            and not need_weights
            and query is key
            and key is value
            and key_padding_mask is None
            and (attn_mask is None or is_causal)
            and self.__dict__.get("_few_tokens_ok")
            and not torch.is_grad_enabled()
        ):
            out = self._few_tokens_step(query, bool(is_causal), kv_cache, attn_mask)
            if out is not None:
                return out, None
        if isinstance(query, torch.fx.Proxy):
            # torch.fx: one node, as for nn.MultiheadAttention (see fn.traced_call),
            # with the arguments that differ from their defaults. Tested after the
            # decode fast path so that path's calls stay as tests/test_torch_ops.py
            # pins them (that path needs a cache, which a traced call cannot hold).
            given = {
                "key_padding_mask": (key_padding_mask, None),
                "need_weights": (need_weights, True),
                "attn_mask": (attn_mask, None),
                "average_attn_weights": (average_attn_weights, True),
                "is_causal": (is_causal, False),
                "kv_cache": (kv_cache, None),
            }
            return fn.traced_call(
                self, (query, key, value), {k: v for k, (v, default) in given.items() if v is not default}
            )
        self_attention = query is key and key is value
        # One tensor for key and value (cross-attention as nn.MultiheadAttention
        # users write it): the core projects k and v with one GEMM. Read before
        # the layout changes below make separate views of it.
        shared_kv = key is value
        for name, t in (("query", query),) if self_attention else (("query", query), ("key", key), ("value", value)):
            _check_float(name, t)
            if t.is_nested:
                raise DamchaTypeError(
                    dc.invalid_argument(
                        name,
                        "a dense (padded) tensor with a key_padding_mask; DamchaAttention takes no nested tensors "
                        "(an nn.TransformerEncoder whose self_attn was replaced by hand makes them in eval: build it "
                        "with enable_nested_tensor=False, or convert it with replace_mha, which does)",
                        f"{name}={describe(t)} (nested)",
                    )
                )
        self._check_dtypes(query, key, value)
        if query.dim() not in (2, 3) or (query.dim() == 3 and (key.dim() != 3 or value.dim() != 3)):
            layout = "(B, N, E)" if self.batch_first else "(N, B, E)"
            raise DamchaValueError(
                dc.invalid_argument(
                    "query" if query.dim() not in (2, 3) else ("key" if key.dim() != 3 else "value"),
                    f"`query`, `key` and `value` all batched {layout} or all unbatched (N, E), as in "
                    "nn.MultiheadAttention",
                    f"query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}",
                )
            )
        unbatched = query.dim() == 2
        # Sequence-first inputs go to the core as they are (it projects tokens in
        # any order and gives SDPA permuted views), so neither the projections
        # nor their backward copy x into batch-first order; the batch-first
        # views below serve the shape checks only. With a cache, batch-first.
        seq_first = not unbatched and not self.batch_first and kv_cache is None
        given = (query, key, value)
        if unbatched:
            query, key, value, key_padding_mask = _add_batch_dim(query, key, value, key_padding_mask)
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        try:
            B, N, M = self._sizes_of(query, key, value)
        except DamchaValueError as error:
            raise _as_passed(error, ("query", "key", "value"), (query, key, value), given) from None
        if self.track_metric_penalty:
            self.last_metric_penalty = self._penalty(query, key)
        if (
            self_attention
            and not unbatched
            and key_padding_mask is None
            and attn_mask is None
            and not is_causal
            and kv_cache is None
            and self._native_ok(query)
        ):
            # metric "none" is nn.MultiheadAttention: its fused inference kernel,
            # with no mask (so no all-masked rows, where it would give NaN).
            in_w, in_b = self.in_proj_weight, self.in_proj_bias
            assert in_w is not None and in_b is not None  # _native_ok checked both
            return torch._native_multi_head_attention(
                query,
                key,
                value,
                self.embed_dim,
                self.num_heads,
                in_w,
                in_b,
                self.out_proj.weight,
                self.out_proj.bias,
                None,
                bool(need_weights),
                bool(average_attn_weights),
                None,
            )
        if kv_cache is not None and not isinstance(kv_cache, DamchaKVCache):
            raise DamchaTypeError(
                dc.invalid_argument("kv_cache", "a DamchaKVCache or None", f"kv_cache={describe(kv_cache)}")
            )
        is_causal = bool(is_causal)
        if is_causal and kv_cache is not None and M != N:
            # Query i sits at P + i: a call appending another number of keys
            # puts the cache's positions out of step with the queries' (as the
            # Keras and Flax caches refuse it). Without is_causal any number of
            # keys may be appended (a prefix, cross-attention keys).
            raise DamchaValueError(
                dc.invalid_argument(
                    "key",
                    "one new key per query token with is_causal=True and a kv_cache (self-attention decoding)",
                    f"query.shape={tuple(given[0].shape)}, key.shape={tuple(given[1].shape)}",
                )
            )
        mask = None
        if key_padding_mask is not None or attn_mask is not None:
            # The is_causal hint (nn.MultiheadAttention's contract): a 2-D
            # attn_mask is the causal mask, left out so that SDPA's causal
            # kernel applies the rule (see _masks.merge_masks). The same on every
            # path (need_weights too), so a wrong hint gives one answer.
            mask = merge_masks(
                self.config,
                key_padding_mask,
                attn_mask,
                B,
                N,
                # The cache's length is read only here: a compiled step without
                # masks never makes it a size of its graph (fixed_shape caches).
                M + (0 if kv_cache is None else len(kv_cache)),
                query.dtype,
                names=_FORWARD_NAMES,
                causal_hint=is_causal,
                device=query.device,
            )
        if seq_first:
            query, key, value = given
        out, weights = fn.attend_weights(
            self._weights(),
            self.config,
            query,
            None if self_attention else key,
            None if self_attention or shared_kv else value,
            seq_first=seq_first,
            mask=mask,
            causal=is_causal,
            query_offset=0,
            kv_cache=kv_cache,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=bool(need_weights),
            recompute=self.recompute and self.training,
        )
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if unbatched:
            return out.squeeze(0), (None if weights is None else weights.squeeze(0))
        if not self.batch_first and not seq_first:
            out = out.transpose(0, 1)
        return out, weights

    # ------------------------------------------------------------ training

    def metric_penalty(self, query: Tensor, key: Tensor | None = None) -> Tensor:
        """The v1 metric penalty: mean over adapted roles of mean_t ||L(t) - I||_F^2 / (S*d).

        Args:
            query: the layer's query input, in the layer's layout (or unbatched (N, E_q)).
            key: the key input; ``None`` for self-attention.

        Returns:
            A 0-d tensor (0 for metric "none") to add, times a coefficient, to the loss.
        """
        _check_float("query", query)
        key = query if key is None else key
        _check_float("key", key)
        given = (query, key)
        if query.dim() == 2:
            query, key, _, _ = _add_batch_dim(query, key, key, None)
        elif not self.batch_first:
            query, key = query.transpose(0, 1), key.transpose(0, 1)
        cfg = self.config
        try:
            dc.check_shapes(
                cfg,
                tuple(query.shape),
                tuple(key.shape),
                value_shape=(*key.shape[:2], fn.config_sizes(cfg)[1]),
                names=_FORWARD_NAMES,
            )
        except DamchaValueError as error:
            raise _as_passed(error, ("query", "key"), (query, key), given) from None
        return self._penalty(query, key)

    def _penalty(self, query: Tensor, key: Tensor) -> Tensor:
        return fn.penalty_weights(self._weights(), self.config, query, key)

    # ------------------------------------------------------- canonical I/O

    @classmethod
    def _from_config(
        cls,
        config: DamchaConfig,
        *,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        metric_generator: MetricGenerator | Mapping[str, MetricGenerator] | None = None,
        recompute: bool = True,
    ) -> DamchaAttention:
        layer = cls(
            config.query_dim,
            config.num_heads,
            dropout=config.dropout,
            bias=config.use_bias,
            kdim=config.context_dim,
            vdim=config.value_input_dim,
            batch_first=batch_first,
            device=device,
            dtype=dtype,
            key_dim=config.key_dim,
            value_dim=config.value_dim,
            num_kv_heads=config.num_kv_heads,
            output_dim=config.output_dim,
            metric=config.metric,
            metric_rank=config.metric_rank,
            coupling=config.coupling,
            scale=config.scale,
            metric_generator=metric_generator,
            recompute=recompute,
        )
        check_config_rebuilt(layer, config)
        return layer

    @classmethod
    def from_canonical(  # names the keywords the mixin's **kwargs forwards
        cls,
        params: Mapping[str, Any],
        config: DamchaConfig,
        *,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        metric_generator: MetricGenerator | Mapping[str, MetricGenerator] | None = None,
        recompute: bool = True,
        **kwargs: Any,
    ) -> DamchaAttention:
        """A layer with ``config`` whose parameters are the canonical ``params``; a keyword that
        the config sets (``num_heads=...``) is a DamchaTypeError naming it."""
        return super().from_canonical(
            params,
            config,
            batch_first=batch_first,
            device=device,
            dtype=dtype,
            metric_generator=metric_generator,
            recompute=recompute,
            **kwargs,
        )

    # ------------------------------------------------------------ from MHA

    @classmethod
    def from_mha(
        cls,
        mha: nn.MultiheadAttention,
        *,
        metric: str = "heads",
        metric_rank: int | None = None,
        coupling: str | None = None,
        metric_generator: MetricGenerator | Mapping[str, MetricGenerator] | None = None,
        recompute: bool = True,
    ) -> DamchaAttention:
        """A DamchaAttention computing exactly what ``mha`` computes (gates at 0).

        Weights are copied (same layout, any dtype/device).

        Args:
            mha: the ``nn.MultiheadAttention`` to copy (its effective weights under a weight tool).
            metric: ``"heads"`` (a full S x S map) or ``"lowrank"``, as in the constructor.
            metric_rank: r for ``metric="lowrank"``; None otherwise.
            coupling: ``"tied"``, ``"separate"``, ``"query"``; None picks "tied" when ``mha``
                has kdim == embed_dim, else "separate".
            metric_generator: a generator (or one per side) shared with other layers.
            recompute: as in the constructor (default True).
        """
        from ._convert import from_mha

        return from_mha(
            cls,
            mha,
            metric=metric,
            metric_rank=metric_rank,
            coupling=coupling,
            metric_generator=metric_generator,
            recompute=recompute,
        )
