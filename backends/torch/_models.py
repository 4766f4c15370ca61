"""Converting third-party torch models (transformers, timm) to DAMCHA in place.

Where the maps go: on each token's projected queries and keys, *inside* the
host's projection call. ``convert`` replaces the ``forward`` of the modules
that project queries and keys (``q_proj``/``k_proj``, GPT-2's fused
``c_attn``, timm's fused ``qkv``, ...) by the projection followed by the
cross-head map of the token that was projected. Everything the host does after
its projections runs unchanged: per-head q/k norms, RoPE, the key/value cache
(which therefore stores mapped keys) and whichever attention kernel the host
selects (eager, sdpa, flash). Parameter names of the host do not change; the
gates and generators live in a new child ``damcha`` of each converted
attention module.

The map is computed in residual form, y + g * (Delta(t) y), never as a product
with a folded identity I + g Delta: with the gates at 0 the converted model is
bit-for-bit the original in every dtype, TF32 and bf16 included.
"""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, cast

import damcha_core as dc
import torch
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, _layout, describe
from damcha_core._layout import AttentionLayout, ModelAdapter, ProjectionSite
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# The port's public names (bound in damcha_torch/__init__ before this module loads).
from . import DamchaAttention, MetricGenerator
from . import _convert as _convert_mod
from . import _functional as fn
from . import _models_fused as _fused
from ._weight_tools import write_initial

__all__ = [
    "AttentionLayout",
    "DamchaMaps",
    "ModelAdapter",
    "ProjectionSite",
    "convert",
    "converted_layers",
    "damcha_parameters",
    "from_pretrained",
    "register_adapter",
    "supported_layouts",
    "track_metric_penalty",
]

# The key under which convert() records its options in a transformers config
# (config.json), so that damcha_torch.from_pretrained can rebuild the layers.
CONFIG_KEY = "damcha"
CONFIG_FORMAT = "damcha-v1-convert"


# ------------------------------------------------------------------ layouts

# ProjectionSite, AttentionLayout, ModelAdapter and the registration rule hold no
# framework object: one definition in damcha_core serves the torch and Keras converters.

_ADAPTERS: list[ModelAdapter] = []


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Teach ``convert`` another attention layout; returns the adapter.

    Adapters are tried in registration order, the built-in ones first; the
    first whose ``matches`` accepts a module converts it.
    """
    return _layout.register(_ADAPTERS, adapter, port="damcha_torch")


def supported_layouts() -> list[str]:
    """One line per layout ``convert`` knows (registered adapters and nn.MultiheadAttention)."""
    _load_builtin_adapters()
    return [f"{a.name}: {a.description}" for a in _ADAPTERS] + [
        "mha: torch.nn.MultiheadAttention (replaced by DamchaAttention.from_mha)"
    ]


def _load_builtin_adapters() -> None:
    from . import _models_layouts, _models_layouts_more, _models_layouts_qkv  # noqa: F401  (register on first import)


# ---------------------------------------------------------------- the maps


def _no_autocast(t: Tensor) -> contextlib.AbstractContextManager:
    device = t.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.autocast(device, enabled=False)
    return contextlib.nullcontext()


class _SiteForward:
    """Installed as a projection module's ``forward``: the projection, then the maps.

    A plain (picklable, deep-copyable) object rather than a closure, so that
    ``copy.deepcopy`` and ``torch.save(model)`` carry the conversion along.
    """

    def __init__(self, maps: DamchaMaps, projection: nn.Module, site: ProjectionSite, previous: Any) -> None:
        self.maps = maps
        self.projection = projection
        self.site = site
        self.previous = previous  # an instance-level forward that was there before (accelerate hooks), or None

    def project(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.previous is not None:
            return self.previous(x, *args, **kwargs)
        return type(self.projection).forward(self.projection, x, *args, **kwargs)

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        maps = self.maps
        hooked = maps._offload_hooked()
        if not hooked:
            return maps._run_site(self, x, args, kwargs)
        with _hooks_run(hooked):
            return maps._run_site(self, x, args, kwargs)


@contextlib.contextmanager
def _hooks_run(hooked: list[nn.Module]) -> Iterator[None]:
    """Run the accelerate hooks (``ModelHook.pre_forward``/``post_forward``)
    of ``hooked`` around the block, as accelerate runs them around a module's
    forward: an offloading ``AlignDevicesHook`` loads the module's parameters
    onto its execution device before and puts them back on the meta device
    after."""
    done: list[nn.Module] = []
    try:
        for module in hooked:
            module.__dict__["_hf_hook"].pre_forward(module)
            done.append(module)
        yield
    finally:
        for module in reversed(done):
            module.__dict__["_hf_hook"].post_forward(module, None)


def _carries_site(projection: nn.Module) -> bool:
    """The projection's forward is its installed map, or a wrapper that a tool
    added around it since conversion: accelerate's ``add_hook_to_module`` keeps
    the forward it wrapped as ``_old_forward`` and calls it, so the map runs
    once inside the hook (installing another would map the output twice)."""
    return isinstance(projection.__dict__.get("forward"), _SiteForward) or isinstance(
        projection.__dict__.get("_old_forward"), _SiteForward
    )


class _SyncHook:
    """Forward pre-hook of a converted attention module: if a projection was
    replaced since conversion (PEFT wraps ``q_proj`` in a LoRA layer), move the
    map onto the module now there, so the LoRA update passes through the map."""

    def __init__(self, maps: DamchaMaps) -> None:
        self.maps = maps

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.fx._symbolic_trace.is_fx_symbolic_tracing():
            # The first hook of a converted module's call. A symbolic trace runs
            # these hooks once, while tracing, and records none of them, so the
            # graph would run the projections' maps without the per-call state
            # the hooks keep: refused, instead of a graph that may compute wrong.
            raise DamchaTypeError(
                dc.invalid_argument(
                    "model",
                    "a model torch.fx can trace: a model converted by damcha_torch.convert computes its maps in "
                    "hooks around each attention call, which a symbolic trace cannot record (torch.compile, "
                    "torch.export and torch.jit.trace record them; layers made by replace_mha trace with torch.fx)",
                    f"{type(module).__module__}.{type(module).__qualname__} converted by damcha_torch.convert, "
                    "under torch.fx symbolic tracing",
                )
            )
        found = module._modules.get(CONFIG_KEY)
        if found is not self.maps:
            # Another module sits where the maps were, while the projections go on
            # reading these maps: PEFT's modules_to_save (its copy would train and
            # save while nothing reads it), or a replica of the attention module
            # (nn.DataParallel's replicate copies the module but not the maps'
            # installation, so a replica would compute with the original's maps).
            if isinstance(found, DamchaMaps):
                expected = (
                    "the DamchaMaps module that convert() registered there; this attention module is a copy "
                    "that shares the original's installed maps (nn.DataParallel replicas are not supported: use "
                    "DistributedDataParallel, one model per process; copy.deepcopy copies a converted model whole)"
                )
            else:
                expected = (
                    "the DamchaMaps module that convert() registered there (to train DAMCHA's parameters under "
                    "PEFT, unfreeze them with damcha_parameters(model) instead of listing them in modules_to_save)"
                )
            raise DamchaTypeError(
                dc.invalid_argument(
                    f"{type(module).__qualname__}.{CONFIG_KEY}", expected, f"{CONFIG_KEY}={describe(found)}"
                )
            )
        self.maps.sync(module)


class _StoreOpen:
    """Forward pre-hook of a converted attention module: opens the store mode
    of its fused projections for this call (``DamchaMaps._open_store``)."""

    def __init__(self, maps: DamchaMaps) -> None:
        self.maps = maps

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.maps._end_norm()  # a call that raised before its forward hook
        self.maps._open_store()


class _StoreClose:
    """Forward hook (always called, also when the forward raises) of a
    converted attention module: closes what ``_StoreOpen`` opened."""

    def __init__(self, maps: DamchaMaps) -> None:
        self.maps = maps

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.maps._end_norm()
        self.maps._close_store()


class DamchaMaps(nn.Module):
    """The DAMCHA parameters of one converted attention module, and its maps.

    Registered as the child ``damcha`` of the attention module. ``gates[side]``
    (S,) start at 0; ``generators[side]`` are ``MetricGenerator`` modules, or,
    with ``share_metric``, borrowed from the first converted layer (registered
    there only, so a checkpoint stores each shared tensor once).

    Args:
        config: the layer's ``DamchaConfig`` (sizes, metric, coupling).
        layout: the attention module's ``AttentionLayout``.
        adapter: name of the adapter that matched the module.
        recompute: in training, recompute the q/k projections and maps in
            backward instead of storing the map's inputs, so activation memory
            stays the original model's.
        shared: generators to borrow, by side (``share_metric``).
    """

    def __init__(
        self,
        config: DamchaConfig,
        layout: AttentionLayout,
        adapter: str,
        *,
        recompute: bool = True,
        shared: Mapping[str, MetricGenerator] | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config, self.layout, self.adapter, self.recompute = config, layout, adapter, recompute
        self.gates = nn.ParameterDict()
        self.generators = nn.ModuleDict()
        self._borrowed: dict[str, MetricGenerator] = {}
        self._installed: dict[str, nn.Module] = {}
        self.track_metric_penalty = False
        self._penalty_terms: dict[str, Tensor] = {}
        self._blocks: dict[str, Any] = {}  # site attr -> the fast paths' blocks (see _site_blocks)
        for side in config.metric_sides:
            S, E = config.side_heads(side), config.side_features(side)
            self.gates[side] = nn.Parameter(torch.zeros(S, device=device, dtype=dtype))
            if shared is not None and side in shared:
                self._borrowed[side] = shared[side]
            else:
                self.generators[side] = MetricGenerator(
                    E, S, config.key_dim, config.metric, config.metric_rank, device=device, dtype=dtype
                )

    def reset_parameters(self) -> None:
        """Zero gates: the layer computes what the unconverted one did (torch's
        meta-device recipe, ``to_empty`` then ``reset_parameters()`` on every
        module that has one, left them holding whatever the memory held). The
        generators are left alone, as ``DamchaAttention.reset_parameters``
        leaves its own: they are modules with their own ``reset_parameters``,
        and may be shared with other layers."""
        with torch.no_grad():
            for side, gate in self.gates.items():
                write_initial(self.gates, side, torch.zeros_like(gate))

    def generator(self, side: str) -> MetricGenerator:
        """The generator of ``side`` ("qk", "q" or "k"), owned or borrowed."""
        if side in self._borrowed:
            return self._borrowed[side]
        return self.generators[side]  # type: ignore[return-value]

    def _offload_hooked(self) -> list[nn.Module]:
        """The modules holding this layer's parameters (the gates' dict and the
        generators, a borrowed one too) that carry an accelerate hook
        (``accelerate.cpu_offload``, ``disk_offload``, ``dispatch_model`` with
        an offloading device map: each module with parameters of its own gets
        a hook that loads them when the module is called). The maps read these
        parameters inside the projections' forward and never call their
        modules, so ``_SiteForward`` runs the hooks itself."""
        # On every projection call: read the module dicts directly (6x cheaper than
        # the attribute and generator() lookups, 0.6 against 3.8 us per call).
        modules = self.__dict__["_modules"]
        gates = modules["gates"]
        hooked = [gates] if gates.__dict__.get("_hf_hook") is not None else []
        for side in self.config.metric_sides:
            generator = self._borrowed.get(side)
            if generator is None:
                generator = modules["generators"]._modules[side]
            if generator.__dict__.get("_hf_hook") is not None:
                hooked.append(generator)
        return hooked

    def extra_repr(self) -> str:
        c = self.config
        shared = f", shared={sorted(self._borrowed)}" if self._borrowed else ""
        return (
            f"adapter={self.adapter!r}, heads={c.num_heads}, kv_heads={c.num_kv_heads}, head_dim={c.key_dim}, "
            f"metric={c.metric!r}, coupling={c.coupling!r}{shared}"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_penalty_terms"] = {}  # tensors of the last forward's graph, not state
        for key in ("_store", "_store_hooks", "_store_pays", "_norm_memo"):  # one call's state, and what it found
            state.pop(key, None)
        return state

    # ------------------------------------------------------------ install

    def install(self, attention: nn.Module) -> None:
        """Patch the projections of ``attention`` and keep them patched."""
        for site in self.layout.sites:
            self._install(site, _child(attention, site.attr))
        attention.register_forward_pre_hook(_SyncHook(self))
        attention.register_forward_pre_hook(_StoreOpen(self))
        attention.register_forward_hook(_StoreClose(self), always_call=True)

    def _install(self, site: ProjectionSite, projection: nn.Module) -> None:
        previous = projection.__dict__.get("forward")
        if isinstance(previous, _SiteForward):
            raise DamchaValueError(
                dc.invalid_argument(
                    site.attr,
                    "a projection without a DAMCHA map; it already carries one (converted twice?)",
                    f"{site.attr}={type(projection).__name__}",
                )
            )
        projection.forward = _SiteForward(self, projection, site, previous)
        self._installed[site.attr] = projection

    def _uninstall(self, attr: str) -> None:
        projection = self._installed.pop(attr, None)
        if projection is None:
            return
        fwd = projection.__dict__.get("forward")
        if isinstance(fwd, _SiteForward):
            if fwd.previous is None:
                del projection.__dict__["forward"]
            else:
                projection.forward = fwd.previous

    def sync(self, attention: nn.Module) -> None:
        """Re-attach the maps to projections replaced since conversion (PEFT),
        or whose ``forward`` was reset by someone else (accelerate's hooks)."""
        for site in self.layout.sites:
            current = attention._modules.get(site.attr)
            installed = self._installed.get(site.attr)
            if current is None or current is not installed or not _carries_site(current):
                self._uninstall(site.attr)
                self._install(site, _child(attention, site.attr))

    # ---------------------------------------------------------------- math

    def _recompute_now(self) -> bool:
        # torch.func transforms reject checkpoint's saved-tensor hooks; store instead.
        # Under torch.jit.trace a site takes the plain projection and maps in every grad
        # mode (its check traces again under no_grad; a fused node would be a Python op).
        return (
            self.recompute
            and self.training
            and torch.is_grad_enabled()
            and not torch._C._are_functorch_transforms_active()
            and not fn.jit_tracing()
        )

    def _open_store(self) -> None:
        """Store mode for this call of the attention module, where it pays: in
        training with ``recompute`` on CPU, with no saved-tensor hooks of the
        caller's (checkpointing, save_on_cpu: only one pair applies at a time,
        and theirs must see what the host saves), the fused projections run
        as ``StoredProjectionMaps`` and every view of their outputs that the
        host saves for backward is saved as its ``OutputRecipe`` (see there):
        the backward then projects nothing again. A host that saved none of
        them in a call (a rotary one: its kernel saves q and k after RoPE)
        is not put in store mode again, its outputs' copies would buy nothing."""
        if torch.compiler.is_compiling():
            return
        if not self._recompute_now() or self.track_metric_penalty:
            return
        if self.__dict__.get("_store_pays", True) is False or "_store" in self.__dict__:
            return
        if torch._C._are_functorch_transforms_active() or fn._saved_tensor_hooks_on():
            return
        if any(g.device.type != "cpu" for g in self.gates.values()):
            return  # CPU kernels save their inputs as given (measured); others are not
        # The hooks open only after the first stored node (``_stored_site``):
        # what the host and the node save before it cannot be a view of a
        # mapped output, and every tensor packed under the hooks costs a detach.
        self.__dict__["_store"] = []

    def _stored_site(self, recipe: _fused.OutputRecipe) -> None:
        """A site ran in store mode with ``recipe``: open the hooks if not yet open."""
        recipes = self.__dict__["_store"]
        recipes.append(recipe)
        if "_store_hooks" not in self.__dict__:
            hooks = _fused.saved_as_recipes(recipes)
            hooks.__enter__()
            self.__dict__["_store_hooks"] = hooks

    def _close_store(self) -> None:
        if torch.compiler.is_compiling():
            return
        recipes = self.__dict__.pop("_store", None)
        if recipes is None:
            return
        hooks = self.__dict__.pop("_store_hooks", None)
        if hooks is not None:
            hooks.__exit__(None, None, None)
        for recipe in recipes:
            recipe.settle()
        if recipes and not any(recipe.hits for recipe in recipes):
            self.__dict__["_store_pays"] = False

    def _site_blocks(self, site: ProjectionSite) -> tuple[_fused.SideBlocks, ...] | None:
        """The blocks of ``site``'s output each side maps, for the fast paths
        (metrics "heads" and "lowrank"; ``None`` otherwise). Made once per site."""
        cache = self.__dict__.setdefault("_blocks", {})  # absent in modules pickled before it existed
        cached = cache.get(site.attr, False)
        if cached is not False:
            return cached
        cfg = self.config
        blocks: tuple[_fused.SideBlocks, ...] | None = None
        # The fast paths read each side's heads as one block of S*d features,
        # or, on an interleaved site (groups > 1), as one head per run
        # (GPT-NeoX's and BLOOM's query_key_value, Qwen3-Next's gated q_proj:
        # SideBlocks.groups). Several heads of a role per run (Falcon's new
        # decoder architecture) and "lowrank" there keep the general path.
        heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads}
        interleaved = site.groups > 1
        if cfg.metric in ("heads", "lowrank") and (
            not interleaved or (cfg.metric == "heads" and all(heads[role] == site.groups for role, _ in site.roles()))
        ):
            by_side: dict[str, list[int]] = {}
            for role, offset in site.roles():
                side = dc.side_of(cfg, role)
                if side is not None:  # the keys under coupling "query" keep the identity map
                    by_side.setdefault(side, []).append(offset)
            blocks = tuple(
                _fused.SideBlocks(side, cfg.side_heads(side), cfg.key_dim, tuple(offsets), cfg.metric, site.groups)
                for side, offsets in by_side.items()
            )
        cache[site.attr] = blocks
        return blocks

    def _run_site(self, fwd: _SiteForward, x: Tensor, args: tuple, kwargs: dict) -> Tensor:
        blocks = self._site_blocks(fwd.site)
        if blocks == ():
            # No role of this site is mapped (the keys under coupling "query"): the host's
            # projection as it is (the fused training node had no block to write and failed).
            return fwd.project(x, *args, **kwargs)
        if blocks is not None and not self.track_metric_penalty and x.is_floating_point():
            weights = [self.generator(b.side).side(fn.tool_entry(self.gates, b.side)) for b in blocks]
            if not torch.is_grad_enabled() and not fn.jit_tracing():  # (traced: see _recompute_now)
                # No graph: map the projection's fresh output in place, no copies
                # (16-bit outputs, autocast's included, get float32 corrections).
                y = fwd.project(x, *args, **kwargs)
                if y.is_contiguous() and y.is_floating_point():
                    # The C kernel in eval mode only: in training a no-grad forward may be a
                    # reentrant checkpoint's, whose recomputation with a graph (the fused
                    # node, torch ops) must give the same bits.
                    return _fused.map_blocks_(
                        y,
                        x,
                        list(zip(blocks, weights)),
                        merge=True,
                        norm=self._shared_norm(x),
                        kernel=not self.training,
                    )
                return self.apply_maps(fwd.site, x, y)
            leaves = [t for w in weights for t in _fused.side_leaves(w)]
            # The fused training node: float32/float64 outside autocast only. Under
            # autocast the host's projection saves its 16-bit casts of x and W and
            # computes its gradients through them; the general path (a checkpoint
            # of the projection and the map) gets exactly those from autocast itself.
            if _plain_dtype(x) and all(t.dtype == x.dtype for t in leaves):
                parts = (
                    _fused_parts(fwd.projection)
                    if (
                        self._recompute_now()
                        and not args
                        and not kwargs
                        and fwd.previous is None
                        and not torch.compiler.is_compiling()
                    )
                    else None
                )
                if parts is not None and all(t is None or t.dtype == x.dtype for t in parts[1:5]):
                    # One autograd node for the projection and its maps, saving what the projection saves.
                    transposed, weight, bias, lora_a, lora_b, scaling = parts
                    # Store mode's recipes read blocks of consecutive heads only.
                    if "_store" in self.__dict__ and fwd.site.groups == 1:
                        recipe = _fused.OutputRecipe()
                        out = _fused.StoredProjectionMaps.apply(
                            recipe,
                            blocks,
                            transposed,
                            scaling,
                            self._shared_norm(x),
                            x,
                            weight,
                            bias,
                            lora_a,
                            lora_b,
                            *leaves,
                        )
                        self._stored_site(recipe)
                        return out
                    return _fused.FusedProjectionMaps.apply(
                        blocks, transposed, scaling, self._shared_norm(x), x, weight, bias, lora_a, lora_b, *leaves
                    )
        if self._recompute_now():
            # Only x (which the projection keeps anyway) is stored; the projected
            # q/k and the map's coefficients are recomputed in backward.
            return checkpoint(self._project_and_map, fwd, x, args, kwargs, use_reentrant=False)
        return self._project_and_map(fwd, x, args, kwargs)

    def _shared_norm(self, x: Tensor) -> _fused.SharedNorm | None:
        """The ``SharedNorm`` of the tokens x for this call of the attention
        module: the one an earlier site of this call made for the same tensor
        (unmodified since), or a new one, kept (x only weakly) until the
        module returns (``_end_norm``). None while compiling (traced graphs
        share the norm themselves) and for inference tensors (no version
        counter tells whether x changed in place between the sites)."""
        if torch.compiler.is_compiling() or x.is_inference():
            return None
        memo = self.__dict__.get("_norm_memo")
        if memo is not None and memo[0]() is x and memo[1] == x._version:
            return memo[2]
        norm = _fused.SharedNorm()
        self.__dict__["_norm_memo"] = (weakref.ref(x), x._version, norm)
        return norm

    def _end_norm(self) -> None:
        if torch.compiler.is_compiling():
            return
        memo = self.__dict__.pop("_norm_memo", None)
        if memo is not None:
            memo[2].end_forward()

    def _project_and_map(self, fwd: _SiteForward, x: Tensor, args: tuple, kwargs: dict) -> Tensor:
        return self.apply_maps(fwd.site, x, fwd.project(x, *args, **kwargs))

    def apply_maps(self, site: ProjectionSite, tokens: Tensor, y: Tensor) -> Tensor:
        """Map the query/key heads of a projection output y (..., F) of ``tokens`` (..., E)."""
        cfg = self.config
        # The output (one run of it per group, see ProjectionSite) as consecutive
        # blocks: (role or None, width). One split (whose backward is one cat)
        # rather than slices (each slice's backward fills a zero tensor of the
        # whole output).
        blocks = site.blocks(cfg.num_heads, cfg.side_heads("k"), cfg.key_dim, y.shape[-1])
        groups = site.groups
        runs = y if groups == 1 else y.unflatten(-1, (groups, y.shape[-1] // groups))
        out = list(runs.split([w for _, w in blocks], dim=-1)) if len(blocks) > 1 else [runs]
        # The parts each side maps, so that a side's generator runs once for
        # all of them (tied q and k of one projection: one A(t)).
        by_side: dict[str, list[int]] = {}
        for i, (block_role, _) in enumerate(blocks):
            # A role without a side (the keys under coupling "query") keeps the identity map.
            side = None if block_role is None else dc.side_of(cfg, block_role)
            if side is not None:
                by_side.setdefault(side, []).append(i)
        with _no_autocast(y):
            for side, indices in by_side.items():
                # A role's heads of all runs, (..., groups, S/groups * d) -> (..., S * d) in head order.
                parts = tuple(out[i] if groups == 1 else out[i].flatten(-2) for i in indices)
                mapped = self.apply_map(side, tokens, parts)
                for i, part in zip(indices, mapped):
                    out[i] = (part if groups == 1 else part.unflatten(-1, (groups, -1))).to(y.dtype)
                if self.track_metric_penalty:
                    for i in indices:
                        mapped_role = blocks[i][0]
                        assert mapped_role is not None  # by_side holds mapped blocks only
                        self._penalty_terms[mapped_role] = self.generator(side).penalty(
                            tokens, fn.tool_entry(self.gates, side)
                        )
        joined = out[0] if len(out) == 1 else torch.cat(out, dim=-1)
        return joined if groups == 1 else joined.flatten(-2)

    def apply_map(self, side: str, tokens: Tensor, parts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """L(t) y for each y of ``parts``, heads flattened to (..., S*d): the
        layer's own map (``_functional.apply_map_weights``: residual form,
        16-bit inputs computed in float32), so both integrations run one code."""
        gate = fn.tool_entry(self.gates, side)
        S, d = gate.shape[0], self.config.key_dim
        heads = tuple(part.unflatten(-1, (S, d)) for part in parts)
        mapped = fn.apply_map_weights(self.generator(side).side(gate), tokens, heads)
        return tuple(m.flatten(-2) for m in mapped)

    @property
    def last_metric_penalty(self) -> Tensor | None:
        """Mean over the roles mapped in the last forward of ||L(t) - I||_F^2 / (S*d)
        (recorded only while ``track_metric_penalty`` is True). Each role's term
        is the one its projection's last call recorded: a module called several
        times per model forward (ALBERT's, one per depth) holds its last call's,
        and a cross-attention whose keys a cache holds keeps the key term of the
        call that projected them."""
        if not self._penalty_terms:
            return None
        return torch.stack(list(self._penalty_terms.values())).mean()


def _plain_dtype(x: Tensor) -> bool:
    """float32/float64 tokens outside autocast: the fast paths' precondition
    (16-bit heads are mapped in float32 by the general path)."""
    if x.dtype not in (torch.float32, torch.float64):
        return False
    device = x.device.type
    return not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device))


def _fused_projection(projection: nn.Module) -> bool | None:
    """Whether the fused training node can compute ``projection`` itself:
    False for a plain ``nn.Linear`` (weight (out, in)), True for transformers'
    ``Conv1D`` (GPT-2; weight (in, out)), None for anything else (a LoRA
    wrapper, a subclass with its own forward), which keeps the general path."""
    forward = type(projection).forward
    if forward is nn.Linear.forward:
        return False
    # Conv1D by its defining module, so that transformers need not be imported.
    if forward.__module__ == "transformers.pytorch_utils" and forward.__qualname__ == "Conv1D.forward":
        weight = getattr(projection, "weight", None)
        if isinstance(weight, Tensor) and weight.dim() == 2:
            return True
    return None


def _fused_parts(
    projection: nn.Module,
) -> tuple[bool, Tensor, Tensor | None, Tensor | None, Tensor | None, float] | None:
    """What the fused training node computes for ``projection``: (transposed,
    weight, bias, lora_a, lora_b, scaling), or None (the general path).

    A plain ``nn.Linear`` or ``Conv1D``; or PEFT's LoRA ``Linear`` around one
    of them whose forward is exactly base(x) + lora_B(lora_A(x)) * scaling:
    one active adapter, no variant (DoRA, ...), not merged or disabled, no
    dropout, plain bias-free ``nn.Linear`` A and B, no hooks inside."""
    transposed = _fused_projection(projection)
    if transposed is not None:
        return transposed, projection.weight, projection.bias, None, None, 1.0  # type: ignore[return-value]
    forward = type(projection).forward
    if forward.__module__ != "peft.tuners.lora.layer" or forward.__qualname__ != "Linear.forward":
        return None
    p: Any = projection
    variants = getattr(p, "lora_variant", None)
    if variants is None or p.disable_adapters or p.merged:
        return None
    active = [a for a in p.active_adapters if a in p.lora_A]
    if len(active) != 1 or active[0] in variants:
        return None
    name = active[0]
    base, lora_a, lora_b, dropout, scaling = (
        p.base_layer,
        p.lora_A[name],
        p.lora_B[name],
        p.lora_dropout[name],
        p.scaling[name],
    )
    transposed = _fused_projection(base)
    if (
        transposed is None
        or type(dropout) is not nn.Identity
        or not isinstance(scaling, (int, float))
        or any(type(m).forward is not nn.Linear.forward or m.bias is not None for m in (lora_a, lora_b))
        or not fn.no_hooks(base, lora_a, lora_b, dropout)
    ):
        return None
    return transposed, base.weight, base.bias, lora_a.weight, lora_b.weight, float(scaling)


def _child(module: nn.Module, attr: str) -> nn.Module:
    child = getattr(module, attr, None)
    if not isinstance(child, nn.Module):
        raise DamchaValueError(
            dc.invalid_argument(
                "module",
                f"an attention module with a projection module `{attr}`; {type(module).__name__} has none",
                f"module.{attr}={describe(child)}",
            )
        )
    return child


def _projection_features(projection: Any) -> tuple[int, int] | None:
    """(in, out) features of a projection: nn.Linear, transformers' Conv1D
    (weight (in, out)), or a wrapper exposing them (PEFT's LoRA layers); None
    when it tells neither. The adapters (``_models_layouts._features``) and
    ``convert``'s site check read them here."""
    if hasattr(projection, "in_features") and hasattr(projection, "out_features"):
        return int(projection.in_features), int(projection.out_features)
    if hasattr(projection, "nx") and hasattr(projection, "nf"):
        return int(projection.nx), int(projection.nf)
    base = getattr(projection, "get_base_layer", None)
    if callable(base) and base() is not projection:
        return _projection_features(base())
    return None


# ------------------------------------------------------------------ convert


def _is_attention_like(module: nn.Module) -> bool:
    name = type(module).__name__
    return "attention" in name.lower() or name.endswith("Attn")


# Per-head query and key norms (children even where they are nn.Identity): timm's
# ParallelScalingBlock computes attention and MLP from one fused `in_proj` (not a
# name in damcha_core._layout's tables) and was left without maps while an attention-pool head beside it converted.
_QK_NORMS = (("q_norm", "k_norm"), ("query_norm", "key_norm"), ("q_layernorm", "k_layernorm"))


def _projects_queries_and_keys(module: nn.Module) -> bool:
    """``module`` holds query/key projections of its own (children with weights
    under ``_layout.FUSED_QK_NAMES``/``QUERY_KEY_NAMES``) or query/key norms: it computes attention whatever
    its class is named."""

    def weighted(attr: str) -> bool:
        child = module._modules.get(attr)
        return child is not None and next(child.parameters(), None) is not None

    children = module._modules
    return (
        any(weighted(a) for a in _layout.FUSED_QK_NAMES)
        or any(weighted(q) and weighted(k) for q, k in _layout.QUERY_KEY_NAMES)
        or any(children.get(q) is not None and children.get(k) is not None for q, k in _QK_NORMS)
    )


def _inside(name: str, prefixes: list[str]) -> bool:
    return any(name != p and (p == "" or name.startswith(p + ".")) for p in prefixes)


def _find(model: nn.Module) -> tuple[list[tuple[str, nn.Module, ModelAdapter]], list[tuple[str, nn.Module]], list[str]]:
    """(matched layers, nn.MultiheadAttention modules, unknown attention-like modules)."""
    _load_builtin_adapters()
    matched: list[tuple[str, nn.Module, ModelAdapter]] = []
    mhas: list[tuple[str, nn.Module]] = []
    claimed: list[str] = []
    for name, module in model.named_modules():
        if _inside(name, claimed):
            continue
        if isinstance(module, (DamchaAttention, DamchaMaps)):
            claimed.append(name)
        elif isinstance(module, nn.MultiheadAttention):
            mhas.append((name, module))
            claimed.append(name)
        else:
            adapter = next((a for a in _ADAPTERS if a.matches(module)), None)
            if adapter is not None:
                matched.append((name, module, adapter))
                claimed.append(name)
    unknown = []
    for name, module in model.named_modules():
        if name in claimed or _inside(name, claimed):
            continue
        if _projects_queries_and_keys(module):
            pass  # attention of its own, even beside converted layers it holds
        elif not _is_attention_like(module) or any(_inside(c, [name]) for c in claimed):
            continue  # not attention, or a container of converted layers (BertAttention holds BertSelfAttention)
        unknown.append(f"{name or '<model>'} ({type(module).__module__}.{type(module).__qualname__})")
    return matched, mhas, unknown


def _supported_text() -> str:
    # A pointer, not the list: inlined, the layouts' descriptions (~6,000
    # characters) came before the part that names the user's layer.
    return f"one of the {len(supported_layouts())} that damcha_torch.supported_layouts() lists"


def convert(
    model: nn.Module,
    *,
    metric: str = "heads",
    metric_rank: int | None = None,
    coupling: str | None = "auto",
    share_metric: bool = False,
    recompute: bool = True,
) -> nn.Module:
    """Convert every supported attention layer of ``model`` to DAMCHA, in place.

    The converted model computes exactly what it computed before (gates start
    at 0), with the same parameter names plus a ``damcha`` child in each
    converted attention module (``nn.MultiheadAttention`` is replaced by
    ``DamchaAttention.from_mha``). The maps act on the projected queries and
    keys, before per-head q/k norms, RoPE and the key/value cache.

    Args:
        model: a torch module, e.g. a transformers ``LlamaForCausalLM`` or a
            timm ``VisionTransformer``, or a single attention module.
        metric: "heads" (default) or "lowrank".
        metric_rank: r for "lowrank".
        coupling: "auto" (default; ``None`` means the same): "tied" where
            queries and keys read the same tokens with as many heads (self-
            attention without GQA), "separate" otherwise (GQA/MQA, cross-
            attention); or force "tied", "separate" or "query".
        share_metric: one generator per side for all converted layers (the
            stack-wise sharing of the spec); each layer keeps its own gates.
        recompute: in training, recompute q/k projections and maps in
            backward, so activation memory equals the original model's.

    Returns:
        ``model``, converted.

    Raises:
        DamchaTypeError: ``model`` not a module, ``metric`` not a string,
            ``share_metric`` or ``recompute`` not a bool.
        DamchaValueError: no supported attention layer, an attention layer of
            a layout no adapter knows (nothing is converted then), a model
            already converted, or an unknown ``metric``.
    """
    if not isinstance(model, nn.Module):
        raise DamchaTypeError(dc.invalid_argument("model", "a torch.nn.Module", f"model={describe(model)}"))
    metric = dc.check_choice("metric", metric, ("heads", "lowrank"))
    coupling = _layout.check_coupling(coupling)
    for name, value in (("share_metric", share_metric), ("recompute", recompute)):
        if not isinstance(value, bool):
            raise DamchaTypeError(dc.invalid_argument(name, "a bool", f"{name}={describe(value)}"))
    if isinstance(model, nn.MultiheadAttention):
        raise DamchaValueError(
            dc.invalid_argument(
                "model",
                "a model that contains attention layers; it is itself an nn.MultiheadAttention "
                "(use DamchaAttention.from_mha(model))",
                f"model={describe(model)}",
            )
        )
    if any(isinstance(m, DamchaMaps) for m in model.modules()):
        raise DamchaValueError(
            dc.invalid_argument(
                "model",
                f"a model not yet converted; it is already converted (it has DAMCHA maps: "
                f"{', '.join(converted_layers(model))})",
                f"model={type(model).__name__}",
            )
        )
    matched, mhas, unknown = _find(model)
    for name, mha in mhas:
        # Before anything is converted: a subclass with its own forward would be
        # swapped for a layer with different outputs, a weight tool dropped.
        _convert_mod.check_replaceable(mha, f"model.{name}")
    # Validate every layer before touching any: a failure leaves the model as it was.
    plans, failures = _plans(matched, metric, metric_rank, coupling)
    if unknown:
        # The known layers that cannot be converted too: a refusal naming only
        # some attention-named module would hide them.
        also = (
            f"; and layers of known layouts that cannot be converted: {'; '.join(str(e) for e in failures[:3])}"
            if failures
            else ""
        )
        raise DamchaValueError(
            dc.invalid_argument(
                "model",
                f"attention layers of a layout convert() knows ({_supported_text()}; teach it another with "
                "damcha_torch.register_adapter). Nothing was converted",
                f"model with layers of unknown layouts: {', '.join(unknown[:5])}"
                + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
                + also,
            )
        )
    if failures:
        raise failures[0]
    if not matched and not mhas:
        already = [n for n, m in model.named_modules() if isinstance(m, DamchaAttention)]
        if already:
            raise DamchaValueError(
                dc.invalid_argument(
                    "model",
                    f"a model not yet converted; it is already converted (DamchaAttention at {', '.join(already[:5])})",
                    f"model={type(model).__name__}",
                )
            )
        raise DamchaValueError(
            dc.invalid_argument(
                "model",
                f"a model with an attention layer convert() supports ({_supported_text()}); it has no attention layer "
                "convert() supports",
                f"model={type(model).__name__}",
            )
        )

    shared: dict[str, MetricGenerator] = {}
    if share_metric:
        _layout.check_shareable([(n, c) for n, _, _, _, c in plans])
    _check_projections_not_shared([(n, m, layout) for n, m, _, layout, _ in plans])

    # Build every new module before installing any (the maps, then the layers
    # replacing nn.MultiheadAttention, which may borrow the maps' shared
    # generators): a layer that cannot be converted leaves the model as it was.
    built = []
    for _name, module, adapter, layout, config in plans:
        ref = next(module.parameters(), None)
        maps = DamchaMaps(
            config,
            layout,
            adapter.name,
            recompute=recompute,
            shared=shared if share_metric else None,
            device=None if ref is None else ref.device,
            dtype=None if ref is None or not ref.is_floating_point() else ref.dtype,
        )
        if share_metric:
            for side in config.metric_sides:
                shared.setdefault(side, maps.generator(side))
        built.append((module, maps))
    _share_tied(model, plans, built)
    replacements = None
    if mhas:
        kwargs: dict[str, Any] = {
            "metric": metric,
            "metric_rank": metric_rank,
            "recompute": recompute,
            "coupling": None if coupling == "auto" else coupling,
        }
        overrides = _probe_heads(model, mhas) if coupling == "auto" else {}
        if share_metric:
            first = overrides.get(id(mhas[0][1]), {}).get("coupling", kwargs["coupling"])
            kwargs["metric_generator"] = _mha_shared(mhas, metric, metric_rank, first, shared)
        replacements = _convert_mod.build_replacements(model, kwargs, overrides)

    for module, maps in built:
        module.add_module(CONFIG_KEY, maps)
        # A model converted in eval mode (from_pretrained returns one) stays in it.
        maps.train(module.training)
        maps.install(module)
    if replacements:
        _convert_mod.install_replacements(model, replacements)
    _register_host_ties(model)

    _record(model, metric=metric, metric_rank=metric_rank, coupling=coupling, share_metric=share_metric)
    return model


def _plans(
    matched: list[tuple[str, nn.Module, ModelAdapter]], metric: str, metric_rank: int | None, coupling: str
) -> tuple[
    list[tuple[str, nn.Module, ModelAdapter, AttentionLayout, DamchaConfig]], list[DamchaValueError | DamchaTypeError]
]:
    """(name, module, adapter, layout, config) of each matched layer, and the
    errors of those that cannot be converted ("Cannot convert layer `name`
    (adapter): why"), without changing any module."""
    plans: list = []
    failures: list[DamchaValueError | DamchaTypeError] = []
    for name, module, adapter in matched:
        try:
            layout = _layout.check_layout(adapter, adapter.layout(module))
            config = _layout.layout_config(layout, metric=metric, metric_rank=metric_rank, coupling=coupling)
            for site in layout.sites:
                # The blocks the maps read and the tokens the generators read, checked
                # against the projection's sizes where it tells them (apply_maps checks
                # every call's output anyway).
                features = _projection_features(_child(module, site.attr))
                if features is not None:
                    _layout.check_site_sizes(layout, site, in_features=features[0], out_features=features[1])
        except (DamchaValueError, DamchaTypeError) as exc:
            failures.append(type(exc)(f"Cannot convert layer `{name}` ({adapter.name}): {exc}"))
            continue
        plans.append((name, module, adapter, layout, config))
    return plans, failures


def _share_tied(model: nn.Module, plans: list, built: list[tuple[nn.Module, DamchaMaps]]) -> None:
    """Layers whose projections are the same parameters (the host ties them:
    transformers builds Zamba's and Zamba2's shared transformer block once per
    hybrid layer and ties their weights) share their maps' gates and
    generators too, registered in each as the host registers its tied
    weights. One block applied at several depths gets one set of maps, as
    ALBERT's one module does; and the host's own tying, which
    ``tie_weights()`` and ``resize_token_embeddings()`` re-apply by module
    prefix, then finds them tied already (it used to tie every block's maps to
    the first's, silently merging maps trained apart)."""
    # Tied by the host's rules (target -> source parameter names) as well as by identity:
    # from_pretrained builds the model with its blocks untied and ties them after loading.
    rules = model.__dict__.get("all_tied_weights_keys")
    rules = rules if isinstance(rules, dict) else {}
    named: dict[int, str] = {}  # a parameter object -> the first name it was seen under

    def source(full: str, p: nn.Parameter) -> str:
        return rules.get(full) or named.setdefault(id(p), full)

    first: dict[tuple[str, ...], tuple[DamchaMaps, DamchaConfig]] = {}
    for (name, module, _adapter, layout, config), (_, maps) in zip(plans, built):
        key = tuple(
            source(".".join(part for part in (name, site.attr, pname) if part), p)
            for site in layout.sites
            for pname, p in _child(module, site.attr).named_parameters()
        )
        if not key:
            continue
        owner, owner_config = first.setdefault(key, (maps, config))
        if owner is maps or owner_config != config:
            continue
        for side in config.metric_sides:
            maps.gates[side] = owner.gates[side]
            if side in owner._borrowed:  # share_metric: both borrow the one shared generator already
                continue
            # Registered where the owner registers it (share_metric's first layer registers the shared
            # generator, the others borrow it): the host's prefix rule pairs the blocks' tensors by name.
            maps._borrowed.pop(side, None)
            maps.generators[side] = owner.generators[side]


def _register_host_ties(model: nn.Module) -> None:
    """Tell transformers that the maps of tied blocks are tied (``_share_tied``):
    it expands a module-prefix tie rule (Zamba's ``"layers.2.shared_transformer":
    "layers.0.shared_transformer"``) into parameter names at ``post_init``, before
    ``convert``, and from that list ``save_pretrained`` drops the tied copies and
    ``from_pretrained`` ties them again (a converted checkpoint loaded the later
    blocks' maps as "newly initialized" zeros, untied). Only DAMCHA's own names
    are added; the host's entries are left as they are."""
    for module in model.modules():
        tied = module.__dict__.get("all_tied_weights_keys")
        expand = getattr(module, "get_expanded_tied_weights_keys", None)
        if not isinstance(tied, dict) or not callable(expand):
            continue
        try:
            expanded = expand(all_submodels=True)
        except ValueError:
            # A rule whose source and target no longer pair up (a module of one converted, of the
            # other not): the host's own list stays as it was, as its own re-tying will find it.
            continue
        tied.update({k: v for k, v in expanded.items() if f".{CONFIG_KEY}." in f".{k}"})


def _check_projections_not_shared(layers: list[tuple[str, nn.Module, AttentionLayout]]) -> None:
    """Refuse a projection module that two converted layers (or two sites of
    one) would both hook: its one forward can carry one layer's maps, so the
    other layer's gates and generators would never act."""
    owner: dict[int, str] = {}
    for name, module, layout in layers:
        for site in layout.sites:
            projection = _child(module, site.attr)
            where = f"{name or '<model>'}.{site.attr}"
            first = owner.setdefault(id(projection), where)
            if first != where:
                raise DamchaValueError(
                    dc.invalid_argument(
                        "model",
                        "attention layers with projection modules of their own (a projection module called by "
                        "two converted layers could carry the maps of one only). Nothing was converted",
                        f"one {type(projection).__name__} at {first} and {where}",
                    )
                )


def _probe_heads(model: nn.Module, mhas: list[tuple[str, nn.Module]]) -> dict[int, dict[str, Any]]:
    """The nn.MultiheadAttention layers of attention-pooling heads, with coupling
    "separate": a learned ``probe`` of their parent is the query, the tokens the
    keys (transformers' SigLIP and SigLIP 2 pooling heads), so queries and keys
    read other tokens, as in timm's ``AttentionPoolLatent`` (its own adapter
    maps them apart too). Other MHA layers keep ``from_mha``'s rule (tied when
    ``kdim == embed_dim``): how they are called is not known before they are."""
    out: dict[int, dict[str, Any]] = {}
    for name, mha in mhas:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        if isinstance(getattr(parent, "probe", None), nn.Parameter):
            out[id(mha)] = {"coupling": "separate"}
    return out


def _mha_shared(mhas, metric, metric_rank, coupling, shared):
    mha = mhas[0][1]
    sides = ("qk",) if (coupling or ("tied" if mha.kdim == mha.embed_dim else "separate")) == "tied" else ("q", "k")
    out = {}
    ref = mha.out_proj.weight
    for side in sides:
        if side not in shared:
            feats = mha.embed_dim if side != "k" else mha.kdim
            shared[side] = MetricGenerator(
                feats, mha.num_heads, mha.head_dim, metric, metric_rank, device=ref.device, dtype=ref.dtype
            )
        out[side] = shared[side]
    return out["qk"] if sides == ("qk",) else out


def _record(model: nn.Module, **options: Any) -> None:
    """Write the options into a transformers config, saved with save_pretrained."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict") and hasattr(config, "save_pretrained"):
        setattr(
            config,
            CONFIG_KEY,
            {
                "format": CONFIG_FORMAT,
                "load_with": "damcha_torch.from_pretrained(<model class>, path); the plain class drops the DAMCHA maps",
                **options,
            },
        )


# ------------------------------------------------------------------ helpers


def converted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> attention module, for every layer of ``model`` carrying DAMCHA
    (converted by ``convert``, or a ``DamchaAttention``)."""
    if not isinstance(model, nn.Module):
        raise DamchaTypeError(dc.invalid_argument("model", "a torch.nn.Module", f"model={describe(model)}"))
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, DamchaAttention) or isinstance(
            getattr(module, "_modules", {}).get(CONFIG_KEY), DamchaMaps
        ):
            out[name] = module
    return out


def _damcha_named(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, module in model.named_modules():
        if isinstance(module, DamchaMaps):
            for pname, p in module.named_parameters():
                yield f"{name}.{pname}", p
        elif isinstance(module, DamchaAttention):
            for pname, p in module.named_parameters():
                if pname.startswith(("metric_gates.", "metric_generators.")):
                    yield f"{name}.{pname}", p


def damcha_parameters(model: nn.Module, *, gates: bool = True, generators: bool = True) -> list[nn.Parameter]:
    """The DAMCHA parameters of ``model`` (gates and metric generators), each once,
    e.g. for an optimizer group of their own.

    Args:
        model: a converted model.
        gates: include the gates.
        generators: include the metric generators' parameters.
    """
    if not isinstance(model, nn.Module):
        raise DamchaTypeError(dc.invalid_argument("model", "a torch.nn.Module", f"model={describe(model)}"))
    # gates='no' read as true: include the gates.
    gates, generators = dc.check_bool("gates", gates), dc.check_bool("generators", generators)
    out, seen = [], set()
    for name, p in _damcha_named(model):
        is_gate = ".gates." in f".{name}" or ".metric_gates." in f".{name}"
        if (is_gate and not gates) or (not is_gate and not generators) or id(p) in seen:
            continue
        seen.add(id(p))
        out.append(p)
    return out


def track_metric_penalty(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Turn recording of the metric penalty on (or off) in every DAMCHA layer
    (converted layers and ``DamchaAttention``); returns ``model``. After a
    forward, ``damcha_torch.metric_penalty(model)`` averages what they recorded."""
    if not isinstance(model, nn.Module):
        raise DamchaTypeError(dc.invalid_argument("model", "a torch.nn.Module", f"model={describe(model)}"))
    enabled = dc.check_bool("enabled", enabled)  # bool("False") would be True
    for m in model.modules():
        if isinstance(m, (DamchaMaps, DamchaAttention)):
            m.track_metric_penalty = enabled
    return model


# --------------------------------------------------------------- checkpoints


def recorded_options(path: str | os.PathLike) -> dict[str, Any] | None:
    """The convert() options recorded in ``path/config.json``, or None."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(file):
        return None
    with open(file, encoding="utf-8") as f:
        options = json.load(f).get(CONFIG_KEY)
    return options if isinstance(options, dict) else None


def from_pretrained(cls: type, path: str | os.PathLike, *, recompute: bool = True, **kwargs: Any) -> nn.Module:
    """Load a converted transformers checkpoint (saved with ``save_pretrained``).

    Reads the options ``convert`` recorded in ``config.json``, builds ``cls``
    converted with them, and loads every tensor, DAMCHA ones included, through
    ``cls.from_pretrained`` (so ``dtype=``, ``device_map=`` and sharded
    checkpoints work as usual).

    Args:
        cls: the transformers model class, e.g. ``LlamaForCausalLM``, or an
            Auto class (``AutoModelForCausalLM``).
        path: the checkpoint folder.
        recompute: as in ``convert``.
        **kwargs: passed to ``cls.from_pretrained``.

    Raises:
        DamchaTypeError: ``cls`` is not a model class, ``path`` not a path.
        DamchaValueError: ``path`` is not a local folder holding
            ``config.json``, or the checkpoint records no DAMCHA conversion
            (load it with ``cls.from_pretrained`` and call ``convert``).
    """
    if not isinstance(cls, type) or not hasattr(cls, "from_pretrained"):
        raise DamchaTypeError(dc.invalid_argument("cls", "a transformers model class", f"cls={describe(cls)}"))
    if not isinstance(path, (str, os.PathLike)):
        raise DamchaTypeError(
            dc.invalid_argument("path", "a folder path (str or os.PathLike)", f"path={describe(path)}")
        )
    if not os.path.isfile(os.path.join(os.fspath(path), "config.json")):
        # The options are read from the folder before transformers sees it: a Hub id is not one.
        found = "a folder without config.json" if os.path.isdir(path) else "no such folder"
        raise DamchaValueError(
            dc.invalid_argument(
                "path",
                "a local folder written by save_pretrained, holding config.json (a Hub checkpoint: download it "
                "first, e.g. huggingface_hub.snapshot_download)",
                f"path={os.fspath(path)!r} ({found})",
            )
        )
    try:
        options = recorded_options(path)
    except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError is a ValueError
        raise DamchaValueError(
            dc.invalid_argument("path", "a folder whose config.json is JSON", f"path={os.fspath(path)!r} ({exc})")
        ) from exc
    if options is None or options.get("format") != CONFIG_FORMAT:
        raise DamchaValueError(
            dc.invalid_argument(
                "path",
                f"a DAMCHA checkpoint; its config.json records no '{CONFIG_KEY}' conversion (load a plain checkpoint "
                f"with {getattr(cls, '__name__', cls)}.from_pretrained and call damcha_torch.convert)",
                f"path={os.fspath(path)!r}",
            )
        )
    opts = {k: options[k] for k in ("metric", "metric_rank", "coupling", "share_metric")}
    # A transformers model class, whose from_pretrained and __init__ `type` does not know of.
    host: Any = cls
    if hasattr(host, "_model_mapping"):  # an Auto class: the concrete class its config maps to
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        host = host._model_mapping[type(config)]

    def __init__(self: Any, *args: Any, **kw: Any) -> None:
        host.__init__(self, *args, **kw)
        convert(self, recompute=recompute, **opts)

    # A subclass converts right after construction, so from_pretrained's own
    # loader sees the DAMCHA tensors as expected keys; the instance gets its
    # class back afterwards (the subclass adds no state).
    converting: Any = type(host.__name__, (host,), {"__init__": __init__, "__module__": host.__module__})
    wants_info = bool(kwargs.get("output_loading_info", False))
    model, info = converting.from_pretrained(path, **{**kwargs, "output_loading_info": True})
    model.__class__ = host
    _initialise_missing_maps(model, info.get("missing_keys", ()))
    # (model, info) on request, as transformers' from_pretrained does (whose annotation also names the model only).
    return cast(nn.Module, (model, info)) if wants_info else model


def _initialise_missing_maps(model: nn.Module, missing: Any) -> None:
    """DAMCHA tensors a checkpoint lacks, given their initial values (transformers
    reports them "newly initialized" but initialises only the module types it
    knows, so they held whatever the memory held): gates 0, so the layer computes
    what the unconverted one did, and a fresh generator."""
    generators: dict[int, MetricGenerator] = {}
    for key in missing:
        head, sep, tail = f".{key}".rpartition(f".{CONFIG_KEY}.")
        if not sep:
            continue
        maps = model.get_submodule(f"{head[1:]}.{CONFIG_KEY}" if head else CONFIG_KEY)
        kind, _, side = tail.partition(".")
        side = side.split(".")[0]
        if not isinstance(maps, DamchaMaps):
            continue
        if kind == "gates" and side in maps.gates:
            with torch.no_grad():
                write_initial(maps.gates, side, torch.zeros_like(maps.gates[side]))
        elif kind == "generators" and side in maps.generators:
            generators.setdefault(id(maps.generators[side]), maps.generators[side])  # type: ignore[arg-type]
    for generator in generators.values():
        generator.reset_parameters()
