"""A deliberately wrong third-party adapter, loaded by the CLI test as module:attr."""

from __future__ import annotations

import numpy as np

import damcha_core as dc
from damcha_conformance import ReferenceAdapter


class WrongMask(ReferenceAdapter):
    """Reads the mask with the opposite polarity (True = masked out)."""

    name = "wrong-mask"

    def forward(self, data, dtype):
        mask = None if data.mask is None else ~data.mask
        return np.nan_to_num(
            dc.damcha_attention(
                data.params, data.config, data.query, data.context, mask=mask, causal=data.causal, value=data.value
            )
        )


class Lazy(ReferenceAdapter):
    """Declares every case unsupported: a run of it checks nothing."""

    name = "lazy"

    def unsupported(self, case):
        return "not implemented yet"


class NoGradients(ReferenceAdapter):
    """An honest forward-only port (``supports_gradients=False``): its run is
    partial unless gradients are explicitly not asked for."""

    name = "no-gradients"


class OutputsOnly:
    """An honest port written before the weights and penalty groups: forward and decode only, no
    optional method added since (not a ReferenceAdapter subclass, which has them all)."""

    name = "outputs-only"
    dtypes = ("float64",)
    supports_gradients = False
    unsupported = ReferenceAdapter.unsupported
    forward = ReferenceAdapter.forward
    decode = ReferenceAdapter.decode


class Interrupted(ReferenceAdapter):
    """Stops the run part-way, as Ctrl-C would."""

    name = "interrupted"

    def forward(self, data, dtype):
        if data.case.group == "masks":
            raise KeyboardInterrupt
        return super().forward(data, dtype)


class DtypesString(ReferenceAdapter):
    """``dtypes = "float64"``: iterating it used to run dtypes 'f', 'l', 'o', ..."""

    name = "dtypes-string"
    dtypes = "float64"  # type: ignore[assignment]


class NoUnsupported:
    """Has forward but no ``unsupported``: used to die with an AttributeError fragment."""

    name = "no-unsupported"
    dtypes = ("float64",)
    supports_gradients = False

    def forward(self, data, dtype):
        return ReferenceAdapter().forward(data, dtype)


def make_dtypes_string():
    """A factory: what it builds is only known once called, so the worker checks it."""
    return DtypesString()


def make_no_unsupported():
    return NoUnsupported()


no_unsupported_instance = NoUnsupported()


def needs_an_argument(device):
    """A factory ``load_adapter`` cannot call (it calls with no arguments)."""
    return ReferenceAdapter()


def make_raises():
    """A factory that fails to build (a constructor that needs a device the machine lacks)."""
    raise RuntimeError("no such device: cuda:7")


def make_exits():
    """A factory that ends its process without a word (a library calling sys.exit on a missing device)."""
    import sys

    sys.exit(3)


class UnknownDtype(ReferenceAdapter):
    """``dtypes = ("fp32",)``: not a key of TOLERANCES; the worker used to die with a traceback."""

    name = "unknown-dtype"
    dtypes = ("fp32",)


class GradientsWithoutMethod(NoUnsupported):
    """Claims gradients but has no ``gradients``: every gradient check was an AttributeError."""

    name = "gradients-without-method"
    supports_gradients = True

    def unsupported(self, case):
        return None


class Unnamed(ReferenceAdapter):
    """A port built on ReferenceAdapter that kept its name: it reports as 'reference'."""


class SameNameAsWrongMask(ReferenceAdapter):
    name = "wrong-mask"


class NameNotAString(ReferenceAdapter):
    name = None  # type: ignore[assignment]


class DtypesTwice(ReferenceAdapter):
    """``dtypes = ("float64", "float64")``: every check ran twice, counted twice in the table."""

    name = "dtypes-twice"
    dtypes = ("float64", "float64")


class BlankName(ReferenceAdapter):
    name = "   "


class SupportsGradientsString(ReferenceAdapter):
    """``supports_gradients = "no"``: a truthy string ran the gradient checks."""

    name = "gradients-string"
    supports_gradients = "no"  # type: ignore[assignment]


class CrashesOnCross(ReferenceAdapter):
    """An honest port whose native kernel dies (here os.abort()) on cross-attention cases:
    the worker ends without its report."""

    name = "crashes-on-cross"

    def forward(self, data, dtype):
        if data.context is not None:
            import os

            os.abort()
        return super().forward(data, dtype)


def make_slowly():
    """A factory that hangs (a constructor waiting on a device); writes its pid where the test says."""
    import os
    import time

    with open(os.environ["DAMCHA_TEST_PID_FILE"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


class Float16NoUpcast(ReferenceAdapter):
    """A float16 port that squares phi's tokens in float16 (``t.pow(2).mean(-1)`` on a half
    tensor): everything else is as a careful float16 port computes, every tensor rounded to
    float16 and its products accumulated in float32, softmax in float32. Ordinary tokens never
    reach |t| = 256, so it passed every float16 case before the large-activation ones; there
    t^2 is inf, phi 0 and the map a constant. ``Float16Upcast`` is the same port, squaring in
    float32."""

    name = "float16-no-upcast"
    dtypes = ("float16",)
    square_dtype = np.float16

    def forward(self, data, dtype):
        from damcha_core import _reference as ref
        from damcha_core._metrics import structure

        def half(a):
            return np.asarray(a, np.float32).astype(np.float16)

        def wide(a):  # float16 values, accumulated in float32 as float16 GEMMs do
            return np.asarray(a, np.float16).astype(np.float32)

        cfg = data.config
        p = {k: wide(half(v)) for k, v in data.params.items()}
        x = wide(half(data.query))
        c = x if data.context is None else wide(half(data.context))
        value = None if data.value is None else wide(half(data.value))
        q, k, v = (wide(half(t)) for t in ref.project(p, cfg, x, c, value))

        def mapped(side, tokens, y):
            table = structure(cfg.metric)
            t = half(tokens).astype(self.square_dtype)
            with np.errstate(over="ignore"):
                square = t * t  # the bug in float16: inf from |t| = 256, silently (as on a device)
            phi = wide(half(tokens / np.sqrt(np.mean(square, axis=-1, keepdims=True, dtype=np.float32) + dc.RMS_EPS)))
            leaves = {leaf: p[f"metric.{side}.{leaf}"] for leaf in table.leaf_names}
            return wide(half(table.apply(np, wide(half(table.coefficients(np, phi, leaves))), y, leaves)))

        sq, sk = dc.side_of(cfg, "q"), dc.side_of(cfg, "k")
        if sq:
            q = mapped(sq, x, q)
        if sk:
            k = mapped(sk, c, k)
        B, N, H, _ = q.shape
        M = k.shape[1]
        logits = wide(half(cfg.softmax_scale * np.einsum("bnhd,bmhd->bhnm", q, np.repeat(k, cfg.group_size, axis=2))))
        mask = None if data.mask is None else np.broadcast_to(data.mask, (B, H, N, M))
        visible = ref.visibility(B, H, N, M, mask, data.causal)
        probs = wide(half(ref.softmax_attend(logits, visible)))
        o = wide(half(ref.attend_values(probs, visible, np.repeat(v, cfg.group_size, axis=2))))
        y = np.einsum("bnhd,hde->bne", o, p["output.kernel"])
        if cfg.use_bias:
            y = y + p["output.bias"]
        return half(y)


class Float16Upcast(Float16NoUpcast):
    """``Float16NoUpcast`` with phi's statistic in float32, as the spec asks: an honest float16 port."""

    name = "float16-upcast"
    square_dtype = np.float32


class AveragedWeights(ReferenceAdapter):
    """Returns the attention weights averaged over the heads (torch's need_weights default,
    average_attn_weights=True), repeated for each head: the right shape, the wrong maps. Every
    output, decode and bad-input check passes."""

    name = "averaged-weights"

    def weights(self, data, dtype):
        probs = super().weights(data, dtype)
        return np.broadcast_to(probs.mean(axis=1, keepdims=True), probs.shape).copy()


class PenaltyQueryRoleOnly(ReferenceAdapter):
    """Computes the metric penalty of the query role alone (forgets the keys' map): right under
    query coupling and metric "none", wrong wherever the keys are adapted. Every output, weights,
    decode and bad-input check passes."""

    name = "penalty-query-role-only"

    def metric_penalty(self, data, dtype):
        from damcha_core._reference import generator

        side = dc.side_of(data.config, "q")
        if side is None:
            return 0.0
        coeff = generator(data.params, data.config, side, data.query)
        return float(dc.role_penalty(np, data.params, data.config, side, coeff))
