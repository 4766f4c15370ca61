"""Property test: malformed inputs to every port's layer and functional entry.

Hypothesis (fixed seed, a small number of examples) draws a valid call of a
small layer, then corrupts one thing: a tensor's rank, a feature size, an
empty dim, a batch that does not match, a dtype (int, bool, complex,
float16/32, a nested list), NaN or inf values, or a mask of a wrong shape or
dtype (int and float 0/1 masks, additive 0/-inf masks, a NaN in a mask).
Each port gets the input in its own convention (torch masks True = masked
out, Flax and Keras read 0/1 masks, ...), and must either

- raise a ``damcha_core.DamchaError`` whose message names the argument (the
  port's own name for it), or
- return what the reference returns for the same input as that port's
  documented convention reads it (NaN exactly where the reference gives NaN).

Anything else escaping (a framework's own exception, a silently broadcast or
truncated result, a finite number where the reference gives NaN) fails.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import keras
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import damcha_core as dc
import damcha_jax
import damcha_keras
import damcha_onnx
import damcha_torch
from damcha_conformance import TOLERANCES, case_params

B, N, M = 2, 3, 4
CONFIGS = {
    "self": dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4),  # tied heads map
    "cross": dc.DamchaConfig(
        query_dim=8,
        num_heads=4,
        num_kv_heads=2,
        key_dim=2,
        context_dim=6,
        metric="lowrank",
        metric_rank=2,
        coupling="separate",
    ),
}
PARAMS = {name: case_params(cfg, 11) for name, cfg in CONFIGS.items()}
# Examples per (port, kind of corruption); the seed is fixed (derandomize), so CI runs the same inputs.
EXAMPLES = 8


# ---------------------------------------------------------------- inputs


@dataclasses.dataclass
class Mask:
    """A mask in the reference's meaning (``attend``: True = may attend, any
    shape) and how it is written down (``encoding``): "bool", "int01",
    "float01", "additive" (0 / -inf) or "nan" (additive with one NaN)."""

    attend: np.ndarray
    encoding: str = "bool"


class Call:
    """One call: a config name, the tokens, a mask, the causal flag, and which
    argument was made malformed ("query", "context", "mask" or "nothing") how."""

    def __init__(
        self,
        config: str,
        query: Any,
        context: Any = None,
        mask: Mask | None = None,
        causal: bool = False,
        corrupted: str = "nothing",
        what: str = "valid",
    ) -> None:
        self.config, self.query, self.context, self.mask, self.causal = config, query, context, mask, causal
        self.corrupted, self.what = corrupted, what

    def replace(self, **changes: Any) -> Call:
        new = Call(self.config, self.query, self.context, self.mask, self.causal, self.corrupted, self.what)
        for key, value in changes.items():
            setattr(new, key, value)
        return new

    def __repr__(self) -> str:  # hypothesis prints it for the failing example: shapes and dtypes, not contents
        def d(x):
            return "None" if x is None else dc.describe(x) if hasattr(x, "shape") else f"list(len={len(x)})"

        mask = None if self.mask is None else f"Mask({d(self.mask.attend)}, {self.mask.encoding!r})"
        return (
            f"Call({self.config!r}, query={d(self.query)}, context={d(self.context)}, mask={mask}, "
            f"causal={self.causal}, corrupted={self.corrupted!r}, what={self.what!r})"
        )


def _tokens(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.normal(size=shape)


@st.composite
def calls(draw: st.DrawFn, kind: str) -> Call:
    """A valid call, then one corruption of the given kind."""
    config = draw(st.sampled_from(sorted(CONFIGS)))
    cfg = CONFIGS[config]
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    cross = config == "cross"
    m = M if cross else N
    call = Call(config, _tokens(rng, B, N, cfg.query_dim), _tokens(rng, B, m, cfg.context_dim) if cross else None)
    call.causal = draw(st.booleans())
    if draw(st.booleans()) or kind == "mask":
        shape = draw(st.sampled_from([(B, 1, 1, m), (B, cfg.num_heads, N, m), (1, 1, N, m)]))
        attend = rng.random(shape) < 0.7
        call.mask = Mask(attend)
    targets = ["query"] + (["context"] if cross else [])
    if kind == "valid":
        return call
    if kind == "mask":
        return _corrupt_mask(draw, call, rng, m)
    target = draw(st.sampled_from(targets))
    x = getattr(call, target)
    if kind == "shape":
        what = draw(
            st.sampled_from(["rank-", "rank+", "features+1", "features-1", "empty-batch", "empty-length", "batch+1"])
        )
        if what == "rank-":
            x = x[0]
        elif what == "rank+":
            x = x[None]
        elif what == "features+1":
            x = np.concatenate([x, x[..., :1]], axis=-1)
        elif what == "features-1":
            x = x[..., :-1]
        elif what == "empty-batch":
            x = x[:0]
        elif what == "empty-length":
            x = x[:, :0]
        else:
            x = np.concatenate([x, x[:1]], axis=0)
    elif kind == "dtype":
        what = draw(st.sampled_from(["int32", "bool", "complex64", "float16", "float32", "list"]))
        x = x.tolist() if what == "list" else (x > 0) if what == "bool" else x.astype(what)
    elif kind == "values":
        what = draw(st.sampled_from(["nan", "inf", "-inf"]))
        x = x.copy()
        index = tuple(draw(st.integers(0, s - 1)) for s in x.shape)
        x[index] = float(what)
    else:
        raise AssertionError(kind)
    setattr(call, target, x)
    call.corrupted, call.what = target, what
    return call


def _corrupt_mask(draw: st.DrawFn, call: Call, rng: np.random.Generator, m: int) -> Call:
    H = CONFIGS[call.config].num_heads
    what = draw(st.sampled_from(["shape", "encoding", "empty"]))
    if what == "shape":
        shape = draw(
            st.sampled_from(
                [
                    (N, m),
                    (B, N, m),
                    (m,),
                    (1, B, 1, 1, m),
                    (B, H + 1, N, m),
                    (B, 1, 1, m + 1),
                    (B, 1, N + 1, m),
                    (B + 1, 1, 1, m),
                ]
            )
        )
        call.mask = Mask(rng.random(shape) < 0.7)
        call.what = f"mask shape {shape}"
    elif what == "encoding":
        call.mask.encoding = draw(st.sampled_from(["int01", "float01", "additive", "nan"]))
        call.what = f"mask {call.mask.encoding}"
    else:
        call.mask = Mask(np.zeros(call.mask.attend.shape[:-1] + (0,), bool))
        call.what = "mask with no keys"
    call.corrupted = "mask"
    return call


def _encode(mask: Mask, true_means_hidden: bool = False) -> np.ndarray:
    """``mask`` written in its encoding (torch's bool masks are inverted)."""
    a = mask.attend
    if mask.encoding == "bool":
        return ~a if true_means_hidden else a
    if mask.encoding == "int01":
        return a.astype(np.int32)
    if mask.encoding == "float01":
        return a.astype(np.float64)
    additive = np.where(a, 0.0, -np.inf)
    if mask.encoding == "nan":
        additive[tuple(0 for _ in a.shape)] = np.nan
    return additive


# ---------------------------------------------------------------- ports


@dataclasses.dataclass
class Port:
    """How one entry point takes a call, and how its convention reads it.

    ``names``: the port's names for query, context and mask (an error must
    name one of them). ``encodings``: the mask encodings the port reads, with
    their meaning given by ``Mask.attend`` ("nan": NaN rows); any other
    encoding must be refused. ``mask_meaning(shape)``: how the port reads a
    mask's shape, as a function of (B, H, N, M) giving the 4-D reshape, or
    None where the reference's rule (2-D or 4-D) applies. ``unbatched``: the
    port reads rank-2 tokens as one sequence, more leading axes as batch axes.
    ``unbatched``: rank-2 tokens are one sequence (torch's MHA).
    ``dtype``: the precision it computes in here.
    """

    name: str
    run: Callable[[Call], Any]
    names: dict[str, tuple[str, ...]]
    encodings: tuple[str, ...] = ("bool",)
    mask_reshape: Callable[[tuple[int, ...], int], tuple[int, ...] | None] | None = None
    batch_axes: bool = False
    unbatched: bool = False
    dtype: str = "float64"


_LAYERS: dict[tuple[str, str], Any] = {}


def _layer(port: str, config: str, make: Callable[[], Any]) -> Any:
    key = (port, config)
    if key not in _LAYERS:
        _LAYERS[key] = make()
    return _LAYERS[key]


def _torch(x: Any) -> Any:
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def run_torch_layer(call: Call) -> Any:
    cfg = CONFIGS[call.config]
    layer = _layer(
        "torch",
        call.config,
        lambda: damcha_torch.DamchaAttention.from_canonical(
            PARAMS[call.config], cfg, batch_first=True, dtype=torch.float64
        ).eval(),
    )
    q = _torch(call.query)
    kv = q if call.context is None else _torch(call.context)
    mask = None if call.mask is None else _torch(_encode(call.mask, true_means_hidden=True))
    with torch.no_grad():
        out, _ = layer(q, kv, kv, attn_mask=mask, need_weights=False, is_causal=call.causal)
    return out.numpy()


def run_torch_functional(call: Call) -> Any:
    params = {k: torch.from_numpy(v) for k, v in PARAMS[call.config].items()}
    mask = None if call.mask is None else _torch(_encode(call.mask))
    with torch.no_grad():
        y = damcha_torch.damcha_attention(
            params, CONFIGS[call.config], _torch(call.query), _torch(call.context), mask=mask, causal=call.causal
        )
    return y.numpy()


def run_jax_functional(call: Call) -> Any:
    params = {k: jnp.asarray(v, jnp.float32) for k, v in PARAMS[call.config].items()}
    mask = None if call.mask is None else _encode(call.mask)
    return np.asarray(
        damcha_jax.damcha_attention(
            params, CONFIGS[call.config], call.query, call.context, mask=mask, is_causal=call.causal
        )
    )


def run_nnx(call: Call) -> Any:
    module = _layer(
        "nnx", call.config, lambda: damcha_jax.DamchaAttention.from_canonical(PARAMS[call.config], CONFIGS[call.config])
    )
    mask = None if call.mask is None else _encode(call.mask)
    return np.asarray(module(call.query, call.context, mask=mask, is_causal=call.causal))


def run_keras(call: Call) -> Any:
    layer = _layer(
        "keras",
        call.config,
        lambda: damcha_keras.DamchaAttention.from_canonical(PARAMS[call.config], CONFIGS[call.config], dtype="float64"),
    )
    mask = None if call.mask is None else _encode(call.mask)
    value = call.query if call.context is None else call.context
    return keras.ops.convert_to_numpy(layer(call.query, value, attention_mask=mask, use_causal_mask=call.causal))


def run_onnx(call: Call) -> Any:
    cross, has_mask = call.context is not None, call.mask is not None
    model = _layer(
        "onnx",
        f"{call.config}-{cross}-{has_mask}-{call.causal}",
        lambda: damcha_onnx.build_model(
            PARAMS[call.config], CONFIGS[call.config], cross=cross, mask=has_mask, causal=call.causal, dtype="float64"
        ),
    )
    feeds = {"query": call.query}
    if cross:
        feeds["context"] = call.context
    if has_mask:
        feeds["mask"] = _encode(call.mask)
    return damcha_onnx.run_ort(model, feeds)


def run_reference(call: Call) -> Any:
    mask = None if call.mask is None else _encode(call.mask)
    return dc.damcha_attention(
        PARAMS[call.config], CONFIGS[call.config], call.query, call.context, mask=mask, causal=call.causal
    )


def _torch_mha_mask(shape: tuple[int, ...], H: int) -> tuple[int, ...] | None:
    # nn.MultiheadAttention: a 3-D attn_mask is (B * H, N, M)
    return (B, H) + shape[1:] if len(shape) == 3 and shape[0] == B * H else None


def _keras_mask(shape: tuple[int, ...], H: int) -> tuple[int, ...] | None:
    # keras MultiHeadAttention: attention_mask (B, N, M)
    return (shape[0], 1) + shape[1:] if len(shape) == 3 else None


def _broadcast_mask(shape: tuple[int, ...], H: int) -> tuple[int, ...] | None:
    # Flax: [batch..., H|1, N|1, M], read by broadcasting
    return (1,) * (4 - len(shape)) + shape if 1 <= len(shape) <= 4 else None


NAMES = {"query": ("query",), "context": ("context",), "mask": ("mask",)}
PORTS = {
    "reference": Port("reference", run_reference, NAMES),
    "torch-layer": Port(
        "torch-layer",
        run_torch_layer,
        {"query": ("query",), "context": ("key", "value"), "mask": ("attn_mask",)},
        encodings=("bool", "additive", "nan"),
        mask_reshape=_torch_mha_mask,
        unbatched=True,
    ),
    "torch-functional": Port("torch-functional", run_torch_functional, NAMES, encodings=("bool", "additive", "nan")),
    "jax-functional": Port(
        "jax-functional", run_jax_functional, NAMES, encodings=("bool", "int01", "float01"), dtype="float32"
    ),
    "jax-nnx": Port(
        "jax-nnx",
        run_nnx,
        {"query": ("inputs_q",), "context": ("inputs_k", "inputs_v"), "mask": ("mask",)},
        encodings=("bool", "int01", "float01"),
        mask_reshape=_broadcast_mask,
        batch_axes=True,
        dtype="float32",
    ),
    "keras-layer": Port(
        "keras-layer",
        run_keras,
        {"query": ("query",), "context": ("value", "key"), "mask": ("attention_mask",)},
        encodings=("bool", "int01", "float01"),
        mask_reshape=_keras_mask,
    ),
    "onnx-run_ort": Port("onnx-run_ort", run_onnx, NAMES),
}


# ---------------------------------------------------------------- expectations


def expected(port: Port, call: Call) -> np.ndarray | None:
    """What the reference gives for ``call`` as ``port`` reads it; None when
    the port must refuse it (the reference refuses it, or it has no meaning
    in the port's convention)."""
    cfg = CONFIGS[call.config]
    query, context, mask = call.query, call.context, None
    lead = None
    if port.batch_axes:
        # Flax folds [batch..., N, E] into one batch axis; (N, E) is one unbatched sequence.
        shape = np.shape(query)
        if len(shape) != 3 and len(shape) >= 2 and (context is None or np.ndim(context) == len(shape)):
            lead = shape[:-2]
            query = np.reshape(query, (-1,) + shape[-2:])
            if context is not None:
                context = np.reshape(context, (-1,) + np.shape(context)[-2:])
    squeeze = False
    if port.unbatched and np.ndim(query) == 2 and (context is None or np.ndim(context) == 2):
        query, context, squeeze = np.asarray(query)[None], None if context is None else np.asarray(context)[None], True
    nan_rows = None
    if call.mask is not None:
        if call.mask.encoding not in port.encodings:
            return None
        attend = call.mask.attend
        shape = attend.shape
        reshaped = None if port.mask_reshape is None else port.mask_reshape(shape, cfg.num_heads)
        if reshaped is not None:
            attend = attend.reshape(reshaped)
        elif len(shape) not in (2, 4):
            return None
        mask = attend
        if call.mask.encoding == "nan":
            nan_rows = np.zeros(np.broadcast_shapes(attend.shape, (1, 1, 1, 1)), bool)
            nan_rows[(0,) * attend.ndim] = True
    try:
        y = dc.damcha_attention(PARAMS[call.config], cfg, query, context, mask=mask, causal=call.causal)
    except dc.DamchaError:
        return None
    if nan_rows is not None:  # NaN in an additive mask: the affected query rows are NaN (as torch's MHA)
        rows = np.broadcast_to(nan_rows, (y.shape[0], cfg.num_heads, y.shape[1], nan_rows.shape[-1])).any(axis=(1, 3))
        y = np.where(rows[..., None], np.nan, y)
    if lead is not None:
        y = y.reshape(lead + y.shape[-2:])
    return y[0] if squeeze else y


def _input_dtype(call: Call) -> str:
    dtypes = [np.asarray(x).dtype for x in (call.query, call.context) if x is not None]
    if any(d == np.float16 for d in dtypes):
        return "float16"
    if any(d == np.float32 for d in dtypes):
        return "float32"
    return "float64"


def check(port: Port, call: Call) -> None:
    want = expected(port, call)
    try:
        got = port.run(call)
    except dc.DamchaError as exc:
        message = str(exc)
        names = port.names.get(call.corrupted, ())
        if call.what.startswith(("rank", "batch", "empty", "mask shape")):
            # a mismatch between two arguments may be reported on either side
            names = tuple(n for ns in port.names.values() for n in ns)
        if call.corrupted != "nothing" and not any(
            re.search(rf"(?<![A-Za-z_]){re.escape(n)}(?![A-Za-z_])", message) for n in names
        ):
            raise AssertionError(
                f"{port.name}: {type(exc).__name__} does not name {call.corrupted!r} (as {names}): {message}"
            ) from exc
        if want is not None and call.corrupted == "nothing":
            raise AssertionError(f"{port.name} refused a valid call: {type(exc).__name__}: {message}") from exc
        return
    except Exception as exc:
        raise AssertionError(f"{port.name} let {type(exc).__name__} escape on {call.what}: {exc}") from exc
    if want is None:
        raise AssertionError(
            f"{port.name} accepted {call.what} ({call.corrupted}), which it must refuse; "
            f"returned {dc.describe(np.asarray(got))}"
        )
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, f"{port.name}: shape {got.shape} != reference {want.shape} on {call.what}"
    nan_got, nan_want = ~np.isfinite(got), ~np.isfinite(want)
    # docs/spec.md section 9: every output the bad value reaches is non-finite, as in the reference; a
    # port may be louder than the reference (a fused kernel multiplies a hidden key's NaN value by p = 0),
    # never quieter, and every finite number it returns is the reference's.
    missing = nan_want & ~nan_got
    assert not missing.any(), (
        f"{port.name}: finite at {np.argwhere(missing)[:3].tolist()} where the reference is NaN/inf on "
        f"{call.what} (reference non-finite: {int(nan_want.sum())}, port: {int(nan_got.sum())})"
    )
    # Louder only where a bad value came in: with finite tokens and an ordinary mask a NaN or inf the
    # reference does not have is a wrong output (an all-NaN port passed every call).
    bad_value_in = _has_non_finite(call)
    louder = nan_got & ~nan_want
    assert bad_value_in or not louder.any(), (
        f"{port.name}: non-finite at {np.argwhere(louder)[:3].tolist()} where the reference is finite, with "
        f"finite inputs, on {call.what}"
    )
    tol = max((TOLERANCES[d] for d in (port.dtype, _input_dtype(call))), key=lambda t: t.rtol)
    ok = np.isclose(got, want, rtol=tol.rtol, atol=tol.atol) | nan_got
    assert ok.all(), f"{port.name}: max |error| {np.nanmax(np.abs(got - want)):.3g} on {call.what}"


def _has_non_finite(call: Call) -> bool:
    """Whether a token is NaN/inf or the mask is written with a NaN (the "nan" encoding): the calls
    where a port may be louder than the reference."""
    for x in (call.query, call.context):
        try:
            array = np.asarray(x)
        except ValueError:  # a ragged list: refused by every port, nothing to be louder about
            continue
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            return True
    return call.mask is not None and call.mask.encoding == "nan"


# ---------------------------------------------------------------- the tests

KINDS = ("valid", "shape", "dtype", "values", "mask")
# Known failures, each reported to the lead with a minimal reproducer; strict, so a fix fails as XPASS and
# its entry must then be removed.
KNOWN: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("port", list(PORTS))
def test_malformed_inputs(port: str, kind: str, request: pytest.FixtureRequest) -> None:
    reason = KNOWN.get((port, kind))
    if reason:
        request.applymarker(pytest.mark.xfail(reason=reason, strict=True))

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(call=calls(kind))
    def run(call: Call) -> None:
        check(PORTS[port], call)

    run()


def test_the_expectations_catch_wrong_ports() -> None:
    """The checker itself: a port that broadcasts a bad batch, returns a finite
    number for NaN, or raises a framework's error must fail it."""
    good = PORTS["reference"]
    call = Call(
        "cross",
        _tokens(np.random.default_rng(0), B, N, 8),
        _tokens(np.random.default_rng(1), B + 1, M, 6),
        corrupted="context",
        what="batch+1",
    )

    def broadcasting(c: Call) -> Any:
        return run_reference(c.replace(context=c.context[:B]))

    with pytest.raises(AssertionError, match="accepted batch"):
        check(dataclasses.replace(good, run=broadcasting), call)
    nan = Call(
        "self",
        np.where(np.arange(24).reshape(1, 3, 8) == 5, np.nan, 1.0) * np.ones((B, N, 8)),
        corrupted="query",
        what="nan",
    )
    with pytest.raises(AssertionError, match="finite at .* where the reference is NaN"):
        check(dataclasses.replace(good, run=lambda c: np.nan_to_num(run_reference(c))), nan)

    def wrong_where_finite(c: Call) -> Any:  # louder is allowed, a different finite number is not
        y = run_reference(c)
        return np.where(np.isfinite(y), y + 1.0, y)

    # The last token NaN under causality: the rows before it stay finite in the reference.
    late_nan = Call(
        "self",
        np.where(np.arange(24).reshape(1, 3, 8) == 21, np.nan, 1.0) * np.ones((B, N, 8)),
        causal=True,
        corrupted="query",
        what="nan",
    )
    with pytest.raises(AssertionError, match="max \\|error\\|"):
        check(dataclasses.replace(good, run=wrong_where_finite), late_nan)
    check(dataclasses.replace(good, run=lambda c: np.full_like(run_reference(c), np.nan)), late_nan)  # louder: allowed
    # ... but not where nothing bad came in: an all-NaN (or inf) port fails a valid call.
    valid = Call("self", _tokens(np.random.default_rng(2), B, N, 8))
    for fill in (np.nan, np.inf):
        with pytest.raises(AssertionError, match="non-finite at .* where the reference is finite, with finite inputs"):
            check(dataclasses.replace(good, run=lambda c, f=fill: np.full_like(run_reference(c), f)), valid)
    with pytest.raises(AssertionError, match="let IndexError escape"):
        check(dataclasses.replace(good, run=lambda c: [][1]), call)
    with pytest.raises(AssertionError, match="does not name 'context'"):
        check(dataclasses.replace(good, run=lambda c: (_ for _ in ()).throw(dc.DamchaValueError("bad shape"))), call)
    check(good, call)  # the reference refuses it, naming context


# ------------------------------------------------ canonical loaders: one class, one argument, every port

_LOADERS: dict[str, Callable[[Any, dc.DamchaConfig], Any]] = {
    "torch": lambda p, c: damcha_torch.DamchaAttention.from_canonical(p, c),
    "jax": lambda p, c: damcha_jax.DamchaAttention.from_canonical(p, c),
    "keras": lambda p, c: damcha_keras.DamchaAttention.from_canonical(p, c),
    "reference": lambda p, c: dc.validate_params(p, c),
}
_SELF = CONFIGS["self"]


def _with(name: str, value: Any) -> dict[str, Any]:
    return {**PARAMS["self"], name: value}


_BAD_PARAMS: dict[str, tuple[Any, type[dc.DamchaError], str]] = {
    "ragged-list": (_with("query.bias", [[0.0] * 4, [0.0]]), dc.DamchaTypeError, "params['query.bias']"),
    "integer": (_with("query.bias", np.zeros((2, 4), np.int32)), dc.DamchaTypeError, "params['query.bias']"),
    "nan": (_with("query.bias", np.full((2, 4), np.nan)), dc.DamchaValueError, "params['query.bias']"),
    "shape": (_with("query.bias", np.zeros((4, 2))), dc.DamchaValueError, "params['query.bias']"),
    "not-a-mapping": ([1, 2], dc.DamchaTypeError, "params"),
}


@pytest.mark.parametrize("bad", list(_BAD_PARAMS))
@pytest.mark.parametrize("port", list(_LOADERS))
def test_canonical_loaders_refuse_alike(port: str, bad: str) -> None:
    """The same bad params give every port's from_canonical the reference's class and argument
    (a ragged nested list escaped as NumPy's bare ValueError from check_params, in every port)."""
    params, error, argument = _BAD_PARAMS[bad]
    with pytest.raises(dc.DamchaError) as info:
        _LOADERS[port](params, _SELF)
    assert type(info.value) is error, info.value
    assert str(info.value).startswith(f"Invalid argument `{argument}`: expected "), info.value
