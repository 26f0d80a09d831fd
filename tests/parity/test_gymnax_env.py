"""The trading env as a gymnax Environment: the same numbers as the trading module, gymnax's
wrappers, vmap/scan, a PureJaxRL-style rollout, the spaces, and the docs' example."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnax.environments import spaces
from gymnax.wrappers import FlattenObservationWrapper, LegacyStepAPIWrapper, LogWrapper
from gymnax.wrappers import StickyActionWrapper

from foxhunt_jax.config import EnvConfig, SyntheticConfig
from foxhunt_jax.data.features import build_tables
from foxhunt_jax.data.synthetic import make_synthetic
from foxhunt_jax.env import trading
from foxhunt_jax.env.gymnax_env import FlatActionWrapper, TradingEnv
from foxhunt_jax.errors import ConfigError

L = 12
# ruin at a 3% loss, volatile bars and all-in exposures: ruin and truncation both happen often
RUINOUS = EnvConfig(episode_length=L, exposures=(-1.0, 0.0, 1.0), ruin_floor=0.97,
                    time_barrier=4, cost_bps=10.0, slippage_bps=2.0)
CONFIGS = {
    "default": EnvConfig(episode_length=L),
    "ruinous": RUINOUS,
    "one_branch_close_fill": EnvConfig(episode_length=L, take_profit=(), stop_loss=(),
                                       fill="close", ruin_floor=0.97),
}


@pytest.fixture(scope="module")
def tables():
    market = make_synthetic(SyntheticConfig(instruments=2, bars=400, volatility=0.03, seed=5))
    return build_tables(market, episode_length=L)


def random_tuple_actions(key, sizes, shape):
    keys = jax.random.split(key, len(sizes))
    return tuple(jax.random.randint(k, shape, 0, n, jnp.int32) for k, n in zip(keys, sizes))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reset_and_step_equal_the_trading_module(tables, name):
    """Many auto-resetting steps of N envs: the gymnax env and trading.reset/trading.step (with
    the reset key gymnax's step uses) give bit-equal obs, states, rewards, flags and info."""
    env, params = TradingEnv.from_market(tables, CONFIGS[name], "train")
    n_envs, n_steps = 16, 60
    key_reset, key_run = jax.random.split(jax.random.key(11))
    reset_keys = jax.random.split(key_reset, n_envs)

    @jax.jit
    def both(params):
        g_obs, g_state = jax.vmap(env.reset, in_axes=(0, None))(reset_keys, params)
        t_obs, t_state = jax.vmap(trading.reset, in_axes=(0, None))(reset_keys, params)

        def body(carry, key):
            g_state, t_state = carry
            k_act, k_step = jax.random.split(key)
            action = random_tuple_actions(k_act, env.branch_sizes, (n_envs,))
            step_keys = jax.random.split(k_step, n_envs)
            g = jax.vmap(env.step, in_axes=(0, 0, 0, None))(step_keys, g_state, action, params)
            reset_keys = jax.vmap(lambda k: jax.random.split(k)[1])(step_keys)
            a = jnp.stack(action, axis=-1)
            t = jax.vmap(trading.step, in_axes=(0, 0, 0, None))(reset_keys, t_state, a, params)
            final_obs = jax.vmap(trading.step_env, in_axes=(0, 0, 0, None))(
                step_keys, t_state, a, params)[0]
            return (g[1], t[1]), (g, t, final_obs)

        _, out = jax.lax.scan(body, (g_state, t_state), jax.random.split(key_run, n_steps))
        return (g_obs, t_obs), *out

    (g_obs0, t_obs0), g, t, final_obs = both(params)
    np.testing.assert_array_equal(g_obs0, t_obs0)
    g_obs, g_state, g_rew, g_term, g_trunc, g_info = g
    t_obs, t_state, t_rew, t_term, t_trunc, t_info = t
    np.testing.assert_array_equal(g_obs, t_obs)
    for a, b in zip(jax.tree.leaves(g_state), jax.tree.leaves(t_state)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(g_rew, t_rew)
    np.testing.assert_array_equal(g_term, t_term)
    np.testing.assert_array_equal(g_trunc, t_trunc)
    for k, v in t_info.items():
        np.testing.assert_array_equal(g_info[k], v, err_msg=k)
    np.testing.assert_array_equal(g_info["discount"], 1.0 - t_term.astype(np.float32))
    # the episodes really ended, by the step limit and (where the config allows it) by ruin
    assert np.asarray(t_trunc).sum() >= n_envs
    if name == "ruinous":
        assert np.asarray(t_term).sum() > 0
    # gymnax's final_observation is the observation before the auto-reset
    np.testing.assert_array_equal(g_info["final_observation"], final_obs)


def test_info_exposure_is_the_chosen_exposure(tables):
    env, params = TradingEnv.from_market(tables, RUINOUS, "validation")
    _, state = env.reset(jax.random.key(0), params)
    for a0, expected in enumerate(RUINOUS.exposures):
        _, _, _, _, _, info = env.step(jax.random.key(1), state, (a0, 1, 2), params)
        assert float(info["exposure"]) == expected
    with pytest.raises(ValueError, match="3 branches"):
        env.step(jax.random.key(1), state, (0, 1), params)


def test_gymnax_wrappers_vmap_and_scan(tables):
    """LogWrapper over FlattenObservationWrapper over StickyActionWrapper over the flat-action
    env, vmapped over envs and scanned over steps: LogWrapper's episode returns are the sums of
    the rewards of each finished episode."""
    base, params = TradingEnv.from_market(tables, RUINOUS, "train")
    env = LogWrapper(FlattenObservationWrapper(StickyActionWrapper(FlatActionWrapper(base),
                                                                   sticky_action_prob=0.25)))
    n_envs, n_steps = 8, 50

    @jax.jit
    def run(key):
        k0, k1 = jax.random.split(key)
        obs, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(k0, n_envs), params)

        def body(state, key):
            k_act, k_step = jax.random.split(key)
            action = jax.random.randint(k_act, (n_envs,), 0, env.num_actions)
            obs, state, reward, term, trunc, info = jax.vmap(
                env.step, in_axes=(0, 0, 0, None))(jax.random.split(k_step, n_envs), state,
                                                   action, params)
            return state, (obs, reward, term | trunc, info)

        return obs, jax.lax.scan(body, state, jax.random.split(k1, n_steps))[1]

    obs0, (obs, reward, done, info) = run(jax.random.key(3))
    assert obs0.shape == (n_envs, trading.obs_dim(params)) and obs.shape == (n_steps, n_envs,
                                                                             obs0.shape[1])
    reward, done = np.asarray(reward, np.float64), np.asarray(done)
    returned = np.asarray(info["returned_episode_returns"])
    checked = 0
    for e in range(n_envs):
        total = 0.0
        for s in range(n_steps):
            total += reward[s, e]
            if done[s, e]:
                np.testing.assert_allclose(returned[s, e], total, rtol=1e-5, atol=1e-4)
                total, checked = 0.0, checked + 1
    assert checked >= n_envs
    np.testing.assert_array_equal(np.asarray(info["returned_episode"]), done)


def flat_policy(weights, obs, key):
    """A linear softmax policy over the flat actions: obs [N, D] -> actions [N]."""
    return jax.random.categorical(key, obs @ weights)


def branch_policy(weights, obs, key):
    """The same policy over each branch: obs [N, D] -> a tuple of per-branch actions [N]."""
    keys = jax.random.split(key, len(weights))
    return tuple(jax.random.categorical(k, obs @ w) for k, w in zip(keys, weights))


def discounted_returns(reward, done, gamma):
    """reward, done [T, N] -> returns [T, N] that restart after every finished episode (the
    tail of the last unfinished episode counts from 0, as a rollout without bootstrap does)."""
    def back(next_return, x):
        r, d = x
        ret = r + gamma * next_return * (1.0 - d)
        return ret, ret

    return jax.lax.scan(back, jnp.zeros(reward.shape[1]), (reward, done), reverse=True)[1]


def make_rollout(env, policy, n_envs, n_steps, gamma=0.99):
    """A PureJaxRL-style rollout: vmapped env, scanned steps, the five-value step API."""
    env = LegacyStepAPIWrapper(LogWrapper(env))

    def rollout(weights, params, key):
        k0, k1 = jax.random.split(key)
        obs, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(k0, n_envs), params)

        def env_step(carry, key):
            obs, state = carry
            k_act, k_step = jax.random.split(key)
            action = policy(weights, obs, k_act)
            next_obs, state, reward, done, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(k_step, n_envs), state, action, params)
            return (next_obs, state), {"obs": obs, "action": action, "reward": reward,
                                       "done": done, "episode_return":
                                           info["returned_episode_returns"]}

        _, batch = jax.lax.scan(env_step, (obs, state), jax.random.split(k1, n_steps))
        batch["return"] = discounted_returns(batch["reward"], batch["done"].astype(jnp.float32),
                                             gamma)
        return batch

    return jax.jit(rollout)


def numpy_returns(reward, done, gamma):
    out = np.zeros_like(reward, np.float64)
    nxt = np.zeros(reward.shape[1])
    for s in range(reward.shape[0] - 1, -1, -1):
        nxt = reward[s] + gamma * nxt * (1.0 - done[s])
        out[s] = nxt
    return out


@pytest.mark.parametrize("flat", [True, False], ids=["flat_action", "tuple_action"])
def test_purejaxrl_style_rollout(tables, flat):
    base, params = TradingEnv.from_market(tables, EnvConfig(episode_length=L), "train")
    d = trading.obs_dim(params)
    key = jax.random.key(7)
    if flat:
        env = FlatActionWrapper(base)
        weights = 0.1 * jax.random.normal(key, (d, env.num_actions))
        policy = flat_policy
    else:
        env = base
        weights = [0.1 * jax.random.normal(k, (d, n))
                   for k, n in zip(jax.random.split(key, 3), base.branch_sizes)]
        policy = branch_policy
    n_envs, n_steps, gamma = 6, 40, 0.9
    batch = make_rollout(env, policy, n_envs, n_steps, gamma)(weights, params, jax.random.key(2))
    assert batch["obs"].shape == (n_steps, n_envs, d)
    reward, done = np.asarray(batch["reward"], np.float64), np.asarray(batch["done"])
    assert np.isfinite(reward).all() and done.sum() >= n_envs
    np.testing.assert_allclose(batch["return"], numpy_returns(reward, done, gamma), rtol=1e-4,
                               atol=1e-4)
    space = env.action_space(params)
    actions = batch["action"]
    assert bool(jax.jit(jax.vmap(jax.vmap(space.contains)))(actions).all())
    # the policy is stochastic over the whole action set, not stuck on one action
    first = actions if flat else actions[0]
    assert len(np.unique(np.asarray(first))) > 1


@pytest.mark.parametrize("name", ["default", "one_branch_close_fill"])
def test_spaces(tables, name):
    env, params = TradingEnv.from_market(tables, CONFIGS[name], "test")
    cfg = CONFIGS[name]
    obs_space = env.observation_space(params)
    assert isinstance(obs_space, spaces.Box) and obs_space.shape == (trading.obs_dim(params),)
    space = env.action_space(params)
    assert isinstance(space, spaces.Tuple)
    assert tuple(s.n for s in space.spaces) == cfg.branch_sizes == env.branch_sizes
    assert env.num_actions == int(np.prod(cfg.branch_sizes))

    @jax.jit
    def run(key):
        """Random episodes driven by action_space.sample: (actions, their validity, the
        observations and theirs)."""
        def body(carry, key):
            obs, state = carry
            k_act, k_step = jax.random.split(key)
            action = space.sample(k_act)
            obs, state, *_ = env.step(k_step, state, action, params)
            return (obs, state), (action, space.contains(action), obs, obs_space.contains(obs))

        def episode(key):
            return jax.lax.scan(body, env.reset(key, params), jax.random.split(key, 50))[1]

        return jax.vmap(episode)(jax.random.split(key, 8))

    actions, actions_valid, obs, obs_valid = run(jax.random.key(5))
    assert bool(jnp.all(actions_valid)) and bool(jnp.all(obs_valid))
    for a, n in zip(actions, cfg.branch_sizes):  # every value of every branch is drawn
        assert sorted(np.unique(np.asarray(a))) == list(range(n))
    assert not bool(space.contains(tuple(jnp.int32(n) for n in cfg.branch_sizes)))
    assert not bool(obs_space.contains(jnp.full(obs_space.shape, 11.0)))


def test_flat_action_wrapper_is_a_bijection(tables):
    env, params = TradingEnv.from_market(tables, EnvConfig(episode_length=L), "train")
    flat = FlatActionWrapper(env)
    sizes = env.branch_sizes
    n = flat.num_actions
    assert n == int(np.prod(sizes)) and flat.action_space(params).n == n
    branches = np.stack([np.asarray(b) for b in flat.branch_action(jnp.arange(n))], axis=-1)
    expected = np.stack(np.unravel_index(np.arange(n), sizes), axis=-1)
    np.testing.assert_array_equal(branches, expected)
    assert len({tuple(r) for r in branches}) == n
    # a flat step is the step of its branch tuple
    _, state = env.reset(jax.random.key(0), params)
    key = jax.random.key(9)
    for i in (0, n // 2, n - 1):
        a = flat.step(key, state, jnp.int32(i), params)
        b = env.step(key, state, tuple(jnp.int32(x) for x in expected[i]), params)
        for x, y in zip(jax.tree.leaves(a[:5]), jax.tree.leaves(b[:5])):
            np.testing.assert_array_equal(x, y)


def test_flat_action_wrapper_needs_discrete_branches():
    class BoxActions:
        default_params = None

        def action_space(self, params):
            return spaces.Box(0.0, 1.0, (2,))

    with pytest.raises(ValueError, match="Tuple of Discrete"):
        FlatActionWrapper(BoxActions())


def test_from_market_checks_the_episode_length(tables):
    with pytest.raises(ConfigError, match="episode_length"):
        TradingEnv.from_market(tables, EnvConfig(episode_length=L + 1))
    with pytest.raises(ConfigError, match="unknown split"):
        TradingEnv.from_market(tables, EnvConfig(episode_length=L), "holdout")


def test_docs_example_runs():
    """The python block of docs/environment.md's gymnax section runs as written."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "environment.md").read_text()
    section = text.split("## As a gymnax environment", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/environment.md", "exec"), {})
