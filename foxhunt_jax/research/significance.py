"""Significance of trading results, on the host in float64 NumPy.

Each function answers one question a researcher asks of a backtest (docs/research.md explains
how to read them):

* :func:`sharpe_ratio`: the Sharpe ratio of per-bar log returns, per bar and annualized, with
  the definition of :func:`foxhunt_jax.training.metrics.trading_metrics` (mean over std with
  ``ddof=0``, risk-free rate 0, 0 when the std is at most ``1e-12``).
* :func:`probabilistic_sharpe_ratio`, :func:`expected_max_sharpe`, :func:`deflated_sharpe_ratio`:
  is the Sharpe ratio above a benchmark, and above the best of ``N`` skill-less trials
  (Bailey and López de Prado, 2012 and 2014).
* :func:`probability_of_backtest_overfitting`: how often the best in-sample trial is below the
  median out of sample, by combinatorially symmetric cross-validation (Bailey, Borwein, López de
  Prado and Zhu, 2017).
* :func:`block_bootstrap_ci`: a stationary block bootstrap interval of any statistic of a
  return series (Politis and Romano, 1994).
* :func:`mean_ci`: the mean over seeds and its Student-t interval, with :func:`student_t_cdf`
  and :func:`student_t_quantile` computed from the regularized incomplete beta function.

Conventions: returns are per-bar log returns, float64; Sharpe ratios given to or returned by
the probabilistic and deflated Sharpe ratio are per bar (not annualized); kurtosis is the
non-excess kurtosis (3 for a normal distribution). No SciPy: the normal distribution is
:class:`statistics.NormalDist`. Bad input raises ``ValueError`` with a one-line message.
"""

from __future__ import annotations

import itertools
import math
from statistics import NormalDist
from typing import Callable, NamedTuple

import numpy as np

# The zero-risk threshold of the project's one Sharpe definition.
from foxhunt_jax.training.metrics import ZERO_RISK

EULER_MASCHERONI = 0.5772156649015329
_NORMAL = NormalDist()
_BOOTSTRAP_CHUNK = 1 << 22  # resampled values held at once (draws x bars), to bound memory


def _finite_array(values, name: str, ndim: int, min_last: int) -> np.ndarray:
    a = np.asarray(values, np.float64)
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if a.shape[-1] < min_last:
        raise ValueError(f"{name} needs at least {min_last} observations along its last axis, "
                         f"got {a.shape[-1]}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} holds non-finite values")
    return a


def _check_level(level: float) -> float:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    return float(level)


# ---------------------------------------------------------------------------------------------
# Sharpe ratio and its probabilistic and deflated versions


class SharpeRatio(NamedTuple):
    per_period: np.ndarray | float
    annualized: np.ndarray | float


def sharpe_ratio(returns, periods_per_year: float = 1.0) -> SharpeRatio:
    """Sharpe ratio of per-period log returns, per period and annualized.

    ``SR = mean(r) / std(r)`` (``std`` with ``ddof=0``, risk-free rate 0), 0 when
    ``std(r) <= 1e-12``; annualized ``SR * sqrt(periods_per_year)``. This is the ``sharpe`` of
    :func:`foxhunt_jax.training.metrics.trading_metrics` for the equity path
    ``exp(cumsum(r))`` (Sharpe, 1966 and 1994, with the ``ddof=0`` standard deviation).

    Args:
      returns: ``[..., T]`` log returns, ``T >= 2``; leading axes are separate series.
      periods_per_year: annualization factor ``A`` (bars per year), > 0.

    Returns:
      ``SharpeRatio(per_period, annualized)``, each ``[...]`` (a float for 1-D input).
    """
    r = np.asarray(returns, np.float64)
    if r.ndim < 1:
        raise ValueError("returns must have a time axis, got a scalar")
    r = _finite_array(r, "returns", r.ndim, 2)
    if not periods_per_year > 0:
        raise ValueError(f"periods_per_year must be > 0, got {periods_per_year}")
    mean, std = r.mean(axis=-1), r.std(axis=-1)
    per_period = np.where(std > ZERO_RISK, mean / np.where(std > ZERO_RISK, std, 1.0), 0.0)
    annualized = per_period * math.sqrt(periods_per_year)
    if r.ndim == 1:
        return SharpeRatio(float(per_period), float(annualized))
    return SharpeRatio(per_period, annualized)


def return_moments(returns) -> tuple[float, float]:
    """Skewness and non-excess kurtosis of a return series (population moments, ``ddof=0``).

    ``skew = m3 / m2^1.5``, ``kurtosis = m4 / m2^2`` with central moments
    ``m_k = mean((r - mean(r))^k)``; a normal distribution has skew 0 and kurtosis 3.

    Args:
      returns: ``[T]``, ``T >= 2``, not constant.

    Returns:
      ``(skew, kurtosis)`` floats.
    """
    r = _finite_array(returns, "returns", 1, 2)
    d = r - r.mean()
    m2 = float(np.mean(d ** 2))
    if math.sqrt(m2) <= ZERO_RISK:
        raise ValueError("returns are constant: their skewness and kurtosis are undefined")
    return float(np.mean(d ** 3)) / m2 ** 1.5, float(np.mean(d ** 4)) / m2 ** 2


def probabilistic_sharpe_ratio(sr: float, sr_benchmark: float, n: int, skew: float,
                               kurtosis: float) -> float:
    """Probability that the true Sharpe ratio exceeds ``sr_benchmark``, given the estimate.

    ``PSR = Phi((sr - sr_benchmark) * sqrt(n - 1) / sqrt(v))`` with
    ``v = 1 - skew * sr + (kurtosis - 1) / 4 * sr^2`` and ``Phi`` the standard normal CDF
    (Bailey and López de Prado, 2012, "The Sharpe Ratio Efficient Frontier", Journal of Risk;
    ``v / (n - 1)`` is the asymptotic variance of the Sharpe estimator of non-normal iid
    returns, Mertens, 2002).

    Args:
      sr: observed per-period (not annualized) Sharpe ratio.
      sr_benchmark: per-period benchmark Sharpe ratio (0: "is there any skill").
      n: number of returns ``sr`` was measured on, ``>= 2``.
      skew: skewness of those returns.
      kurtosis: their NON-excess kurtosis (3 for normal returns).

    Returns:
      float in ``[0, 1]``.
    """
    values = {"sr": sr, "sr_benchmark": sr_benchmark, "skew": skew, "kurtosis": kurtosis}
    for name, v in values.items():
        if not math.isfinite(v):
            raise ValueError(f"probabilistic_sharpe_ratio: {name} must be finite, got {v}")
    if int(n) != n or n < 2:
        raise ValueError(f"probabilistic_sharpe_ratio needs n >= 2 observations, got {n}")
    variance_factor = 1.0 - skew * sr + (kurtosis - 1.0) / 4.0 * sr ** 2
    if not variance_factor > 0.0:
        raise ValueError(f"probabilistic_sharpe_ratio: 1 - skew*sr + (kurtosis-1)/4*sr^2 = "
                         f"{variance_factor} is not positive (is kurtosis non-excess?)")
    z = (sr - sr_benchmark) * math.sqrt(n - 1) / math.sqrt(variance_factor)
    return _NORMAL.cdf(z)


def expected_max_sharpe(sharpe_variance: float, n_trials: int) -> float:
    """Expected maximum of ``N`` independent skill-less Sharpe ratio estimates.

    ``E[max SR] ~= sqrt(V) * ((1 - g) * Phi^-1(1 - 1/N) + g * Phi^-1(1 - 1/(N e)))`` with ``g``
    the Euler-Mascheroni constant and ``V`` the variance of the trials' Sharpe ratios
    (Bailey and López de Prado, 2014, "The Deflated Sharpe Ratio", from the extreme-value
    approximation of the maximum of ``N`` normal variables with true Sharpe 0).

    Args:
      sharpe_variance: ``V >= 0``, in the units of the Sharpe ratios (per period).
      n_trials: ``N >= 2``, the number of independent trials.

    Returns:
      float, per-period Sharpe ratio.
    """
    if not (math.isfinite(sharpe_variance) and sharpe_variance >= 0.0):
        raise ValueError(f"sharpe_variance must be finite and >= 0, got {sharpe_variance}")
    if int(n_trials) != n_trials or n_trials < 2:
        raise ValueError(f"expected_max_sharpe needs n_trials >= 2, got {n_trials} (one trial "
                         "has no selection to deflate: use probabilistic_sharpe_ratio)")
    g = EULER_MASCHERONI
    z = ((1.0 - g) * _NORMAL.inv_cdf(1.0 - 1.0 / n_trials)
         + g * _NORMAL.inv_cdf(1.0 - 1.0 / (n_trials * math.e)))
    return math.sqrt(sharpe_variance) * z


class DeflatedSharpe(NamedTuple):
    probability: float  # DSR: PSR against expected_max
    sharpe: float  # per-period Sharpe ratio of the selected returns
    expected_max: float  # per-period expected maximum Sharpe of n_trials skill-less trials
    n_trials: int
    sharpe_variance: float  # variance (ddof 1) of the trials' per-period Sharpe ratios
    observations: int
    skew: float
    kurtosis: float  # non-excess


def deflated_sharpe_ratio(returns, trial_sharpes, n_trials: int | None = None) -> DeflatedSharpe:
    """Deflated Sharpe ratio of the strategy selected among several trials.

    ``DSR = PSR(SR0)`` with ``SR0 = expected_max_sharpe(V, N)``: the probability that the
    selected strategy's true Sharpe ratio exceeds the best that ``N`` skill-less trials would
    show (Bailey and López de Prado, 2014, "The Deflated Sharpe Ratio: Correcting for Selection
    Bias, Backtest Overfitting and Non-Normality"). ``SR``, skew and non-excess kurtosis are of
    the selected strategy's ``returns`` (:func:`sharpe_ratio`, :func:`return_moments`); ``V``
    is the sample variance (``ddof=1``) of ``trial_sharpes``.

    Args:
      returns: ``[T]`` per-period log returns of the selected strategy, ``T >= 2``.
      trial_sharpes: ``[K]`` per-period (NOT annualized) Sharpe ratios of every trial tried,
        the selected one included, ``K >= 2``.
      n_trials: ``N``, the number of independent trials; defaults to ``K`` (every trial counts
        as independent, which deflates the most when trials are alike).

    Returns:
      :class:`DeflatedSharpe`; ``probability`` is the DSR in ``[0, 1]``.
    """
    r = _finite_array(returns, "returns", 1, 2)
    trials = _finite_array(trial_sharpes, "trial_sharpes", 1, 2)
    n = trials.size if n_trials is None else n_trials
    variance = float(np.var(trials, ddof=1))
    sr0 = expected_max_sharpe(variance, n)
    sr = sharpe_ratio(r).per_period
    skew, kurtosis = return_moments(r)
    dsr = probabilistic_sharpe_ratio(sr, sr0, r.size, skew, kurtosis)
    return DeflatedSharpe(dsr, sr, sr0, int(n), variance, int(r.size), skew, kurtosis)


# ---------------------------------------------------------------------------------------------
# Probability of backtest overfitting


class OverfittingResult(NamedTuple):
    pbo: float  # share of logits <= 0
    logits: np.ndarray  # [C] logit of the in-sample best trial's out-of-sample relative rank
    best_trial: np.ndarray  # [C] int, the in-sample best trial of each combination
    in_sample: np.ndarray  # [C] its in-sample score
    out_of_sample: np.ndarray  # [C] its out-of-sample score


def _column_sharpe(rows: np.ndarray) -> np.ndarray:
    return np.asarray(sharpe_ratio(rows.T).per_period)


def probability_of_backtest_overfitting(
        performance_matrix, splits: int,
        score: Callable[[np.ndarray], np.ndarray] | None = None) -> OverfittingResult:
    """Probability of backtest overfitting by combinatorially symmetric cross-validation.

    The ``T`` rows of ``M`` (periods) are cut into ``S`` contiguous blocks (``np.array_split``:
    sizes differ by at most one row, order kept). For each of the ``C(S, S/2)`` choices of
    ``S/2`` blocks as the in-sample set ``J`` (the rest ``J'`` out of sample): score every
    trial on ``J`` and on ``J'``, take the in-sample best trial ``n*`` (the first on ties), its
    out-of-sample relative rank ``w = rank(score_J'[n*]) / (N + 1)`` (rank 1 = worst, ``N`` =
    best; ties get the mean of their ranks) and the logit ``l = ln(w / (1 - w))``.
    ``PBO = #(l <= 0) / C``: how often the in-sample winner is at or below the median out of
    sample (Bailey, Borwein, López de Prado and Zhu, 2017, "The Probability of Backtest
    Overfitting", Journal of Computational Finance; working paper 2014). Skill-less trials
    give ``PBO ~= 0.5`` (exactly, in expectation, for even ``N``); a trial that is best
    everywhere gives 0.

    Args:
      performance_matrix: ``[T, N]`` per-period returns (or per-window scores) of ``N >= 2``
        trials, ``T >= 2 S``.
      splits: ``S``, even, ``>= 2``.
      score: maps a ``[rows, N]`` block of the matrix to ``[N]`` scores (higher is better);
        default the per-period Sharpe ratio of each column (:func:`sharpe_ratio`); pass
        ``lambda m: m.mean(axis=0)`` for per-window scores.

    Returns:
      :class:`OverfittingResult`, with arrays ``[C]`` over the combinations in
      ``itertools.combinations(range(S), S // 2)`` order.
    """
    m = _finite_array(performance_matrix, "performance_matrix", 2, 2)
    if int(splits) != splits or splits < 2 or splits % 2:
        raise ValueError(f"splits (CSCV partitions) must be an even integer >= 2, got {splits}")
    n_periods, n_trials = m.shape
    if n_periods < 2 * splits:
        raise ValueError(f"performance_matrix has {n_periods} rows: {splits} partitions need "
                         f"at least {2 * splits} (two rows each)")
    score = _column_sharpe if score is None else score
    blocks = np.array_split(np.arange(n_periods), splits)
    combos = list(itertools.combinations(range(splits), splits // 2))
    logits = np.empty(len(combos))
    best = np.empty(len(combos), np.int64)
    in_scores, out_scores = np.empty(len(combos)), np.empty(len(combos))
    for c, chosen in enumerate(combos):
        inside = np.zeros(n_periods, bool)
        inside[np.concatenate([blocks[b] for b in chosen])] = True
        score_in = np.asarray(score(m[inside]), np.float64)
        score_out = np.asarray(score(m[~inside]), np.float64)
        if score_in.shape != (n_trials,) or score_out.shape != (n_trials,):
            raise ValueError(f"score must map a [rows, {n_trials}] block to [{n_trials}] "
                             f"scores, got {score_in.shape}")
        if not (np.all(np.isfinite(score_in)) and np.all(np.isfinite(score_out))):
            raise ValueError(f"score returned non-finite scores on combination {chosen}")
        star = int(np.argmax(score_in))
        value = score_out[star]
        rank = np.sum(score_out < value) + 0.5 * (np.sum(score_out == value) + 1)
        w = rank / (n_trials + 1)
        logits[c] = math.log(w / (1.0 - w))
        best[c], in_scores[c], out_scores[c] = star, score_in[star], value
    return OverfittingResult(float(np.mean(logits <= 0.0)), logits, best, in_scores, out_scores)


# ---------------------------------------------------------------------------------------------
# Bootstrap and confidence intervals


class BootstrapInterval(NamedTuple):
    estimate: float  # the statistic of the original series
    low: float
    high: float
    level: float
    samples: np.ndarray  # [draws] the statistic of each resampled series


def _stationary_indices(rng: np.random.Generator, draws: int, n: int,
                        block: float) -> np.ndarray:
    """``[draws, n]`` stationary-bootstrap indices: blocks start at uniform bars, run on
    circularly, and end after each bar with probability ``1 / block``."""
    starts = rng.integers(0, n, size=(draws, n))
    new_block = rng.random((draws, n)) < 1.0 / block
    new_block[:, 0] = True
    t = np.arange(n)
    block_start = np.maximum.accumulate(np.where(new_block, t, 0), axis=1)
    return (np.take_along_axis(starts, block_start, axis=1) + t - block_start) % n


def block_bootstrap_ci(returns, statistic: Callable[[np.ndarray], np.ndarray], block: float,
                       draws: int = 2000, level: float = 0.95,
                       seed: int = 0) -> BootstrapInterval:
    """Stationary block bootstrap percentile interval of a statistic of a return series.

    Each draw resamples the ``T`` bars as blocks of consecutive bars (wrapping from the last
    bar to the first) with geometric lengths of mean ``block`` starting at uniform bars: the
    stationary bootstrap of Politis and Romano (1994, "The Stationary Bootstrap", JASA),
    which keeps the serial dependence within blocks. The interval is the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (``np.quantile``, linear) of the
    statistic over the draws (Efron's percentile interval). ``block = 1`` is the iid bootstrap.
    The same ``seed`` gives the same interval.

    Args:
      returns: ``[T]`` per-bar returns, ``T >= 2``.
      statistic: maps ``[draws, T]`` resampled series to ``[draws]`` values (and ``[1, T]``
        to ``[1]``), e.g. ``lambda r: sharpe_ratio(r, A).annualized`` or
        ``lambda r: r.mean(axis=-1)``.
      block: mean block length in bars, ``1 <= block <= T``.
      draws: number of resampled series, ``>= 2``.
      level: coverage of the interval, in ``(0, 1)``.
      seed: seed of ``np.random.default_rng``.

    Returns:
      :class:`BootstrapInterval`.
    """
    r = _finite_array(returns, "returns", 1, 2)
    n = r.size
    if not 1.0 <= block <= n:
        raise ValueError(f"block (mean block length) must be in [1, {n}], got {block}")
    if int(draws) != draws or draws < 2:
        raise ValueError(f"draws must be an integer >= 2, got {draws}")
    level = _check_level(level)

    def apply(series: np.ndarray) -> np.ndarray:
        values = np.asarray(statistic(series), np.float64)
        if values.shape != (series.shape[0],):
            raise ValueError(f"statistic must map [draws, T] series to [draws] values, got "
                             f"{values.shape} for {series.shape}")
        if not np.all(np.isfinite(values)):
            raise ValueError("statistic returned non-finite values")
        return values

    rng = np.random.default_rng(seed)
    chunk = max(1, _BOOTSTRAP_CHUNK // n)
    samples = np.concatenate([
        apply(r[_stationary_indices(rng, min(chunk, draws - done), n, block)])
        for done in range(0, draws, chunk)])
    low, high = np.quantile(samples, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return BootstrapInterval(float(apply(r[None])[0]), float(low), float(high), level, samples)


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def _beta_continued_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction ``1 + d1/(1 + d2/(1 + ...))`` of the incomplete beta function,
    ``d_{2m+1} = -(a+m)(a+b+m) x / ((a+2m)(a+2m+1))``, ``d_{2m} = m(b-m) x / ((a+2m-1)(a+2m))``,
    evaluated by the modified Lentz method; converges fast for ``x < (a+1)/(a+b+2)``."""
    floor = 1e-300
    value, numer, denom = 1.0, 1.0, 0.0  # the convergent and Lentz's C and D
    for j in range(1, 1000):
        m = j // 2
        if j % 2:
            d = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        else:
            d = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        denom = 1.0 + d * denom
        denom = 1.0 / (denom if abs(denom) > floor else floor)
        numer = 1.0 + d / numer
        numer = numer if abs(numer) > floor else floor
        value *= numer * denom
        if abs(numer * denom - 1.0) < 1e-16:
            break
    return value


def _regularized_beta(x: float, a: float, b: float) -> float:
    """``I_x(a, b) = B(x; a, b) / B(a, b)``, by the continued fraction on the side of
    ``(a+1)/(a+b+2)`` where it converges, and ``I_x(a, b) = 1 - I_{1-x}(b, a)`` on the other."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _regularized_beta(1.0 - x, b, a)
    front = math.exp(a * math.log(x) + b * math.log1p(-x) - _log_beta(a, b)) / a
    return front / _beta_continued_fraction(x, a, b)


def _t_upper_tail(t: float, dof: float) -> float:
    """``P(T > t)`` for ``t >= 0``: ``I_{dof/(dof+t^2)}(dof/2, 1/2) / 2``."""
    return 0.5 * _regularized_beta(dof / (dof + t * t), dof / 2.0, 0.5)


def student_t_cdf(t: float, dof: float) -> float:
    """CDF of Student's t distribution with ``dof > 0`` degrees of freedom.

    ``F(t) = 1 - I_{dof/(dof+t^2)}(dof/2, 1/2) / 2`` for ``t >= 0`` and ``F(-t) = 1 - F(t)``,
    with ``I`` the regularized incomplete beta function (Abramowitz and Stegun, 1964, 26.7.1
    and 26.5.27), evaluated by its continued fraction (26.5.8).
    """
    if not dof > 0:
        raise ValueError(f"dof must be > 0, got {dof}")
    tail = _t_upper_tail(abs(t), dof)
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(p: float, dof: float) -> float:
    """Quantile of Student's t distribution: the ``t`` with ``student_t_cdf(t, dof) = p``.

    Found by bisection to float64 resolution on the tail ``P(T > |t|) = min(p, 1 - p)``
    (monotone; the tail keeps its precision for ``p`` near 0 or 1), after doubling an upper
    bracket, with the sign of ``p - 1/2``.

    Args:
      p: probability in ``(0, 1)``.
      dof: degrees of freedom, ``> 0``.

    Returns:
      float.
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if not dof > 0:
        raise ValueError(f"dof must be > 0, got {dof}")
    if p == 0.5:
        return 0.0
    tail = min(p, 1.0 - p)  # P(T > |t|), exact in float64 on both sides
    low, high = 0.0, 1.0
    while _t_upper_tail(high, dof) > tail:
        low, high = high, 2.0 * high
    for _ in range(200):
        mid = 0.5 * (low + high)
        if mid in (low, high):
            break
        if _t_upper_tail(mid, dof) > tail:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high) if p >= 0.5 else -0.5 * (low + high)


class MeanInterval(NamedTuple):
    mean: float
    low: float
    high: float
    level: float
    n: int


def mean_ci(values, level: float = 0.95) -> MeanInterval:
    """Mean of ``n`` independent values (e.g. one metric over seeds) and its Student-t interval.

    ``mean +- t_{(1+level)/2, n-1} * s / sqrt(n)`` with ``s`` the sample standard deviation
    (``ddof=1``) and ``t`` the Student-t quantile (:func:`student_t_quantile`; Student, 1908,
    "The Probable Error of a Mean"). Exact for normal values, approximate otherwise.

    Args:
      values: ``[n]``, ``n >= 2``, finite.
      level: coverage, in ``(0, 1)``.

    Returns:
      :class:`MeanInterval`.
    """
    v = _finite_array(values, "values", 1, 2)
    level = _check_level(level)
    n = v.size
    mean = float(v.mean())
    half = student_t_quantile((1.0 + level) / 2.0, n - 1) * float(v.std(ddof=1)) / math.sqrt(n)
    return MeanInterval(mean, mean - half, mean + half, level, n)


__all__ = [
    "EULER_MASCHERONI", "BootstrapInterval", "DeflatedSharpe", "MeanInterval",
    "OverfittingResult", "SharpeRatio", "block_bootstrap_ci", "deflated_sharpe_ratio",
    "expected_max_sharpe", "mean_ci", "probabilistic_sharpe_ratio",
    "probability_of_backtest_overfitting", "return_moments", "sharpe_ratio", "student_t_cdf",
    "student_t_quantile"]
