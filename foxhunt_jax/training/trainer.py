"""The trainer: builds everything one config needs, then runs epochs and evaluations.

One epoch is Experience -> Training (K learner steps) -> Validation, each one jitted program
(with ``train.overlap``: Training beside the next epoch's Experience, then Validation): the
phases are pure functions in :mod:`~foxhunt_jax.training.phases`; compiling, queueing, pairing
and timing them is :mod:`~foxhunt_jax.training.pipeline`, whose docstring says when a
returned state is ahead of its epoch and must not be checkpointed. Init (data, tables, device
upload, initial state) and Compile (the phase programs) are reported on the first epoch a
process runs.

Data parallelism (:mod:`foxhunt_jax.parallel`): the state holds ``S = train.shards`` shards of
episodes and of replay, placed on a 1-D device mesh along ``"data"``; the agent is replicated.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from foxhunt_jax import parallel
from foxhunt_jax.agent.learner import AgentState, Learner, make_learner, schedule_values
from foxhunt_jax.agent.value_range import resolve_trading
from foxhunt_jax.backend import Backend, resolve, resolve_config
from foxhunt_jax.config import Config
from foxhunt_jax.data.features import MarketTables, build_tables
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.data.market import MarketData
from foxhunt_jax.env import trading
from foxhunt_jax.env.gymnax_task import TRADING
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.jitcache import cache_key, compile_cached, jit
from foxhunt_jax.training import validate
from foxhunt_jax.training.metrics import (evaluation_results, trading_metrics,
                                          trading_metrics_of_runs)
from foxhunt_jax.training.phases import (TRADING_ADAPTER, TrainerState, initial_agent,
                                         initial_state)
from foxhunt_jax.training.pipeline import (EpochResults, Pipeline, ProgramInputs,
                                           program_key_config, state_shardings,
                                           without_run_settings)

__all__ = ["Trainer", "TrainerState", "TRADING_ADAPTER"]


@dataclass
class Trainer:
    """Data, env params, learner, device mesh and the phase pipeline of one config.

    ``env_params["train"]`` is replicated on ``mesh``; ``env_params["validation"]`` lives on this
    process's first device of it. ``init_ms`` and ``compile_ms`` accumulate until the next epoch
    record reports them.
    """

    cfg: Config
    market: MarketData
    tables: MarketTables
    learner: Learner
    backend: Backend  # resolved once in build() from the config and the mesh's device
    env_params: dict[str, Any]
    validation_starts: np.ndarray  # [W] int32 first bars of the fixed validation windows
    mesh: Any  # jax.sharding.Mesh over the devices that run the phases
    pipeline: Pipeline
    init_ms: float = 0.0
    compile_ms: float = 0.0
    executables_loaded: int = 0  # programs the last compile() loaded from the executable cache
    init_beside_compile: bool = False  # init_ms and compile_ms overlap (init_and_compile)
    # the network parameters of the epoch run_epoch last reported (a copy, replicated on the
    # mesh, that later epochs leave alone): what a selection keeps
    validated_params: Any = None
    _validation_buy_and_hold: dict | None = None  # its metrics on the validation windows
    # the full walks' executables by cache key (compile_walks), and the thread compiling them
    _walk_executables: dict = field(default_factory=dict)
    _walks_compiling: threading.Thread | None = None

    @classmethod
    def build(cls, cfg: Config, market: MarketData | None = None,
              devices: list | None = None) -> "Trainer":
        """``devices``: the mesh (default: every device of every process); their count must
        divide ``train.shards``, else ConfigError. The trainer's ``cfg`` is ``cfg`` with
        ``network.support: auto`` resolved (:func:`~foxhunt_jax.agent.value_range.
        resolve_trading`)."""
        if cfg.env.name != TRADING:
            raise ConfigError(f"Trainer.build runs the trading env; env.name {cfg.env.name} is "
                              "built by foxhunt_jax.api.build_trainer")
        start = time.perf_counter()
        mesh = parallel.make_mesh(cfg.train.shards, devices)
        local = parallel.local_device(mesh)
        cfg = resolve_config(cfg, local)  # network.dtype auto, for this device
        if market is None:
            market = load_market(cfg.data.source, sort=cfg.data.sort, synthetic=cfg.data.synthetic,
                                 window=cfg.data.window)
        tables = build_tables(market, cfg.data.splits, cfg.env.episode_length,
                              features=cfg.data.features, split_dates=cfg.data.split_dates)
        cfg = resolve_trading(cfg, tables)  # network.support auto: the range, from train bars
        validation_starts = validate.window_starts(tables.starts["validation"],
                                                   cfg.train.validation_windows)
        # Training runs on the whole mesh; validation (small) on this process's first device,
        # its params' starts the windows' (so their shape is the config's, not the data's)
        rows = cfg.data.min_table_rows
        env_params = {"train": parallel.put_replicated(
                          trading.make_params(tables, cfg.env, "train", min_rows=rows), mesh),
                      "validation": jax.device_put(trading.make_params(
                          tables, cfg.env, "validation", validation_starts, rows), local)}
        backend = resolve(cfg.network, local)
        learner = make_learner(cfg, cfg.env.branch_sizes, replay_search=backend.tuning.replay)
        inputs = ProgramInputs(
            train_env_params=env_params["train"], validation_env_params=env_params["validation"],
            window_starts=jax.device_put(validation_starts, local),
            # epsilon and beta follow the state's epoch counter on the device
            schedule=parallel.put_replicated(schedule_values(cfg.replay, cfg.train), mesh))
        trainer = cls(cfg, market, tables, learner, backend, env_params, validation_starts, mesh,
                      Pipeline(learner, backend, cfg, mesh, inputs))
        trainer.init_ms = (time.perf_counter() - start) * 1e3
        return trainer

    @property
    def obs_dim(self) -> int:
        return trading.obs_dim(self.env_params["train"])

    @property
    def pairs_rollouts(self) -> bool:
        """Whether queued epochs run Validation and the next Experience as one program
        (:func:`~foxhunt_jax.training.pipeline.pairs_rollouts`)."""
        return self.pipeline.pairs_rollouts

    def init_state(self, seed: int | None = None) -> TrainerState:
        """The state before epoch 1 (:func:`~foxhunt_jax.training.phases.initial_state`), placed
        on the mesh (:func:`~foxhunt_jax.training.pipeline.state_shardings`).

        Two jitted programs, both through the executable cache: the agent (small) on this
        process's first device, replicated from there; then episodes and empty replay, built in
        place on the mesh. The agent's program does not depend on the mesh, so it compiles once
        per machine.
        """
        start = time.perf_counter()
        key = jax.random.PRNGKey(self.cfg.train.seed if seed is None else seed)
        local = parallel.local_device(self.mesh)
        programs = self.init_programs()
        args = (parallel.local_view(self.env_params["train"], local), jax.device_put(key, local))
        make_agent = self._compile_init("init_agent", programs["init_agent"], args)
        agent = parallel.put_replicated(make_agent(*args), self.mesh)
        args = (self.env_params["train"], parallel.put_replicated(key, self.mesh), agent)
        make_state = self._compile_init("init_state", programs["init_state"], args)
        state = jax.block_until_ready(make_state(*args))
        self.init_ms += (time.perf_counter() - start) * 1e3
        return state

    def abstract_state(self, seed: int | None = None) -> TrainerState:
        """:meth:`init_state`'s state as shapes, dtypes and placements (``ShapeDtypeStruct``
        leaves), traced without compiling or running anything: what :meth:`compile` needs."""
        local = parallel.local_device(self.mesh)
        programs, whole = self.init_programs(), parallel.replicated(self.mesh)
        key = jax.eval_shape(lambda: jax.random.PRNGKey(0 if seed is None else seed))
        args = (parallel.local_view(self.env_params["train"], local), key)
        agent = jax.eval_shape(programs["init_agent"](args), *args)
        agent = jax.tree.map(lambda x: parallel.abstract(x, whole), agent)
        args = (self.env_params["train"], parallel.abstract(key, whole), agent)
        shape = jax.eval_shape(programs["init_state"](args), *args)
        return jax.tree.map(parallel.abstract, shape, state_shardings(shape, self.mesh))

    def init_and_compile(self, queued: bool = False) -> TrainerState:
        """:meth:`init_state` and :meth:`compile` (``paired_in_background``) at once: in one
        process the phase programs compile from :meth:`abstract_state` in a thread while the
        state is built (its own two programs), instead of after it; the Init and Compile times
        then overlap."""
        if jax.process_count() > 1:  # compile waits for every process: keep the order
            state = self.init_state()
            self.compile(state, queued=queued, paired_in_background=True)
            return state
        with ThreadPoolExecutor(max_workers=1) as pool:
            compiling = pool.submit(self.compile, self.abstract_state())
            state = self.init_state()
            compiling.result()
        self.init_beside_compile = True
        if queued:
            self.pipeline.compile_paired_in_background(state)
        return state

    def init_programs(self) -> dict:
        """``{name: make(args) -> jitted}`` of :meth:`init_state`'s two programs: ``init_agent``
        of ``(train env params, key)`` and ``init_state`` of ``(train env params, key, agent)``,
        each keyed in the executable cache by
        :func:`~foxhunt_jax.training.pipeline.program_key_config` (no run setting or market
        datum is a constant of theirs: the seed reaches them as the key, the market as the env
        params)."""
        learner, cfg, adapter = self.learner, self.cfg, self.pipeline.adapter
        build = lambda p, k, a: initial_state(learner, cfg, p, k, a, adapter)  # noqa: E731
        # every output leaf of init_state is a fresh buffer (the agent is copied in), as the
        # donating phases need
        return {"init_agent": lambda args: jit(lambda p, k: initial_agent(learner, p, k,
                                                                         adapter)),
                "init_state": lambda args: jit(build, out_shardings=state_shardings(
                    jax.eval_shape(build, *args), self.mesh))}

    def _compile_init(self, name: str, make, args):
        compiled, _ = compile_cached(lambda: make(args), args, name=name,
                                     config=program_key_config(self.cfg, name))
        return compiled

    def phase_programs(self, state: TrainerState, queued: bool = False) -> dict:
        """The jitted phase programs with example arguments, ``{name: (jitted, args)}``
        (:meth:`~foxhunt_jax.training.pipeline.Pipeline.jitted_programs`)."""
        return self.pipeline.jitted_programs(state, queued)

    def compile(self, state: TrainerState, threads: bool = True, queued: bool = False,
                paired_in_background: bool = False) -> None:
        """Compiles (or loads from the executable cache) the phase programs, timed as Compile.

        ``threads``: the programs compile in a thread each. ``queued``: also the program that
        queued epochs use where :attr:`pairs_rollouts` holds (otherwise :meth:`run_epoch`
        compiles it when a queued epoch first needs it); with ``paired_in_background`` that
        one compiles in a thread while the epochs run (not timed as Compile), which take it up
        once it is ready (:meth:`~foxhunt_jax.training.pipeline.Pipeline.compile_paired_in_background`).
        """
        background = queued and paired_in_background
        self.compile_ms, self.executables_loaded = self.pipeline.compile(
            state, threads=threads, queued=queued and not background)
        if background:
            self.pipeline.compile_paired_in_background(state)

    def run_epoch(self, state: TrainerState, queue_next: int = 0
                  ) -> tuple[TrainerState, dict]:
        """One epoch; returns the new state and its metrics record (host floats).

        ``queue_next``: 1 (or True) also queues the next epoch's Experience and Training before
        this epoch's metrics are read, so the host's work between epochs overlaps device work;
        2 also the next epoch's Validation where it is paired with the following Experience.
        The returned state is then ahead: pass it to the next ``run_epoch`` and do not
        checkpoint it (:mod:`~foxhunt_jax.training.pipeline`). The numbers are the same either
        way.
        """
        if not self.pipeline.programs:  # the first epoch of this trainer
            self.compile(state, queued=queue_next >= 1)
        elif queue_next >= 1:
            self.compile_ms += self.pipeline.compile_paired(state)
        state, results, phase_ms = self.pipeline.run_epoch(state, queue_next)
        phase_ms["init"], phase_ms["compile"] = self.init_ms, self.compile_ms
        self.init_ms = self.compile_ms = 0.0  # reported once
        phase_ms["total"] = sum(phase_ms.values())
        self.validated_params = results.validated_params  # stays on the devices
        return state, self._record(jax.device_get(results._replace(validated_params=None)),
                                   phase_ms)

    def _record(self, results: EpochResults, phase_ms: dict) -> dict:
        """The epoch's metrics record from its results, read to the host in one transfer."""
        return self.epoch_record(results.experience_stats, results.training_metrics,
                                 results.validation_paths, results.validation_loss, phase_ms)

    def epoch_record(self, collected: dict, learned: dict, validation_paths: dict | None,
                     validation_loss, phase_ms: dict, val: dict | None = None) -> dict:
        """An epoch's metrics record from its host results: the Experience stats, Training
        metrics, Validation paths ``[L, W]`` and loss (one population member's, too). ``val``:
        the paths' metrics where the caller computed them already (a population's members, all
        at once by :meth:`validation_metrics`); the paths are then not read."""
        if val is None:
            val = self._metrics(validate.equity_paths(validation_paths))
        return dict(self.learning_fields(collected, learned, phase_ms),
                    val_loss=float(validation_loss), val=val,
                    val_buy_and_hold=self._validation_buy_and_hold_metrics())

    def validation_metrics(self, paths: dict) -> list[dict]:
        """The trading metrics of ``R`` runs' validation walks at once: ``paths`` as
        :func:`~foxhunt_jax.training.validate.equity_paths` gives them with a leading ``[R]``
        (``equity [R, W, L+1]``, ...); one dict a run, each equal to what :meth:`epoch_record`
        computes for that run alone up to float rounding."""
        return trading_metrics_of_runs(paths["equity"], paths["exposure"], paths["trades"],
                                       self.market.bars_per_year, turnover=paths["turnover"])

    def learning_fields(self, collected: dict, learned: dict, phase_ms: dict) -> dict:
        """The fields every env's epoch record shares: the epoch, its env steps and phase times,
        the learner's metrics and the collection's stats."""
        epoch, cfg = int(learned["epoch"]), self.cfg
        return {
            "epoch": epoch,
            "env_steps": epoch * cfg.train.num_episodes * cfg.env.episode_length,
            "phase_ms": phase_ms,
            "loss": float(learned["loss"]),
            "grad_norm": float(learned["grad_norm"]),
            "rnd_loss": float(learned["rnd_loss"]),
            "support_edge_mass": float(learned["support_edge_mass"]),
            "finite_params": bool(learned["finite_params"]),
            "finite_opt_state": bool(learned["finite_opt_state"]),
            "epsilon": float(collected["epsilon"]),
            "beta": float(learned["beta"]),
            "reward": float(collected["reward"]),
            "bonus": float(collected["bonus"]),
        }

    def _metrics(self, paths: dict) -> dict:
        return trading_metrics(paths["equity"], paths["exposure"], paths["trades"],
                               self.market.bars_per_year, turnover=paths["turnover"])

    def _validation_buy_and_hold_metrics(self) -> dict:
        """Buy-and-hold's metrics on the validation windows (the same every epoch: cached)."""
        if self._validation_buy_and_hold is None:
            lengths = np.full(len(self.validation_starts), self.cfg.env.episode_length)
            self._validation_buy_and_hold = self._metrics(validate.buy_and_hold_paths(
                self.tables, self.cfg.env, self.validation_starts, lengths))
        return dict(self._validation_buy_and_hold)

    def evaluate_split(self, agent: AgentState, split: str, seed: int = 0) -> dict:
        """Full-split greedy walk of the agent beside the baselines, as portfolios by date.

        Every instrument with a bar in ``split`` is walked from its first bar to its last by the
        agent (greedy), buy-and-hold, flat (cash), on ``builtin:synthetic`` data the oracle
        (:func:`validate.oracle_policy`), and ``eval.random_policies`` random policies
        (:func:`validate.random_walks`, one program). Each policy's walks make one equal-weight
        portfolio by date (:func:`~foxhunt_jax.training.metrics.portfolio_by_date`): its curve
        is what the figures draw and its metrics what the tables show.

        Returns :func:`~foxhunt_jax.training.metrics.evaluation_results`: ``dates``,
        ``curves``, ``exposure``, ``metrics`` (JSON-able: what summary.json and ``evaluate``
        write) and ``paths`` (per instrument).
        """
        split_params, starts, lengths = self._walk_params(split)
        own, key = int(lengths.max()), self.walk_key_config(split_params.episode_length)

        def walked(traj):  # a deterministic policy's paths, with the actions it took [W, L, B]
            traj = validate.own_walks(traj, len(starts), own, walk_axis=1, time_axis=0)
            return dict(validate.equity_paths(traj), action=np.swapaxes(traj["action"], 0, 1))

        programs = self._walk_programs(agent, split, seed, split_params, starts, lengths)
        if self._walks_compiling is not None:  # compile_walks_in_background
            self._walks_compiling.join()
            self._walks_compiling = None
        executables = self._compiled_walks(programs, key)
        walk_with = lambda name: executables[name](*programs[name][1])  # noqa: E731
        paths = {name: walked(walk_with(name)) for name in programs if name != "random"}
        paths["buy_and_hold"] = validate.buy_and_hold_paths(self.tables, self.cfg.env, starts,
                                                            lengths)
        paths["flat"] = validate.flat_paths(lengths)
        random = validate.walk_paths(validate.own_walks(walk_with("random"), len(starts), own,
                                                        walk_axis=1, time_axis=2))

        dates = validate.walk_dates(self.tables.timestamps, starts, lengths)
        names = [self.tables.instrument_names[int(self.tables.instrument[s])] for s in starts]
        return evaluation_results(paths, random, dates, names, self.market.bars_per_year)

    def _compiled_walks(self, programs: dict, key: dict) -> dict:
        """``{name: executable}`` of :meth:`walk_programs`' ``programs`` keyed by ``key``
        (:meth:`walk_key_config`): compiled here once (or loaded from the executable cache) and
        kept."""
        out = {}
        for name, (jitted, args) in programs.items():
            digest = cache_key(f"evaluate_{name}", key, args)
            if digest not in self._walk_executables:
                self._walk_executables[digest], _ = compile_cached(
                    jitted, args, name=f"evaluate_{name}", config=key)
            out[name] = self._walk_executables[digest]
        return out

    def compile_walks(self, agent: AgentState) -> None:
        """Compiles (or loads) the programs of :meth:`evaluate_split`'s walks for an agent of
        ``agent``'s shapes and placement (the validation and test splits share them), so that
        the final report only runs them."""
        split_params, starts, lengths = self._walk_params("validation")
        programs = self._walk_programs(agent, "validation", 0, split_params, starts, lengths)
        self._compiled_walks(programs, self.walk_key_config(split_params.episode_length))

    def compile_walks_in_background(self, agent: AgentState) -> None:
        """:meth:`compile_walks` in a thread, while epochs run (a run's final report then
        waits for what is left of it); on a failure there the report compiles them itself.
        ``agent``: host arrays, as the report's selected agent."""
        def work():
            try:
                self.compile_walks(agent)
            except Exception:  # noqa: BLE001 - the report compiles what is missing (and
                pass  # raises there what failed here)

        # not a daemon: a process that ends early (an error, an interrupt) waits for the
        # compile, as one cut off by the interpreter's exit aborts the process
        self._walks_compiling = threading.Thread(target=work, name="compile-walks")
        self._walks_compiling.start()

    def _walk_params(self, split: str):
        """:func:`validate.evaluation_params` of ``split``, its tables padded as the phases'."""
        return validate.evaluation_params(self.tables, self.cfg.env, split,
                                          self.cfg.data.min_table_rows)

    def walk_key_config(self, steps: int) -> dict:
        """What keys the full walks' programs in the executable cache: the config without its
        run settings and market data (both reach the programs as arguments, the tables
        padded), the number of random policies, and the walk's ``steps``; so the folds of a
        walk-forward, whose tables are padded alike, share them where their walks' lengths and
        instruments agree."""
        return {"config": without_run_settings(self.cfg),
                "random_policies": self.cfg.eval.random_policies, "steps": int(steps)}

    def walk_programs(self, agent: AgentState, split: str, seed: int = 0) -> dict:
        """``{name: (jitted, args)}`` of the full walks of ``split`` that :meth:`evaluate_split`
        runs: ``agent`` (greedy, from ``agent.params``), ``random`` and, on
        ``builtin:synthetic`` data, ``oracle``. Every array is an argument, so a program is
        fixed by :meth:`walk_key_config` and the arguments' shapes.

        The validation and test splits walk the same steps and rows
        (:func:`validate.walk_length`, :func:`validate.walk_rows`), so both run one set of
        programs; :meth:`evaluate_split` cuts the results to the split's own."""
        return self._walk_programs(agent, split, seed, *self._walk_params(split))

    def _walk_programs(self, agent: AgentState, split: str, seed: int, split_params,
                       starts: np.ndarray, lengths: np.ndarray) -> dict:
        """:meth:`walk_programs` from :meth:`_walk_params`' result."""
        steps = split_params.episode_length
        learner, backend = self.learner, self.backend
        walk = tuple(map(jnp.asarray, validate.shared_walks(
            starts, lengths, validate.walk_rows(self.tables, split))))
        branch_sizes, policies = self.cfg.env.branch_sizes, self.cfg.eval.random_policies

        def run_greedy(env_params, network_params, key, walk_starts, walk_lengths):
            return validate.greedy_rollout(learner, backend, network_params, env_params,
                                           walk_starts, steps, key, walk_lengths)

        def run_random(env_params, key, walk_starts, walk_lengths):
            return validate.random_walks(env_params, walk_starts, steps, key, walk_lengths,
                                         branch_sizes, policies)

        def run_oracle(env_params, last_log_return, walk_starts, walk_lengths):
            oracle = validate.oracle_policy(last_log_return, self.cfg.env)
            return validate.policy_rollout(env_params, walk_starts, steps, oracle,
                                           jax.random.key(0), walk_lengths)

        programs = {"agent": (jit(run_greedy), (split_params, agent.params,
                                                jax.random.key(seed)) + walk)}
        if validate.is_synthetic(self.market):  # the oracle knows the planted signal
            programs["oracle"] = (jit(run_oracle), (split_params, jnp.asarray(
                self.tables.last_log_return)) + walk)
        programs["random"] = (jit(run_random), (split_params, jax.random.key(seed + 1)) + walk)
        return programs
