"""Using a trained agent: decisions on new bars (:class:`Policy`), a live stepping form, and a
self-contained export (:mod:`foxhunt_jax.policy.export`)."""

from foxhunt_jax.policy.policy import (BarInputs, Decision, Policy, PolicyState, Position)

__all__ = ["Policy", "Position", "BarInputs", "PolicyState", "Decision"]
