"""The ``xla`` backend: the agent's own definitions, compiled by XLA as written.

The Q-forward is the Flax ``QNetwork`` (:mod:`foxhunt_jax.agent.network`), the bootstrap loss
:func:`foxhunt_jax.agent.loss.bootstrap_loss` and the novelty
:func:`foxhunt_jax.agent.curiosity.prediction_error`; rollouts are ``lax.scan`` loops of the
collector and the validator (no rollout kernel).
"""

from __future__ import annotations

from foxhunt_jax.agent import curiosity
from foxhunt_jax.agent.loss import bootstrap_loss
from foxhunt_jax.agent.network import act, q_forward, taken_logits

ENTRY_POINTS = {"q_forward": q_forward, "act": act, "taken_logits": taken_logits,
                "bootstrap_loss": bootstrap_loss, "novelty": curiosity.prediction_error,
                "rollout": None}

__all__ = ["ENTRY_POINTS"]
