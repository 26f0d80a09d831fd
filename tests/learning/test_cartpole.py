"""The agent learns gymnax CartPole-v1 through the trainer (``env.name``, configs/cartpole.yaml,
run by scripts/cartpole.py), and the script's output line; MountainCar-v0 gets a support that
fits its negative returns from ``network.support: auto``.

A short run (the config with fewer epochs, epsilon decayed over the first quarter as in the full
run) must beat a uniformly random policy (about 22 steps per episode) by a wide margin on two
seeds. The full criterion (>= 475 over 100 greedy episodes) is the full run's, whose figures are
in docs/agent.md. The env's step and the greedy episodes are checked against float64 CartPole in
tests/unit/test_gymnax_task.py.
"""

import re

import numpy as np
import pytest
from scripts_loader import load_script

# 40 epochs of 16 episodes x 80 steps: 51,200 env steps
SHORT_EPOCHS = 40
# A random policy scores ~22; 200 leaves a wide margin while still demanding a balancing policy.
MIN_SHORT_RETURN = 200.0
LINE = re.compile(r"mean_return=(-?\d+\.\d{2}) env_steps=(\d+) seconds=(\d+\.\d) "
                  r"support=\[(-?[\d.]+), (-?[\d.]+)\] edge_mass=(\d\.\d{4}|nan)")
MOUNTAIN_CAR_EPOCHS = 6


@pytest.fixture(scope="module")
def cartpole():
    return load_script("cartpole")


def random_return(rng) -> float:
    """Mean steps survived by a uniformly random policy on float64 CartPole-v1."""
    g, mc, mp, length, f, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    steps = []
    for _ in range(200):
        x, x_dot, th, th_dot = rng.uniform(-0.05, 0.05, 4)
        for t in range(1, 501):
            force = f if rng.integers(2) else -f
            temp = (force + mp * length * th_dot ** 2 * np.sin(th)) / (mc + mp)
            th_acc = (g * np.sin(th) - np.cos(th) * temp) / (
                length * (4.0 / 3.0 - mp * np.cos(th) ** 2 / (mc + mp)))
            x_acc = temp - mp * length * th_acc * np.cos(th) / (mc + mp)
            x, x_dot, th, th_dot = (x + tau * x_dot, x_dot + tau * x_acc, th + tau * th_dot,
                                    th_dot + tau * th_acc)
            if abs(x) > 2.4 or abs(th) > 12 * 2 * np.pi / 360:
                break
        steps.append(t)
    return float(np.mean(steps))


def test_main_prints_the_line_and_short_runs_learn(cartpole, capsys):
    baseline = random_return(np.random.default_rng(1))
    assert 15.0 < baseline < 30.0, baseline
    assert cartpole.main(["--epochs", str(SHORT_EPOCHS), "--seed", "0"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    match = LINE.fullmatch(out[-1])
    assert match is not None, out
    scores = {0: float(match.group(1))}
    steps = SHORT_EPOCHS * 16 * 80
    assert int(match.group(2)) == steps and float(match.group(3)) > 0
    # auto: CartPole's reward 1 a step at gamma 0.98 gives [0, 1 / (1 - 0.98)]
    assert (float(match.group(4)), float(match.group(5))) == (0.0, 50.0)
    assert float(match.group(6)) < 0.05
    result = cartpole.run(SHORT_EPOCHS, seed=1)
    assert result["env_steps"] == steps
    assert cartpole.format_result(result) == (
        f"mean_return={result['mean_return']:.2f} env_steps={steps} "
        f"seconds={result['seconds']:.1f} support=[0, 50] "
        f"edge_mass={result['edge_mass']:.4f}")
    scores[1] = result["mean_return"]
    for seed, score in scores.items():
        assert 0.0 <= score <= 500.0, (seed, score)
        assert score >= MIN_SHORT_RETURN > 5 * baseline, (seed, score, baseline)


def test_mountain_car_gets_a_support_that_fits_its_negative_returns(cartpole, capsys):
    """MountainCar-v0 pays -1 a step: auto derives [-50, 0] (gamma 0.98, no hand-set range),
    which holds every discounted return, and a short run's targets stay on it
    (tests/unit/test_learner.py checks that a support off the returns warns)."""
    assert cartpole.main(["--env", "MountainCar-v0", "--epochs", str(MOUNTAIN_CAR_EPOCHS)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    match = LINE.fullmatch(out[-1])
    assert match is not None, out
    v_min, v_max, edge = (float(match.group(i)) for i in (4, 5, 6))
    assert (v_min, v_max) == (-50.0, 0.0)
    assert -200.0 <= float(match.group(1)) <= 0.0
    assert edge < 0.05 and len(out) == 1  # no warning line
