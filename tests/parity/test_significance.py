"""The research statistics against independent float64 references (SciPy, installed with JAX,
and direct loops) on fresh random inputs, a published example, and their rates on noise."""

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from foxhunt_jax.research import (
    block_bootstrap_ci, deflated_sharpe_ratio, expected_max_sharpe, mean_ci,
    probabilistic_sharpe_ratio, probability_of_backtest_overfitting, return_moments,
    sharpe_ratio, student_t_cdf, student_t_quantile)
from foxhunt_jax.training.metrics import trading_metrics


def _psr_reference(sr, sr_star, n, skew, kurt):
    return stats.norm.cdf((sr - sr_star) * np.sqrt(n - 1)
                          / np.sqrt(1 - skew * sr + (kurt - 1) / 4 * sr ** 2))


# --- Sharpe ratio ------------------------------------------------------------------------------


def test_sharpe_ratio_is_the_metrics_sharpe():
    rng = np.random.default_rng(0)
    for _ in range(5):
        size = int(rng.integers(2, 500))
        r = rng.normal(rng.normal(0, 0.01), rng.uniform(0.005, 0.03), size=size)
        bars_per_year = float(rng.uniform(10, 10000))
        equity = np.exp(np.concatenate([[0.0], np.cumsum(r)]))
        expected = trading_metrics(equity, np.zeros(r.size), 0, bars_per_year)["sharpe"]
        got = sharpe_ratio(r, bars_per_year)
        assert got.annualized == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert got.per_period == pytest.approx(r.mean() / r.std(), rel=1e-12)
        assert got.annualized == pytest.approx(got.per_period * math.sqrt(bars_per_year))


def test_sharpe_ratio_batches_over_leading_axes_and_is_zero_without_risk():
    rng = np.random.default_rng(1)
    r = rng.normal(0.001, 0.01, size=(3, 4, 50))
    batched = sharpe_ratio(r, 252.0)
    assert batched.annualized.shape == (3, 4)
    for i, j in itertools.product(range(3), range(4)):
        assert batched.annualized[i, j] == pytest.approx(sharpe_ratio(r[i, j], 252.0).annualized)
    assert sharpe_ratio(np.full(10, 0.002), 252.0) == (0.0, 0.0)


def test_return_moments_match_scipy():
    rng = np.random.default_rng(2)
    r = rng.standard_t(5, size=300) * 0.01
    skew, kurt = return_moments(r)
    assert skew == pytest.approx(stats.skew(r), rel=1e-10)
    assert kurt == pytest.approx(stats.kurtosis(r, fisher=False), rel=1e-10)  # non-excess


# --- PSR and DSR -------------------------------------------------------------------------------


def test_psr_matches_the_direct_formula_on_random_inputs():
    rng = np.random.default_rng(3)
    for _ in range(50):
        sr, sr_star = rng.normal(0.05, 0.1), rng.normal(0.0, 0.05)
        n, skew = int(rng.integers(2, 5000)), rng.normal(0, 1)
        kurt = skew ** 2 + 1 + rng.exponential(5)  # Pearson's bound: kurtosis >= skew^2 + 1
        assert probabilistic_sharpe_ratio(sr, sr_star, n, skew, kurt) == pytest.approx(
            _psr_reference(sr, sr_star, n, skew, kurt), rel=1e-9, abs=1e-12)
    assert probabilistic_sharpe_ratio(0.1, 0.1, 100, -1.0, 6.0) == pytest.approx(0.5)


def test_dsr_matches_the_direct_formula_on_random_inputs():
    rng = np.random.default_rng(4)
    for _ in range(10):
        n_obs, k = int(rng.integers(30, 600)), int(rng.integers(2, 80))
        r = rng.standard_t(4, size=n_obs) * 0.01 + 0.001
        trials = rng.normal(0.02, 0.05, size=k)
        got = deflated_sharpe_ratio(r, trials)
        sr = r.mean() / r.std()
        v = np.var(trials, ddof=1)
        g = 0.5772156649015329
        sr0 = np.sqrt(v) * ((1 - g) * stats.norm.ppf(1 - 1 / k)
                            + g * stats.norm.ppf(1 - 1 / (k * np.e)))
        expected = _psr_reference(sr, sr0, n_obs, stats.skew(r), stats.kurtosis(r, fisher=False))
        assert got.probability == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert got.expected_max == pytest.approx(sr0, rel=1e-9)
        assert got.n_trials == k and got.observations == n_obs
    fewer = deflated_sharpe_ratio(r, trials, n_trials=2)
    assert fewer.probability >= got.probability  # fewer independent trials deflate less


def test_published_example_of_the_deflated_sharpe_ratio():
    # Bailey and Lopez de Prado (2014), numerical example: N = 100 trials whose annualized
    # Sharpe ratios have variance 1/2, the best with annualized Sharpe 2.5 over T = 1250 daily
    # returns (250 a year), skewness -3 and kurtosis 10: E[max SR] = 0.1132 per day and
    # DSR = 0.9004.
    sr0 = expected_max_sharpe(0.5 / 250, 100)
    assert sr0 == pytest.approx(0.1132, abs=5e-5)
    dsr = probabilistic_sharpe_ratio(2.5 / math.sqrt(250), sr0, 1250, -3.0, 10.0)
    assert dsr == pytest.approx(0.9004, abs=5e-5)


def test_expected_max_sharpe_tracks_the_maximum_of_noise():
    # The approximation against a simulation: max of N normal Sharpe estimates with mean 0.
    rng = np.random.default_rng(5)
    n, sd = 50, 0.1
    simulated = rng.normal(0, sd, size=(20000, n)).max(axis=1).mean()
    assert expected_max_sharpe(sd ** 2, n) == pytest.approx(simulated, rel=0.03)


# --- PBO ---------------------------------------------------------------------------------------


def _pbo_loops(m, s, score):
    """Brute-force CSCV: explicit loops over combinations, trials and ranks."""
    t, n = m.shape
    bounds = [0]
    for b in range(s):  # np.array_split: the first t % s blocks get one extra row
        bounds.append(bounds[-1] + t // s + (1 if b < t % s else 0))
    logits = []
    for chosen in itertools.combinations(range(s), s // 2):
        rows_in = [i for b in chosen for i in range(bounds[b], bounds[b + 1])]
        rows_out = [i for i in range(t) if i not in rows_in]
        score_in = [score([m[i, j] for i in rows_in]) for j in range(n)]
        score_out = [score([m[i, j] for i in rows_out]) for j in range(n)]
        best = max(range(n), key=lambda j: (score_in[j], -j))
        below = sum(1 for j in range(n) if score_out[j] < score_out[best])
        ties = sum(1 for j in range(n) if score_out[j] == score_out[best])
        w = (below + (ties + 1) / 2) / (n + 1)
        logits.append(math.log(w / (1 - w)))
    return sum(1 for x in logits if x <= 0) / len(logits), logits


def _sharpe_loop(xs):
    mean = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    return mean / sd if sd > 1e-12 else 0.0


def test_pbo_matches_a_brute_force_loop():
    rng = np.random.default_rng(6)
    m = rng.normal(0.0, 1.0, size=(27, 5)) + rng.normal(0, 0.3, size=5)
    got = probability_of_backtest_overfitting(m, 6)
    pbo, logits = _pbo_loops(m, 6, _sharpe_loop)
    assert got.pbo == pbo
    np.testing.assert_allclose(got.logits, logits, rtol=1e-12)
    assert got.logits.shape == (math.comb(6, 3),)
    windows = np.round(rng.normal(size=(12, 4)), 1)  # coarse values: ties out of sample
    got = probability_of_backtest_overfitting(windows, 4, score=lambda b: b.mean(axis=0))
    pbo, logits = _pbo_loops(windows, 4, lambda xs: sum(xs) / len(xs))
    assert got.pbo == pbo
    np.testing.assert_allclose(got.logits, logits, rtol=1e-12)


def test_pbo_of_noise_is_near_one_half():
    rng = np.random.default_rng(7)
    pbos = [probability_of_backtest_overfitting(rng.normal(size=(48, 10)), 6).pbo
            for _ in range(200)]
    assert np.mean(pbos) == pytest.approx(0.5, abs=0.05)  # standard error ~0.018


def test_pbo_is_zero_when_one_trial_dominates_every_period():
    rng = np.random.default_rng(8)
    m = rng.uniform(-1, 1, size=(40, 6))
    m[:, 2] = 2.0 + rng.uniform(0, 0.1, size=40)  # best on every bar, and by Sharpe
    for score in (None, lambda b: b.mean(axis=0)):
        got = probability_of_backtest_overfitting(m, 8, score=score)
        assert got.pbo == 0.0
        assert np.all(got.best_trial == 2)
        np.testing.assert_allclose(got.logits, math.log(6))  # rank N of N: w = N / (N + 1)


# --- bootstrap ---------------------------------------------------------------------------------


def test_bootstrap_interval_of_the_mean_covers_at_about_the_nominal_rate():
    rng = np.random.default_rng(9)
    reps, covered = 200, 0
    for i in range(reps):
        x = rng.normal(0.3, 1.0, size=200)
        ci = block_bootstrap_ci(x, lambda r: r.mean(axis=-1), block=3, draws=400, seed=i)
        assert ci.low <= ci.estimate <= ci.high and ci.estimate == pytest.approx(x.mean())
        covered += ci.low <= 0.3 <= ci.high
    assert covered / reps == pytest.approx(0.95, abs=0.05)  # binomial standard error ~0.015


def test_bootstrap_is_deterministic_per_seed_and_takes_a_sharpe_statistic():
    rng = np.random.default_rng(10)
    x = rng.normal(0.001, 0.01, size=300)
    annual_sharpe = lambda r: sharpe_ratio(r, 252.0).annualized  # noqa: E731
    a = block_bootstrap_ci(x, annual_sharpe, block=10, draws=300, seed=4)
    b = block_bootstrap_ci(x, annual_sharpe, block=10, draws=300, seed=4)
    c = block_bootstrap_ci(x, annual_sharpe, block=10, draws=300, seed=5)
    np.testing.assert_array_equal(a.samples, b.samples)
    assert (a.low, a.high) == (b.low, b.high)
    assert not np.array_equal(a.samples, c.samples)
    assert a.estimate == pytest.approx(sharpe_ratio(x, 252.0).annualized)
    assert a.samples.shape == (300,)
    assert (a.low, a.high) == tuple(np.quantile(a.samples, [0.025, 0.975]))


def test_bootstrap_blocks_keep_serial_dependence():
    # A trending series: mean blocks of T bars resample (nearly) whole circular rotations,
    # which keep the lag-1 autocorrelation; blocks of 1 bar destroy it.
    x = np.sin(np.linspace(0, 6 * np.pi, 240))
    lag1 = lambda r: np.mean(r[:, 1:] * r[:, :-1], axis=-1)  # noqa: E731
    long_blocks = block_bootstrap_ci(x, lag1, block=240, draws=200, seed=0)
    iid = block_bootstrap_ci(x, lag1, block=1, draws=200, seed=0)
    assert np.median(long_blocks.samples) > 0.4 > 0.1 > abs(np.median(iid.samples))


# --- Student t and mean_ci ---------------------------------------------------------------------


def test_t_quantiles_match_known_values_and_scipy():
    assert student_t_quantile(0.975, 4) == pytest.approx(2.776445, abs=1e-6)
    assert student_t_quantile(0.975, 10) == pytest.approx(2.228139, abs=1e-6)
    assert student_t_quantile(0.975, 30) == pytest.approx(2.042272, abs=1e-6)
    rng = np.random.default_rng(11)
    for _ in range(30):
        p, dof = float(rng.uniform(0.001, 0.999)), float(rng.choice([1, 2, 3, 7, 15, 60, 500]))
        assert student_t_quantile(p, dof) == pytest.approx(stats.t.ppf(p, dof), rel=1e-9, abs=1e-12)
        t = float(rng.normal(0, 3))
        assert student_t_cdf(t, dof) == pytest.approx(stats.t.cdf(t, dof), rel=1e-10, abs=1e-14)
    for p in (1e-12, 1e-6, 0.5, 1 - 1e-9):  # far tails keep their precision
        assert student_t_quantile(p, 3) == pytest.approx(stats.t.ppf(p, 3), rel=1e-12)


def test_mean_ci_matches_scipy_t_interval():
    rng = np.random.default_rng(12)
    for n in (2, 5, 16, 64):
        v = rng.normal(1.0, 2.0, size=n)
        got = mean_ci(v, 0.9)
        low, high = stats.t.interval(0.9, n - 1, loc=v.mean(), scale=stats.sem(v))
        assert got.mean == pytest.approx(v.mean())
        assert (got.low, got.high) == pytest.approx((low, high), rel=1e-9)
        assert got.n == n and got.level == 0.9


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("call, message", [
    (lambda: sharpe_ratio([0.01]), "at least 2 observations"),
    (lambda: sharpe_ratio([0.01, np.nan]), "non-finite"),
    (lambda: sharpe_ratio([0.01, 0.02], 0), "periods_per_year"),
    (lambda: return_moments([0.01, 0.01, 0.01]), "constant"),
    (lambda: probabilistic_sharpe_ratio(0.1, 0.0, 1, 0.0, 3.0), "n >= 2"),
    (lambda: probabilistic_sharpe_ratio(0.5, 0.0, 10, 4.0, 0.0), "not positive"),
    (lambda: expected_max_sharpe(0.01, 1), "n_trials >= 2"),
    (lambda: expected_max_sharpe(-0.01, 10), "sharpe_variance"),
    (lambda: deflated_sharpe_ratio(np.arange(10.0), [0.1]), "trial_sharpes"),
    (lambda: probability_of_backtest_overfitting(np.ones((20, 3)), 3), "even"),
    (lambda: probability_of_backtest_overfitting(np.ones((7, 3)), 4), "at least 8"),
    (lambda: probability_of_backtest_overfitting(np.ones(20), 2), "2-D"),
    (lambda: probability_of_backtest_overfitting(np.ones((20, 3)), 2, score=np.mean), "score"),
    (lambda: probability_of_backtest_overfitting(
        np.ones((20, 3)), 2, score=lambda b: np.full(3, np.inf)), "non-finite"),
    (lambda: block_bootstrap_ci(np.ones(10), np.mean, block=3), "statistic"),
    (lambda: block_bootstrap_ci(np.ones(10), lambda r: r.mean(-1), block=11), "block"),
    (lambda: block_bootstrap_ci(np.ones(10), lambda r: r.mean(-1), block=2, draws=1), "draws"),
    (lambda: block_bootstrap_ci(np.ones(10), lambda r: r.mean(-1), block=2, level=1.0), "level"),
    (lambda: mean_ci([1.0]), "at least 2"),
    (lambda: student_t_quantile(1.0, 3), "p must be"),
    (lambda: student_t_quantile(0.5, 0), "dof"),
])
def test_bad_input_raises_a_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_example_of_docs_research_runs():
    text = (Path(__file__).resolve().parents[2] / "docs" / "research.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    scope = {}
    exec(compile(block, "docs/research.md", "exec"), scope)
    assert 0.0 <= scope["dsr"].probability <= 1.0 and 0.0 <= scope["pbo"].pbo <= 1.0
    assert scope["ci"].low <= scope["ci"].estimate <= scope["ci"].high
