"""One wording for every argument rule (issues 14 and 16).

Every argument error reads ``Invalid argument `<name>`: expected <rule>.
Received: <value>`` (Keras's wording), built by ``damcha_core.invalid_argument``,
so one rule never reads two ways in two places. Two kinds of test:

* an audit of the source (no framework imported): every ``DamchaValueError`` /
  ``DamchaTypeError`` built from a string literal must not start with the old
  hand-written forms (a backtick, as in ``"`query_offset` must be ..."``),
  spell out ``"Invalid argument"`` by hand, or spell out the rule and the value
  by hand under another first word (``"expected ..."``, or ``"... expected
  ... Received: ..."``); the few messages still written the old way are listed
  below, each with the reason, and the list can only shrink;
* the converted messages of each package, through its public API: the class,
  the argument as the caller spelled it, ``Received:`` with the value (shape
  and dtype for arrays, never their contents), and the automatic coupling
  named as automatic (a user who passed no ``coupling`` must not read
  ``coupling='separate'`` as if they had).
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest

import damcha_core as dc

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("damcha_core", "backends", "onnx_export", "experiments", "conformance")
ERRORS = {"DamchaValueError", "DamchaTypeError", "DamchaNotIntegerError", "DamchaError"}

# Messages still written the old way: the start of the message -> why. Each is
# not an argument rule (a state error: "call convert first", or a third-party
# sublayer's layout); remove an entry when its message is converted.
STILL_OLD = {
    # Not argument rules: the state of an object, or a model's own sublayers.
    "`{}` needs a built layer": "keras canonical I/O on an unbuilt layer (state)",
    "`{}` is not available with use_gate=True": "keras canonical I/O with a gate (state)",
    "`{}` needs float projections": "keras canonical I/O after quantize() (state)",
    "`canonical_variables` cannot give": "keras canonical variables under LoRA (state)",
    "`metric_penalty` needs": "keras metric_penalty before track_metric_penalty (state)",
    "`head_map` is the S x S factor": "torch MetricGenerator.head_map on a low-rank generator (state)",
    "`{}` is quantized": "keras model-conversion layout of a third-party sublayer",
    "`{}` computes": "keras model-conversion layout of a third-party sublayer",
    "`{}` projects": "keras model-conversion layout of a third-party sublayer",
    "`{}` has {} output features": "torch model-conversion layout of a third-party sublayer",
    "`{}` already carries a DAMCHA map": "keras model conversion of a sublayer converted twice (state)",
}


def _literal_text(node: ast.expr) -> str | None:
    """The text of a message written as literals (f-string fields, and
    operands of ``+`` that are not literals, as ``{}``), or None when it has
    no literal start (a variable, a call such as ``invalid_argument(...)``)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _literal_text(node.left)
        return None if left is None else left + (_literal_text(node.right) or "{}")
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


# ``invalid_argument``'s two parts spelled by hand, whatever the first word: a
# rule ("expected ...") followed by the value ("Received: ..."). State errors
# ("... needs a built layer. Received: an unbuilt layer") have no rule part.
_RULE_AND_VALUE = re.compile(r"\b[Ee]xpected\b.*\bReceived:", re.S)
# Python's own wording for unknown keywords, or a variant of it, spelled by hand: the rule reads
# another way than ``unknown_fields``' (``Invalid argument `x`: expected ..., a subset of [...]``).
_UNKNOWN_KEYWORDS = re.compile(r"\bgot (unknown|unexpected) keyword|\b[Uu]nknown\b.*\barguments?\b", re.S)


def _hand_written(text: str) -> bool:
    return (
        text.startswith(("`", "Invalid argument", "A 3-D `"))
        or text.lower().startswith("expected")
        or _RULE_AND_VALUE.search(text) is not None
        or _UNKNOWN_KEYWORDS.search(text) is not None
    )


def _old_style_messages() -> list[tuple[str, int, str]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and node.args):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                text = _literal_text(node.args[0]) if name in ERRORS else None
                if text is not None and _hand_written(text):
                    found.append((str(path.relative_to(ROOT)), node.lineno, text))
    return found


def _builtin_errors_with_policy_messages() -> list[str]:
    """``TypeError(invalid_argument(...))`` and the like: the policy's message under a class that is
    not a DamchaError, which ``except DamchaError`` misses."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Call)):
                    continue
                name = getattr(node.func, "id", None)
                inner = node.args[0].func
                inner_name = inner.attr if isinstance(inner, ast.Attribute) else getattr(inner, "id", None)
                if name in ("TypeError", "ValueError") and inner_name in ("invalid_argument", "unknown_fields"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}({inner_name}(...))")
    return found


def test_policy_messages_are_raised_as_damcha_errors():
    assert not _builtin_errors_with_policy_messages()


def test_no_hand_written_argument_messages():
    """A hand-written ``"`x` must ..."`` (or ``"Invalid argument ..."``, or
    ``"... expected ... Received: ..."``) message reappearing fails here: route
    it through ``damcha_core.invalid_argument``."""
    found = _old_style_messages()
    new = [f"{path}:{line}: {text[:90]}" for path, line, text in found if not text.startswith(tuple(STILL_OLD))]
    assert not new, "messages not built by damcha_core.invalid_argument:\n" + "\n".join(new)
    # The list only shrinks: an entry whose message is gone must go too.
    stale = [start for start in STILL_OLD if not any(text.startswith(start) for _, _, text in found)]
    assert not stale, f"STILL_OLD lists messages that no longer exist; remove them: {stale}"


def test_the_audit_finds_a_rule_and_value_spelled_by_hand_under_any_first_word():
    def text(source: str) -> str | None:
        call = ast.parse(source, mode="eval").body
        assert isinstance(call, ast.Call)
        return _literal_text(call.args[0])

    hand = text('DamchaValueError(f"expected exactly one {what}, " + "as the rule says. Received: " + str(n))')
    assert hand == "expected exactly one {}, as the rule says. Received: {}"
    assert _hand_written(hand)
    assert _hand_written(
        text('DamchaValueError(f"The {name} offset is wrong: expected a multiple of {d}. Received: o={o}")')
    )
    # A state error names no rule; a message built by invalid_argument is not literal text.
    assert not _hand_written(
        text('DamchaValueError("The cache was made under inference_mode. Received: a call outside it")')
    )
    # Unknown keywords in Python's words or the torch blocks' old ones.
    assert _hand_written(text('DamchaTypeError(f"replace_mha() got unknown keyword arguments {unknown}")'))
    assert _hand_written(text('DamchaTypeError(f"Unknown DAMCHA attention arguments {u}. Expected some of {k}")'))
    assert not _hand_written(text('DamchaTypeError("The layer knows no such argument state")'))
    assert text('DamchaValueError(invalid_argument("n", "an int", f"n={n}"))') is None
    assert text('DamchaValueError(prefix + "expected x. Received: y")') is None


# ------------------------------------------------------------ the converted messages


def _message(call: Callable[[], Any], error: type[Exception]) -> str:
    """The message of the error ``call`` raises; Keras re-raises an error from
    ``call()`` with its own frame around it (the arguments, in bold): the line
    of ours, without the terminal's bold."""
    with pytest.raises(error) as info:
        call()
    assert type(info.value).__module__.startswith("damcha_core"), type(info.value)
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(info.value))
    return next((line for line in text.splitlines() if "Invalid argument" in line), text)


CFG = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
P = dc.init_params(CFG, 0)
X = np.random.default_rng(0).normal(size=(2, 3, 8))


def _nan_params() -> dict[str, np.ndarray]:
    bad = dict(P)
    bad["query.bias"] = np.full_like(P["query.bias"], np.nan)
    return bad


CORE = {
    "config": (
        lambda: dc.damcha_attention(P, "cfg", X),
        dc.DamchaTypeError,
        r"Invalid argument `config`: expected a DamchaConfig\. Received: config='cfg'",
    ),
    "config-init": (
        lambda: dc.init_params({"query_dim": 8}),
        dc.DamchaTypeError,
        r"Invalid argument `config`: expected a DamchaConfig\. Received: config=dict\(len=1, keys=\['query_dim'\]\)",
    ),
    "query-dtype": (
        lambda: dc.damcha_attention(P, CFG, X.astype(np.int64)),
        dc.DamchaTypeError,
        r"Invalid argument `query`: expected a real floating tensor \(float16/32/64 or bfloat16\)\. "
        r"Received: query=ndarray\(shape=\(2, 3, 8\), dtype=int64\)",
    ),
    "mask-dtype": (
        lambda: dc.damcha_attention(P, CFG, X, mask=np.ones((3, 3))),
        dc.DamchaTypeError,
        r"Invalid argument `mask`: expected a mask that is boolean \(True = may attend\); convert other masks "
        r"explicitly\. Received: mask=ndarray\(shape=\(3, 3\), dtype=float64\)",
    ),
    "query-offset-float": (
        lambda: dc.damcha_attention(P, CFG, X, query_offset=1.5),
        dc.DamchaValueError,
        r"Invalid argument `query_offset`: expected an int >= 0\. Received: query_offset=1\.5",
    ),
    "query-offset-negative": (
        lambda: dc.damcha_attention(P, CFG, X, query_offset=-1),
        dc.DamchaValueError,
        r"Invalid argument `query_offset`: expected an int >= 0\. Received: query_offset=-1",
    ),
    "param-dtype": (
        lambda: dc.validate_params({**P, "query.bias": np.zeros((2, 4), np.int32)}, CFG),
        dc.DamchaTypeError,
        r"Invalid argument `params\['query.bias'\]`: expected a real floating array\. "
        r"Received: params\['query.bias'\]=ndarray\(shape=\(2, 4\), dtype=int32\)",
    ),
    "param-shape": (
        lambda: dc.validate_params({**P, "query.bias": np.zeros((4, 2))}, CFG),
        dc.DamchaValueError,
        r"Invalid argument `params\['query.bias'\]`: expected shape \(2, 4\) for this config\. "
        r"Received: params\['query.bias'\]\.shape=\(4, 2\)",
    ),
    "param-nan": (
        lambda: dc.validate_params(_nan_params(), CFG),
        dc.DamchaValueError,
        r"Invalid argument `params\['query.bias'\]`: expected finite values \(no NaN or inf\)\. "
        r"Received: 8 NaN and 0 inf of 8 entries, shape=\(2, 4\)",
    ),
    "param-names": (
        lambda: dc.validate_params({k: v for k, v in P.items() if k != "query.bias"}, CFG),
        dc.DamchaValueError,
        r"Invalid argument `params`: expected exactly the config's parameter names \[.*\]\. "
        r"Received: params with missing \['query.bias'\] names",
    ),
    "offset-validator": (
        lambda: dc.check_offset("pos", True),
        dc.DamchaValueError,
        r"Invalid argument `pos`: expected an int >= 0\. Received: pos=True",
    ),
    "rotary-dim": (
        lambda: dc.Rotary.from_base(3),
        dc.DamchaValueError,
        r"Invalid argument `dim`: expected an even int >= 2\. Received: dim=3",
    ),
}


@pytest.mark.parametrize("call, error, pattern", list(CORE.values()), ids=list(CORE))
def test_core_messages(call, error, pattern):
    message = _message(call, error)
    assert re.fullmatch(pattern, message), message
    assert "[[" not in message  # never an array's contents


# Both model converters check `coupling` with damcha_core._layout.check_coupling: one wording.
CONVERT_COUPLING = (
    r"Invalid argument `coupling`: expected one of \('auto', 'tied', 'separate', 'query'\) or None\. "
    r"Received: coupling='both'"
)
# A coupling of another type is a DamchaTypeError (as DamchaConfig's), same wording.
CONVERT_COUPLING_TYPE = CONVERT_COUPLING.replace("'both'", "3")


def _torch_cases() -> dict[str, tuple[Callable[[], Any], type[Exception], str]]:
    import torch

    import damcha_torch as dt

    layer = dt.DamchaAttention(8, 2, batch_first=True)
    x = torch.zeros(2, 3, 8)
    return {
        "query-dtype": (
            lambda: layer(x.long(), x.long(), x.long()),
            dc.DamchaTypeError,
            r"Invalid argument `query`: expected a real floating tensor .*Received: query=Tensor\(shape=\(2, 3, 8\), "
            r"dtype=torch\.int64\)",
        ),
        "input-dtype": (
            lambda: layer(x, x.double(), x.double()),
            dc.DamchaTypeError,
            r"Invalid argument `key`: expected the dtype of this layer's parameters \(torch\.float32\) .*"
            r"Received: query\.dtype=torch\.float32, key\.dtype=torch\.float64, value\.dtype=torch\.float64",
        ),
        "batched": (
            lambda: layer(x, torch.zeros(3, 8), torch.zeros(3, 8)),
            dc.DamchaValueError,
            r"Invalid argument `key`: expected `query`, `key` and `value` all batched \(B, N, E\) or all unbatched "
            r"\(N, E\), as in nn\.MultiheadAttention\. Received: query\.shape=\(2, 3, 8\), key\.shape=\(3, 8\), "
            r"value\.shape=\(3, 8\)",
        ),
        "embed-dim": (
            lambda: dt.DamchaAttention(10, 4),
            dc.DamchaValueError,
            r"Invalid argument `embed_dim`: expected a multiple of `num_heads` when `key_dim` is not given\. "
            r"Received: embed_dim=10, num_heads=4",
        ),
        "activation": (
            lambda: dt.build_encoder(8, 2, 1, activation="swish"),
            dc.DamchaValueError,
            r"Invalid argument `activation`: expected 'relu', 'gelu' or a callable\. Received: activation='swish'",
        ),
        "num-layers": (
            lambda: dt.build_encoder(8, 2, 0),
            dc.DamchaValueError,
            r"Invalid argument `num_layers`: expected an int >= 1\. Received: num_layers=0",
        ),
        "model": (
            lambda: dt.convert(torch.nn.MultiheadAttention(8, 2)),
            dc.DamchaValueError,
            r"Invalid argument `model`: expected a model that contains attention layers; it is itself an "
            r"nn\.MultiheadAttention \(use DamchaAttention\.from_mha\(model\)\)\. Received: model=.*",
        ),
        "coupling": (
            lambda: dt.convert(torch.nn.Linear(2, 2), coupling="both"),
            dc.DamchaValueError,
            CONVERT_COUPLING,
        ),
        "coupling-type": (
            lambda: dt.convert(torch.nn.Linear(2, 2), coupling=3),
            dc.DamchaTypeError,
            CONVERT_COUPLING_TYPE,
        ),
        "rank": (
            lambda: dt.MetricGenerator(8, 2, 4, metric="lowrank"),
            dc.DamchaValueError,
            r"Invalid argument `rank`: expected an int >= 1 with metric='lowrank' \(it is required\)\. "
            r"Received: rank=None",
        ),
    }


def _jax_cases() -> dict[str, tuple[Callable[[], Any], type[Exception], str]]:
    from flax import nnx

    import damcha_jax as dj

    layer = dj.DamchaAttention(2, 8, rngs=nnx.Rngs(0))
    x = np.zeros((2, 3, 8), np.float32)
    return {
        "query-dtype": (
            lambda: layer(x.astype(np.int32)),
            dc.DamchaTypeError,
            r"Invalid argument `inputs_q`: expected a real floating tensor .*Received: inputs_q=ndarray\(shape=\(2, 3, 8\), "
            r"dtype=int32\)",
        ),
        "features": (
            lambda: layer(x, np.zeros((2, 3, 6), np.float32)),
            dc.DamchaValueError,
            r"Invalid argument `inputs_k`: expected 8 features \(in_kv_features\)\. Received: inputs_k\.shape=\(2, 3, 6\)",
        ),
        "qkv-features": (
            lambda: dj.DamchaAttention(2, 8, qkv_features=8, key_dim=3, rngs=nnx.Rngs(0)),
            dc.DamchaValueError,
            r"Invalid argument `qkv_features`: expected num_heads \* key_dim when both are given .*"
            r"Received: qkv_features=8, key_dim=3, num_heads=2",
        ),
        "inputs-k": (
            lambda: layer(x, None, x),
            dc.DamchaValueError,
            r"Invalid argument `inputs_k`: expected the key tokens when `inputs_v` is given .*Received: inputs_k=None, "
            r"inputs_v=ndarray\(shape=\(2, 3, 8\), dtype=float32\)",
        ),
    }


def _keras_cases() -> dict[str, tuple[Callable[[], Any], type[Exception], str]]:
    import keras

    import damcha_keras as dk

    x = np.zeros((2, 3, 8), np.float32)

    def built() -> Any:
        layer = dk.DamchaAttention(2, 4)
        layer(x, x)
        return layer

    return {
        "batch": (
            lambda: built()(x, np.zeros((3, 3, 8), np.float32)),
            dc.DamchaValueError,
            r"Invalid argument `value`: expected the batch size of `query` \(they must be equal\)\. "
            r"Received: query\.shape=\(2, 3, 8\), value\.shape=\(3, 3, 8\)",
        ),
        "key-value": (
            # Keras' own MHA test matches "must be equal" here.
            lambda: dk.DamchaAttention(2, 4).compute_output_shape((2, 4, 8), (2, 2, 8), (2, 1, 8)),
            dc.DamchaValueError,
            r"Invalid argument `key`: expected the shape of `value` but for the last \(feature\) axis \(all other dims "
            r"must be equal\)\. Received: key\.shape=\(2, 1, 8\), value\.shape=\(2, 2, 8\)",
        ),
        "cache-index": (
            lambda: built()(x, x, cache_update_index=0),
            dc.DamchaValueError,
            r"Invalid argument `cache_update_index`: expected None without a `cache`\. "
            r"Received: cache=None, cache_update_index=0",
        ),
        "epsilon": (
            lambda: dk.TransformerEncoder(16, 2, layer_norm_epsilon=0.0),
            dc.DamchaValueError,
            r"Invalid argument `layer_norm_epsilon`: expected a number > 0\. Received: layer_norm_epsilon=0\.0",
        ),
        "coupling": (
            lambda: dk.convert(keras.layers.Dense(2), coupling="both"),
            dc.DamchaValueError,
            CONVERT_COUPLING,
        ),
        "coupling-type": (
            lambda: dk.convert(keras.layers.Dense(2), coupling=3),
            dc.DamchaTypeError,
            CONVERT_COUPLING_TYPE,
        ),
    }


def _onnx_cases() -> dict[str, tuple[Callable[[], Any], type[Exception], str]]:
    import damcha_onnx as do

    return {
        "form-opset": (
            lambda: do.ExportOptions(form="attention", opset=18),
            dc.DamchaValueError,
            r"Invalid argument `opset`: expected an int >= 23 with form='attention' .*Received: opset=18, form='attention'",
        ),
        "fixed-dim": (
            lambda: do.ExportOptions(dynamic=False),
            dc.DamchaValueError,
            r"Invalid argument `batch_size`: expected an int >= 1 with dynamic=False\. Received: batch_size=None",
        ),
        "context-len": (
            lambda: do.ExportOptions(context_len=3),
            dc.DamchaValueError,
            r"Invalid argument `context_len`: expected None without cross=True\. Received: context_len=3, cross=False",
        ),
        "kv-cache": (
            lambda: do.ExportOptions(kv_cache=True),
            dc.DamchaValueError,
            r"Invalid argument `kv_cache`: expected False unless causal=True: .*Received: kv_cache=True, causal=False",
        ),
    }


def _experiments_cases() -> dict[str, tuple[Callable[[], Any], type[Exception], str]]:
    import damcha_experiments as de

    return {
        "paired": (
            lambda: de.paired_difference([1.0, 2.0], [1.0]),
            dc.DamchaValueError,
            r"Invalid argument `b`: expected the shape of `a` \(one value per seed in each\)\. "
            r"Received: a\.shape=\(2,\), b\.shape=\(1,\)",
        ),
        "task": (
            lambda: de.task_config("nope"),
            dc.DamchaValueError,
            r"Invalid argument `task`: expected one of \[.*\]\. Received: task='nope'",
        ),
    }


PORT_CASES = {
    "torch": _torch_cases,
    "jax": _jax_cases,
    "keras": _keras_cases,
    "onnx": _onnx_cases,
    "experiments": _experiments_cases,
}
PORT_IDS = {
    "torch": [
        "query-dtype",
        "input-dtype",
        "batched",
        "embed-dim",
        "activation",
        "num-layers",
        "model",
        "coupling",
        "coupling-type",
        "rank",
    ],
    "jax": ["query-dtype", "features", "qkv-features", "inputs-k"],
    "keras": ["batch", "key-value", "cache-index", "epsilon", "coupling", "coupling-type"],
    "onnx": ["form-opset", "fixed-dim", "context-len", "kv-cache"],
    "experiments": ["paired", "task"],
}


@pytest.mark.parametrize("package, case", [(p, c) for p, cases in PORT_IDS.items() for c in cases], ids=lambda v: v)
def test_package_messages(package, case):
    cases = PORT_CASES[package]()
    assert sorted(cases) == sorted(PORT_IDS[package])
    call, error, pattern = cases[case]
    message = _message(call, error)
    assert re.fullmatch(pattern, message, re.S), message
    assert "[[" not in message  # arrays by shape and dtype, never by contents


# ----------------------------------------------- the coupling as the user passed it


def _separate_layer(port: str, generator: Any, **kwargs: Any) -> Any:
    """A layer whose coupling comes out "separate" (key features 6 != query features 8)."""
    if port == "torch":
        import damcha_torch as dt

        return dt.DamchaAttention(8, 2, kdim=6, vdim=6, metric_generator=generator, **kwargs)
    if port == "jax":
        from flax import nnx

        import damcha_jax as dj

        return dj.DamchaAttention(2, 8, in_kv_features=6, metric_generator=generator, rngs=nnx.Rngs(0), **kwargs)
    import damcha_keras as dk

    layer = dk.DamchaAttention(2, 4, metric_generator=generator, **kwargs)
    layer(np.zeros((2, 3, 8), np.float32), np.zeros((2, 3, 6), np.float32))
    return layer


def _generator(port: str) -> Any:
    if port == "torch":
        import damcha_torch as dt

        return dt.MetricGenerator(8, 2, 4)
    if port == "jax":
        from flax import nnx

        import damcha_jax as dj

        return dj.MetricGenerator(8, 2, head_dim=4, rngs=nnx.Rngs(0))
    import damcha_keras as dk

    return dk.MetricGenerator(2, key_dim=4)


SIZES = {
    "torch": r"kdim=6 != embed_dim=8",
    "jax": r"in_kv_features=6 != in_features=8",
    "keras": r"config\.context_dim=6 != config\.query_dim=8",
}


@pytest.mark.parametrize("port", ["torch", "jax", "keras"])
def test_an_automatic_coupling_is_named_as_automatic(port):
    """One generator where the sizes make the coupling "separate": with no
    ``coupling`` passed the message says it was chosen automatically and why;
    with ``coupling="separate"`` passed it says so, and never ``coupling=None``."""
    auto = _message(lambda: _separate_layer(port, _generator(port)), dc.DamchaValueError)
    assert re.fullmatch(
        r"Invalid argument `metric_generator`: expected a dict \{'q': \.\.\., 'k': \.\.\.\} with coupling='separate', "
        rf"which was chosen automatically because {SIZES[port]} \(no coupling was passed; pass coupling=\.\.\. to "
        r"choose one\) \(one generator per side\)\. Received: metric_generator=.*",
        auto,
    ), auto
    explicit = _message(lambda: _separate_layer(port, _generator(port), coupling="separate"), dc.DamchaValueError)
    assert re.fullmatch(
        r"Invalid argument `metric_generator`: expected a dict \{'q': \.\.\., 'k': \.\.\.\} with "
        r"coupling='separate' \(one generator per side\)\. Received: metric_generator=.*",
        explicit,
    ), explicit
    for message in (auto, explicit):
        assert "coupling=None" not in message and "coupling='auto'" not in message
