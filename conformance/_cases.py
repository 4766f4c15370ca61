"""The catalogue: named, seeded cases whose expected values come from the reference."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import numpy as np

import damcha_core as dc

from ._tolerances import DTYPES

MASK_KINDS = ("padding", "per_head", "all_masked_row", "shared", "per_batch", "per_head_batch1", "per_key")
INPUT_KINDS = ("small-and-zero", "nan-token", "large", "nan-context")
# The factor of inputs="large": a power of 2, so a float16 port's inputs are exactly LARGE times
# float16 values. With it every token's t^2 exceeds float16's max (65504) once |t| >= 256,
# i.e. for any feature above 0.25 before scaling: a port that squares in float16 gets inf.
LARGE = 1024.0


@dataclasses.dataclass(frozen=True)
class Case:
    """One conformance case: a config, input sizes, mask kind and seed.

    Args:
        name: unique readable id.
        group: the column of the report table this case counts towards.
        config: the layer.
        batch, query_len: B and N.
        context_len: M for cross-attention; ``None`` is self-attention.
        mask: ``None``, "padding" ((B, 1, 1, M): some trailing keys hidden per
            batch row), "per_head" ((B, H, N, M) random), "all_masked_row"
            (per-head mask where one query row sees no key at all), or a random
            mask with size-1 axes that the port must broadcast: "shared"
            (1, 1, N, M), "per_batch" (B, 1, N, M), "per_head_batch1" (1, H, N, M),
            "per_key" (B, H, 1, M).
        causal: top-left causal rule.
        seed: seeds params, inputs, mask and gradient directions.
        gradients: whether the case checks gradients (off only where central
            differences over every tensor would be slow).
        inputs: ``None`` (standard normal tokens) or "small-and-zero": every
            other token scaled by 3e-3 (mean(t^2) ~ 10 x the RMS eps, so phi depends
            on eps = 1e-6 and on the normalisation itself) and one token of
            each input exactly 0 (phi(0) = 0, which a port must not turn into NaN);
            "nan-token": one feature of query token 1 of batch row 0 is NaN, so that
            query's output row is NaN and every other row finite (NaN in gives NaN
            out; a port that zeroes it, as CPU SDPA does, fails);
            "large": the tokens (query and context, which give the values) times
            ``LARGE`` (features in the thousands, as the massive activations of
            large models' residual streams) and the query, key and value kernels
            divided by it, so q, k, v and the output stay O(1) and every value is
            finite in float16, while phi (scale-free) sees the same tokens. The
            statistic mean(t^2) overflows float16 (65504 from |t| = 256): a port
            that does not compute it in at least float32 (spec section 7) gets
            inf, phi = 0, and a map that ignores its token;
            "nan-context": one feature of context token 3 of batch row 0 is NaN (cross-attention,
            no mask, not causal), so that key and value, which every query of that row sees,
            make all of batch row 0's output NaN and batch row 1's finite (a port that zeroes
            NaN in keys or values, or lets a fused kernel read it as "masked", fails). Hidden
            from some query it would let a fused kernel be louder than the reference (spec
            section 9), which the exact non-finite check would fail: hence visible to all.
        dtypes: the dtypes the case runs in (``None``: every dtype the adapter
            declares). ``("float16",)`` for the large-activation case: it is
            the float16 port's upcast it checks, and the runner, ``checks()`` and
            the vectors leave it out of other dtypes.

    A cross-attention case whose ``config.value_input_dim`` differs from its
    ``context_dim`` has separate value tokens (B, M, E_v): ``CaseData.value``.
    """

    name: str
    group: str
    config: dc.DamchaConfig
    batch: int
    query_len: int
    context_len: int | None = None
    mask: str | None = None
    causal: bool = False
    seed: int = 0
    gradients: bool = True
    inputs: str | None = None
    dtypes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        # _make_mask reads any other string as a random per-head mask: reject typos.
        if self.mask is not None and self.mask not in MASK_KINDS:
            raise dc.DamchaValueError(
                dc.invalid_argument("mask", f"None or one of {MASK_KINDS}", f"mask={self.mask!r}")
            )
        if self.inputs is not None and self.inputs not in INPUT_KINDS:
            raise dc.DamchaValueError(
                dc.invalid_argument("inputs", f"None or one of {INPUT_KINDS}", f"inputs={self.inputs!r}")
            )
        if self.inputs == "nan-context" and (self.context_len is None or self.mask is not None or self.causal):
            # A NaN key hidden from some query lets a port be louder than the reference there (spec
            # section 9), which the exact non-finite check would fail; without a context it has no key.
            raise dc.DamchaValueError(
                dc.invalid_argument(
                    "inputs",
                    'inputs="nan-context" in cross-attention (context_len set) without a mask and not causal',
                    f"inputs={self.inputs!r}, context_len={self.context_len!r}, mask={self.mask!r}, "
                    f"causal={self.causal!r}",
                )
            )
        # A list would make the case unhashable (materialise is cached), a typo would run it nowhere.
        if self.dtypes is not None and (
            not isinstance(self.dtypes, tuple) or not self.dtypes or any(d not in DTYPES for d in self.dtypes)
        ):
            raise dc.DamchaValueError(
                dc.invalid_argument(
                    "dtypes", f"None or a non-empty tuple of dtype names, some of {DTYPES}", f"dtypes={self.dtypes!r}"
                )
            )

    @property
    def self_attention(self) -> bool:
        return self.context_len is None

    def runs_in(self, dtype: str) -> bool:
        """Whether the case is checked in ``dtype`` (``dtypes`` is None or names it)."""
        return self.dtypes is None or dtype in self.dtypes

    @property
    def separate_value(self) -> bool:
        """Whether the values are tokens of their own (E_v != E_kv), not the context."""
        return not self.self_attention and self.config.value_input_dim != self.config.context_dim


@dataclasses.dataclass(frozen=True)
class CaseData:
    """Everything an adapter needs to run a case, as float64/bool NumPy arrays,
    and nothing it is judged by: the expected output stays with the runner
    (``ReferenceData``), so a port cannot hand it back.

    ``mask`` is always 4-D, (B|1, H|1, N|1, M), True = may attend; ``context``
    is ``None`` for self-attention. ``value`` is ``None`` when the context (or,
    in self-attention, the query) also gives the values, else the value
    tokens (B, M, E_v) (torch's ``value`` with ``vdim != kdim``, Keras' ``value``
    next to ``key``, Flax's ``inputs_v``). ``cotangent`` defines the scalar loss
    ``sum(output * cotangent)`` whose gradients the adapters return.
    """

    case: Any  # the Case, DecodeCase or ErrorCase it was made from
    params: dict[str, np.ndarray]
    query: np.ndarray
    context: np.ndarray | None
    mask: np.ndarray | None
    cotangent: np.ndarray
    value: np.ndarray | None = None

    @property
    def config(self) -> dc.DamchaConfig:
        return self.case.config

    @property
    def causal(self) -> bool:
        return self.case.causal


@dataclasses.dataclass(frozen=True)
class ReferenceData(CaseData):
    """A case's ``CaseData`` plus what the reference computes from it: what
    ``materialise`` returns and the runner keeps. ``expected`` is the reference
    output; ``reference(...)`` recomputes it with some tensors replaced (the
    central differences of the gradient check). Adapters are handed
    ``adapter_data()``, which has neither."""

    expected: np.ndarray = dataclasses.field(kw_only=True)

    def adapter_data(self) -> CaseData:
        """The ``CaseData`` an adapter receives: the same arrays, without ``expected``."""
        return CaseData(**{f.name: getattr(self, f.name) for f in dataclasses.fields(CaseData)})

    def reference(
        self, params: dict[str, np.ndarray] | None = None, query=None, context=None, value=None
    ) -> np.ndarray:
        """The reference output with some tensors replaced (used by central differences)."""
        return dc.damcha_attention(
            self.params if params is None else params,
            self.config,
            self.query if query is None else query,
            self.context if context is None else context,
            mask=self.mask,
            causal=self.causal,
            value=self.value if value is None else value,
        )


def _cfg(**kw: Any) -> dc.DamchaConfig:
    return dc.DamchaConfig(**{"query_dim": 16, "num_heads": 4, "key_dim": 4, **kw})


def _build_catalogue() -> tuple[Case, ...]:
    lr = dict(metric="lowrank", metric_rank=3)
    cases = [
        # MHA special case and the three metric structures.
        Case("mha-none-self", "mha", _cfg(metric="none"), 2, 6),
        Case("mha-none-gqa-cross", "mha", _cfg(metric="none", num_kv_heads=2, context_dim=12), 2, 5, 7),
        Case("heads-tied-self", "heads", _cfg(), 2, 6),
        Case("heads-tied-nobias", "heads", _cfg(use_bias=False), 2, 6),
        Case("heads-tied-scale-dims", "heads", _cfg(value_dim=6, output_dim=10, scale=0.3), 2, 5),
        Case("heads-separate-cross", "heads", _cfg(coupling="separate", context_dim=12), 2, 5, 8),
        Case("heads-query-cross", "heads", _cfg(coupling="query", context_dim=10), 2, 6, 4),
        Case("lowrank-tied-self", "lowrank", _cfg(**lr), 2, 6),
        Case("lowrank-separate-cross", "lowrank", _cfg(coupling="separate", context_dim=12, **lr), 2, 5, 7),
        Case("lowrank-query-nobias", "lowrank", _cfg(coupling="query", use_bias=False, **lr), 2, 6),
        # Grouped and multi-query attention.
        Case("heads-query-gqa", "gqa-mqa", _cfg(coupling="query", num_kv_heads=2), 2, 6),
        Case("heads-separate-gqa-cross", "gqa-mqa", _cfg(coupling="separate", num_kv_heads=2, context_dim=8), 2, 5, 7),
        Case("heads-query-mqa", "gqa-mqa", _cfg(coupling="query", num_kv_heads=1), 2, 6),
        Case("lowrank-separate-mqa", "gqa-mqa", _cfg(coupling="separate", num_kv_heads=1, **lr), 2, 6),
        # Masks.
        Case("heads-tied-padding", "masks", _cfg(), 2, 6, mask="padding"),
        Case(
            "heads-separate-per-head-cross",
            "masks",
            _cfg(coupling="separate", context_dim=12),
            2,
            5,
            7,
            mask="per_head",
        ),
        Case("heads-tied-all-masked-row", "masks", _cfg(), 2, 6, mask="all_masked_row"),
        Case("lowrank-query-gqa-padding", "masks", _cfg(coupling="query", num_kv_heads=2, **lr), 2, 6, mask="padding"),
        # Causal, square and non-square (top-left aligned).
        Case("heads-tied-causal", "causal", _cfg(), 2, 7, causal=True),
        Case("heads-tied-causal-wide", "causal", _cfg(), 2, 4, 7, causal=True),
        Case("heads-query-causal-tall", "causal", _cfg(coupling="query", num_kv_heads=2), 2, 7, 4, causal=True),
        Case("heads-tied-causal-padding", "causal", _cfg(), 2, 6, mask="padding", causal=True),
        Case("mha-none-causal-batch1", "causal", _cfg(metric="none"), 1, 6, causal=True),
        # Batch 1 and a long-ish sequence.
        Case("heads-separate-batch1", "shapes", _cfg(coupling="separate"), 1, 3, 5),
        Case(
            "heads-tied-long-512",
            "long",
            _cfg(query_dim=32, num_heads=4, key_dim=8),
            1,
            512,
            causal=True,
            gradients=False,
        ),
        Case(
            "lowrank-query-long-cross-600",
            "long",
            _cfg(query_dim=32, num_heads=4, key_dim=8, coupling="query", num_kv_heads=2, **lr),
            1,
            520,
            600,
            mask="padding",
            # Checked since session 30: a tiled backward wrong past the first 256 keys passed.
            gradients=True,
        ),
        # Added later: appended so that every earlier case keeps its seed (and golden values).
        # Cross-attention whose context has the query's shape: a port that drives
        # the key-side map with the query tokens (or, separate, with the query
        # side's generator) computes without error here, and must fail.
        Case("heads-tied-cross-same-shape", "heads", _cfg(), 2, 5, 5),
        Case(
            "heads-separate-cross-same-shape-small-tokens",
            "heads",
            _cfg(coupling="separate"),
            2,
            5,
            5,
            inputs="small-and-zero",
        ),
        # Rank 1, and tokens whose phi depends on eps and on the normalisation itself.
        Case(
            "lowrank-tied-rank1-small-tokens",
            "lowrank",
            _cfg(metric="lowrank", metric_rank=1),
            2,
            6,
            inputs="small-and-zero",
        ),
        # Values of their own feature size, E_v != E_kv (torch kdim != vdim, Keras key/value,
        # Flax inputs_k/inputs_v), with a padding mask over the M keys/values.
        Case(
            "heads-separate-cross-value-dim",
            "shapes",
            _cfg(coupling="separate", context_dim=12, value_input_dim=6, value_dim=5),
            2,
            5,
            7,
            mask="padding",
        ),
        # Empty shapes, as the frameworks' MHA take them (a dynamic batch with no item, no
        # query): the empty output, and gradients that are empty for the inputs and 0 for
        # every parameter. (Queries over no key, M = 0 with N >= 1, are the bad input
        # "context-empty".)
        Case("heads-tied-self-empty-batch", "shapes", _cfg(), 0, 6),
        Case(
            "heads-separate-cross-empty-batch",
            "shapes",
            _cfg(coupling="separate", context_dim=12),
            0,
            5,
            7,
            mask="padding",
        ),
        Case("heads-separate-cross-empty-query", "shapes", _cfg(coupling="separate", context_dim=12), 2, 0, 7),
        Case("heads-tied-self-empty-query", "shapes", _cfg(), 2, 0),
        # From a mutation audit (session 30): each of these caught a wrong port that passed
        # every case above. key_dim != query_dim / num_heads: a scale taken from the embed dim.
        Case("heads-tied-key-dim-6", "heads", _cfg(key_dim=6, value_dim=5), 2, 5),
        # The reference is the inference function: a port must not drop out at inference.
        Case("heads-tied-dropout-inference", "heads", _cfg(dropout=0.5), 2, 6),
        # Masks with size-1 axes to broadcast (one sent down a key-padding path, or batch row
        # 0's mask used for every row), and per-head masks with grouped heads (G < H).
        Case("heads-tied-mask-shared", "masks", _cfg(), 2, 6, mask="shared"),
        Case(
            "heads-separate-mask-per-batch-cross",
            "masks",
            _cfg(coupling="separate", context_dim=12),
            2,
            5,
            7,
            mask="per_batch",
        ),
        Case("lowrank-tied-mask-per-head-batch1", "masks", _cfg(**lr), 2, 6, mask="per_head_batch1"),
        Case("heads-query-gqa-mask-per-key", "masks", _cfg(coupling="query", num_kv_heads=2), 2, 6, mask="per_key"),
        Case("heads-query-gqa-per-head", "masks", _cfg(coupling="query", num_kv_heads=2), 2, 6, mask="per_head"),
        Case(
            "heads-separate-gqa-all-masked-row-cross",
            "masks",
            _cfg(coupling="separate", num_kv_heads=2, context_dim=8),
            2,
            5,
            7,
            mask="all_masked_row",
        ),
        # NaN in gives NaN out, in that query's row only (no gradients: they are NaN).
        Case(
            "heads-separate-nan-token-cross",
            "shapes",
            _cfg(coupling="separate", context_dim=12),
            2,
            5,
            7,
            gradients=False,
            inputs="nan-token",
        ),
        # float16 only: features in the thousands (inputs="large"), whose mean square overflows
        # float16. A port without the float32 statistic the spec asks for (section 7) used to be
        # caught only when the rounding of some other case happened to exceed the tolerance; here
        # phi collapses to 0 and the output is off by far more than float16's tolerance. Tied
        # self-attention (one generator for queries and keys) and lowrank with separate sides
        # over a large context of its own.
        Case("heads-tied-large-tokens", "heads", _cfg(), 2, 6, causal=True, inputs="large", dtypes=("float16",)),
        Case(
            "lowrank-separate-large-tokens-cross",
            "lowrank",
            _cfg(coupling="separate", context_dim=12, **lr),
            2,
            5,
            7,
            mask="padding",
            inputs="large",
            dtypes=("float16",),
        ),
        # Session 32 (a review): NaN in a context token every query sees (spec section 9, NaN in
        # gives NaN out). The query-token case above left a port that zeroes NaN keys or values
        # passing. Grouped key heads with a key-side map of their own, so the NaN reaches the
        # generator, the keys and the values.
        Case(
            "heads-separate-gqa-nan-context-cross",
            "shapes",
            _cfg(coupling="separate", num_kv_heads=2, context_dim=12),
            2,
            5,
            7,
            gradients=False,
            inputs="nan-context",
        ),
    ]
    cases = [dataclasses.replace(c, seed=1000 + i) for i, c in enumerate(cases)]
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "case names must be unique"
    return tuple(cases)


CATALOGUE: tuple[Case, ...] = _build_catalogue()
GROUPS: tuple[str, ...] = tuple(dict.fromkeys(c.group for c in CATALOGUE)) + ("decode", "weights", "penalty", "errors")


def _pick(names: tuple[str, ...]) -> tuple[Case, ...]:
    by_name = {c.name: c for c in CATALOGUE}
    return tuple(by_name[n] for n in names)


# The catalogue cases whose attention weights (B, H, N, M) are checked, per head (the "weights"
# group): every mask kind (all-masked rows must be 0, as the reference defines them), the
# causal rule square, wide and tall, grouped and multi-query heads (head h reads kv head
# h // (H/G)), cross-attention, a scale of its own, dropout at inference and empty shapes.
# The long cases are left out (their outputs already check the same softmax at length).
WEIGHTS_CASES: tuple[Case, ...] = _pick(
    (
        "mha-none-gqa-cross",
        "heads-tied-self",
        "heads-tied-scale-dims",
        "heads-separate-cross",
        "lowrank-separate-mqa",
        "heads-tied-padding",
        "heads-separate-per-head-cross",
        "heads-tied-all-masked-row",
        "heads-separate-gqa-all-masked-row-cross",
        "heads-query-gqa-mask-per-key",
        "lowrank-tied-mask-per-head-batch1",
        "heads-tied-mask-shared",
        "heads-tied-causal",
        "heads-tied-causal-wide",
        "heads-query-causal-tall",
        "heads-tied-causal-padding",
        "heads-separate-cross-value-dim",
        "heads-tied-dropout-inference",
        "heads-tied-self-empty-batch",
        "heads-separate-cross-empty-query",
    )
)

# The catalogue cases whose metric penalty (spec: the mean over adapted roles of
# mean_t ||L(t) - I||_F^2 / (S*d)) is checked (the "penalty" group): each metric and
# coupling, metric "none" (0), grouped and multi-query key sides (S = G on the key side),
# cross-attention whose context has the query's shape (the key role reads the context),
# tokens near the RMS eps and a zero token, value tokens of their own (never mapped), a
# mask (the penalty ignores it: every token counts) and an empty batch (0, not NaN).
PENALTY_CASES: tuple[Case, ...] = _pick(
    (
        "mha-none-self",
        "heads-tied-self",
        "heads-tied-cross-same-shape",
        "heads-separate-cross",
        "heads-query-cross",
        "heads-query-gqa",
        "lowrank-tied-self",
        "lowrank-separate-cross",
        "lowrank-query-nobias",
        "lowrank-separate-mqa",
        "lowrank-tied-rank1-small-tokens",
        "heads-separate-cross-same-shape-small-tokens",
        "heads-separate-cross-value-dim",
        "heads-tied-padding",
        "heads-tied-self-empty-batch",
    )
)


def catalogue(names: list[str] | None = None, groups: list[str] | None = None) -> list[Case]:
    """The catalogue, optionally filtered by case names and/or groups."""
    known = {c.name for c in CATALOGUE}
    for name in names or ():
        if name not in known:
            raise dc.DamchaValueError(
                dc.invalid_argument("names", f"case names, some of {sorted(known)}", f"an unknown case {name!r}")
            )
    for group in groups or ():
        if group not in GROUPS:
            raise dc.DamchaValueError(
                dc.invalid_argument("groups", f"group names, some of {list(GROUPS)}", f"an unknown group {group!r}")
            )
    return [c for c in CATALOGUE if (not names or c.name in names) and (not groups or c.group in groups)]


def resolve_cases(cases: Any, known: tuple[Any, ...], argument: str) -> list[Any]:
    """``cases`` as case objects: each item one of ``known`` or its name (as
    ``damcha conform --case`` takes them), checked by ``argument``'s name.

    Raises:
        DamchaTypeError: ``cases`` is one string (read letter by letter) or
            not iterable, or an item is neither a case nor a string.
        DamchaValueError: a name that is not one of ``known``'s.
    """
    if isinstance(cases, (str, bytes)) or not hasattr(cases, "__iter__"):
        raise dc.DamchaTypeError(
            dc.invalid_argument(
                argument,
                "an iterable of cases or case names, e.g. ['heads-tied-self']",
                f"{argument}={dc.describe(cases)}"
                + (" (one string, read letter by letter)" if isinstance(cases, str) else ""),
            )
        )
    by_name = {c.name: c for c in known}
    kind = type(known[0]).__name__ if known else "Case"
    out = []
    for i, case in enumerate(cases):
        if isinstance(case, str):
            if case not in by_name:
                raise dc.DamchaValueError(
                    dc.invalid_argument(
                        f"{argument}[{i}]", f"the name of one of the {len(by_name)} {kind}s it takes", f"{case!r}"
                    )
                )
            case = by_name[case]
        elif not isinstance(case, type(known[0]) if known else Case):
            raise dc.DamchaTypeError(
                dc.invalid_argument(f"{argument}[{i}]", f"a {kind} or its name", f"{dc.describe(case)}")
            )
        out.append(case)
    return out


def case_params(config: dc.DamchaConfig, seed: int) -> dict[str, np.ndarray]:
    """Parameters that exercise every term: open gates, non-zero biases.

    Fresh ``init_params`` have gates at 0 (plain MHA), which would let a port
    that ignores the metric pass; here gates are drawn in +-[0.3, 1.0].
    """
    rng = np.random.default_rng([seed, 1])
    params = dc.init_params(config, seed)
    for name, value in params.items():
        leaf = name.rsplit(".", 1)[1]
        if leaf == "gate":
            params[name] = rng.uniform(0.3, 1.0, value.shape) * rng.choice([-1.0, 1.0], value.shape)
        elif leaf == "bias":
            params[name] = rng.normal(0.0, 0.3, value.shape)
        elif name.startswith("metric.") and leaf == "kernel":
            params[name] = value * 2.0  # a visibly data-dependent map
    return params


def _make_mask(case: Case, rng: np.random.Generator, M: int) -> np.ndarray | None:
    B, H, N = case.batch, case.config.num_heads, case.query_len
    if case.mask is None:
        return None
    if case.mask == "padding":
        # Batch row b keeps its first M - b keys (at least one).
        lengths = np.maximum(M - np.arange(B) * max(1, M // 3), 1)
        return (np.arange(M)[None, :] < lengths[:, None])[:, None, None, :]
    shape = {
        "shared": (1, 1, N, M),
        "per_batch": (B, 1, N, M),
        "per_head_batch1": (1, H, N, M),
        "per_key": (B, H, 1, M),
    }.get(case.mask, (B, H, N, M))
    mask = rng.random(shape) < 0.7
    mask[..., 0] |= ~mask.any(-1)  # every row sees a key unless we hide it on purpose
    if case.mask == "all_masked_row":
        mask[0, :, 1, :] = False  # query 1 of batch 0 sees nothing, in every head
        mask[-1, 1, -1, :] = False  # and one (batch, head, query) row alone
    return mask


def _small_and_zero(tokens: np.ndarray) -> np.ndarray:
    out = tokens.copy()
    out[:, 1::2] *= 3e-3  # mean(t^2) ~ 1e-5: the RMS eps (1e-6) moves phi by ~5%
    out[0, 0] = 0.0  # phi(0) = 0
    return out


@functools.cache
def materialise(case: Case) -> ReferenceData:
    """Params, inputs, mask and the reference output of ``case`` (cached)."""
    cfg = case.config
    rng = np.random.default_rng([case.seed, 2])
    params = case_params(cfg, case.seed)
    E_kv, E_v = cast(int, cfg.context_dim), cast(int, cfg.value_input_dim)
    query = rng.normal(size=(case.batch, case.query_len, cfg.query_dim))
    context = None if case.context_len is None else rng.normal(size=(case.batch, case.context_len, E_kv))
    M = case.query_len if case.context_len is None else case.context_len
    mask = _make_mask(case, rng, M)
    if case.inputs == "small-and-zero":
        query, context = _small_and_zero(query), None if context is None else _small_and_zero(context)
    if case.inputs == "nan-token":
        query = query.copy()
        query[0, 1, 2] = np.nan
    if case.inputs == "nan-context":
        context = np.array(context)  # a cross-attention case (Case.__post_init__ refuses self-attention)
        context[0, 3, 2] = np.nan
    if case.inputs == "large":
        # Large tokens into kernels scaled down as much: q, k, v stay what they were.
        query, context = query * LARGE, None if context is None else context * LARGE
        params = {**params, **{f"{n}.kernel": params[f"{n}.kernel"] / LARGE for n in ("query", "key", "value")}}
    # Drawn after everything else, and only when needed: earlier cases keep their inputs.
    value = rng.normal(size=(case.batch, M, E_v)) if case.separate_value else None
    expected = dc.damcha_attention(params, cfg, query, context, mask=mask, causal=case.causal, value=value)
    cotangent = rng.normal(size=expected.shape) / np.sqrt(expected.size)
    return ReferenceData(case, params, query, context, mask, cotangent, value, expected=expected)


@functools.cache
def reference_weights(case: Case) -> np.ndarray:
    """The reference's attention probabilities of ``case`` (B, H, N, M), per head, after the
    mask and the causal rule; a query that sees no key has probabilities 0 (kept by the runner,
    like ``expected``)."""
    data = materialise(case)
    _, weights = dc.damcha_attention(
        data.params,
        case.config,
        data.query,
        data.context,
        mask=data.mask,
        causal=case.causal,
        value=data.value,
        return_weights=True,
    )
    return np.asarray(weights)


def _penalty_at(data: ReferenceData, target: str, moved: np.ndarray) -> float:
    """The reference's metric penalty of ``data`` with ``target`` replaced by ``moved``."""
    get = lambda name: moved if name == target else getattr(data, name)  # noqa: E731
    params = {**data.params, target: moved} if target in data.params else data.params
    return dc.metric_penalty(params, data.config, get("query"), get("context"), value=get("value"))


@functools.cache
def reference_penalty(case: Case) -> float:
    """The reference's ``metric_penalty`` of ``case``'s params and tokens (0.0 for metric "none")."""
    data = materialise(case)
    return dc.metric_penalty(data.params, case.config, data.query, data.context, value=data.value)


# ---------------------------------------------------------------- decoding


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """Incremental decoding with a key/value cache: a port reads a prefix of
    P tokens into its cache, then the remaining N tokens, and returns the
    outputs of every token it fed (or, as before, of the N decoded ones).
    They must equal one causal pass over the whole sequence: the prefill's
    tokens see the prefix causally, and query i of the second part sits at
    position P + i and sees keys j <= P + i (the bottom-right rule of the
    design note).

    Args:
        name: unique readable id.
        config: a self-attention layer with ``value_dim == key_dim`` (some
            ports keep keys and values in one cache tensor).
        batch: B.
        prefix_len: P, tokens read into the cache first.
        new_len: N, tokens decoded after the prefix.
        seed: seeds params and inputs.
    """

    name: str
    config: dc.DamchaConfig
    batch: int
    prefix_len: int
    new_len: int
    seed: int = 0

    @property
    def group(self) -> str:
        return "decode"

    @property
    def query_len(self) -> int:  # adapters' unsupported() may read the lengths
        return self.prefix_len + self.new_len

    context_len = None
    self_attention = True
    gradients = False
    # Read by adapters' unsupported() as on a Case: a cache decodes causally, without a mask.
    mask = None
    causal = True
    inputs = None

    @property
    def steps(self) -> tuple[tuple[int, int], ...]:
        """(start, stop) token ranges an adapter feeds in turn: the prefix, one
        new token alone, then the other new tokens as one chunk, so the
        single-token and the multi-token bottom-right paths are both run.
        The first step's outputs are the prefill's, every later step's the
        decoded ones."""
        P, L = self.prefix_len, self.prefix_len + self.new_len
        return tuple((a, b) for a, b in ((0, P), (P, P + 1), (P + 1, L)) if b > a)


def _build_decode_catalogue() -> tuple[DecodeCase, ...]:
    lr = dict(metric="lowrank", metric_rank=3)
    cases = [
        DecodeCase("decode-heads-tied", _cfg(), 2, 5, 3),
        DecodeCase("decode-lowrank-separate", _cfg(coupling="separate", **lr), 2, 4, 3),
        DecodeCase("decode-heads-query-gqa", _cfg(coupling="query", num_kv_heads=2), 1, 6, 2),
        DecodeCase("decode-mha-none-mqa", _cfg(metric="none", num_kv_heads=1), 2, 3, 4),
    ]
    return tuple(dataclasses.replace(c, seed=2000 + i) for i, c in enumerate(cases))


DECODE_CATALOGUE: tuple[DecodeCase, ...] = _build_decode_catalogue()


@functools.cache
def reference_prefill(case: DecodeCase) -> np.ndarray:
    """The outputs (B, P, E_o) of the prefill, the first P tokens read into the cache: a causal
    pass over the prefix alone (kept by the runner, like ``expected``, which holds the rest)."""
    data = materialise_decode(case)
    return dc.damcha_attention(data.params, case.config, data.query[:, : case.prefix_len], causal=True)


@functools.cache
def materialise_decode(case: DecodeCase) -> ReferenceData:
    """Params, the whole sequence as ``query`` (B, P + N, E) and the expected
    outputs of the last N tokens (B, N, E_o), from the reference with
    ``query_offset=P``."""
    cfg = case.config
    rng = np.random.default_rng([case.seed, 4])
    params = case_params(cfg, case.seed)
    x = rng.normal(size=(case.batch, case.prefix_len + case.new_len, cfg.query_dim))
    P = case.prefix_len
    expected = dc.damcha_attention(params, cfg, x[:, P:], x, causal=True, query_offset=P)
    return ReferenceData(case, params, x, None, None, np.zeros_like(expected), expected=expected)


# ---------------------------------------------------------------- bad input

# What the error message must name for each corruption: the reference's own
# argument names first, then the names ports use for the same tensor.
_NAMES = {
    "query": ("query", "inputs_q"),
    "context": ("context", "key", "value", "inputs_k", "inputs_kv"),
    "value": ("value", "inputs_v"),  # separate value tokens (torch's value with vdim, Flax's inputs_v)
    "mask": ("mask",),  # also matches attn_mask, attention_mask, key_padding_mask
}
CORRUPTIONS: dict[str, str] = {
    "query-features": "query",  # one feature too many: never silently sliced
    "context-empty": "context",  # M = 0 keys for N >= 1 queries: no row has an output (N = 0 is a valid case)
    "query-rank": "query",  # (1, B, N, E): an extra leading axis, never silently squeezed
    "context-features": "context",
    "context-batch": "context",  # B + 1 context rows: never broadcast against B queries
    "mask-keys": "mask",  # one key column too many
    "mask-heads": "mask",  # a head axis that is neither 1 nor H
    # Added later. Separate value tokens (E_v != E_kv) and the other mask axes: a port that takes
    # value[:, :M], value[..., :E_v], mask[:B] or mask[:, :, :N] computes the right output from them.
    "value-features": "value",
    "value-length": "value",  # one value token more than there are keys
    "mask-queries": "mask",  # a query axis that is neither 1 nor N
    "mask-batch": "mask",  # a batch axis that is neither 1 nor B
    # Session 30 (a mutation audit): broadcasts a port could do silently.
    "context-batch-one": "context",  # a context of batch 1 for B > 1 queries: never broadcast
    "mask-heads-divisor": "mask",  # G heads (G divides H, G < H): never repeated to H
    # Session 32 (a review): the value tokens' batch, as the context's. A port that checks their
    # length and features but not their batch let einsum broadcast batch 1 over B, or took value[:B].
    "value-batch": "value",  # B + 1 value rows: never sliced to B
    "value-batch-one": "value",  # value tokens of batch 1 for B > 1 queries: never broadcast
}


@dataclasses.dataclass(frozen=True)
class ErrorCase:
    """Bad input every port must reject with a clear error: a ``ValueError``
    (in this project's ports, ``damcha_core.DamchaValueError``) whose message
    names the offending argument and says what it received.

    Args:
        name: unique readable id.
        base: the valid catalogue case the input is derived from.
        corruption: one of ``CORRUPTIONS``.
    """

    name: str
    base: Case
    corruption: str

    def __post_init__(self) -> None:
        if self.corruption not in CORRUPTIONS:
            raise dc.DamchaValueError(
                dc.invalid_argument("corruption", f"one of {tuple(CORRUPTIONS)}", f"corruption={self.corruption!r}")
            )

    @property
    def group(self) -> str:
        return "errors"

    @property
    def argument(self) -> str:
        """The argument the message must name (or a port's name for it, see ``names``)."""
        return CORRUPTIONS[self.corruption]

    @property
    def names(self) -> tuple[str, ...]:
        return _NAMES[self.argument]


def _build_error_catalogue() -> tuple[ErrorCase, ...]:
    by_name = {c.name: c for c in CATALOGUE}
    plan = [
        ("query-features", "heads-tied-self"),
        ("context-empty", "heads-separate-cross"),
        ("query-rank", "heads-tied-self"),
        ("context-features", "heads-separate-cross"),
        ("context-batch", "heads-separate-cross"),
        ("mask-keys", "heads-tied-padding"),
        ("mask-heads", "heads-separate-per-head-cross"),
        ("value-features", "heads-separate-cross-value-dim"),
        ("value-length", "heads-separate-cross-value-dim"),
        ("mask-queries", "heads-separate-per-head-cross"),
        ("mask-batch", "heads-separate-per-head-cross"),
        ("context-batch-one", "heads-separate-cross"),
        ("mask-heads-divisor", "heads-query-gqa-per-head"),
        ("value-batch", "heads-separate-cross-value-dim"),
        ("value-batch-one", "heads-separate-cross-value-dim"),
    ]
    return tuple(ErrorCase(f"{corruption}:{base}", by_name[base], corruption) for corruption, base in plan)


ERROR_CATALOGUE: tuple[ErrorCase, ...] = _build_error_catalogue()


def materialise_error(case: ErrorCase) -> ReferenceData:
    """The base case's data with one tensor corrupted; ``expected`` is the
    valid output, which a port must *not* return."""
    data = materialise(case.base)
    query, context, mask, value = data.query, data.context, data.mask, data.value
    kind = case.corruption
    if kind == "query-features":
        query = np.concatenate([query, query[..., :1]], axis=-1)
    elif kind == "context-empty":
        context = context[:, :0]  # type: ignore[index]
    elif kind == "query-rank":
        # Not (N, E): PyTorch's MHA convention reads a 2-D query as one unbatched sequence.
        query = query[None]
    elif kind == "context-features":
        context = np.concatenate([context, context[..., :1]], axis=-1)  # type: ignore[index]
    elif kind == "context-batch":
        context = np.concatenate([context, context[:1]], axis=0)  # type: ignore[index]
    elif kind == "mask-keys":
        mask = np.concatenate([mask, mask[..., :1]], axis=-1)  # type: ignore[index]
    elif kind == "mask-heads":
        mask = np.concatenate([mask, mask[:, :1]], axis=1)  # type: ignore[index]
    elif kind == "value-features":
        value = np.concatenate([value, value[..., :1]], axis=-1)  # type: ignore[index]
    elif kind == "value-length":
        value = np.concatenate([value, value[:, :1]], axis=1)  # type: ignore[index]
    elif kind == "mask-queries":
        mask = np.concatenate([mask, mask[:, :, :1]], axis=2)  # type: ignore[index]
    elif kind == "mask-batch":
        mask = np.concatenate([mask, mask[:1]], axis=0)  # type: ignore[index]
    elif kind == "context-batch-one":
        context = context[:1]  # type: ignore[index]
    elif kind == "mask-heads-divisor":
        mask = mask[:, : case.base.config.num_kv_heads]  # type: ignore[index]
    elif kind == "value-batch":
        value = np.concatenate([value, value[:1]], axis=0)  # type: ignore[index]
    elif kind == "value-batch-one":
        value = value[:1]  # type: ignore[index]
    return dataclasses.replace(data, query=query, context=context, mask=mask, value=value)


_INPUTS = ("query", "context", "value")


def gradient_targets(data: CaseData) -> list[str]:
    """Tensors whose gradients are checked: the inputs, then every parameter."""
    inputs = ["query"] + ([] if data.context is None else ["context"]) + ([] if data.value is None else ["value"])
    return inputs + list(data.params)


@functools.cache
def reference_directional(case: Case, eps: float = 1e-5) -> dict[str, tuple[np.ndarray, float]]:
    """For each target tensor: a seeded unit direction V and the central difference
    (loss(T + eps V) - loss(T - eps V)) / (2 eps) of the float64 reference, where
    loss = sum(output * cotangent).

    Cases with ``inputs="small-and-zero"`` use the fourth-order stencil
    (8 (l(e) - l(-e)) - (l(2e) - l(-2e))) / (12 e): phi curves sharply at tokens
    whose RMS is near sqrt(eps), and the second-order one is off by ~1e-6 there."""
    return _directional(case, _loss_at, 3, eps)


@functools.cache
def reference_penalty_directional(case: Case, eps: float = 1e-5) -> dict[str, tuple[np.ndarray, float]]:
    """As ``reference_directional``, for loss = the reference's ``metric_penalty`` (directions
    of their own seed stream). Its gradient is 0 for the tensors the penalty does not read (the
    values, the projections), which a port returns as zeros."""
    return _directional(case, _penalty_at, 5, eps)


def _directional(case: Case, loss_at: Any, stream: int, eps: float) -> dict[str, tuple[np.ndarray, float]]:
    """The directional derivatives of ``loss_at(data, target, moved)`` along seeded unit
    directions (seed stream ``stream``), for every gradient target of ``case``."""
    data = materialise(case)
    rng = np.random.default_rng([case.seed, stream])
    signs = (1.0, -1.0) if case.inputs is None else (1.0, -1.0, 2.0, -2.0)
    out = {}
    for target in gradient_targets(data):
        base = getattr(data, target) if target in _INPUTS else data.params[target]
        direction = rng.normal(size=base.shape)
        direction /= np.linalg.norm(direction)
        loss = {s: loss_at(data, target, base + s * eps * direction) for s in signs}
        if case.inputs is None:
            out[target] = (direction, (loss[1.0] - loss[-1.0]) / (2 * eps))
        else:
            out[target] = (direction, (8 * (loss[1.0] - loss[-1.0]) - (loss[2.0] - loss[-2.0])) / (12 * eps))
    return out


def _loss_at(data: ReferenceData, target: str, moved: np.ndarray) -> float:
    """sum(output * cotangent) of the reference with ``target`` replaced by ``moved``."""
    if target in _INPUTS:
        inputs: dict[str, Any] = {target: moved}
        y = data.reference(**inputs)
    else:
        y = data.reference(params={**data.params, target: moved})
    return float(np.sum(y * data.cotangent))
