"""The execution backend: one value, resolved once from the config and the device.

:func:`resolve` reads ``network.backend`` and the device and returns a :class:`Backend`, a
frozen value whose fields are the entry points that collection, validation and inference run.
Whoever needs them is handed the value; no other module asks which backend or which device it
runs on. Two implementations exist:

* ``xla`` (:mod:`foxhunt_jax.backend.xla`): the agent's definitions (the Flax ``QNetwork``, the
  jnp loss, the Flax RND networks) compiled by XLA; rollouts are ``lax.scan`` loops.
* ``pallas`` (:mod:`foxhunt_jax.backend.pallas`): the same functions as fused Pallas kernels
  (:mod:`pallas_kernels`), tested equal to the definitions, and the trading env's whole rollout
  as one kernel up to ``tuning.rollout_max_episodes`` episodes.

Training's update always differentiates the definitions, whatever the backend.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

from foxhunt_jax.backend import pallas, xla
from foxhunt_jax.config import Config, NetworkConfig
from foxhunt_jax.errors import ConfigError
from pallas_kernels.tuning import Tuning, for_device

NAMES = ("xla", "pallas")


@dataclass(frozen=True)
class Backend:
    """The resolved backend: its entry points and the device's launch tuning.

    Shapes: ``N`` rows, ``D`` observation width, ``B`` branches, ``n_d`` actions of branch d,
    ``K`` atoms; ``network`` is the ``QNetwork``, ``z`` its support ``[K]``.

    Attributes:
      name: ``"xla"`` or ``"pallas"``.
      tuning: the device's :class:`~pallas_kernels.tuning.Tuning` (launch shapes, thresholds).
      q_forward: ``(params, obs [..., D], network, z, *, with_q=False) -> (q, actions)``:
        greedy actions ``[..., B]`` int32 and, with ``with_q``, per branch ``[..., n_d]``
        expected Q (else None); :func:`foxhunt_jax.agent.network.q_forward`.
      act: ``(params, obs [N, D], draws [N, B], network, z) -> (greedy, action, taken)``: the
        collection forward (:func:`foxhunt_jax.agent.network.act`).
      taken_logits: ``(params, obs [..., D], actions [..., B], network)`` -> per branch
        ``[..., K]`` logits of the given actions (:func:`foxhunt_jax.agent.network.taken_logits`).
      bootstrap_loss: ``(target_params, next_obs [M, D], best [M, B], taken, returns [M],
        discounts [M], network, z) -> [M]`` (:func:`foxhunt_jax.agent.loss.bootstrap_loss`).
      novelty: ``(rnd_state, obs [N, D]) -> [N]`` raw RND prediction error
        (:func:`foxhunt_jax.agent.curiosity.prediction_error`).
      rollout: the trading env's rollout kernel, with the arguments of
        :func:`pallas_kernels.rollout.fused_rollout` less ``config``/``interpret``; None where
        rollouts are scans (``xla``).
    """

    name: str
    tuning: Tuning
    q_forward: Callable
    act: Callable
    taken_logits: Callable
    bootstrap_loss: Callable
    novelty: Callable
    rollout: Callable | None

    def runs_rollout_kernel(self, num_episodes: int) -> bool:
        """Whether a trading rollout of ``num_episodes`` parallel episodes runs as one kernel
        (:attr:`rollout`): a backend that has it, up to ``tuning.rollout_max_episodes``."""
        return self.rollout is not None and num_episodes <= self.tuning.rollout_max_episodes


@functools.lru_cache(maxsize=None)
def make(name: str, tuning: Tuning) -> Backend:
    """The backend ``name`` (one of :data:`NAMES`) with ``tuning``; the same value for the same
    arguments. ConfigError for any other name."""
    if name not in NAMES:
        raise ConfigError(f"config key 'network.backend' must be one of {NAMES}, got {name!r}")
    entries = xla.ENTRY_POINTS if name == "xla" else pallas.entry_points(tuning)
    return Backend(name=name, tuning=tuning, **entries)


def resolve_config(cfg: Config, device=None) -> Config:
    """``cfg`` with ``network.dtype="auto"`` made concrete for ``device`` (default: JAX's first
    device): ``bfloat16`` where the Pallas kernels compile (a CUDA GPU), the configuration that
    runs the fast path (bf16 matrix inputs and, with ``network.backend=auto``, the kernels);
    else ``float32``. A run resolves its config once, before writing it, so its ``config.yaml``
    and everything that reads it (resume, evaluate, act, export) name the dtype it ran with.
    ConfigError when ``network.backend=pallas`` resolves to float32."""
    if cfg.network.dtype != "auto":
        return cfg
    dtype = "bfloat16" if for_device(device).compiled else "float32"
    if cfg.network.backend == "pallas" and dtype == "float32":
        raise ConfigError("config key 'network.backend' pallas needs network.dtype=bfloat16 "
                          "(auto resolves to float32 off a CUDA GPU)")
    return dataclasses.replace(cfg, network=dataclasses.replace(cfg.network, dtype=dtype))


def resolve(network_cfg: NetworkConfig, device=None, env_name: str = "trading",
            copies: int = 1) -> Backend:
    """The backend of a validated ``network`` config on ``device`` (default: JAX's first
    device) for the env ``env_name`` (``env.name``), whose programs run ``copies`` agents at
    once under ``jax.vmap`` (a population's members on the device; the launch tuning shares
    the device among them, :func:`~pallas_kernels.tuning.for_device`).
    ``network.backend="auto"`` picks ``pallas`` for the trading env where the kernels compile
    (a CUDA GPU) and the network computes in bfloat16, the configuration where they are faster
    than XLA; else ``xla`` (the float32 kernel is slower than XLA, elsewhere the kernels only
    run interpreted, and the rollout kernels are the trading env's). ConfigError for
    ``pallas`` with another env."""
    tuning = for_device(device, copies)
    name = network_cfg.backend
    trading = env_name == "trading"
    if name == "pallas" and not trading:
        raise ConfigError(f"config key 'network.backend' pallas runs the trading env's kernels "
                          f"only; use xla or auto for {env_name}")
    if name == "auto":  # network.dtype auto is bfloat16 exactly where the kernels compile
        name = ("pallas" if trading and tuning.compiled
                and network_cfg.dtype in ("auto", "bfloat16") else "xla")
    return make(name, tuning)


__all__ = ["Backend", "NAMES", "make", "resolve", "resolve_config"]
