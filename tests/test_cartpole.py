"""scripts/cartpole.py: the agent learns gymnax CartPole-v1, and the script's output line.

A short run of the script's own training (same hyper-parameters, fewer iterations, epsilon
decayed over the first half as in the full run) must beat a uniformly random policy (about 22
steps per episode) by a wide margin on two seeds. The full criterion (>= 475 over 100 greedy
episodes) is the script's full run, whose figures are in docs/agent.md.
"""

import importlib.util
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SHORT_ITERATIONS = 400
MIN_SHORT_RETURN = 150.0  # a random policy scores ~22; short runs on seeds 0 and 1 score well above
LINE = re.compile(r"mean_return=(\d+\.\d{2}) env_steps=(\d+) seconds=(\d+\.\d)")


def _load_script():
    spec = importlib.util.spec_from_file_location("cartpole_script", ROOT / "scripts" / "cartpole.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cartpole():
    return _load_script()


def reference_random_return(episodes: int, seed: int) -> float:
    """Mean return of uniformly random actions, from the CartPole equations in float64 NumPy."""
    rng = np.random.default_rng(seed)
    g, mc, mp, length, f, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    total_mass, pml = mc + mp, mp * length
    theta_max, x_max = 12 * 2 * np.pi / 360, 2.4
    returns = []
    for _ in range(episodes):
        x, x_dot, th, th_dot = rng.uniform(-0.05, 0.05, 4)
        steps = 0
        while steps < 500:
            force = f if rng.integers(2) else -f
            temp = (force + pml * th_dot ** 2 * np.sin(th)) / total_mass
            th_acc = (g * np.sin(th) - np.cos(th) * temp) / (
                length * (4.0 / 3.0 - mp * np.cos(th) ** 2 / total_mass))
            x_acc = temp - pml * th_acc * np.cos(th) / total_mass
            x, x_dot = x + tau * x_dot, x_dot + tau * x_acc
            th, th_dot = th + tau * th_dot, th_dot + tau * th_acc
            steps += 1
            if abs(x) > x_max or abs(th) > theta_max:
                break
        returns.append(steps)
    return float(np.mean(returns))


def test_env_adapter_matches_float64_cartpole_and_flags(cartpole):
    """The adapter's step against the float64 equations; termination vs the 500-step truncation."""
    params = cartpole.ENV_PARAMS
    obs, state = cartpole._reset(jax.random.PRNGKey(3), params)
    rng = np.random.default_rng(0)
    ref = np.asarray(obs, np.float64)
    g, mc, mp, length, f, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    for _ in range(5):
        a = int(rng.integers(2))
        obs, state, reward, term, trunc, _ = cartpole._step_env(
            jax.random.PRNGKey(0), state, jnp.array([a], jnp.int32), params)
        x, x_dot, th, th_dot = ref
        temp = ((f if a else -f) + mp * length * th_dot ** 2 * np.sin(th)) / (mc + mp)
        th_acc = (g * np.sin(th) - np.cos(th) * temp) / (
            length * (4.0 / 3.0 - mp * np.cos(th) ** 2 / (mc + mp)))
        x_acc = temp - mp * length * th_acc * np.cos(th) / (mc + mp)
        ref = np.array([x + tau * x_dot, x_dot + tau * x_acc, th + tau * th_dot,
                        th_dot + tau * th_acc])
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


def test_main_prints_the_line_and_short_runs_learn(cartpole, capsys):
    random_return = reference_random_return(200, seed=1)
    assert 15.0 < random_return < 30.0, random_return
    cartpole.main(["--iterations", str(SHORT_ITERATIONS), "--seed", "0"])
    out = capsys.readouterr().out.strip().splitlines()
    match = LINE.fullmatch(out[-1])
    assert match is not None, out
    scores = {0: float(match.group(1))}
    steps = SHORT_ITERATIONS * cartpole.NUM_ENVS * cartpole.STEPS_PER_ITER
    assert int(match.group(2)) == steps and float(match.group(3)) > 0
    result = cartpole.run(SHORT_ITERATIONS, seed=1)
    assert result["env_steps"] == steps
    assert cartpole.format_result(result) == (
        f"mean_return={result['mean_return']:.2f} env_steps={steps} "
        f"seconds={result['seconds']:.1f}")
    scores[1] = result["mean_return"]
    for seed, score in scores.items():
        assert 0.0 <= score <= 500.0, (seed, score)
        assert score >= MIN_SHORT_RETURN > 5 * random_return, (seed, score, random_return)
