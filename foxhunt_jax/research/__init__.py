"""Research statistics: whether a selected strategy's result is better than luck, and the report
of a population of agents."""

from foxhunt_jax.research import population, significance
from foxhunt_jax.research.population import (chosen_member, member_table, population_report,
                                             setting_summary)
from foxhunt_jax.research.significance import (
    EULER_MASCHERONI, BootstrapInterval, DeflatedSharpe, MeanInterval, OverfittingResult,
    SharpeRatio, block_bootstrap_ci, deflated_sharpe_ratio, expected_max_sharpe, mean_ci,
    probabilistic_sharpe_ratio, probability_of_backtest_overfitting, return_moments,
    sharpe_ratio, student_t_cdf, student_t_quantile)

__all__ = significance.__all__ + ["population_report", "member_table", "setting_summary",
                                  "chosen_member"]
