"""The argument policy (damcha_core._policy): every validator and rule, with the
port's own argument names in every message, and the metric-structure table."""

from __future__ import annotations

import itertools
import math
import threading

import numpy as np
import pytest

import damcha_core as dc

TORCH_CONFIG_NAMES = {"query_dim": "embed_dim", "context_dim": "kdim", "use_bias": "bias", "value_input_dim": "vdim"}
TORCH_SHAPE_NAMES = {
    "query": "query",
    "context": "key",
    "mask": "attn_mask",
    "query_dim": "embed_dim",
    "context_dim": "kdim",
    "value_input_dim": "vdim",
}


# ------------------------------------------------------------------ validators


# A table, one case a line (not reformatted).
# fmt: off
@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda: dc.check_int("heads_arg", 0), dc.DamchaValueError, r"^Invalid argument `heads_arg`: expected an int >= 1\. Received: heads_arg=0$"),
        (lambda: dc.check_int("heads_arg", 2.0), dc.DamchaTypeError, r"^Invalid argument `heads_arg`: expected an int >= 1\. Received: heads_arg=2\.0$"),
        (lambda: dc.check_int("heads_arg", True), dc.DamchaTypeError, r"^Invalid argument `heads_arg`: expected an int >= 1\. Received: heads_arg=True$"),
        (lambda: dc.check_int("heads_arg", np.bool_(True)), dc.DamchaTypeError, r"Received: heads_arg=True$"),
        (lambda: dc.check_int("heads_arg", None), dc.DamchaTypeError, r"^Invalid argument `heads_arg`: expected an int >= 1\. Received: heads_arg=None$"),
        (lambda: dc.check_int("heads_arg", "3", optional=True), dc.DamchaTypeError, r"^Invalid argument `heads_arg`: expected an int >= 1 or None\. Received: heads_arg='3'$"),
        (lambda: dc.check_int("pos", -2, minimum=0), dc.DamchaValueError, r"^Invalid argument `pos`: expected an int >= 0\. Received: pos=-2$"),
        (lambda: dc.check_choice("kind", "full", ("a", "b")), dc.DamchaValueError, r"^Invalid argument `kind`: expected one of \('a', 'b'\)\. Received: kind='full'$"),
        (lambda: dc.check_choice("kind", 1, ("a", "b")), dc.DamchaTypeError, r"^Invalid argument `kind`: expected one of \('a', 'b'\)\. Received: kind=1$"),
        (lambda: dc.check_real("temp", "1"), dc.DamchaTypeError, r"^Invalid argument `temp`: expected a real number\. Received: temp='1'$"),
        (lambda: dc.check_real("temp", False), dc.DamchaTypeError, r"Received: temp=False$"),
        (lambda: dc.check_real("temp", 1j), dc.DamchaTypeError, r"Received: temp=1j$"),
        (lambda: dc.check_bool("flag", 1), dc.DamchaTypeError, r"^Invalid argument `flag`: expected a bool\. Received: flag=1$"),
        (lambda: dc.check_bool("flag", "yes"), dc.DamchaTypeError, r"^Invalid argument `flag`: expected a bool\. Received: flag='yes'$"),
        (lambda: dc.check_rate("drop", 1.0), dc.DamchaValueError, r"^Invalid argument `drop`: expected a number in \[0, 1\)\. Received: drop=1\.0$"),
        (lambda: dc.check_rate("drop", -0.1), dc.DamchaValueError, r"Received: drop=-0\.1$"),
        (lambda: dc.check_rate("drop", float("nan")), dc.DamchaValueError, r"Received: drop=nan$"),
        (lambda: dc.check_rate("drop", "0.1"), dc.DamchaTypeError, r"^Invalid argument `drop`: expected a real number\. Received: drop='0\.1'$"),
        (lambda: dc.check_seed("rng_seed", -1), dc.DamchaValueError, r"^Invalid argument `rng_seed`: expected an int >= 0 or None\. Received: rng_seed=-1$"),
        (lambda: dc.check_seed("rng_seed", 1.5), dc.DamchaTypeError, r"^Invalid argument `rng_seed`: expected an int >= 0 or None\. Received: rng_seed=1\.5$"),
        (lambda: dc.check_seed("rng_seed", None, optional=False), dc.DamchaTypeError, r"^Invalid argument `rng_seed`: expected an int >= 0\. Received: rng_seed=None$"),
        (lambda: dc.check_finite_nonneg("l2", -1.0), dc.DamchaValueError, r"^Invalid argument `l2`: expected a finite number >= 0\. Received: l2=-1\.0$"),
        (lambda: dc.check_finite_nonneg("l2", float("inf")), dc.DamchaValueError, r"Received: l2=inf$"),
        (lambda: dc.check_finite_nonneg("l2", float("nan")), dc.DamchaValueError, r"Received: l2=nan$"),
        (lambda: dc.check_finite_nonneg("l2", "0"), dc.DamchaTypeError, r"^Invalid argument `l2`: expected a finite number >= 0\. Received: l2='0'$"),
        (lambda: dc.check_finite_nonneg("l2", True), dc.DamchaTypeError, r"Received: l2=True$"),
    ],
    ids=lambda v: None,
)
# fmt: on
def test_validators_reject_with_class_name_and_value(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_validators_accept_and_normalise():
    assert dc.check_int("n", np.int64(3)) == 3 and type(dc.check_int("n", np.int64(3))) is int
    assert dc.check_int("n", None, optional=True) is None
    assert dc.check_int("n", 0, minimum=0) == 0
    assert dc.check_choice("k", "a", ("a", "b")) == "a"
    assert dc.check_real("t", np.float32(0.5)) == 0.5 and type(dc.check_real("t", 2)) is float
    assert dc.check_bool("f", np.bool_(True)) is True and dc.check_bool("f", False) is False
    assert dc.check_rate("d", 0) == 0.0 and dc.check_rate("d", 0.999) == 0.999
    assert dc.check_seed("s", None) is None and dc.check_seed("s", 0) == 0
    assert dc.check_finite_nonneg("l2", 0) == 0.0 and dc.check_finite_nonneg("l2", np.float64(2.5)) == 2.5


# ----------------------------------------------------------------- make_config

# A table, one case a line (not reformatted).
# fmt: off
@pytest.mark.parametrize(
    "fields, error, pattern",
    [
        (dict(query_dim=16.0, num_heads=4, key_dim=4), dc.DamchaTypeError, r"^Invalid argument `embed_dim`: expected an int >= 1\. Received: embed_dim=16\.0$"),
        (dict(query_dim=16, num_heads=4, key_dim=4, use_bias="no"), dc.DamchaTypeError, r"^Invalid argument `bias`: expected a bool\. Received: bias='no'$"),
        (dict(query_dim=16, num_heads=4, key_dim=4, context_dim=0), dc.DamchaValueError, r"^Invalid argument `kdim`: expected an int >= 1 or None\. Received: kdim=0$"),
        (dict(query_dim=16, num_heads=4, key_dim=4, context_dim=12, coupling="tied"), dc.DamchaValueError,
         r"^Invalid argument `coupling`: expected 'separate' or 'query' .*coupling='tied' feeds .* needs kdim == embed_dim\. "
         r"Received: coupling='tied', embed_dim=16, kdim=12$"),
        (dict(query_dim=16, num_heads=4, key_dim=4, value_input_dim=-3), dc.DamchaValueError, r"^Invalid argument `vdim`: expected an int >= 1 or None\. Received: vdim=-3$"),
        (dict(num_heads=4, key_dim=4), dc.DamchaTypeError, r"^Invalid argument `embed_dim`: expected an int >= 1\. Received: embed_dim=None$"),
    ],
    ids=["embed-type", "bias-type", "kdim-zero", "tied-kdim", "vdim", "embed-missing"],
)
# fmt: on
def test_make_config_errors_name_the_ports_arguments(fields, error, pattern):
    with pytest.raises(error, match=pattern):
        dc.make_config(names=TORCH_CONFIG_NAMES, **fields)


def test_make_config_builds_the_same_config_and_leaks_no_names():
    cfg = dc.make_config(names=TORCH_CONFIG_NAMES, query_dim=16, num_heads=4, key_dim=4, context_dim=12, coupling=None)
    assert cfg == dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, context_dim=12, coupling="separate")
    with pytest.raises(dc.DamchaValueError):
        dc.make_config(names=TORCH_CONFIG_NAMES, query_dim=0, num_heads=4, key_dim=4)
    # names apply only inside make_config: a plain DamchaConfig speaks of its own fields again
    with pytest.raises(dc.DamchaValueError, match=r"^Invalid argument `query_dim`: expected an int >= 1\. Received: query_dim=0$"):
        dc.DamchaConfig(query_dim=0, num_heads=4, key_dim=4)


def test_make_config_names_are_per_thread():
    """Another thread building a plain config while make_config is validating here sees no names."""
    seen: list[str] = []

    class HookInt(int):
        # check_int compares the value with its minimum while make_config's names are set
        def __lt__(self, other):
            worker = threading.Thread(target=lambda: seen.append(_message(lambda: dc.DamchaConfig(query_dim=0, num_heads=1, key_dim=1))))
            worker.start()
            worker.join()
            return int(self) < other

    cfg = dc.make_config(names={"query_dim": "embed_dim"}, query_dim=HookInt(4), num_heads=1, key_dim=1)
    assert cfg.query_dim == 4
    assert seen == ["Invalid argument `query_dim`: expected an int >= 1. Received: query_dim=0"]


def _message(call) -> str:
    try:
        call()
    except dc.DamchaError as exc:
        return str(exc)
    raise AssertionError("no error")


def test_make_config_rejects_unknown_fields_and_bad_names():
    with pytest.raises(dc.DamchaTypeError, match=r"^Invalid argument `heads`: expected DamchaConfig fields.*Received: unknown field \['heads'\]$"):
        dc.make_config(query_dim=4, num_heads=1, key_dim=1, heads=3)
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `names`: expected a mapping.*Received: names=\['embed_dim'\]"):
        dc.make_config(names=["embed_dim"], query_dim=4, num_heads=1, key_dim=1)


# ---------------------------------------------------------------- check_layer_args

def test_check_layer_args_validates_without_input_sizes():
    got = dc.check_layer_args(num_heads=4, key_dim=2, value_dim=None, num_kv_heads=None, output_dim=None,
                              use_bias=np.bool_(False), metric="lowrank", metric_rank=np.int64(3), coupling=None,
                              scale=None, dropout=0)
    assert got == dict(num_heads=4, key_dim=2, value_dim=2, num_kv_heads=4, output_dim=None, use_bias=False,
                       metric="lowrank", metric_rank=3, coupling="auto", scale=None, dropout=0.0)
    assert type(got["metric_rank"]) is int and type(got["use_bias"]) is bool
    both = dc.check_layer_args(query_dim=8, context_dim=6, num_heads=2, key_dim=2, coupling="auto")
    assert both["coupling"] == "separate"


# A table, one case a line (not reformatted).
# fmt: off
@pytest.mark.parametrize(
    "fields, error, pattern",
    [
        (dict(num_heads=4, key_dim=2, output_dim=0), dc.DamchaValueError, r"^Invalid argument `output_shape`: expected an int >= 1 or None\. Received: output_shape=0$"),
        (dict(num_heads=4, num_kv_heads=3), dc.DamchaValueError, r"Invalid argument `num_heads`: expected a multiple of `num_kv_heads`.*num_heads=4, num_kv_heads=3"),
        (dict(num_heads=4, num_kv_heads=2, coupling="tied"), dc.DamchaValueError, r"coupling='tied'.*num_kv_heads == num_heads"),
        (dict(metric="lowrank"), dc.DamchaValueError, r"Invalid argument `metric_rank`: expected an int >= 1 with metric='lowrank'"),
        (dict(metric="heads", metric_rank=2), dc.DamchaValueError, r"only used with metric='lowrank'"),
        (dict(dropout=1.5), dc.DamchaValueError, r"^Invalid argument `dropout`: expected a number in \[0, 1\)\. Received: dropout=1\.5$"),
        (dict(coupling="both"), dc.DamchaValueError, r"Invalid argument `coupling`: expected one of \('tied', 'separate', 'query', 'auto'\)"),
        (dict(scale=-1.0), dc.DamchaValueError, r"Invalid argument `scale`: expected a finite number > 0 or None"),
        (dict(num_heads=4, heads=2), dc.DamchaTypeError, r"^Invalid argument `heads`: expected DamchaConfig fields.*Received: unknown field \['heads'\]$"),
    ],
    ids=["output-shape", "divisible", "tied-gqa", "rank-missing", "rank-extra", "dropout", "coupling", "scale", "unknown"],
)
# fmt: on
def test_check_layer_args_errors(fields, error, pattern):
    with pytest.raises(error, match=pattern):
        dc.check_layer_args(names={"output_dim": "output_shape"}, **fields)


def test_check_layer_args_and_damcha_config_share_one_implementation():
    """The same bad value gives the same class and message both ways."""
    base = dict(query_dim=8, num_heads=4, key_dim=2)
    for bad in (dict(num_heads=0), dict(key_dim=2.5), dict(metric="full"), dict(metric="lowrank", metric_rank=0),
                dict(scale=float("nan")), dict(dropout=-0.5), dict(use_bias=0), dict(num_kv_heads=3)):
        try:
            dc.DamchaConfig(**{**base, **bad})
        except dc.DamchaError as exc:
            from_config = (type(exc), str(exc))
        with pytest.raises(from_config[0]) as info:
            dc.check_layer_args(**{**base, **bad})
        assert str(info.value) == from_config[1]


# ------------------------------------------------------------------- coupling

COUPLING_TABLE = [
    # metric, H, G, E_q, E_kv, same_inputs -> auto
    ("heads", 4, 4, 8, 8, None, "tied"),
    ("heads", 4, 4, 8, 8, True, "tied"),
    ("heads", 4, 4, 8, 8, False, "separate"),
    ("heads", 4, 2, 8, 8, None, "separate"),
    ("heads", 4, 4, 8, 6, None, "separate"),
    ("lowrank", 4, 1, 8, 6, None, "separate"),
    ("none", 4, 4, 8, 8, None, "tied"),
    ("none", 4, 2, 8, 6, None, "separate"),
]


@pytest.mark.parametrize("metric, H, G, E_q, E_kv, same, want", COUPLING_TABLE,
                         ids=[f"{m}-H{h}G{g}-E{a}x{b}-same{s}" for m, h, g, a, b, s, _ in COUPLING_TABLE])
def test_coupling_auto_resolution(metric, H, G, E_q, E_kv, same, want):
    for given in (None, "auto"):
        got = dc.resolve_coupling(given, metric=metric, query_dim=E_q, context_dim=E_kv, num_heads=H,
                                  num_kv_heads=G, same_inputs=same)
        assert got == want
    if same is None:
        rank = 2 if metric == "lowrank" else None
        cfg = dc.DamchaConfig(query_dim=E_q, num_heads=H, key_dim=2, num_kv_heads=G, context_dim=E_kv,
                              metric=metric, metric_rank=rank, coupling="auto")
        assert cfg.coupling == want
        assert cfg == dc.DamchaConfig(query_dim=E_q, num_heads=H, key_dim=2, num_kv_heads=G, context_dim=E_kv,
                                      metric=metric, metric_rank=rank, coupling=want)
        assert dc.DamchaConfig(query_dim=E_q, num_heads=H, key_dim=2, num_kv_heads=G, context_dim=E_kv,
                               metric=metric, metric_rank=rank).coupling == want  # the default is auto


def test_resolve_coupling_keeps_explicit_choices_and_checks_tied():
    kw = dict(metric="heads", query_dim=8, context_dim=8, num_heads=4, num_kv_heads=4)
    for coupling in ("tied", "separate", "query"):
        assert dc.resolve_coupling(coupling, **kw) == coupling
    assert dc.resolve_coupling("query", metric="heads", query_dim=8, context_dim=None, num_heads=4, num_kv_heads=None) == "query"
    with pytest.raises(dc.DamchaValueError, match=r"^Invalid argument `coupling`: .*coupling='tied'.*needs kdim == embed_dim.*Received: coupling='tied', embed_dim=8, kdim=6$"):
        dc.resolve_coupling("tied", **{**kw, "context_dim": 6}, names=TORCH_CONFIG_NAMES)
    assert dc.resolve_coupling("tied", **{**kw, "metric": "none", "num_kv_heads": 2}) == "tied"
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `coupling`: expected one of"):
        dc.resolve_coupling("mixed", **kw)
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `same_inputs`: expected a bool"):
        dc.resolve_coupling(None, **kw, same_inputs="no")


# ----------------------------------------------------------------- generators

class Gen:
    def __init__(self, features, heads, metric="heads", head_dim=2, rank=None):
        self.spec = dc.GeneratorSpec(features, heads, metric, head_dim, rank)


class OtherGen:
    pass


def _resolve(given, cfg, **kw):
    return dc.resolve_generators(given, cfg, generator_type=Gen, spec_of=lambda g: g.spec, **kw)


TIED = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=2)
SEPARATE = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=2, num_kv_heads=2, context_dim=6, coupling="separate")
QUERY = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=2, num_kv_heads=2, coupling="query")
NONE = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=2, metric="none")
LOWRANK = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=2, metric="lowrank", metric_rank=3)


def test_resolve_generators_accepts_what_fits():
    g, q, k = Gen(8, 4), Gen(8, 4), Gen(6, 2)
    assert _resolve(None, TIED) == {} and _resolve(None, NONE) == {} and _resolve({}, NONE) == {}
    assert _resolve(g, TIED) == {"qk": g}
    assert _resolve(g, QUERY) == {"q": g}
    assert _resolve({"q": q, "k": k}, SEPARATE) == {"q": q, "k": k}
    assert _resolve({"qk": g}, TIED) == {"qk": g}
    # a "heads" generator does not depend on the head size; a "lowrank" one does
    other_d = Gen(8, 4, head_dim=7)
    assert _resolve(other_d, TIED) == {"qk": other_d}
    lr = Gen(8, 4, "lowrank", 2, 3)
    assert _resolve(lr, LOWRANK) == {"qk": lr}
    assert TIED.generator_spec("qk") == dc.GeneratorSpec(8, 4, "heads", 2, None)
    assert SEPARATE.generator_spec("k") == dc.GeneratorSpec(6, 2, "heads", 2, None)


# A table, one case a line (not reformatted).
# fmt: off
GENERATOR_RULES = [
        (Gen(8, 4), NONE, dc.DamchaValueError, r"^Invalid argument `metric_generator`: expected None with metric='none'"),
        ({"qk": Gen(8, 4)}, NONE, dc.DamchaValueError, r"^Invalid argument `metric_generator`: expected None with metric='none'.*Received: metric_generator with keys \[\"'qk'\"\]$"),
        (Gen(8, 4), SEPARATE, dc.DamchaValueError, r"^Invalid argument `metric_generator`: expected a dict \{'q': \.\.\., 'k': \.\.\.\} with coupling='separate'"),
        ({"q": Gen(8, 4)}, SEPARATE, dc.DamchaValueError, r"exactly this layer's metric sides \['q', 'k'\].*missing sides \['k'\]"),
        ({"q": Gen(8, 4), "k": Gen(6, 2), "v": Gen(6, 2)}, SEPARATE, dc.DamchaValueError, r"unexpected keys \['v'\]"),
        ({"q": Gen(8, 4)}, TIED, dc.DamchaValueError, r"missing sides \['qk'\]; unexpected keys \['q'\]"),
        ({"q": Gen(8, 4), "k": OtherGen()}, SEPARATE, dc.DamchaTypeError, r"^Invalid argument `metric_generator\['k'\]`: expected a Gen\. Received: metric_generator\['k'\]=<"),
        (OtherGen(), TIED, dc.DamchaTypeError, r"^Invalid argument `metric_generator`: expected a Gen, a dict of side -> Gen for sides \['qk'\], or None"),
        ([Gen(8, 4)], TIED, dc.DamchaTypeError, r"Received: metric_generator=list\(len=1"),
        (Gen(6, 4), TIED, dc.DamchaValueError, r"^Invalid argument `metric_generator`: expected a generator that fits side 'qk' of this layer; it differs in features=6 \(expected 8\)\. Received: metric_generator with GeneratorSpec\(features=6"),
        ({"q": Gen(8, 4), "k": Gen(6, 4)}, SEPARATE, dc.DamchaValueError, r"^Invalid argument `metric_generator\['k'\]`: expected a generator that fits side 'k'.*heads=4 \(expected 2\)"),
        (Gen(8, 4, "lowrank", 2, 3), TIED, dc.DamchaValueError, r"metric='lowrank' \(expected 'heads'\), rank=3 \(expected None\)"),
        (Gen(8, 4, "lowrank", 5, 3), LOWRANK, dc.DamchaValueError, r"head_dim=5 \(expected 2\)"),
        (Gen(8, 4, "lowrank", 2, 4), LOWRANK, dc.DamchaValueError, r"rank=4 \(expected 3\)"),
]
GENERATOR_RULE_IDS = ["metric-none", "metric-none-dict", "single-for-separate", "missing-side", "extra-side", "wrong-side-name",
         "value-type", "given-type", "list", "features", "kv-heads", "metric", "lowrank-head-dim", "rank"]
# fmt: on


@pytest.mark.parametrize("given, cfg, error, pattern", GENERATOR_RULES, ids=GENERATOR_RULE_IDS)
def test_resolve_generators_rules(given, cfg, error, pattern):
    with pytest.raises(error, match=pattern):
        _resolve(given, cfg)


def test_resolve_generators_says_when_the_coupling_was_automatic():
    """With ``coupling_was_auto=True`` (the user passed no coupling) a message
    that depends on the coupling says it was chosen, and why, in the port's
    names; without it the coupling is stated as the user's."""
    auto = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=2, num_kv_heads=2, context_dim=6)
    names = {"query_dim": "embed_dim", "context_dim": "kdim"}
    with pytest.raises(dc.DamchaValueError) as info:
        _resolve(Gen(8, 4), auto, names=names, coupling_was_auto=True)
    assert str(info.value).startswith(
        "Invalid argument `metric_generator`: expected a dict {'q': ..., 'k': ...} with coupling='separate', which "
        "was chosen automatically because num_kv_heads=2 != num_heads=4 and kdim=6 != embed_dim=8 (no coupling was "
        "passed; pass coupling=... to choose one) (one generator per side). Received: metric_generator=<"
    ), info.value
    with pytest.raises(dc.DamchaValueError, match=r"as keys with coupling='separate', which was chosen automatically"):
        _resolve({"q": Gen(8, 4)}, auto, coupling_was_auto=True)
    with pytest.raises(dc.DamchaValueError, match=r"as keys with coupling='separate': missing sides \['k'\]"):
        _resolve({"q": Gen(8, 4)}, auto)
    tied = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=2)
    with pytest.raises(
        dc.DamchaValueError,
        match=r"with coupling='tied', which was chosen automatically because num_kv_heads=4 == num_heads=4 and "
        r"config\.context_dim=8 == config\.query_dim=8 ",
    ):
        _resolve({"q": Gen(8, 4)}, tied, coupling_was_auto=True)
    with pytest.raises(dc.DamchaTypeError, match="Invalid argument `coupling_was_auto`: expected a bool"):
        _resolve(Gen(8, 4), tied, coupling_was_auto="yes")


def test_resolve_generators_speaks_the_ports_name():
    with pytest.raises(dc.DamchaTypeError, match=r"^Invalid argument `shared_metric\['k'\]`: expected a Gen"):
        _resolve({"q": Gen(8, 4), "k": 3}, SEPARATE, names={"metric_generator": "shared_metric"})
    with pytest.raises(dc.DamchaValueError, match=r"^Invalid argument `shared_metric`: expected a generator that fits"):
        _resolve(Gen(6, 4), TIED, names={"metric_generator": "shared_metric"})


# The rules of the table that need no feature size (all but the "does not fit" ones).
SIZE_FREE = [
    "metric-none",
    "metric-none-dict",
    "single-for-separate",
    "missing-side",
    "extra-side",
    "wrong-side-name",
    "value-type",
    "given-type",
    "list",
]


@pytest.mark.parametrize("rule", SIZE_FREE)
def test_check_generator_arg_raises_what_resolve_generators_raises(rule):
    given, cfg, error, pattern = GENERATOR_RULES[GENERATOR_RULE_IDS.index(rule)]
    # A lazily built layer (Keras) applies these at construction: the same class and message.
    with pytest.raises(error, match=pattern) as at_build:
        _resolve(given, cfg)
    with pytest.raises(error) as early:
        dc.check_generator_arg(given, metric=cfg.metric, coupling=cfg.coupling, generator_type=Gen)
    assert str(early.value) == str(at_build.value)


def test_check_generator_arg_leaves_size_rules_and_auto_sides_to_build():
    kw = dict(metric="heads", generator_type=Gen)
    # Does not fit (features): only resolve_generators, with the sizes, can tell.
    dc.check_generator_arg(Gen(6, 4), coupling="tied", **kw)
    # Automatic coupling: tied or separate depends on the feature sizes.
    for coupling in (None, "auto"):
        dc.check_generator_arg(Gen(8, 4), coupling=coupling, **kw)
        dc.check_generator_arg({"q": Gen(8, 4), "k": Gen(6, 2)}, coupling=coupling, **kw)
        with pytest.raises(dc.DamchaTypeError, match=r"^Invalid argument `metric_generator\['k'\]`: expected a Gen"):
            dc.check_generator_arg({"q": Gen(8, 4), "k": OtherGen()}, coupling=coupling, **kw)
        with pytest.raises(dc.DamchaTypeError, match=r"^Invalid argument `shared`: expected a Gen, a dict"):
            dc.check_generator_arg("g", coupling=coupling, names={"metric_generator": "shared"}, **kw)
    # Metric "none" refuses any generator whatever the coupling.
    with pytest.raises(
        dc.DamchaValueError, match=r"^Invalid argument `metric_generator`: expected None with metric='none'"
    ):
        dc.check_generator_arg(Gen(8, 4), metric="none", coupling=None, generator_type=Gen)
    dc.check_generator_arg(None, metric="none", coupling="separate", generator_type=Gen)


def test_spec_of_that_returns_no_generator_spec_is_a_damcha_type_error():
    """A port's ``spec_of`` returning something else raised a plain TypeError (not a DamchaError)."""
    with pytest.raises(dc.DamchaTypeError, match=r"^Invalid argument `spec_of`: expected a callable that returns a "):
        dc.resolve_generators(Gen(8, 4), TIED, generator_type=Gen, spec_of=lambda g: "not a spec")


def test_generator_spec_of_a_side_the_config_lacks():
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `side`: expected one of this config's metric sides \('qk',\)\. Received: side='q'",
    ):
        TIED.generator_spec("q")


# ----------------------------------------------------------------- check_shapes

SHAPE_CFG = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, context_dim=12, coupling="separate")


# A table, one case a line (not reformatted).
# fmt: off
@pytest.mark.parametrize(
    "args, kw, pattern",
    [
        (((2, 5, 12), (2, 5, 12)), {}, r"^Invalid argument `query`: expected 16 features \(embed_dim\)\. Received: query\.shape=\(2, 5, 12\)$"),
        (((2, 5, 16), (2, 5, 16)), {}, r"^Invalid argument `key`: expected 12 features \(kdim\)\. Received: key\.shape=\(2, 5, 16\)$"),
        (((2, 5, 16), (1, 5, 12)), {}, r"^Invalid argument `key`: expected the batch size of `query`\. Received: query\.shape=\(2, 5, 16\), key\.shape=\(1, 5, 12\)$"),
        (((2, 5, 16),), {}, r"^Invalid argument `key`: expected a tensor when kdim != embed_dim .*Received: key=None, embed_dim=16, kdim=12$"),
        (((2, 5, 16), (2, 0, 12)), {}, r"^Invalid argument `key`: expected at least one key \(M >= 1\) when there are queries: a query row with no key has no defined output\. Received: key\.shape=\(2, 0, 12\)$"),
        (((2, 5, 16), (2, 7, 12), (2, 5, 7)), {}, r"pass attn_mask\[:, None\]\)\. Received: attn_mask\.shape=\(2, 5, 7\)$"),
        (((2, 5, 16), (2, 7, 12), (2, 4, 5, 6)), {}, r"^Invalid argument `attn_mask`: expected a shape broadcastable to \(B, H, N, M\) = \(2, 4, 5, 7\).*attn_mask\.shape=\(2, 4, 5, 6\)$"),
        (((2, 5, 16), (2, 7, 12)), {"value_shape": (2, 7, 10)}, r"^Invalid argument `value`: expected 12 features \(vdim\)\. Received: value\.shape=\(2, 7, 10\)$"),
        (((2, 5, 16), (2, 7, 12)), {"value_shape": (2, 6, 12)}, r"^Invalid argument `value`: expected the batch size and length of `key`.*key\.shape=\(2, 7, 12\), value\.shape=\(2, 6, 12\)$"),
        (((2, 5, 16), (2, 7, 12)), {"value_shape": (7, 12)}, r"^Invalid argument `value`: expected rank 3"),
    ],
    ids=["query-features", "key-features", "batch", "key-required", "no-keys", "mask-3d", "mask-broadcast",
         "value-features", "value-length", "value-rank"],
)
# fmt: on
def test_check_shapes_names_the_ports_arguments(args, kw, pattern):
    with pytest.raises(dc.DamchaValueError, match=pattern):
        dc.check_shapes(SHAPE_CFG, *args, names=TORCH_SHAPE_NAMES, **kw)


def test_check_shapes_default_names_and_value_rules():
    assert dc.check_shapes(SHAPE_CFG, (2, 5, 16), (2, 7, 12), (5, 7)) == (2, 5, 7)
    with pytest.raises(dc.DamchaValueError, match=r"^Invalid argument `context`: expected 12 features \(config\.context_dim\)"):
        dc.check_shapes(SHAPE_CFG, (2, 5, 16), (2, 7, 16))
    wide = SHAPE_CFG.replace(value_input_dim=10)
    assert dc.check_shapes(wide, (2, 5, 16), (2, 7, 12), value_shape=(2, 7, 10)) == (2, 5, 7)
    with pytest.raises(dc.DamchaValueError, match=r"^Invalid argument `value`: expected a tensor when config\.value_input_dim != config\.context_dim.*"
                                                  r"Received: value=None, context_dim=12, value_input_dim=10$"):
        dc.check_shapes(wide, (2, 5, 16), (2, 7, 12))


def test_check_shapes_mask_name_is_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="mask_name"), pytest.raises(
        dc.DamchaValueError, match=r"^Invalid argument `attn_mask`: expected a shape broadcastable"
    ):
        dc.check_shapes(SHAPE_CFG, (2, 5, 16), (2, 7, 12), (5, 6), mask_name="attn_mask")


# -------------------------------------------------------------- metric table

def test_metric_table_matches_param_shapes_and_init():
    for metric, coupling in itertools.product(("heads", "lowrank"), ("tied", "separate", "query")):
        kv = 4 if coupling == "tied" else 2
        cfg = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=3, num_kv_heads=kv, context_dim=None if coupling == "tied" else 6,
                              metric=metric, metric_rank=5 if metric == "lowrank" else None, coupling=coupling)
        table = dc.METRIC_STRUCTURES[metric]
        assert cfg.metric_structure is table
        shapes, params = cfg.param_shapes(), dc.init_params(cfg, seed=0)
        for side in cfg.metric_sides:
            E, S = cfg.side_features(side), cfg.side_heads(side)
            want = {f"metric.{side}.{leaf}": shape for leaf, shape in table.shapes(E, S, 3, cfg.metric_rank).items()}
            assert {k: v for k, v in shapes.items() if k.startswith(f"metric.{side}.")} == want
            assert list(want) == [k for k in shapes if k.startswith(f"metric.{side}.")]  # canonical order
            for leaf, std in table.stds(E, S, 3, cfg.metric_rank).items():
                value = params[f"metric.{side}.{leaf}"]
                assert np.all(value == 0) if std == 0 else np.all(value != 0), (metric, side, leaf)
            spec = cfg.generator_spec(side)
            assert (spec.features, spec.heads) == (E, S)
    assert "gate" not in dc.METRIC_STRUCTURES["heads"].generator_leaves
    assert dc.METRIC_STRUCTURES["lowrank"].uses_head_dim and not dc.METRIC_STRUCTURES["heads"].uses_head_dim
    assert dc.METRIC_STRUCTURES["heads"].stds(8, 4, 2) == {"gate": 0.0, "kernel": 1 / math.sqrt(32), "bias": 0.0}
    assert dc.METRIC_STRUCTURES["lowrank"].stds(8, 4, 2, 3) == {
        "gate": 0.0, "kernel": 1 / math.sqrt(8), "bias": 0.0, "u": 1 / math.sqrt(3), "v": 1 / math.sqrt(8)}


@pytest.mark.parametrize("metric", ["heads", "lowrank"])
def test_metric_table_math_is_consistent(metric):
    """coefficients has the declared shape; apply, dense_delta and penalty_sq agree."""
    table = dc.METRIC_STRUCTURES[metric]
    rng = np.random.default_rng(0)
    E, S, d, r = 5, 3, 2, 4
    leaves = {leaf: rng.normal(size=shape) for leaf, shape in table.shapes(E, S, d, r).items()}
    phi = rng.normal(size=(2, 3, E))
    coeff = table.coefficients(np, phi, leaves)
    assert coeff.shape == (2, 3, *table.coefficient_shape(S, r))
    y = rng.normal(size=(2, 3, S, d))
    dense = np.eye(S * d).reshape(S, d, S, d) + leaves["gate"][:, None, None, None] * table.dense_delta(np, coeff, leaves, d)
    np.testing.assert_allclose(table.apply(np, coeff, y, leaves), np.einsum("bthiaj,btaj->bthi", dense, y), rtol=1e-12)
    minus_eye = (dense - np.eye(S * d).reshape(S, d, S, d)).reshape(2, 3, -1)
    np.testing.assert_allclose(table.penalty_sq(np, coeff, leaves, d), np.sum(minus_eye ** 2, axis=-1), rtol=1e-12)


@pytest.mark.parametrize("value", [1.5, 8.0, np.float32(2.0)], ids=["1.5", "8.0", "np.float32"])
def test_a_real_number_for_an_int_is_both_a_type_and_a_value_error(value):
    # Python calls it a TypeError, Keras' MultiHeadAttention a ValueError: either `except` catches it.
    with pytest.raises(dc.DamchaNotIntegerError, match=r"Invalid argument `num_heads`: expected an int >= 1\. Received: num_heads=") as info:
        dc.DamchaConfig(query_dim=8, num_heads=value, key_dim=2)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert isinstance(info.value, dc.DamchaTypeError)


@pytest.mark.parametrize("value", ["2", True, None, [2]], ids=["str", "bool", "None", "list"])
def test_other_non_ints_stay_plain_type_errors(value):
    with pytest.raises(dc.DamchaTypeError) as info:
        dc.DamchaConfig(query_dim=8, num_heads=value, key_dim=2)
    assert not isinstance(info.value, ValueError)
