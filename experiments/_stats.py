"""Statistics of the paired seed design, in plain Python and NumPy (no SciPy).

Every headline comparison is *paired*: run s of variant A and run s of
variant B share seed s, hence the same data order, so the seed-to-seed
variation of the data mostly cancels in the difference d_s = A_s - B_s. The
helpers here give the mean and sample std of d, Student's t interval for its
mean, the two-sided p-value of the paired t test, and Holm's step-down
adjustment for a family of comparisons.

Student's t distribution is evaluated exactly for integer degrees of freedom
with the finite trigonometric series (Abramowitz & Stegun 26.7.3-4); the
quantile is found by bisection on it. With n seeds the paired test has
n - 1 degrees of freedom, always an integer.

Timings (claim 3) are not paired over seeds but over rounds of an
interleaved measurement; ``median_interval`` gives the median of per-round
values with a percentile bootstrap interval that resamples rounds, from a
fixed seed so that a report regenerated from the same file prints the same
interval.

A binary outcome per seed (a run that never learns the task) is compared
with McNemar's exact test (``mcnemar_exact``): only the seeds where exactly
one side failed carry information, and under the null each of them is a
fair coin.

The paired t test assumes the mean gain is roughly normal; with a handful
of seeds and a two-humped difference (a baseline that fails on a few seeds
and matches on the rest) it can be far off. ``sign_flip_test`` is the
distribution-free counterpart the report prints beside it: the exact paired
sign-flip permutation test of the mean gain (under the null each gain is as
likely negated, so every one of the 2**n sign patterns is equally likely).
Its two-sided p-value cannot go below 2 / 2**n (0.0625 with 5 seeds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from damcha_core import DamchaTypeError, DamchaValueError, invalid_argument
from damcha_core import describe as describe_value  # of a received value; this module's describe is statistics

__all__ = [
    "describe",
    "holm",
    "mcnemar_exact",
    "median_interval",
    "paired_difference",
    "sign_flip_test",
    "t_cdf",
    "t_quantile",
]


def _check_df(df: object) -> int:
    if isinstance(df, bool) or not isinstance(df, (int, np.integer)):
        raise DamchaTypeError(invalid_argument("df", "an int >= 1", f"df={df!r} ({type(df).__name__})"))
    if df < 1:
        raise DamchaValueError(invalid_argument("df", "an int >= 1", f"df={df}"))
    return int(df)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _check_real(name: str, value: object, expected: str) -> float:
    """``value`` as a float if it is a real number (a Python or numpy int or float, not a bool);
    ``float()`` would read a string of digits or a bool as a number and fail on None with a bare
    TypeError."""
    if not _is_real(value):
        raise DamchaTypeError(
            invalid_argument(name, expected, f"{name}={describe_value(value)} ({type(value).__name__})")
        )
    return float(value)  # type: ignore[arg-type]


def _check_confidence(confidence: object) -> float:
    expected = "a number in (0, 1)"
    value = _check_real("confidence", confidence, expected)
    if not 0.0 < value < 1.0:  # NaN fails this too
        raise DamchaValueError(invalid_argument("confidence", expected, f"confidence={confidence}"))
    return value


def _abs_t_prob(t: float, df: int) -> float:
    """P(|T| <= t) for t >= 0 and Student's T with integer ``df`` degrees of freedom."""
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:
        # odd df: (2/pi) (theta + sin cos (1 + 2/3 c2 + 2*4/(3*5) c2^2 + ...)), (df - 3) / 2 terms after 1
        total, term = 0.0, 1.0
        if df > 1:
            total = 1.0
            for k in range(1, (df - 3) // 2 + 1):
                term *= c2 * (2 * k) / (2 * k + 1)
                total += term
        return (2.0 / math.pi) * (theta + math.sin(theta) * math.cos(theta) * total)
    # even df: sin (1 + 1/2 c2 + 1*3/(2*4) c2^2 + ...), (df - 2) / 2 terms after 1
    total, term = 1.0, 1.0
    for k in range(1, (df - 2) // 2 + 1):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with integer ``df`` >= 1 degrees of freedom (exact series)."""
    df = _check_df(df)
    t = _check_real("t", t, "a real number")
    if math.isnan(t):
        return math.nan
    half = 0.5 * _abs_t_prob(abs(t), df)
    return 0.5 + half if t >= 0 else 0.5 - half


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with integer ``df`` degrees of freedom (e.g. 2.776 for p=0.975, df=4)."""
    df = _check_df(df)
    p = _check_real("p", p, "a number in (0, 1)")
    if not 0.0 < p < 1.0:
        raise DamchaValueError(invalid_argument("p", "a number in (0, 1)", f"p={p}"))
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):  # far below float resolution long before 200 halvings
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def _as_real_values(
    name: str, values: object, expected: str = "a non-empty 1-D sequence of real numbers"
) -> np.ndarray:
    """``values`` as a non-empty 1-D float64 array, refusing what ``np.asarray`` would turn into a
    cryptic error (a string, a complex number) or silently into a number (a string of digits, None
    as NaN, a bool as 0 or 1): only a list, tuple or array of real numbers is one. NaN and
    infinities pass (a diverged run); callers that need finite values check that."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "iuf":
            raise DamchaTypeError(invalid_argument(name, expected, f"{name}={describe_value(values)}"))
        arr = values.astype(np.float64)
    elif isinstance(values, (list, tuple)):
        for i, x in enumerate(values):
            if not _is_real(x):
                raise DamchaTypeError(
                    invalid_argument(name, expected, f"{name}[{i}]={describe_value(x)} ({type(x).__name__})")
                )
        arr = np.asarray(values, dtype=np.float64)
    else:
        raise DamchaTypeError(
            invalid_argument(name, expected, f"{name}={describe_value(values)} ({type(values).__name__})")
        )
    if arr.ndim != 1 or arr.size == 0:
        raise DamchaValueError(invalid_argument(name, expected, f"{name}={describe_value(values)}"))
    return arr


def describe(values: Sequence[float], confidence: float = 0.95) -> dict[str, Any]:
    """n, mean, sample std (ddof 1), min, max and the t interval of the mean.

    With one value, std and the interval are None (no estimate of noise).
    NaN values (diverged runs) propagate into mean and std; ``n_finite``
    says how many are finite. ``values`` is a list, tuple or array of real
    numbers (not strings, None or bools, which numpy would read as numbers
    or NaN); ``confidence`` a number in (0, 1).
    """
    arr = _as_real_values("values", values)
    confidence = _check_confidence(confidence)
    n = int(arr.size)
    out: dict[str, Any] = {
        "n": n,
        "n_finite": int(np.isfinite(arr).sum()),
        "mean": float(arr.mean()),
        "std": None,
        "min": float(arr.min()),
        "max": float(arr.max()),
        "ci": None,
    }
    if n >= 2:
        std = float(arr.std(ddof=1))
        half = t_quantile(0.5 + confidence / 2, n - 1) * std / math.sqrt(n)
        out["std"] = std
        out["ci"] = [out["mean"] - half, out["mean"] + half]
    return out


# Paired gains whose spread is below this fraction of the values' magnitude are one gain (float
# rounding, not noise): see paired_difference.
_SAME_GAIN_RTOL = 1e-12


def paired_difference(
    a: Sequence[float], b: Sequence[float], *, higher_is_better: bool = True, confidence: float = 0.95
) -> dict[str, Any]:
    """Paired comparison of ``a`` against ``b`` (same seeds, same order).

    ``gain`` is oriented so that positive means ``a`` is better: a - b when
    higher is better, b - a otherwise. Returns n, mean/std/se of the gain, its
    t interval, the t statistic, the two-sided p-value of H0: mean gain = 0,
    and ``a_mean``/``b_mean``. When every pair differs by the same amount (up
    to float rounding: a spread below 1e-12 of the values) the p-value is the
    exact sign test's and the interval is None. Needs n >= 2 pairs for any
    noise estimate; with one pair the std, interval and p are None. A pair with a NaN (a diverged
    run) makes every statistic NaN: divergences are reported, not hidden.
    ``a`` and ``b`` are lists, tuples or arrays of real numbers;
    ``higher_is_better`` a bool (a string such as "False" is truthy, and
    would silently flip the gain).
    """
    x, y = _as_real_values("a", a), _as_real_values("b", b)
    if not isinstance(higher_is_better, (bool, np.bool_)):
        raise DamchaTypeError(
            invalid_argument(
                "higher_is_better",
                "True or False",
                f"higher_is_better={describe_value(higher_is_better)} ({type(higher_is_better).__name__})",
            )
        )
    confidence = _check_confidence(confidence)
    if x.shape != y.shape:
        raise DamchaValueError(
            invalid_argument(
                "b", "the shape of `a` (one value per seed in each)", f"a.shape={x.shape}, b.shape={y.shape}"
            )
        )
    gain = (x - y) if higher_is_better else (y - x)
    n = int(gain.size)
    out: dict[str, Any] = {
        "n": n,
        "a_mean": float(x.mean()),
        "b_mean": float(y.mean()),
        "mean": float(gain.mean()),
        "std": None,
        "se": None,
        "ci": None,
        "t": None,
        "p": None,
        "test": "t",
        "confidence": confidence,
    }
    if n < 2:
        return out
    std = float(gain.std(ddof=1))
    se = std / math.sqrt(n)
    half = t_quantile(0.5 + confidence / 2, n - 1) * se
    out.update(std=std, se=se, ci=[out["mean"] - half, out["mean"] + half])
    # "Every pair differs by the same amount" up to float rounding: accuracies are counts over a
    # test set (k / 359), and (300 - 290) / 359 and (340 - 330) / 359 differ in the last bits, so a
    # test of se > 0 alone read five equal gains as t ~ 1e15, p = 0 and a zero-width interval.
    # Rounding in a difference is below 1e-15 of the values' magnitude; real seed noise is far above
    # 1e-12 of it.
    scale = float(max(np.abs(x).max(), np.abs(y).max())) if np.isfinite(gain).all() else math.inf
    if std <= _SAME_GAIN_RTOL * scale:
        se = 0.0
    if se > 0:
        t = out["mean"] / se
        out["t"] = t
        out["p"] = 2.0 * (1.0 - t_cdf(abs(t), n - 1)) if math.isfinite(t) else math.nan
    elif math.isfinite(out["mean"]):
        # Every pair differs by exactly the same amount. With quantised
        # metrics (steps on an evaluation grid, accuracy on a finite test set)
        # that happens with real noise below the resolution, so t = inf and
        # p = 0 would overstate it: fall back to the exact two-sided sign test
        # (all n pairs on one side: p = 2 / 2**n, 0.0625 for 5 seeds).
        out["t"] = None
        out["p"] = min(1.0, 2.0 * 0.5**n) if abs(out["mean"]) > _SAME_GAIN_RTOL * scale else 1.0
        out["test"] = "sign"
        # Nor is [mean, mean] an interval: the noise is unknown, not zero, so
        # no decision that reads the interval (no gain, non-inferior) may use it.
        out["ci"] = None
    else:
        out["p"] = math.nan
    return out


# Up to this many pairs ``sign_flip_test`` enumerates every sign pattern (2**(n-1) sums, 4 MiB at
# n = 20); above it, a seeded Monte Carlo sample of patterns.
SIGN_FLIP_EXACT_MAX_N = 20
SIGN_FLIP_RESAMPLES = 100_000
SIGN_FLIP_SEED = 0


def sign_flip_test(
    gains: Sequence[float],
    *,
    exact_max_n: int = SIGN_FLIP_EXACT_MAX_N,
    resamples: int = SIGN_FLIP_RESAMPLES,
    seed: int = SIGN_FLIP_SEED,
) -> dict[str, Any]:
    """Two-sided paired sign-flip permutation test of H0: the gains are symmetric about 0.

    ``gains`` are the paired differences d_s (one per seed). The statistic is
    |sum d| (equivalently |mean d|); the p-value is the share of sign
    patterns e in {-1, +1}**n with |sum e_s d_s| >= |sum d_s| (ties within a
    relative 1e-12 of sum |d| count as reaching it: quantised metrics give
    exact ties that float rounding would split). Up to ``exact_max_n`` pairs
    every pattern is enumerated ("exact"); above, ``resamples`` patterns are
    drawn (numpy's PCG64 from ``seed``) and p = (1 + hits) / (1 + resamples)
    ("monte carlo"). ``floor``: the smallest p the exact test can give with n
    pairs, 2 / 2**n (the observed pattern and its mirror image). With fewer
    than 2 gains p is None (as the t test's); a NaN or infinite gain (a
    diverged run) makes it NaN; all gains 0 give p = 1.
    """
    arr = _as_real_values("gains", gains)
    for name, value, low in (("exact_max_n", exact_max_n, 1), ("resamples", resamples, 1), ("seed", seed, 0)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise DamchaTypeError(
                invalid_argument(name, f"an int >= {low}", f"{name}={describe_value(value)} ({type(value).__name__})")
            )
        if value < low:
            raise DamchaValueError(invalid_argument(name, f"an int >= {low}", f"{name}={value}"))
    n = int(arr.size)
    exact = n <= exact_max_n
    out: dict[str, Any] = {
        "n": n,
        "p": None,
        "method": "exact" if exact else "monte carlo",
        "resamples": None if exact else int(resamples),
        "seed": None if exact else int(seed),
        "floor": min(1.0, 2.0 / 2.0**n),
    }
    if n < 2:
        return out
    if not np.isfinite(arr).all():
        out["p"] = math.nan
        return out
    observed = abs(float(arr.sum()))
    tol = _SAME_GAIN_RTOL * float(np.abs(arr).sum())
    if observed <= tol:
        out["p"] = 1.0
        return out
    if exact:
        # |sum| is the same for a pattern and its mirror image: fix the first sign, enumerate the rest.
        sums = np.array([arr[0]])
        for d in arr[1:]:
            sums = np.concatenate([sums + d, sums - d])
        out["p"] = float(np.count_nonzero(np.abs(sums) >= observed - tol)) / sums.size
        return out
    rng = np.random.default_rng(seed)
    hits, left = 0, int(resamples)
    while left:  # in chunks: resamples x n signs at once could be large
        k = min(left, 10_000)
        signs = rng.integers(0, 2, size=(k, n)) * 2 - 1
        hits += int(np.count_nonzero(np.abs(signs @ arr) >= observed - tol))
        left -= k
    out["p"] = (1.0 + hits) / (1.0 + resamples)
    return out


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (same order as given; None and NaN stay as they are).

    The family size m counts the usable (finite) p-values only. ``p_values``
    is a list, tuple or 1-D array whose entries are None or real numbers,
    the finite ones in [0, 1].
    """
    expected = "a list, tuple or 1-D array of p-values (None, NaN or a real number in [0, 1])"
    if isinstance(p_values, np.ndarray):
        if p_values.dtype.kind not in "iuf" or p_values.ndim != 1:
            raise DamchaTypeError(invalid_argument("p_values", expected, f"p_values={describe_value(p_values)}"))
    elif not isinstance(p_values, (list, tuple)):
        # A string would be iterated character by character; a number is not a family.
        raise DamchaTypeError(
            invalid_argument("p_values", expected, f"p_values={describe_value(p_values)} ({type(p_values).__name__})")
        )
    for i, p in enumerate(p_values):
        if p is None:
            continue
        if not _is_real(p):
            raise DamchaTypeError(
                invalid_argument("p_values", expected, f"p_values[{i}]={describe_value(p)} ({type(p).__name__})")
            )
        if math.isfinite(p) and not 0.0 <= p <= 1.0:
            raise DamchaValueError(invalid_argument("p_values", expected, f"p_values[{i}]={p!r}"))
    usable = [(p, i) for i, p in enumerate(p_values) if p is not None and math.isfinite(p)]
    usable.sort()
    m = len(usable)
    out: list[float | None] = list(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(usable):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided p-value of McNemar's exact test from the two discordant counts of a paired binary outcome.

    ``only_a``: pairs where the event (say, "failed to learn") happened to
    side a only; ``only_b``: to side b only; concordant pairs do not enter.
    Under the null each discordant pair falls either way with probability
    1/2, so p = min(1, 2 P(X <= min(only_a, only_b))), X ~ Binomial(only_a +
    only_b, 1/2). With 3 discordant pairs all one way p = 0.25: the smallest
    count that can reach p < 0.05 is 6 of 6 (p = 0.031). No discordant pair:
    p = 1.
    """
    counts = []
    for name, value in (("only_a", only_a), ("only_b", only_b)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise DamchaTypeError(
                invalid_argument(name, "a count (int >= 0)", f"{name}={describe_value(value)} ({type(value).__name__})")
            )
        if value < 0:
            raise DamchaValueError(invalid_argument(name, "a count (int >= 0)", f"{name}={int(value)}"))
        counts.append(int(value))
    n, k = sum(counts), min(counts)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def median_interval(
    values: Sequence[float], *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> dict[str, Any]:
    """Median of ``values`` (one per round) and its percentile bootstrap interval.

    Each of ``resamples`` resamples draws n values with replacement (numpy's
    PCG64 from ``seed``: the same values give the same interval); the
    interval is the (1 - confidence) / 2 and (1 + confidence) / 2 quantiles
    of the resampled medians. It treats the rounds as independent draws, so
    a slow phase lasting several rounds makes it too narrow; with few rounds
    (7) it is coarse and tends to be too narrow as well, which is why the
    measurement takes dozens. With fewer than 2 values, or any NaN or
    infinity, ``ci`` is None.
    """
    arr = _as_real_values("values", values)
    confidence = _check_confidence(confidence)
    if isinstance(resamples, (bool, np.bool_)) or not isinstance(resamples, (int, np.integer)):
        raise DamchaTypeError(
            invalid_argument(
                "resamples", "an int >= 1", f"resamples={describe_value(resamples)} ({type(resamples).__name__})"
            )
        )
    if resamples < 1:
        raise DamchaValueError(invalid_argument("resamples", "an int >= 1", f"resamples={resamples}"))
    # None would draw a fresh seed each call: the interval would no longer be a function of the values.
    seed_expected = "an int >= 0 (a fixed seed, so the same values give the same interval)"
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise DamchaTypeError(
            invalid_argument("seed", seed_expected, f"seed={describe_value(seed)} ({type(seed).__name__})")
        )
    if seed < 0:
        raise DamchaValueError(invalid_argument("seed", seed_expected, f"seed={seed}"))
    n = int(arr.size)
    out: dict[str, Any] = {
        "n": n,
        "median": float(np.median(arr)),
        "ci": None,
        "confidence": confidence,
        "method": "percentile bootstrap over rounds",
        "resamples": int(resamples),
        "seed": int(seed),
    }
    if n < 2 or not np.isfinite(arr).all():
        return out
    rng = np.random.default_rng(seed)
    medians = np.median(arr[rng.integers(0, n, size=(int(resamples), n))], axis=1)
    lo, hi = np.quantile(medians, [(1.0 - confidence) / 2, (1.0 + confidence) / 2])
    out["ci"] = [float(lo), float(hi)]
    return out
