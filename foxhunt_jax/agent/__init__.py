"""The agent: Q-network, loss, replay, curiosity and learner."""

from foxhunt_jax.agent.loss import (c51_double_q_loss, c51_loss, categorical_projection,
                                    n_step_targets)
from foxhunt_jax.agent.network import (
    QNetwork,
    expected_q,
    greedy_actions,
    make_network,
    param_count,
    select_action,
    support,
    taken_logits,
)

__all__ = [
    "QNetwork", "make_network", "support", "expected_q", "greedy_actions", "param_count",
    "select_action", "taken_logits", "categorical_projection", "c51_loss", "c51_double_q_loss",
    "n_step_targets",
]
