"""scripts/cartpole.py: the agent learns gymnax CartPole-v1, and the script's output line;
MountainCar-v0 gets a support that fits its negative returns from ``network.support: auto``.

A short run of the script's own training (same hyper-parameters, fewer iterations, epsilon
decayed over the first quarter as in the full run) must beat a uniformly random policy (about 22
steps per episode) by a wide margin on two seeds. The full criterion (>= 475 over 100 greedy
episodes) is the script's full run, whose figures are in docs/agent.md.
"""

import importlib.util
import re
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.agent.learner import init_agent, make_learner
from foxhunt_jax.agent.network import greedy_actions
from foxhunt_jax.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SHORT_ITERATIONS = 400
# A random policy scores ~22. 400 iterations scored 458 and 454 on seeds 0 and 1 (318-374 on
# seeds 2 and 3), so 200 leaves a wide margin while still demanding a balancing policy.
MIN_SHORT_RETURN = 200.0
LINE = re.compile(r"mean_return=(-?\d+\.\d{2}) env_steps=(\d+) seconds=(\d+\.\d) "
                  r"support=\[(-?[\d.]+), (-?[\d.]+)\] edge_mass=(\d\.\d{4}|nan)")
MOUNTAIN_CAR_ITERATIONS = 60


def _load_script():
    path = ROOT / "scripts" / "cartpole.py"
    spec = importlib.util.spec_from_file_location("cartpole_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cartpole():
    return _load_script()


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


def test_env_adapter_matches_float64_cartpole_and_flags(cartpole):
    """The adapter's step against the float64 equations; termination vs the 500-step truncation."""
    params = cartpole.ENV_PARAMS
    obs, state = cartpole._reset(jax.random.PRNGKey(3), params)
    rng = np.random.default_rng(0)
    ref = np.asarray(obs, np.float64)
    for _ in range(5):
        a = int(rng.integers(2))
        obs, state, reward, term, trunc, _ = cartpole._step_env(
            jax.random.PRNGKey(0), state, jnp.array([a], jnp.int32), params)
        ref = reference_step(ref, a)
        chex.assert_shape(obs, (4,))
        np.testing.assert_allclose(np.asarray(obs, np.float64), ref, rtol=1e-5, atol=1e-6)
        assert float(reward) == 1.0 and not bool(term) and not bool(trunc)
    # the last allowed step truncates (bootstrap), a fallen pole terminates, never both
    at_limit = state.replace(time=params.max_steps_in_episode - 1)
    *_, term, trunc, _ = cartpole._step_env(jax.random.PRNGKey(0), at_limit,
                                            jnp.array([0], jnp.int32), params)
    assert (bool(term), bool(trunc)) == (False, True)
    fallen = at_limit.replace(theta=jnp.float32(0.5))
    *_, term, trunc, _ = cartpole._step_env(jax.random.PRNGKey(0), fallen,
                                            jnp.array([0], jnp.int32), params)
    assert (bool(term), bool(trunc)) == (True, False)


def test_greedy_score_counts_steps_like_the_float64_reference(cartpole):
    """A network that always prefers action 0 (push left): its score against float64 episodes
    from the same initial states."""
    cfg = load_config(None, cartpole.OVERRIDES)
    learner = make_learner(cfg, (2,))
    params = init_agent(jax.random.PRNGKey(0), learner, 4).params
    k = cfg.network.atoms
    out = params["params"]["adv0_out"]
    # inputs are ignored; action 0 puts its mass on high atoms, action 1 on low ones
    bias = jnp.concatenate([jnp.linspace(-5.0, 5.0, k), jnp.linspace(5.0, -5.0, k)])
    params["params"]["adv0_out"] = {"kernel": jnp.zeros_like(out["kernel"]), "bias": bias}
    key, episodes = jax.random.PRNGKey(11), 20
    got = float(jax.jit(lambda p, kk: cartpole.greedy_score(learner, p, kk, episodes))(params, key))
    obs, _ = jax.vmap(cartpole._reset, in_axes=(0, None))(jax.random.split(key, episodes),
                                                           cartpole.ENV_PARAMS)
    acts = greedy_actions(learner.network.apply(params, obs), learner.support)
    chex.assert_type(acts, jnp.int32)
    np.testing.assert_array_equal(np.asarray(acts), np.zeros((episodes, 1)))
    want = [reference_return(np.asarray(o, np.float64), lambda s: 0) for o in obs]
    assert 5 < np.mean(want) < 20  # pushing one way only fails fast
    np.testing.assert_allclose(got, np.mean(want), atol=1.0 / episodes)


def test_main_prints_the_line_and_short_runs_learn(cartpole, capsys):
    rng = np.random.default_rng(1)
    random_return = np.mean([reference_return(rng.uniform(-0.05, 0.05, 4),
                                              lambda s: int(rng.integers(2))) for _ in range(200)])
    assert 15.0 < random_return < 30.0, random_return
    cartpole.main(["--iterations", str(SHORT_ITERATIONS), "--seed", "0"])
    out = capsys.readouterr().out.strip().splitlines()
    match = LINE.fullmatch(out[-1])
    assert match is not None, out
    scores = {0: float(match.group(1))}
    steps = SHORT_ITERATIONS * cartpole.NUM_ENVS * cartpole.STEPS_PER_ITER
    assert int(match.group(2)) == steps and float(match.group(3)) > 0
    # auto: CartPole's reward 1 a step at gamma 0.98 gives [0, 1 / (1 - 0.98)]
    assert (float(match.group(4)), float(match.group(5))) == (0.0, 50.0)
    assert float(match.group(6)) < 0.05
    result = cartpole.run(SHORT_ITERATIONS, seed=1)
    assert result["env_steps"] == steps
    assert cartpole.format_result(result) == (
        f"mean_return={result['mean_return']:.2f} env_steps={steps} "
        f"seconds={result['seconds']:.1f} support=[0, 50] "
        f"edge_mass={result['edge_mass']:.4f}")
    scores[1] = result["mean_return"]
    for seed, score in scores.items():
        assert 0.0 <= score <= 500.0, (seed, score)
        assert score >= MIN_SHORT_RETURN > 5 * random_return, (seed, score, random_return)


def test_mountain_car_gets_a_support_that_fits_its_negative_returns(cartpole, capsys):
    """MountainCar-v0 pays -1 a step: auto derives [-50, 0] from a random rollout (gamma 0.98,
    no hand-set range), which holds every discounted return, and a short run's targets stay on
    it (tests/test_learner.py checks that a support off the returns warns)."""
    task = cartpole.TASKS["MountainCar-v0"]
    rewards = np.asarray(cartpole.observed_rewards(task, jax.random.PRNGKey(0)))
    assert set(np.unique(rewards)) == {-1.0}
    cartpole.main(["--env", "MountainCar-v0", "--iterations", str(MOUNTAIN_CAR_ITERATIONS)])
    out = capsys.readouterr().out.strip().splitlines()
    match = LINE.fullmatch(out[-1])
    assert match is not None, out
    v_min, v_max, edge = (float(match.group(i)) for i in (4, 5, 6))
    assert (v_min, v_max) == (-50.0, 0.0)
    assert -200.0 <= float(match.group(1)) <= 0.0
    assert edge < 0.05 and len(out) == 1  # no warning line
