"""Research statistics: whether a selected strategy's result is better than luck."""

from foxhunt_jax.research import significance
from foxhunt_jax.research.significance import (
    EULER_MASCHERONI, BootstrapInterval, DeflatedSharpe, MeanInterval, OverfittingResult,
    SharpeRatio, block_bootstrap_ci, deflated_sharpe_ratio, expected_max_sharpe, mean_ci,
    probabilistic_sharpe_ratio, probability_of_backtest_overfitting, return_moments,
    sharpe_ratio, student_t_cdf, student_t_quantile)

__all__ = significance.__all__
