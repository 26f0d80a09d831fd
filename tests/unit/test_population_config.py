"""Population expansion (config -> one hyperparameter dict a member) and a traced n-step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.agent.loss import n_step_targets
from foxhunt_jax.config import (load_config, member_config, population_grid,
                                population_members)
from foxhunt_jax.errors import ConfigError


def cfg(*overrides):
    return load_config(None, list(overrides))


def test_single_agent_has_one_empty_member():
    assert population_members(cfg()) == [{}]


def test_grid_cells_cycle_over_members_last_key_fastest():
    c = cfg("train.population=8", 'population.grid=["train.learning_rate=1e-4,3e-4", '
                                  '"train.gamma=0.9,0.99"]')
    cells = [{"train.learning_rate": lr, "train.gamma": g}
             for lr in (1e-4, 3e-4) for g in (0.9, 0.99)]
    assert population_grid(c) == cells
    assert population_members(c) == cells + cells


def test_random_draws_are_in_range_typed_and_reproducible():
    spec = ('population.random=["train.learning_rate=1e-5..1e-3:log", "train.n_step=1..5", '
            '"env.cost_bps=0..10"]')
    members = population_members(cfg("train.population=64", spec))
    assert members == population_members(cfg("train.population=64", spec))
    assert members != population_members(cfg("train.population=64", spec, "population.seed=1"))
    lr = np.array([m["train.learning_rate"] for m in members])
    n = [m["train.n_step"] for m in members]
    cost = np.array([m["env.cost_bps"] for m in members])
    assert ((1e-5 <= lr) & (lr <= 1e-3)).all() and (lr < 1e-4).any() and (lr > 1e-4).any()
    assert all(type(v) is int for v in n) and set(n) == {1, 2, 3, 4, 5}
    assert ((0 <= cost) & (cost <= 10)).all()


def test_member_config_sets_seed_and_hyperparameters():
    c = cfg("train.population=2", "train.seed=7", 'population.grid=["train.n_step=2,4"]')
    member = member_config(c, population_members(c)[1], 1)
    assert (member.train.seed, member.train.n_step, member.train.population) == (8, 4, 1)
    assert member.population.grid == ()


@pytest.mark.parametrize("overrides, named", [
    (["train.population=0"], "train.population"),
    (["train.population=2", 'population.grid=["train.batch_size=8,16"]'], "train.batch_size"),
    (["train.population=2", 'population.grid=["train.learning_rate"]'], "KEY=VALUES"),
    (["train.population=2", 'population.grid=["train.gamma=,"]'], "no values"),
    (["train.population=3", 'population.grid=["train.gamma=0.9,0.99"]'], "multiple"),
    (["train.population=2", 'population.grid=["train.gamma=0.5,2"]'], "member 1"),
    (["train.population=2", 'population.grid=["train.n_step=1,6"]'], "train.n_step"),
    (["train.population=2", 'population.grid=["train.n_step=1,x"]'], "integer"),
    (["train.population=2", 'population.random=["train.gamma=0.9..0.1"]'], "LOW <= HIGH"),
    (["train.population=2", 'population.random=["train.learning_rate=0..1:log"]'], "LOW > 0"),
    (["train.population=2", 'population.random=["train.gamma=0.1-0.9"]'], "LOW..HIGH"),
    (["train.population=2", 'population.grid=["train.gamma=0.9,0.99"]',
      'population.random=["train.gamma=0.9..0.99"]'], "both vary"),
])
def test_bad_population_input_is_a_config_error_naming_it(overrides, named):
    with pytest.raises(ConfigError, match=named):
        cfg(*overrides)


def test_traced_n_equals_the_static_n():
    rng = np.random.default_rng(0)
    rewards = jnp.asarray(rng.normal(size=(12, 3)), jnp.float32)
    terminated = jnp.asarray(rng.random((12, 3)) < 0.1)
    truncated = jnp.asarray(rng.random((12, 3)) < 0.1)
    ns = jnp.arange(1, 6, dtype=jnp.int32)
    traced = jax.vmap(lambda n: n_step_targets(rewards, terminated, truncated, 0.9, n))(ns)
    for i, n in enumerate(range(1, 6)):
        static = n_step_targets(rewards, terminated, truncated, 0.9, n)
        for a, b in zip(static, traced):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b[i]), rtol=1e-6)
