"""The trainer: one epoch = Experience -> Training (K steps) -> Validation, each one jitted call.

Read :meth:`Trainer.run_epoch` top to bottom for the whole algorithm. Phase times (DESIGN 3.11)
are measured around each call with ``block_until_ready``; Init (data, tables, device upload,
state) and Compile (ahead-of-time ``lower().compile()`` of the three phase functions) are
reported on the first epoch a process runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from foxhunt_jax.agent import curiosity, replay
from foxhunt_jax.agent.learner import (AgentState, Learner, beta_at, epsilon_at, init_agent,
                                       make_learner, train_steps)
from foxhunt_jax.config import Config
from foxhunt_jax.data.features import MarketTables, build_tables
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.data.market import MarketData
from foxhunt_jax.env import trading
from foxhunt_jax.training import validate
from foxhunt_jax.training.collect import EnvAdapter, Rollout, collect, start
from foxhunt_jax.training.metrics import trading_metrics

_P = trading.PORTFOLIO_DIM


# A transition stores the bar index and the 6 portfolio numbers, not the whole observation: the
# feature row is gathered again at sample time (docs/replay.md gives the bytes saved).
TRADING_ADAPTER = EnvAdapter(reset=trading.reset, step_env=trading.step_env,
                             encode=trading.encode, decode=trading.decode)


@struct.dataclass
class TrainerState:
    """Everything a checkpoint holds besides the config: resuming from it is exact."""

    agent: AgentState
    buffer: replay.ReplayState
    rollout: Rollout
    key: jax.Array  # raw uint32 PRNG key data, so checkpoints store plain arrays
    epoch: jax.Array  # epochs completed, int32


def all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


# --- the state before epoch 1, and the three phases: pure functions of (env params, state) -------

def initial_state(learner: Learner, cfg: Config, env_params, key: jax.Array) -> TrainerState:
    k_agent, k_env, k_run = jax.random.split(key, 3)
    agent = init_agent(k_agent, learner, trading.obs_dim(env_params))
    rollout = start(TRADING_ADAPTER, env_params, k_env, cfg.train.num_episodes)
    enc = {"bar": jnp.zeros((), jnp.int32), "portfolio": jnp.zeros((_P,), jnp.float32)}
    example = {"obs": enc, "next_obs": enc,
               "action": jnp.zeros((len(cfg.env.branch_sizes),), jnp.int32),
               "reward": jnp.zeros((), jnp.float32), "discount": jnp.zeros((), jnp.float32)}
    return TrainerState(agent=agent, buffer=replay.init(example, cfg.replay.capacity),
                        rollout=rollout, key=k_run, epoch=jnp.zeros((), jnp.int32))


def experience_phase(learner: Learner, cfg: Config, env_params, state: TrainerState, eps):
    key, k = jax.random.split(state.key)
    rollout, items, priorities, rnd, stats = collect(
        learner, TRADING_ADAPTER, env_params, state.agent, state.rollout, k, eps,
        cfg.env.episode_length)
    buffer = replay.add(state.buffer, items, priorities, cfg.replay.alpha, cfg.replay.priority_eps)
    agent = state.agent.replace(rnd=rnd)
    return state.replace(agent=agent, buffer=buffer, rollout=rollout, key=key), stats


def training_phase(learner: Learner, cfg: Config, env_params, state: TrainerState, beta):
    key, k = jax.random.split(state.key)
    decode = lambda items: (trading.decode(items["obs"], env_params),
                            trading.decode(items["next_obs"], env_params))
    agent, buffer, m = train_steps(learner, decode, state.agent, state.buffer, k, beta,
                                   cfg.train.train_steps)
    m = dict(m, finite_params=all_finite(agent.params))
    return state.replace(agent=agent, buffer=buffer, key=key, epoch=state.epoch + 1), m


def validation_phase(learner: Learner, cfg: Config, env_params, starts, agent: AgentState):
    policy = validate.greedy_policy(learner, agent.params)
    traj = validate.policy_rollout(env_params, starts, cfg.env.episode_length, policy,
                                   jax.random.key(0))
    loss = validate.validation_loss(learner, agent.params, agent.target_params, env_params, traj)
    return {"equity": traj["equity"], "exposure": traj["exposure"], "traded": traj["traded"]}, loss


@dataclass
class Trainer:
    """Builds data, env params, learner and compiled phase functions for one config."""

    cfg: Config
    market: MarketData
    tables: MarketTables
    learner: Learner
    env_params: dict[str, Any]
    val_starts: np.ndarray
    init_ms: float = 0.0
    compile_ms: float = 0.0
    _phases: dict | None = None

    @classmethod
    def build(cls, cfg: Config, market: MarketData | None = None) -> "Trainer":
        t0 = time.perf_counter()
        if market is None:
            market = load_market(cfg.data.source, sort=cfg.data.sort, synthetic=cfg.data.synthetic)
        tables = build_tables(market, cfg.data.splits, cfg.env.episode_length)
        env_params = {s: trading.make_params(tables, cfg.env, s) for s in ("train", "validation")}
        learner = make_learner(cfg, cfg.env.branch_sizes)
        starts = validate.window_starts(tables.starts["validation"], cfg.train.validation_windows)
        tr = cls(cfg, market, tables, learner, env_params, starts)
        tr.init_ms = (time.perf_counter() - t0) * 1e3
        return tr

    @property
    def obs_dim(self) -> int:
        return trading.obs_dim(self.env_params["train"])

    def init_state(self, seed: int | None = None) -> TrainerState:
        """The state before epoch 1 (one jitted program: network, RND, episodes, empty replay)."""
        t0 = time.perf_counter()
        key = jax.random.PRNGKey(self.cfg.train.seed if seed is None else seed)
        init = jax.jit(lambda p, k: initial_state(self.learner, self.cfg, p, k))
        # The phases donate the state; donation needs every leaf in its own buffer, and init code
        # may legitimately share one array between leaves (zeros, a copied target network).
        state = jax.block_until_ready(jax.tree.map(jnp.array, init(self.env_params["train"], key)))
        self.init_ms += (time.perf_counter() - t0) * 1e3
        return state

    def compile(self, state: TrainerState) -> None:
        """Ahead-of-time compilation of the three phase functions (timed as Compile)."""
        t0 = time.perf_counter()
        lr, cfg = self.learner, self.cfg
        tr, va = self.env_params["train"], self.env_params["validation"]
        starts = jnp.asarray(self.val_starts)
        exp = jax.jit(lambda p, s, e: experience_phase(lr, cfg, p, s, e), donate_argnums=1)
        trn = jax.jit(lambda p, s, b: training_phase(lr, cfg, p, s, b), donate_argnums=1)
        scalar = jnp.float32(0)
        val = jax.jit(lambda p, st, a: validation_phase(lr, cfg, p, st, a))
        self._phases = {
            "experience": exp.lower(tr, state, scalar).compile(),
            "training": trn.lower(tr, state, scalar).compile(),
            "validation": val.lower(va, starts, state.agent).compile(),
        }
        self.compile_ms = (time.perf_counter() - t0) * 1e3

    def run_epoch(self, state: TrainerState) -> tuple[TrainerState, dict]:
        """One epoch; returns the new state and its metrics record (host floats)."""
        if self._phases is None:
            self.compile(state)
        ph, ms = self._phases, {}
        tr, va = self.env_params["train"], self.env_params["validation"]

        done = int(state.epoch)  # epochs completed before this one
        eps = epsilon_at(self.cfg.train, done)
        beta = beta_at(self.cfg.replay, self.cfg.train, done)

        t0 = time.perf_counter()
        state, exp_stats = ph["experience"](tr, state, jnp.float32(eps))
        jax.block_until_ready(state)
        ms["experience"] = (time.perf_counter() - t0) * 1e3

        t0 = time.perf_counter()
        state, learn = ph["training"](tr, state, jnp.float32(beta))
        jax.block_until_ready(state)
        ms["training"] = (time.perf_counter() - t0) * 1e3

        t0 = time.perf_counter()
        val, val_loss = ph["validation"](va, jnp.asarray(self.val_starts), state.agent)
        jax.block_until_ready(val)
        ms["validation"] = (time.perf_counter() - t0) * 1e3

        ms["init"], ms["compile"] = self.init_ms, self.compile_ms
        self.init_ms = self.compile_ms = 0.0  # reported once per process
        ms["total"] = sum(ms.values())
        epoch = int(state.epoch)
        cfg = self.cfg
        record = {
            "epoch": epoch,
            "env_steps": epoch * cfg.train.num_episodes * cfg.env.episode_length,
            "phase_ms": ms,
            "loss": float(learn["loss"]),
            "grad_norm": float(learn["grad_norm"]),
            "rnd_loss": float(learn["rnd_loss"]),
            "finite_params": bool(learn["finite_params"]),
            "epsilon": eps,
            "beta": beta,
            "reward": float(exp_stats["reward"]),
            "bonus": float(exp_stats["bonus"]),
            "val_loss": float(val_loss),
            "val": self._metrics(validate.equity_paths(val)),
            "val_buy_and_hold": self._metrics(self._val_buy_and_hold()),
        }
        return state, record

    # --- metrics helpers ---------------------------------------------------------------------

    def _metrics(self, paths: dict) -> dict:
        return trading_metrics(paths["equity"], paths["exposure"], paths["traded"],
                               self.market.bars_per_year)

    def _val_buy_and_hold(self) -> dict:
        lengths = np.full(len(self.val_starts), self.cfg.env.episode_length)
        return validate.buy_and_hold_paths(self.tables.close, self.val_starts, lengths,
                                           self.cfg.env.cost_bps / 1e4)

    def evaluate_split(self, agent: AgentState, split: str, seed: int = 0) -> dict:
        """Full-split greedy evaluation vs buy-and-hold and random: metrics and mean equity curves.

        Curves are the mean over instruments of each one's equity, step by step from the split's
        first bar (instruments that ended drop out of the mean).
        """
        params, starts, lengths = validate.evaluation_params(self.tables, self.cfg.env, split)
        steps, lr, sizes = int(lengths.max()), self.learner, self.cfg.env.branch_sizes
        starts_d, lengths_d = jnp.asarray(starts), jnp.asarray(lengths)

        @jax.jit
        def run(env_p, net_params, key):
            greedy = validate.greedy_policy(lr, net_params)
            return validate.policy_rollout(env_p, starts_d, steps, greedy, key, lengths_d)

        @jax.jit
        def run_random(env_p, key):
            return validate.policy_rollout(env_p, starts_d, steps, validate.random_policy(sizes),
                                           key, lengths_d)

        paths = {
            "agent": validate.equity_paths(run(params, agent.params, jax.random.key(seed))),
            "buy_and_hold": validate.buy_and_hold_paths(self.tables.close, starts, lengths,
                                                        self.cfg.env.cost_bps / 1e4),
            "random": validate.equity_paths(run_random(params, jax.random.key(seed + 1))),
        }
        return {name: {"metrics": self._metrics(p), "curve": np.nanmean(p["equity"], axis=0)}
                for name, p in paths.items()}
