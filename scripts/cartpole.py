"""The foxhunt-jax agent on environments nobody here wrote: gymnax CartPole-v1 (the default)
and MountainCar-v0, trained by the library's ``train`` with ``configs/cartpole.yaml``.

The same as ``foxhunt-jax train --config cartpole --set env.name=ENV --set train.seed=S``
(docs/agent.md, "Any gymnax environment"); ``--epochs`` shortens the run and decays epsilon over
its first quarter, as the full run does. Ends by printing one line:

    mean_return=<float> env_steps=<int> seconds=<float> support=[<v_min>, <v_max>] edge_mass=<float>

(``mean_return``: the final report's 100 greedy episodes of the agent selected on validation;
``seconds``: wall time of ``train``, compilation included; ``edge_mass``: the learner's
``support_edge_mass`` over the last tenth of the epochs; above 5% the run prints a warning line
first.)

Usage: python scripts/cartpole.py [--env CartPole-v1|MountainCar-v0] [--epochs N] [--seed S]
                                  [--set KEY=VALUE ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from foxhunt_jax.api import train
from foxhunt_jax.config import load_config
from foxhunt_jax.errors import FoxhuntError

CONFIG = "cartpole"
ENVS = ("CartPole-v1", "MountainCar-v0")
EPSILON_DECAY_FRACTION = 0.25  # epsilon reaches epsilon_end after this fraction of the epochs


def run(epochs: int | None = None, seed: int = 0, env: str = "CartPole-v1",
        overrides: tuple[str, ...] = (), out_dir: str | None = None) -> dict:
    """Trains ``configs/cartpole.yaml`` on ``env`` (``epochs``: None keeps the config's) and
    returns ``{"mean_return", "env_steps", "seconds", "support": (v_min, v_max),
    "edge_mass"}``; ``overrides`` are config settings applied last."""
    settings = [f"env.name={env}", f"train.seed={seed}"]
    if epochs is not None:
        decay = max(int(epochs * EPSILON_DECAY_FRACTION), 1)
        settings += [f"train.epochs={epochs}", f"train.epsilon_decay_epochs={decay}"]
    cfg = load_config(CONFIG, settings + list(overrides))
    start = time.perf_counter()
    result = train(cfg, out_dir, progress=False, log=_warnings_only)
    seconds = time.perf_counter() - start
    edge = [rec["support_edge_mass"] for rec in result.history]
    network = result.trainer.cfg.network  # the support network.support auto derived
    return {"mean_return": result.summary["final"]["mean_return"],
            "env_steps": result.history[-1]["env_steps"], "seconds": seconds,
            "support": (network.v_min, network.v_max),
            "edge_mass": float(np.mean(edge[-max(len(edge) // 10, 1):]))}


def _warnings_only(line: str) -> None:
    if line.startswith("warning:"):
        print(line, flush=True)


def format_result(result: dict) -> str:
    """The script's one output line from :func:`run`'s result."""
    v_min, v_max = result["support"]
    return (f"mean_return={result['mean_return']:.2f} env_steps={result['env_steps']} "
            f"seconds={result['seconds']:.1f} support=[{v_min:g}, {v_max:g}] "
            f"edge_mass={result['edge_mass']:.4f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", choices=ENVS, default="CartPole-v1")
    ap.add_argument("--epochs", type=int, default=None,
                    help="epochs to train (default: the config's train.epochs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config setting applied last (repeatable)")
    ap.add_argument("--out", default=None, help="write the run folder here (default: none)")
    a = ap.parse_args(argv)
    if a.epochs is not None and a.epochs < 1:
        ap.error(f"--epochs must be >= 1, got {a.epochs}")
    try:
        result = run(a.epochs, a.seed, a.env, tuple(a.overrides), a.out)
    except FoxhuntError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_result(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
