"""The trading environment: pure JAX reset/step over device tables (docs/environment.md)."""

from foxhunt_jax.env.trading import (
    PORTFOLIO_DIM,
    EnvParams,
    EnvState,
    decode,
    encode,
    make_params,
    obs_dim,
    obs_from,
    observation,
    portfolio_obs,
    random_policy,
    reset,
    reset_at,
    rollout,
    step,
    step_env,
)

__all__ = [
    "EnvParams", "EnvState", "make_params", "reset", "reset_at", "step_env", "step",
    "observation", "portfolio_obs", "obs_from", "obs_dim",
    "encode", "decode", "rollout", "random_policy", "PORTFOLIO_DIM",
]
