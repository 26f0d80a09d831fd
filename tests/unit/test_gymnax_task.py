"""A gymnax env as the trainer runs it (``env.name``): the task's step against float64
CartPole equations, its terminated/truncated split, greedy episodes against float64 episodes,
the support ``network.support: auto`` derives, the replay adapter, and the config's rules."""

from __future__ import annotations

import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.agent.learner import init_agent, make_learner
from foxhunt_jax.agent.network import greedy_actions
from foxhunt_jax.agent.value_range import gymnax_range, observed_rewards, resolve_gymnax
from foxhunt_jax.backend import make
from foxhunt_jax.config import load_config
from foxhunt_jax.env.gymnax_task import make_task
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.training.collect import gymnax_adapter
from foxhunt_jax.training.phases import greedy_episodes, observation_width
from pallas_kernels.tuning import for_device


@pytest.fixture(scope="module")
def cartpole():
    return make_task("CartPole-v1")


def reference_step(s: np.ndarray, action: int) -> np.ndarray:
    """One CartPole-v1 Euler step in float64: ``[x, x_dot, theta, theta_dot]`` -> the next."""
    g, mc, mp, length, f, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    x, x_dot, th, th_dot = s
    temp = ((f if action else -f) + mp * length * th_dot ** 2 * np.sin(th)) / (mc + mp)
    th_acc = (g * np.sin(th) - np.cos(th) * temp) / (
        length * (4.0 / 3.0 - mp * np.cos(th) ** 2 / (mc + mp)))
    x_acc = temp - mp * length * th_acc * np.cos(th) / (mc + mp)
    return np.array([x + tau * x_dot, x_dot + tau * x_acc, th + tau * th_dot,
                     th_dot + tau * th_acc])


def reference_return(s: np.ndarray, policy) -> int:
    """Steps survived (the undiscounted return) from state ``s`` under ``policy(s) -> 0 | 1``."""
    for t in range(1, 501):
        s = reference_step(s, policy(s))
        if abs(s[0]) > 2.4 or abs(s[2]) > 12 * 2 * np.pi / 360:
            return t
    return 500


def test_step_matches_float64_cartpole_and_splits_termination_from_the_time_limit(cartpole):
    params = cartpole.params
    assert (cartpole.obs_dim, cartpole.num_actions, cartpole.max_steps) == (4, 2, 500)
    obs, state = cartpole.reset(jax.random.PRNGKey(3), params)
    rng = np.random.default_rng(0)
    ref = np.asarray(obs, np.float64)
    for _ in range(5):
        a = int(rng.integers(2))
        obs, state, reward, term, trunc, _ = cartpole.step_env(
            jax.random.PRNGKey(0), state, jnp.array([a], jnp.int32), params)
        ref = reference_step(ref, a)
        chex.assert_shape(obs, (4,))
        np.testing.assert_allclose(np.asarray(obs, np.float64), ref, rtol=1e-5, atol=1e-6)
        assert float(reward) == 1.0 and not bool(term) and not bool(trunc)
    # the last allowed step truncates (bootstrap), a fallen pole terminates, never both
    at_limit = dict(state, time=params.max_steps_in_episode - 1)
    *_, term, trunc, _ = cartpole.step_env(jax.random.PRNGKey(0), at_limit,
                                           jnp.array([0], jnp.int32), params)
    assert (bool(term), bool(trunc)) == (False, True)
    fallen = dict(at_limit, theta=jnp.float32(0.5))
    *_, term, trunc, _ = cartpole.step_env(jax.random.PRNGKey(0), fallen,
                                           jnp.array([0], jnp.int32), params)
    assert (bool(term), bool(trunc)) == (True, False)


def test_mountain_car_reaching_the_goal_terminates():
    task = make_task("MountainCar-v0")
    _, state = task.reset(jax.random.PRNGKey(0), task.params)
    at_goal = dict(state, position=jnp.float32(0.6), velocity=jnp.float32(0.05))
    *_, reward, term, trunc, _ = task.step_env(jax.random.PRNGKey(0), at_goal,
                                               jnp.array([2], jnp.int32), task.params)
    assert (float(reward), bool(term), bool(trunc)) == (-1.0, True, False)


def test_the_adapter_stores_whole_observations(cartpole):
    adapter = gymnax_adapter(cartpole)
    obs, state = adapter.reset(jax.random.PRNGKey(1), cartpole.params)
    enc = adapter.encode(obs, state)
    np.testing.assert_array_equal(np.asarray(enc), np.asarray(obs))
    batch = jnp.stack([obs, 2 * obs])
    np.testing.assert_array_equal(np.asarray(adapter.decode(batch, cartpole.params)),
                                  np.asarray(batch))
    assert observation_width(adapter, cartpole.params) == 4
    assert adapter.max_episode_steps(cartpole.params) == 500


def test_greedy_episodes_count_steps_like_the_float64_reference(cartpole):
    """A network that always prefers action 0 (push left): its episodes' returns and lengths
    against float64 episodes from the same initial states."""
    cfg = load_config("cartpole")
    learner = make_learner(cfg, (2,))
    params = init_agent(jax.random.PRNGKey(0), learner, 4).params
    k = cfg.network.atoms
    out = params["params"]["adv0_out"]
    # inputs are ignored; action 0 puts its mass on high atoms, action 1 on low ones
    bias = jnp.concatenate([jnp.linspace(-5.0, 5.0, k), jnp.linspace(5.0, -5.0, k)])
    params["params"]["adv0_out"] = {"kernel": jnp.zeros_like(out["kernel"]), "bias": bias}
    adapter, backend = gymnax_adapter(cartpole), make("xla", for_device(None))
    keys = jax.random.split(jax.random.PRNGKey(11), 20)
    got = jax.jit(lambda p, kk: greedy_episodes(learner, backend, cartpole.params, kk, p,
                                                adapter))(params, keys)
    obs, _ = jax.vmap(cartpole.reset, in_axes=(0, None))(keys, cartpole.params)
    acts = greedy_actions(learner.network.apply(params, obs), learner.support)
    np.testing.assert_array_equal(np.asarray(acts), np.zeros((20, 1)))
    want = [reference_return(np.asarray(o, np.float64), lambda s: 0) for o in obs]
    assert 5 < np.mean(want) < 20  # pushing one way only fails fast
    np.testing.assert_array_equal(np.asarray(got["return"]), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(got["length"]), want)


def test_auto_support_from_a_random_policys_rewards(cartpole):
    """Reward 1 a step at gamma 0.98 gives [0, 50]; MountainCar's -1 gives [-50, 0]."""
    key = jax.random.PRNGKey(0)
    mountain = make_task("MountainCar-v0")
    assert set(np.unique(np.asarray(observed_rewards(mountain, key)))) == {-1.0}
    assert gymnax_range(cartpole, 0.98, key) == pytest.approx((0.0, 50.0), abs=1e-9)
    assert gymnax_range(mountain, 0.98, key) == pytest.approx((-50.0, 0.0), abs=1e-9)
    cfg = resolve_gymnax(load_config("cartpole"), cartpole)
    assert (cfg.network.support, cfg.network.v_min, cfg.network.v_max) == ("explicit", 0.0, 50.0)
    explicit = load_config("cartpole", ["network.support=explicit", "network.v_min=-3",
                                        "network.v_max=7"])
    assert resolve_gymnax(explicit, cartpole) is explicit


def test_unknown_ids_and_a_missing_gymnax_are_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="env.name.*'CartPole-v9'.*CartPole-v1"):
        make_task("CartPole-v9")
    with pytest.raises(ConfigError, match="no discrete action set"):
        make_task("Pendulum-v1")
    monkeypatch.setitem(sys.modules, "gymnax", None)  # import gymnax now raises ImportError
    with pytest.raises(ConfigError, match=r"optional gymnax package.*foxhunt-jax\[gymnax\]"):
        make_task("CartPole-v1")


def test_config_rules_of_env_name():
    assert load_config(None).env.name == "trading"
    assert load_config("cartpole").env.name == "CartPole-v1"
    with pytest.raises(ConfigError, match="train.select_by.*must be return for a gymnax env"):
        load_config(None, ["env.name=CartPole-v1"])
    with pytest.raises(ConfigError, match="train.select_by.*must be sharpe, total_return or loss"):
        load_config(None, ["train.select_by=return"])
    with pytest.raises(ConfigError, match="network.backend.*trading env's kernels only"):
        load_config("cartpole", ["network.backend=pallas", "network.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="env.name"):
        load_config(None, ["env.name= "])
