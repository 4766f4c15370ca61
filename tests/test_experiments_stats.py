"""Statistics helpers: Student's t against tabulated values and SciPy, the paired
comparison and Holm's adjustment against hand-computed cases."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from damcha_core import DamchaTypeError, DamchaValueError
from damcha_experiments import (
    describe,
    holm,
    mcnemar_exact,
    median_interval,
    paired_difference,
    sign_flip_test,
    t_cdf,
    t_quantile,
)


@pytest.mark.parametrize(
    "df, value",
    [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042)],
    ids=["df1", "df2", "df4", "df9", "df30"],
)
def test_t_quantile_matches_the_printed_table(df, value):
    assert t_quantile(0.975, df) == pytest.approx(value, abs=5e-4)


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 10, 31, 120])
def test_t_distribution_matches_scipy(df):
    for t in (-7.5, -1.0, 0.0, 0.3, 2.0, 40.0):
        assert t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-12)
    for p in (0.6, 0.9, 0.975, 0.995):
        assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9)
    assert t_quantile(0.025, df) == pytest.approx(-t_quantile(0.975, df))


def test_t_rejects_bad_arguments():
    with pytest.raises(DamchaValueError, match="Invalid argument `df`: expected an int >= 1"):
        t_cdf(1.0, 0)
    with pytest.raises(DamchaTypeError, match="Invalid argument `df`: expected an int"):
        t_quantile(0.9, 2.5)
    with pytest.raises(DamchaValueError, match=r"Invalid argument `p`: expected a number in \(0, 1\)"):
        t_quantile(1.0, 3)


def test_paired_difference_hand_checked():
    # gains (a - b) = 0.02, 0.04, 0.06: mean 0.04, std 0.02, se 0.02/sqrt(3), t = 2 sqrt(3), df 2.
    r = paired_difference([0.52, 0.54, 0.56], [0.50, 0.50, 0.50])
    se = 0.02 / math.sqrt(3)
    assert r["mean"] == pytest.approx(0.04) and r["std"] == pytest.approx(0.02) and r["se"] == pytest.approx(se)
    assert r["t"] == pytest.approx(2 * math.sqrt(3))
    assert r["ci"] == pytest.approx([0.04 - 4.302653 * se, 0.04 + 4.302653 * se], rel=1e-6)
    assert r["p"] == pytest.approx(stats.ttest_rel([0.52, 0.54, 0.56], [0.5] * 3).pvalue)
    # Lower is better (bits per char): the gain flips sign.
    low = paired_difference([2.0, 2.1, 2.2], [2.1, 2.2, 2.2], higher_is_better=False)
    assert low["mean"] == pytest.approx((0.1 + 0.1 + 0.0) / 3)


def test_paired_design_sees_what_an_unpaired_test_misses():
    """Seed effects shared by both variants cancel in the paired difference."""
    rng = np.random.default_rng(0)
    seed_effect = rng.normal(0, 0.05, 5)
    a, b = 0.60 + seed_effect + 0.01, 0.60 + seed_effect + rng.normal(0, 0.002, 5)
    paired = paired_difference(a, b)
    assert paired["p"] < 0.01 and paired["ci"][0] > 0
    assert stats.ttest_ind(a, b).pvalue > 0.5  # the unpaired test drowns in the seed effect


def test_paired_difference_edge_cases():
    one = paired_difference([0.5], [0.4])
    assert one["mean"] == pytest.approx(0.1) and one["std"] is None and one["ci"] is None and one["p"] is None
    # Identical gain in every pair (noise below a quantised metric's resolution): the exact
    # two-sided sign test, not t = inf and p = 0.
    exact = paired_difference([0.5, 0.6], [0.4, 0.5])
    assert exact["p"] == 0.5 and exact["test"] == "sign" and exact["ci"] is None and exact["mean"] == pytest.approx(0.1)
    # The same +10 correct of 359 on every seed: the float differences agree only to ~1e-17, which
    # read as t ~ 1e15, p = 0 and a zero-width interval (binomtest: scipy, independent of ours).
    counts = paired_difference([k / 359 for k in range(300, 341, 10)], [k / 359 for k in range(290, 331, 10)])
    assert np.std([(k + 10) / 359 - k / 359 for k in range(290, 331, 10)]) > 0  # the case is not exact
    assert counts["test"] == "sign" and counts["ci"] is None
    assert counts["p"] == pytest.approx(stats.binomtest(5, 5).pvalue)
    # Real noise, however small against the gain, is still a t test.
    noisy = paired_difference([0.5 + 1e-6 * i for i in range(5)], [0.4] * 5)
    assert noisy["test"] == "t" and noisy["p"] < 1e-6 and noisy["ci"][0] > 0
    grid = paired_difference([1000.0] * 5, [1500.0] * 5, higher_is_better=False)  # +500 steps on every seed
    assert grid["p"] == pytest.approx(stats.binomtest(5, 5).pvalue) == 0.0625
    assert paired_difference([0.5, 0.6], [0.5, 0.6])["p"] == 1.0
    nan = paired_difference([0.5, math.nan], [0.4, 0.5])
    assert math.isnan(nan["mean"]) and math.isnan(nan["p"])  # a diverged run is never hidden
    with pytest.raises(
        DamchaValueError, match=r"Invalid argument `b`: expected the shape of `a` \(one value per seed in each\)"
    ):
        paired_difference([1, 2, 3], [1, 2])


def test_holm_hand_checked():
    # sorted 0.01, 0.03, 0.04 -> 3*0.01, max(0.03, 2*0.03), max(0.06, 1*0.04)
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, None, 0.01]) == [pytest.approx(0.5), None, pytest.approx(0.02)]
    assert holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])  # 2 * 0.8 capped at 1, then monotone


def test_describe_hand_checked():
    d = describe([1.0, 2.0, 3.0])
    assert d["mean"] == 2.0 and d["std"] == 1.0 and d["n"] == 3
    assert d["ci"] == pytest.approx([2.0 - 4.302653 / math.sqrt(3), 2.0 + 4.302653 / math.sqrt(3)], rel=1e-6)
    assert describe([5.0])["std"] is None


def test_median_interval_is_reproducible_and_matches_scipy():
    """The bootstrap of a median (claim 3's per-round ratios): the same seed gives the same interval
    (a report regenerated from one file prints one interval), and it agrees with SciPy's percentile
    bootstrap up to the resampling noise (an independent implementation with its own draws)."""
    ratios = np.random.default_rng(7).normal(1.2, 0.05, 41)
    first, again = median_interval(ratios), median_interval(list(ratios))
    assert first == again and first["n"] == 41 and first["median"] == pytest.approx(np.median(ratios))
    lo, hi = first["ci"]
    assert lo < first["median"] < hi
    ref = stats.bootstrap(
        (ratios,), np.median, confidence_level=0.95, n_resamples=10_000, method="percentile", random_state=1
    ).confidence_interval
    # Endpoints are order statistics of 41 values ~0.01 apart near the centre: within two of SciPy's.
    assert lo == pytest.approx(ref.low, abs=0.02) and hi == pytest.approx(ref.high, abs=0.02)
    assert first["seed"] == 0 and first["resamples"] == 10_000 and first["confidence"] == 0.95
    # More noise, wider interval; the same noise shifted, the same width.
    wide = median_interval(1.2 + 3 * (ratios - 1.2))["ci"]
    assert wide[1] - wide[0] == pytest.approx(3 * (hi - lo))


def test_median_interval_hand_checked_and_edge_cases():
    # Two rounds: the resampled medians are 1, 2, 3 with probabilities 1/4, 1/2, 1/4.
    assert median_interval([1.0, 3.0])["ci"] == [1.0, 3.0]
    assert median_interval([1.0, 3.0], confidence=0.4)["ci"] == [2.0, 2.0]
    one = median_interval([1.3])
    assert one["median"] == 1.3 and one["ci"] is None  # no noise estimate from one round
    assert median_interval([1.1, math.nan, 1.2])["ci"] is None
    with pytest.raises(DamchaValueError, match="`values`"):
        median_interval([])
    with pytest.raises(DamchaValueError, match="`confidence`"):
        median_interval([1.0, 2.0], confidence=95)
    with pytest.raises(DamchaValueError, match="`resamples`"):
        median_interval([1.0, 2.0], resamples=0)


@pytest.mark.parametrize(
    "kwargs, error, received",
    [
        ({"values": "1.5"}, DamchaTypeError, "values='1.5' (str)"),
        ({"values": 1.5}, DamchaTypeError, "values=1.5 (float)"),
        ({"values": None}, DamchaTypeError, "values=None (NoneType)"),
        ({"values": ["1.5", "2"]}, DamchaTypeError, "values[0]='1.5' (str)"),  # was silently 1.5
        ({"values": [1.0, None]}, DamchaTypeError, "values[1]=None (NoneType)"),  # was silently NaN
        ({"values": [1.0, True]}, DamchaTypeError, "values[1]=True (bool)"),  # was silently 1.0
        ({"values": [1 + 2j, 1.0]}, DamchaTypeError, "values[0]=(1+2j) (complex)"),
        ({"values": np.array(["a"])}, DamchaTypeError, "values=ndarray(shape=(1,), dtype=<U1)"),
        ({"values": []}, DamchaValueError, "values=[]"),
        ({"values": np.ones((2, 2))}, DamchaValueError, "values=ndarray(shape=(2, 2), dtype=float64)"),
        ({"confidence": "0.9"}, DamchaTypeError, "confidence='0.9' (str)"),
        ({"confidence": None}, DamchaTypeError, "confidence=None (NoneType)"),
        ({"confidence": math.nan}, DamchaValueError, "confidence=nan"),
        ({"resamples": 10.0}, DamchaTypeError, "resamples=10.0 (float)"),
        ({"resamples": "10"}, DamchaTypeError, "resamples='10' (str)"),
        ({"seed": "x"}, DamchaTypeError, "seed='x' (str)"),
        ({"seed": 1.5}, DamchaTypeError, "seed=1.5 (float)"),
        ({"seed": None}, DamchaTypeError, "seed=None (NoneType)"),  # was a fresh random seed per call
        ({"seed": -1}, DamchaValueError, "seed=-1"),
    ],
)
def test_median_interval_refuses_bad_arguments_naming_them(kwargs, error, received):
    """Strings, None and floats reached numpy or python internals (a bare TypeError or ValueError about
    '<' or SeedSequence) or were read silently as numbers; each is refused up front by name."""
    (name,) = kwargs
    args = {"values": [1.0, 2.0, 3.0], **kwargs}
    with pytest.raises(error, match=f"argument `{name}`") as info:
        median_interval(args.pop("values"), **args)
    assert str(info.value).endswith(f"Received: {received}")


def test_median_interval_takes_numpy_scalars_and_arrays():
    ints = median_interval(np.array([1, 3]), confidence=np.float64(0.4), resamples=np.int64(100), seed=np.int64(3))
    assert ints["ci"] == [2.0, 2.0] and ints["seed"] == 3 and type(ints["confidence"]) is float
    assert median_interval([np.float32(1.0), np.int64(3)])["ci"] == [1.0, 3.0]
    assert median_interval([1.0, math.inf])["ci"] is None  # a diverged value: no interval, not an error


@pytest.mark.parametrize(
    "rounds, mha_rounds, error, received",
    [
        (None, [1.0], DamchaTypeError, "rounds=None (NoneType)"),
        ([1.0], 2.0, DamchaTypeError, "mha_rounds=2.0 (float)"),
        ("ab", "cd", DamchaTypeError, "rounds='ab' (str)"),
        ([1.0], ["x"], DamchaTypeError, "mha_rounds[0]='x' (str)"),
        ([1.0], [None], DamchaTypeError, "mha_rounds[0]=None (NoneType)"),
        ([], [], DamchaValueError, "rounds=[]"),
        ([1.0, 1.0], [0.5, 0.0], DamchaValueError, "mha_rounds[1]=0.0"),  # was ZeroDivisionError
        ([1.0], [-1.0], DamchaValueError, "mha_rounds[0]=-1.0"),  # was a ratio of -1
        ([1.0], [math.inf], DamchaValueError, "mha_rounds[0]=inf"),  # was a ratio of 0
        ([math.nan], [1.0], DamchaValueError, "rounds[0]=nan"),
        ([1.0, 2.0], [1.0], DamchaValueError, "len(rounds)=2, len(mha_rounds)=1"),
    ],
)
def test_ratio_interval_refuses_what_is_not_round_times(rounds, mha_rounds, error, received):
    from damcha_experiments._analysis import ratio_interval

    with pytest.raises(error, match="argument `(mha_)?rounds`") as info:
        ratio_interval(rounds, mha_rounds)
    assert str(info.value).endswith(f"Received: {received}")
    assert ratio_interval([2.0, 3.0], [1, 2])["median"] == 1.75  # JSON ints are round times too


@pytest.mark.parametrize(
    "call, name, error, received",
    [
        (lambda: describe("1.5"), "values", DamchaTypeError, "values='1.5' (str)"),  # was a TypeError inside numpy
        (lambda: describe(["1.5", "2"]), "values", DamchaTypeError, "values[0]='1.5' (str)"),  # was read as 1.5
        (lambda: describe([1.0, None]), "values", DamchaTypeError, "values[1]=None (NoneType)"),  # was NaN
        (lambda: describe([True, 2.0]), "values", DamchaTypeError, "values[0]=True (bool)"),  # was 1.0
        (lambda: describe(None), "values", DamchaTypeError, "values=None (NoneType)"),  # was shape ()
        (lambda: describe([]), "values", DamchaValueError, "values=[]"),
        (lambda: describe([1.0, 2.0], confidence="0.9"), "confidence", DamchaTypeError, "confidence='0.9' (str)"),
        (lambda: describe([1.0, 2.0], confidence=95), "confidence", DamchaValueError, "confidence=95"),  # was `p`
        (lambda: describe([1.0, 2.0], confidence=None), "confidence", DamchaTypeError, "confidence=None (NoneType)"),
        (lambda: paired_difference(["0.5", "0.6"], [0.4, 0.5]), "a", DamchaTypeError, "a[0]='0.5' (str)"),
        (lambda: paired_difference([0.5, 0.6], [0.4, None]), "b", DamchaTypeError, "b[1]=None (NoneType)"),
        (lambda: paired_difference([0.5, 0.6], [True, 0.5]), "b", DamchaTypeError, "b[0]=True (bool)"),
        (lambda: paired_difference([0.5, 0.6], "ab"), "b", DamchaTypeError, "b='ab' (str)"),
        (lambda: paired_difference([0.5, 0.6], np.array(["a", "b"])), "b", DamchaTypeError, "b=ndarray("),
        (
            lambda: paired_difference([0.5, 0.6], [0.4, 0.5], higher_is_better="False"),  # was truthy: gain a - b
            "higher_is_better",
            DamchaTypeError,
            "higher_is_better='False' (str)",
        ),
        (
            lambda: paired_difference([0.5, 0.6], [0.4, 0.5], higher_is_better=None),
            "higher_is_better",
            DamchaTypeError,
            "higher_is_better=None (NoneType)",
        ),
        (
            lambda: paired_difference([0.5, 0.6], [0.4, 0.5], confidence=0),
            "confidence",
            DamchaValueError,
            "confidence=0",
        ),
        (lambda: t_cdf("1.5", 3), "t", DamchaTypeError, "t='1.5' (str)"),  # was read as 1.5
        (lambda: t_cdf(None, 3), "t", DamchaTypeError, "t=None (NoneType)"),  # was a bare TypeError
        (lambda: t_cdf(True, 3), "t", DamchaTypeError, "t=True (bool)"),  # was 1.0
        (lambda: t_quantile("0.975", 3), "p", DamchaTypeError, "p='0.975' (str)"),  # was read as 0.975
        (lambda: t_quantile(True, 3), "p", DamchaTypeError, "p=True (bool)"),  # was refused as p=1.0
        (lambda: t_quantile(None, 3), "p", DamchaTypeError, "p=None (NoneType)"),
        (lambda: holm(["0.01", 0.5]), "p_values", DamchaTypeError, "p_values[0]='0.01' (str)"),  # a bare TypeError
        (lambda: holm([0.01, True]), "p_values", DamchaTypeError, "p_values[1]=True (bool)"),  # was p = 1
        (lambda: holm("0.01"), "p_values", DamchaTypeError, "p_values='0.01' (str)"),  # iterated its characters
        (lambda: holm(0.01), "p_values", DamchaTypeError, "p_values=0.01 (float)"),
        (lambda: holm([0.01, -0.2]), "p_values", DamchaValueError, "p_values[1]=-0.2"),  # not a p-value
        (lambda: holm([1.5]), "p_values", DamchaValueError, "p_values[0]=1.5"),
    ],
)
def test_stats_functions_refuse_bad_arguments_naming_them(call, name, error, received):
    """Strings, None and bools were read silently as numbers (or NaN) or reached numpy and python
    internals; like median_interval (1f1bd09), each function refuses them up front by name."""
    with pytest.raises(error, match=f"argument `{name}`") as info:
        call()
    assert f"Received: {received}" in str(info.value)


def test_stats_functions_take_numpy_scalars_and_arrays():
    d = describe(np.array([1, 2, 3]), confidence=np.float64(0.95))
    assert d == describe([1.0, 2.0, 3.0]) and d["n"] == 3
    assert describe([np.float32(1.0), np.int64(2), 3])["mean"] == 2.0
    assert describe([1.0, math.nan])["n_finite"] == 1  # a diverged run: reported, not refused
    r = paired_difference(np.array([0.52, 0.54, 0.56]), (0.5, 0.5, np.float64(0.5)), higher_is_better=np.True_)
    assert r == paired_difference([0.52, 0.54, 0.56], [0.5, 0.5, 0.5])
    low = paired_difference([2.0, 2.1], [2.1, 2.2], higher_is_better=np.False_)
    assert low["mean"] == pytest.approx(0.1)
    assert t_cdf(np.float32(0.0), np.int64(3)) == 0.5 and t_cdf(2, 3) == pytest.approx(stats.t.cdf(2, 3))
    assert math.isnan(t_cdf(math.nan, 3))
    assert t_quantile(np.float64(0.975), 4) == pytest.approx(2.776, abs=5e-4)
    assert holm(np.array([0.01, 0.04, 0.03])) == pytest.approx([0.03, 0.06, 0.06])
    assert holm((np.float64(0.01), None, math.nan)) == [pytest.approx(0.01), None, pytest.approx(math.nan, nan_ok=True)]
    assert holm([]) == []


@pytest.mark.parametrize(
    "only_a, only_b",
    [(3, 0), (0, 3), (6, 0), (5, 2), (4, 4), (1, 0), (12, 3), (0, 0)],
    ids=["3-0", "0-3", "6-0", "5-2", "4-4", "1-0", "12-3", "none"],
)
def test_mcnemar_exact_is_scipys_two_sided_binomial_test_on_the_discordant_pairs(only_a, only_b):
    n = only_a + only_b
    expected = 1.0 if n == 0 else stats.binomtest(only_a, n, 0.5).pvalue
    assert mcnemar_exact(only_a, only_b) == pytest.approx(expected, rel=1e-12)
    assert mcnemar_exact(only_b, only_a) == mcnemar_exact(only_a, only_b)


def test_mcnemar_exact_names_a_bad_count():
    with pytest.raises(DamchaValueError, match=r"Invalid argument `only_b`: expected a count \(int >= 0\).*only_b=-1"):
        mcnemar_exact(3, -1)
    with pytest.raises(DamchaTypeError, match=r"Invalid argument `only_a`: expected a count.*\(float\)"):
        mcnemar_exact(3.0, 0)
    with pytest.raises(DamchaTypeError, match=r"`only_a`.*\(bool\)"):
        mcnemar_exact(True, 0)


# ------------------------------------------------------------- sign-flip permutation test


def _brute_force_sign_flip(gains):
    """Every one of the 2**n sign patterns, one at a time: the share whose |sum| reaches the observed one."""
    g = np.asarray(gains, dtype=float)
    observed = abs(g.sum())
    hits = sum(abs(float(np.dot(signs, g))) >= observed - 1e-12 for signs in itertools.product((1, -1), repeat=len(g)))
    return hits / 2 ** len(g)


# crosshead1's damcha-heads-tied - mha by seed (docs/results/full/crosshead1.json): MHA stuck at 0.39 on 3
# of 15 seeds, capped at 0.82 and 0.955 on two more, level elsewhere; accuracies count 2,000 test examples.
_BIMODAL = [0.0025, 0.0005, 0.604, 0.045, -0.002, 0.002, -0.0005, 0.6045]
_BIMODAL += [0.0035, 0.0, 0.6055, 0.0025, 0.0105, 0.006, 0.182]


@pytest.mark.parametrize(
    "gains",
    [
        [0.03, 0.01, 0.02, 0.05, 0.04],
        [0.03, -0.01, 0.02, 0.05, -0.04, 0.0],
        list(np.random.default_rng(3).normal(0.2, 1.0, 9)),
        [k / 2000 for k in (3, 0, 0, -1, 2, 2, 5, 0, -3, 1, 4)],  # quantised: ties and zeros
        _BIMODAL,
    ],
    ids=["five-positive", "mixed", "normal-9", "quantised-11", "bimodal-15"],
)
def test_sign_flip_test_is_the_exact_enumeration_and_scipys_permutation_test(gains):
    r = sign_flip_test(gains)
    assert r["method"] == "exact" and r["n"] == len(gains) and r["resamples"] is None
    assert r["p"] == pytest.approx(_brute_force_sign_flip(gains), abs=1e-15)
    # SciPy's exact one-sample ("samples": sign flips) permutation test of the mean, an independent implementation.
    ref = stats.permutation_test(
        (np.asarray(gains),), np.mean, permutation_type="samples", alternative="two-sided", n_resamples=np.inf
    )
    assert r["p"] == pytest.approx(min(1.0, ref.pvalue), rel=1e-9)
    assert r["floor"] == 2 / 2 ** len(gains)


def test_sign_flip_test_hand_checked_and_edge_cases():
    # Five gains of one sign: only the observed pattern and its mirror image reach it, p = 2 / 32.
    five = sign_flip_test([0.03, 0.01, 0.02, 0.05, 0.04])
    assert five["p"] == 0.0625 == five["floor"] == stats.binomtest(5, 5).pvalue
    # The crosshead1 difference whose t test p is 0.048: 12 of 15 gains positive, the 3 largest far out.
    bimodal = sign_flip_test(_BIMODAL)
    assert stats.ttest_1samp(_BIMODAL, 0).pvalue == pytest.approx(0.0479, abs=5e-4)
    assert bimodal["p"] == pytest.approx(0.00146, abs=1e-5) and bimodal["p"] == 48 / 2**15
    # The same +10 of 359 on every seed (float differences in the last bits) is one gain: the sign test's p.
    counts = [(k + 10) / 359 - k / 359 for k in range(290, 331, 10)]
    assert sign_flip_test(counts)["p"] == pytest.approx(stats.binomtest(5, 5).pvalue)
    assert sign_flip_test([0.0, 0.0, 0.0])["p"] == 1.0
    assert sign_flip_test([0.1, -0.1])["p"] == 1.0
    assert sign_flip_test([0.5])["p"] is None  # one pair: no test, as the t test's
    assert math.isnan(sign_flip_test([0.1, math.nan, 0.2])["p"])  # a diverged run is never hidden


def test_sign_flip_test_samples_patterns_beyond_the_exact_limit_reproducibly():
    gains = list(np.random.default_rng(7).normal(0.25, 1.0, 14))
    exact = sign_flip_test(gains)["p"]
    mc = sign_flip_test(gains, exact_max_n=10, resamples=40_000, seed=5)
    assert mc["method"] == "monte carlo" and mc["resamples"] == 40_000 and mc["seed"] == 5
    assert mc == sign_flip_test(gains, exact_max_n=10, resamples=40_000, seed=5)  # the same seed, the same p
    se = math.sqrt(exact * (1 - exact) / 40_000)
    assert abs(mc["p"] - exact) < 4 * se + 1 / 40_001
    # Never 0: the observed pattern counts, p = (1 + hits) / (1 + resamples).
    far = sign_flip_test([1.0 + 0.01 * i for i in range(30)], resamples=1_000)
    assert far["method"] == "monte carlo" and far["p"] == pytest.approx(1 / 1_001)


@pytest.mark.parametrize(
    "kwargs, name, error, received",
    [
        ({"gains": "0.1 0.2"}, "gains", DamchaTypeError, "(str)"),
        ({"gains": [0.1, None]}, "gains", DamchaTypeError, "gains[1]=None (NoneType)"),
        ({"gains": [0.1, 0.2], "resamples": 0}, "resamples", DamchaValueError, "resamples=0"),
        ({"gains": [0.1, 0.2], "seed": -1}, "seed", DamchaValueError, "seed=-1"),
        ({"gains": [0.1, 0.2], "exact_max_n": True}, "exact_max_n", DamchaTypeError, "exact_max_n=True (bool)"),
    ],
)
def test_sign_flip_test_refuses_bad_arguments_naming_them(kwargs, name, error, received):
    with pytest.raises(error, match=f"argument `{name}`") as info:
        sign_flip_test(**kwargs)
    assert received in str(info.value)
