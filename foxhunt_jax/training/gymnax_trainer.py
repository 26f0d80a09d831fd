"""The trainer on a gymnax environment (``env.name: CartPole-v1`` and the like).

The same phases, pipeline, learner, replay and collector as the trading trainer
(:class:`~foxhunt_jax.training.trainer.Trainer`, whose methods it inherits); what differs is the
env adapter (:func:`~foxhunt_jax.training.collect.gymnax_adapter`: observations stored whole,
one action branch of the env's ``num_actions``), the support (``network.support: auto`` from a
random policy's rewards, :func:`~foxhunt_jax.agent.value_range.resolve_gymnax`), the backend
(always ``xla``: the Pallas kernels are the trading env's, :func:`~foxhunt_jax.backend.resolve`)
and Validation: ``train.validation_windows`` greedy episodes from fixed resets, each up to the
env's step limit (:func:`~foxhunt_jax.training.phases.episode_validation`), recorded as
``val/return`` (their mean), ``val/return_min``, ``val/return_max`` and ``val/length``.
There is no market, table, baseline or validation loss.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import jax
import numpy as np

from foxhunt_jax import parallel
from foxhunt_jax.agent.learner import AgentState, make_learner, schedule_values
from foxhunt_jax.agent.value_range import resolve_gymnax
from foxhunt_jax.backend import resolve, resolve_config
from foxhunt_jax.config import Config
from foxhunt_jax.env.gymnax_task import GymnaxTask, make_task
from foxhunt_jax.jitcache import compile_cached, jit
from foxhunt_jax.training import phases
from foxhunt_jax.training.collect import gymnax_adapter
from foxhunt_jax.training.pipeline import EpochResults, Pipeline, ProgramInputs
from foxhunt_jax.training.trainer import Trainer

# Reset keys: Validation's episodes come from PRNGKey(VALIDATION_SEED) every epoch, the final
# report's from PRNGKey(FINAL_SEED), so the reported episodes are not those the selection saw.
VALIDATION_SEED, FINAL_SEED = 0, 1
FINAL_EPISODES = 100  # greedy episodes the final report scores


def reset_keys(seed: int, count: int) -> np.ndarray:
    """``count`` fixed episode reset keys ``[count, 2]`` uint32 from ``PRNGKey(seed)``."""
    return np.asarray(jax.random.split(jax.random.PRNGKey(seed), count))


@dataclass
class GymnaxTrainer(Trainer):
    """A :class:`Trainer` of a gymnax env: ``market`` and ``tables`` are None,
    ``validation_starts`` holds the validation episodes' reset keys ``[W, 2]``."""

    task: GymnaxTask | None = None

    @classmethod
    def build(cls, cfg: Config, market=None, devices: list | None = None) -> "GymnaxTrainer":
        """``cfg.env.name`` a gymnax id (ConfigError if unknown or gymnax is missing);
        ``devices`` as for :meth:`Trainer.build`; ``market`` must be None."""
        del market
        start = time.perf_counter()
        task = make_task(cfg.env.name)
        mesh = parallel.make_mesh(cfg.train.shards, devices)
        local = parallel.local_device(mesh)
        cfg = resolve_gymnax(resolve_config(cfg, local), task)
        backend = resolve(cfg.network, local, cfg.env.name)
        learner = make_learner(cfg, (task.num_actions,), replay_search=backend.tuning.replay)
        adapter = gymnax_adapter(task)
        keys = reset_keys(VALIDATION_SEED, cfg.train.validation_windows)
        env_params = {"train": parallel.put_replicated(task.params, mesh),
                      "validation": jax.device_put(task.params, local)}
        inputs = ProgramInputs(
            train_env_params=env_params["train"], validation_env_params=env_params["validation"],
            window_starts=jax.device_put(keys, local),
            schedule=parallel.put_replicated(schedule_values(cfg.replay, cfg.train), mesh))
        pipeline = Pipeline(learner, backend, cfg, mesh, inputs, adapter,
                            functools.partial(phases.episode_validation, adapter=adapter))
        trainer = cls(cfg, None, None, learner, backend, env_params, keys, mesh, pipeline,
                      task=task)
        trainer.init_ms = (time.perf_counter() - start) * 1e3
        return trainer

    @property
    def obs_dim(self) -> int:
        return self.task.obs_dim

    def _record(self, results: EpochResults, phase_ms: dict) -> dict:
        learned, collected = results.training_metrics, results.experience_stats
        returns = np.asarray(results.validation_paths["return"], np.float64)
        lengths = np.asarray(results.validation_paths["length"], np.float64)
        return {
            **self.learning_fields(collected, learned, phase_ms),
            "episodes_done": int(collected["episodes_done"]),
            "val": {"return": float(returns.mean()), "return_min": float(returns.min()),
                    "return_max": float(returns.max()), "length": float(lengths.mean())},
        }

    def evaluate_episodes(self, agent: AgentState, episodes: int = FINAL_EPISODES,
                          seed: int = FINAL_SEED) -> dict:
        """``episodes`` greedy episodes of ``agent`` (on the host) from the fixed resets of
        :func:`reset_keys` ``(seed, episodes)``: ``{"episodes", "mean_return", "std_return",
        "min_return", "max_return", "mean_length"}``."""
        learner, backend, adapter = self.learner, self.backend, self.pipeline.adapter
        keys = reset_keys(seed, episodes)
        params = parallel.local_view(self.env_params["validation"],
                                     parallel.local_device(self.mesh))

        def run(env_params, network_params, reset):
            return phases.greedy_episodes(learner, backend, env_params, reset, network_params,
                                          adapter)

        args = (params, agent.params, keys)
        compiled, _ = compile_cached(jit(run), args, name="evaluate_episodes",
                                     config={"config": self.cfg, "episodes": episodes})
        out = jax.device_get(compiled(*args))
        returns = np.asarray(out["return"], np.float64)
        return {"episodes": episodes, "mean_return": float(returns.mean()),
                "std_return": float(returns.std()), "min_return": float(returns.min()),
                "max_return": float(returns.max()),
                "mean_length": float(np.mean(out["length"]))}


__all__ = ["GymnaxTrainer", "FINAL_EPISODES", "reset_keys"]
