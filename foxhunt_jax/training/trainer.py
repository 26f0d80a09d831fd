"""The trainer: one epoch = Experience -> Training (K steps) -> Validation, each one jitted call.

Read :meth:`Trainer.run_epoch` top to bottom for the whole algorithm. The three phase programs
are queued back to back, so each one's launch overlaps the GPU work before it; with
``queue_next`` the next epoch's Experience and Training are queued behind them before the
metrics are read. Phase times (DESIGN 3.11) are measured with ``block_until_ready`` on each
phase's results: each phase from the previous phase's completion to its own (Experience from
the call, or from the previous epoch's Validation when that epoch queued it). Init (data,
tables, device upload, state) and Compile (ahead-of-time ``lower().compile()`` of the three
phase functions) are reported on the first epoch a process runs. With ``train.pair_rollouts``
(the default) a queued epoch runs Validation and the next Experience as a fourth program where
both rollouts are kernels on one device (:func:`validation_experience_phase`,
:func:`pairs_rollouts`).

Data parallelism (DESIGN 3.13, :mod:`foxhunt_jax.parallel`): the state holds ``S =
train.shards`` shards of episodes (rollout ``[S, N/S, ...]``) and of replay (``[S, C/S, ...]``),
placed on a 1-D device mesh along ``"data"``; the agent is replicated. The phases vmap over the
shard axis and XLA partitions them over the mesh, so results depend on ``S``, not on the device
count.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from foxhunt_jax import parallel
from foxhunt_jax.agent import replay
from foxhunt_jax.agent.learner import (AgentState, Learner, beta_from, epsilon_from, init_agent,
                                       make_learner, schedule_values, train_steps)
from foxhunt_jax.backend import Backend, resolve
from foxhunt_jax.config import Config
from foxhunt_jax.data.features import MarketTables, build_tables
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.data.market import MarketData
from foxhunt_jax.env import trading
from foxhunt_jax.jitcache import compile_cached, jit
from foxhunt_jax.training import fused, validate
from foxhunt_jax.training.collect import EnvAdapter, Rollout, collect_shards, start_shards
from foxhunt_jax.training.metrics import trading_metrics

_P = trading.PORTFOLIO_DIM


# A transition stores the bar index and the 6 portfolio numbers, not the whole observation: the
# feature row is gathered again at sample time (docs/replay.md gives the bytes saved).
TRADING_ADAPTER = EnvAdapter(reset=trading.reset, step_env=trading.step_env,
                             encode=trading.encode, decode=trading.decode,
                             fused=fused.collect_trajectory,
                             max_episode_steps=lambda params: params.episode_length)


@struct.dataclass
class TrainerState:
    """Everything a checkpoint holds besides the config: resuming from it is exact.

    ``buffer`` and ``rollout`` carry the leading shard axis ``S`` (split over devices); the rest
    is replicated.
    """

    agent: AgentState
    buffer: replay.ReplayState  # sharded: leaves [S, C/S, ...]
    rollout: Rollout  # sharded: leaves [S, N/S, ...]
    key: jax.Array  # raw uint32 PRNG key data, so checkpoints store plain arrays
    epoch: jax.Array  # epochs completed, int32


def all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


# --- the state before epoch 1, and the three phases: pure functions of (env params, state) -------

def initial_agent(learner: Learner, env_params, key: jax.Array) -> AgentState:
    """The agent of :func:`initial_state` (network, target, optimizer, RND) by itself."""
    return init_agent(jax.random.split(key, 3)[0], learner, trading.obs_dim(env_params))


def initial_state(learner: Learner, cfg: Config, env_params, key: jax.Array,
                  agent: AgentState | None = None) -> TrainerState:
    """The state before epoch 1; ``agent`` (default: :func:`initial_agent` of ``key``) may be
    built beforehand."""
    _, k_env, k_run = jax.random.split(key, 3)
    if agent is None:
        agent = initial_agent(learner, env_params, key)
    rollout = start_shards(TRADING_ADAPTER, env_params, k_env, cfg.train.shards,
                           cfg.train.num_episodes)
    enc = {"bar": jnp.zeros((), jnp.int32), "portfolio": jnp.zeros((_P,), jnp.float32)}
    example = {"obs": enc, "next_obs": enc,
               "action": jnp.zeros((len(cfg.env.branch_sizes),), jnp.int32),
               "reward": jnp.zeros((), jnp.float32), "discount": jnp.zeros((), jnp.float32)}
    buffer = replay.init_shards(example, cfg.replay.capacity, cfg.train.shards)
    return TrainerState(agent=agent, buffer=buffer, rollout=rollout, key=k_run,
                        epoch=jnp.zeros((), jnp.int32))


def state_shardings(state: TrainerState, mesh) -> TrainerState:
    """Shardings of a (possibly abstract) state: rollout and replay split along the shard axis,
    the agent, key and epoch replicated."""
    rep, shd = parallel.replicated(mesh), parallel.sharded(mesh)
    return TrainerState(agent=jax.tree.map(lambda _: rep, state.agent),
                        buffer=jax.tree.map(lambda _: shd, state.buffer),
                        rollout=jax.tree.map(lambda _: shd, state.rollout), key=rep, epoch=rep)


def experience_phase(learner: Learner, backend: Backend, cfg: Config, env_params,
                     state: TrainerState, schedule, mesh=None):
    """``schedule``: :func:`~foxhunt_jax.agent.learner.schedule_values`; stats include the
    epoch's exploration rate. ``mesh``: where the shards live (each device collects its own,
    :func:`~foxhunt_jax.training.collect.collect_shards`)."""
    eps = epsilon_from(schedule, state.epoch)
    key, k = jax.random.split(state.key)
    rollout, items, priorities, rnd, stats = collect_shards(
        learner, backend, TRADING_ADAPTER, env_params, state.agent, state.rollout, k, eps,
        cfg.env.episode_length, mesh)
    buffer = replay.add_shards(state.buffer, items, priorities, cfg.replay.alpha,
                               cfg.replay.priority_eps)
    agent = state.agent.replace(rnd=rnd)
    return state.replace(agent=agent, buffer=buffer, rollout=rollout, key=key), dict(stats,
                                                                                    epsilon=eps)


def training_phase(learner: Learner, cfg: Config, env_params, state: TrainerState, schedule):
    """``schedule``: :func:`~foxhunt_jax.agent.learner.schedule_values`; metrics include the
    epoch's importance-sampling exponent."""
    beta = beta_from(schedule, state.epoch)
    key, k = jax.random.split(state.key)
    decode = lambda items: (trading.decode(items["obs"], env_params),
                            trading.decode(items["next_obs"], env_params))
    agent, buffer, m = train_steps(learner, decode, state.agent, state.buffer, k, beta,
                                   cfg.train.train_steps)
    m = dict(m, finite_params=all_finite(agent.params),
             finite_opt_state=all_finite(agent.opt_state), beta=beta, epoch=state.epoch + 1)
    return state.replace(agent=agent, buffer=buffer, key=key, epoch=state.epoch + 1), m


def validation_phase(learner: Learner, backend: Backend, cfg: Config, env_params, starts,
                     agent: AgentState):
    traj = validate.greedy_rollout(learner, backend, agent.params, env_params, starts,
                                   cfg.env.episode_length, jax.random.key(0))
    loss = validate.validation_loss(learner, backend, agent.params, agent.target_params,
                                    env_params, traj)
    return {"equity": traj["equity"], "exposure": traj["exposure"], "traded": traj["traded"]}, loss


def validation_experience_phase(learner: Learner, backend: Backend, cfg: Config, val_params,
                                starts, train_params, state: TrainerState, schedule):
    """:func:`validation_phase` of ``state.agent`` and :func:`experience_phase` of the next
    epoch in one program. They share no data, so a GPU runs them at once: XLA's command
    buffers, scheduled as a DAG (:func:`foxhunt_jax.jitcache.compiler_options`), launch the
    validation rollout, which fills few of the GPU's multiprocessors, beside the collection
    (BENCHMARKS.md, session 11). Both read the agent that Training left, and Validation changes
    no state, so the results equal the two phases run one after the other. Returns ``(val,
    val_loss, state, exp_stats)``.
    """
    val, val_loss = validation_phase(learner, backend, cfg, val_params, starts, state.agent)
    return (val, val_loss) + experience_phase(learner, backend, cfg, train_params, state,
                                              schedule)


def pairs_rollouts(backend: Backend, cfg: Config, mesh) -> bool:
    """Whether a queued epoch runs Validation and the next Experience as one program
    (:func:`validation_experience_phase`): ``train.pair_rollouts`` is on, both rollouts are
    kernels (:meth:`~foxhunt_jax.backend.Backend.runs_rollout_kernel`)
    and the phases run on one device (Validation runs on the mesh's first device, Experience on
    the whole mesh). Two rollout kernels run at once; two ``lax.scan`` rollouts of the XLA
    backend did not (the seed epoch took 18.2 ms paired against 16.5 on an H200, BENCHMARKS.md,
    session 11)."""
    n, w = cfg.train.num_episodes, cfg.train.validation_windows
    return (cfg.train.pair_rollouts and backend.runs_rollout_kernel(n)
            and backend.runs_rollout_kernel(w) and (mesh is None or mesh.size == 1))


def _ready_time(tree) -> Callable[[], float]:
    """Starts a thread that waits until ``tree``'s arrays are ready; the returned function joins
    it and gives that moment (``time.perf_counter``), or raises what the wait raised (a failed
    program). The thread waits in JAX's C++ code without the GIL; it takes the GIL back only to
    read the clock."""
    box = {}

    def wait():
        try:
            jax.block_until_ready(tree)
        except BaseException as e:  # noqa: BLE001 - handed to the caller by join()
            box["error"] = e
        box["time"] = time.perf_counter()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()

    def join() -> float:
        waiter.join()
        if "error" in box:
            raise box["error"]
        return box["time"]
    return join


def program_key_config(cfg: Config, name: str) -> Config:
    """The config that keys phase program ``name`` in the executable cache.

    The training program does not depend on ``network.backend``: the update always runs the Flax
    layers (a test lowers it under both backends and compares). So the key leaves the backend
    out, and a run of either backend loads the training program that a run of the other
    compiled. Without that, JAX's persistent cache served the second backend's training
    program, such programs are not stored (``jitcache.compile_cached``), and each later start
    compiled it again from that cache: 1.04 s against 0.37 s on an H200 (BENCHMARKS.md).
    ``train.pair_rollouts`` only decides whether the ``validation_experience`` program exists,
    so the other programs' keys leave it out.
    """
    if name != "validation_experience":
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, pair_rollouts=False))
    if name != "training":
        return cfg
    return dataclasses.replace(cfg, network=dataclasses.replace(cfg.network, backend="any"))


@dataclass(frozen=True)
class _Queued:
    """An epoch's Experience and Training, queued by the previous ``run_epoch(...,
    queue_next=True)``: the state after them, their results, the joins of their completion
    threads (:func:`_ready_time`) and the moment the host saw the previous epoch's Validation
    complete (where this epoch's time starts)."""

    state: TrainerState
    exp_stats: dict
    exp_done: Callable[[], float]
    learn: dict
    learn_done: Callable[[], float]
    since: float


@dataclass
class Trainer:
    """Builds data, env params, learner, device mesh and compiled phase functions for one config.

    ``env_params["train"]`` is replicated on ``mesh``, ``env_params["validation"]`` lives on this
    process's first device of it; the phases take and return states placed by :meth:`shardings`.
    """

    cfg: Config
    market: MarketData
    tables: MarketTables
    learner: Learner
    env_params: dict[str, Any]
    val_starts: np.ndarray
    init_ms: float = 0.0
    compile_ms: float = 0.0
    executables_loaded: int = 0  # phases the last compile() loaded from the executable cache
    _phases: dict | None = None
    mesh: Any = None  # jax.sharding.Mesh over the devices that run the phases
    _val_starts_dev: Any = None  # val_starts on this process's first device of the mesh
    _schedule_dev: Any = None  # schedule_values on the mesh
    _queued: _Queued | None = None  # see run_epoch(queue_next=True)
    _val_bh: dict | None = None  # buy-and-hold metrics of the validation windows (fixed)
    backend: Backend | None = None  # resolved once in build() from the config and the mesh

    @classmethod
    def build(cls, cfg: Config, market: MarketData | None = None,
              devices: list | None = None) -> "Trainer":
        """``devices``: the mesh (default: every device of every process); their count must
        divide ``train.shards``, else ConfigError."""
        t0 = time.perf_counter()
        mesh = parallel.make_mesh(cfg.train.shards, devices)
        if market is None:
            market = load_market(cfg.data.source, sort=cfg.data.sort, synthetic=cfg.data.synthetic)
        tables = build_tables(market, cfg.data.splits, cfg.env.episode_length)
        # Training runs on the whole mesh; validation (small) on this process's first device.
        params = lambda split: trading.make_params(tables, cfg.env, split)
        env_params = {"train": parallel.put_replicated(params("train"), mesh),
                      "validation": jax.device_put(params("validation"),
                                                   parallel.local_device(mesh))}
        backend = resolve(cfg.network, parallel.local_device(mesh))
        learner = make_learner(cfg, cfg.env.branch_sizes,
                               replay_search=backend.tuning.replay)
        starts = validate.window_starts(tables.starts["validation"], cfg.train.validation_windows)
        tr = cls(cfg, market, tables, learner, env_params, starts, mesh=mesh, backend=backend)
        tr.init_ms = (time.perf_counter() - t0) * 1e3
        return tr

    def shardings(self, state: TrainerState) -> TrainerState:
        """Where each leaf of a state lives on this trainer's mesh (see :func:`state_shardings`)."""
        return state_shardings(state, self.mesh)

    @property
    def obs_dim(self) -> int:
        return trading.obs_dim(self.env_params["train"])

    def init_state(self, seed: int | None = None) -> TrainerState:
        """The state before epoch 1, placed on the mesh (see :func:`state_shardings`).

        Two jitted programs: the agent (network, RND, optimizer; small) on this process's first
        device, replicated from there; then episodes and empty replay, built in place on the
        mesh. The agent's program does not depend on the mesh, so it compiles once per machine.
        """
        t0 = time.perf_counter()
        key = jax.random.PRNGKey(self.cfg.train.seed if seed is None else seed)
        tr, lr, cfg = self.env_params["train"], self.learner, self.cfg
        local = parallel.local_device(self.mesh)
        args = (parallel.local_view(tr, local), jax.device_put(key, local))
        # both programs go through the executable cache, as the phases do (compile_cached)
        make_agent, _ = compile_cached(jit(lambda p, k: initial_agent(lr, p, k)), args,
                                       name="init_agent", config=cfg)
        agent = parallel.put_replicated(make_agent(*args), self.mesh)
        build = lambda p, k, a: initial_state(lr, cfg, p, k, a)
        args = (tr, parallel.put_replicated(key, self.mesh), agent)
        # Every output leaf is a fresh buffer (the agent is copied in), as the donating phases need.
        init, _ = compile_cached(
            lambda: jit(build, out_shardings=self.shardings(jax.eval_shape(build, *args))),
            args, name="init_state", config=cfg)
        state = jax.block_until_ready(init(*args))
        self.init_ms += (time.perf_counter() - t0) * 1e3
        return state

    def phase_programs(self, state: TrainerState, queued: bool = False) -> dict:
        """The three phase functions, jitted with their placements, and example arguments:
        ``{name: (jitted, args)}`` for experience, training and validation; with ``queued``
        (epochs run with ``queue_next``) and :attr:`pairs_rollouts` also
        ``validation_experience``."""
        lr, be, cfg = self.learner, self.backend, self.cfg
        tr, va = self.env_params["train"], self.env_params["validation"]
        # The state keeps its placement from epoch to epoch (so donation reuses its buffers);
        # metrics come back replicated, readable on every process. Validation runs on this
        # process's first device with its copy of the replicated agent (every process computes
        # the same numbers), so its program is the same for every mesh.
        sh, rep = self.shardings(state), parallel.replicated(self.mesh)
        mesh = self.mesh
        exp = jit(lambda p, s, e: experience_phase(lr, be, cfg, p, s, e, mesh), donate_argnums=1,
                  in_shardings=(rep, sh, rep), out_shardings=(sh, rep))
        trn = jit(lambda p, s, b: training_phase(lr, cfg, p, s, b), donate_argnums=1,
                  in_shardings=(rep, sh, rep), out_shardings=(sh, rep), training=True)
        val = jit(lambda p, st, a: validation_phase(lr, be, cfg, p, st, a))
        sched = self._schedule_device()
        programs = {"experience": (exp, (tr, state, sched)),
                    "training": (trn, (tr, state, sched)),
                    "validation": (val, (va, self._val_starts_device(),
                                         self._local_agent(state)))}
        if queued and self.pairs_rollouts:
            both = jit(lambda v, st, p, s, e: validation_experience_phase(lr, be, cfg, v, st, p, s,
                                                                          e),
                       donate_argnums=3, in_shardings=(rep, rep, rep, sh, rep),
                       out_shardings=(rep, rep, sh, rep))
            programs["validation_experience"] = (both, (va, self._val_starts_device(), tr, state,
                                                        sched))
        return programs

    @property
    def pairs_rollouts(self) -> bool:
        """Whether queued epochs run Validation and the next Experience as one program
        (:func:`pairs_rollouts`)."""
        return pairs_rollouts(self.backend, self.cfg, self.mesh)

    def compile(self, state: TrainerState, threads: bool = True, queued: bool = False) -> None:
        """Ahead-of-time compilation of the phase functions (timed as Compile).

        ``threads``: the programs are traced, compiled (or loaded from the executable cache) in
        threads at once; XLA's compiler and the loading release the GIL. ``queued``: also the
        program that queued epochs use where :attr:`pairs_rollouts` holds (otherwise
        :meth:`run_epoch` compiles it when a queued epoch first needs it).
        """
        t0 = time.perf_counter()
        self._phases = {}
        self.executables_loaded = self._compile_programs(self.phase_programs(state, queued),
                                                         threads)
        self.compile_ms = (time.perf_counter() - t0) * 1e3

    def _compile_programs(self, programs: dict, threads: bool) -> int:
        """Compiles ``programs`` (:meth:`phase_programs`' form) into ``self._phases``; returns
        how many the executable cache served."""
        cfg = self.cfg
        # the executable cache (jitcache) skips tracing and lowering when a previous process
        # compiled the same program; with the cache off this is lower().compile()
        build = lambda name: compile_cached(*programs[name], name=name,  # noqa: E731
                                            config=program_key_config(cfg, name))
        if threads:
            with ThreadPoolExecutor(max_workers=len(programs)) as pool:
                done = dict(zip(programs, pool.map(build, programs)))
        else:
            done = {name: build(name) for name in programs}
        self._phases.update({name: compiled for name, (compiled, _) in done.items()})
        return sum(int(loaded) for _, loaded in done.values())

    def run_epoch(self, state: TrainerState, queue_next: bool = False
                  ) -> tuple[TrainerState, dict]:
        """One epoch; returns the new state and its metrics record (host floats).

        ``queue_next``: also queue the next epoch's Experience and Training behind this epoch's
        Validation, before this epoch's metrics are read. Their launches (~2 ms of host work on
        an H200) and the host's work between epochs then overlap GPU work instead of leaving
        the GPU idle. The returned state is then the state *after* those two phases: pass it to
        the next ``run_epoch``, which picks them up, but do not checkpoint it (it is a phase
        ahead of the epoch counter). The numbers are the same either way (a test compares them).
        Where :attr:`pairs_rollouts` holds, this Validation and the next Experience run as one
        program (:func:`validation_experience_phase`): Validation's time then includes the next
        Experience, whose own time reads about 0.
        """
        if self._phases is None:
            self.compile(state, queued=queue_next)
        elif queue_next and self.pairs_rollouts and "validation_experience" not in self._phases:
            # the first queued epoch of a trainer compiled without it (reported as Compile)
            t0 = time.perf_counter()
            name = "validation_experience"
            self._compile_programs({name: self.phase_programs(state, queued=True)[name]}, False)
            self.compile_ms += (time.perf_counter() - t0) * 1e3
        ph, ms = self._phases, {}
        tr, va = self.env_params["train"], self.env_params["validation"]
        sched = self._schedule_device()  # epsilon and beta follow state.epoch on the device

        def training_after(state, exp_stats):
            # Queued right behind the Experience that produced `state`: Training's launch (~1 ms
            # of host work) overlaps Experience's GPU work. Threads note when each one's results
            # are ready (:func:`_ready_time`).
            exp_done = _ready_time(exp_stats)  # not donated: the training call takes `state`
            state, learn = ph["training"](tr, state, sched)
            return state, exp_stats, exp_done, learn, _ready_time(learn)

        def experience_and_training(state):
            return training_after(*ph["experience"](tr, state, sched))

        # Each phase's time runs from the previous phase's completion to its own; the first,
        # Experience, from the previous epoch's Validation when that epoch queued this one, else
        # from this call.
        queued, self._queued = self._queued, None
        if queued is not None and queued.state is state:
            t0, state = queued.since, queued.state
            exp_stats, exp_done, learn, learn_done = (queued.exp_stats, queued.exp_done,
                                                      queued.learn, queued.learn_done)
        else:
            t0 = time.perf_counter()
            state, exp_stats, exp_done, learn, learn_done = experience_and_training(state)
        if queue_next and "validation_experience" in ph:
            # Validation and the next epoch's Experience as one program (the GPU runs their
            # rollouts at once); that Experience completes with this Validation
            val, val_loss, state, exp_stats_next = ph["validation_experience"](
                va, self._val_starts_device(), tr, state, sched)
            val_done = _ready_time((val, val_loss))
            nxt = training_after(state, exp_stats_next)
            state = nxt[0]
        else:
            val, val_loss = ph["validation"](va, self._val_starts_device(),
                                             self._local_agent(state))
            # a thread, not this one: the queuing below may keep this thread busy past
            # Validation's completion (an H200 run saw it noted ~10 ms late, BENCHMARKS.md,
            # session 7)
            val_done = _ready_time((val, val_loss))
            if queue_next:  # donates `state` (Validation above was queued first)
                nxt = experience_and_training(state)
                state = nxt[0]
        t1, t2, t3 = exp_done(), learn_done(), val_done()
        # A GPU runs the programs in queue order, but a CPU may run a queued Experience beside
        # the Validation before it (they share no data), and threads wake in any order: a phase
        # seen to end before the one before it counts as taking no time.
        t1 = max(t1, t0)
        t2 = max(t2, t1)
        t3 = max(t3, t2)
        if queue_next:
            self._queued = _Queued(*nxt, since=t3)
        ms["experience"], ms["training"], ms["validation"] = (
            (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)

        ms["init"], ms["compile"] = self.init_ms, self.compile_ms
        self.init_ms = self.compile_ms = 0.0  # reported once per process
        ms["total"] = sum(ms.values())
        # one device-to-host transfer for every number of the record
        learn, exp_stats, val, val_loss = jax.device_get((learn, exp_stats, val, val_loss))
        epoch = int(learn["epoch"])
        cfg = self.cfg
        record = {
            "epoch": epoch,
            "env_steps": epoch * cfg.train.num_episodes * cfg.env.episode_length,
            "phase_ms": ms,
            "loss": float(learn["loss"]),
            "grad_norm": float(learn["grad_norm"]),
            "rnd_loss": float(learn["rnd_loss"]),
            "finite_params": bool(learn["finite_params"]),
            "finite_opt_state": bool(learn["finite_opt_state"]),
            "epsilon": float(exp_stats["epsilon"]),
            "beta": float(learn["beta"]),
            "reward": float(exp_stats["reward"]),
            "bonus": float(exp_stats["bonus"]),
            "val_loss": float(val_loss),
            "val": self._metrics(validate.equity_paths(val)),
            "val_buy_and_hold": self._val_buy_and_hold(),
        }
        return state, record

    def _schedule_device(self) -> jax.Array:
        """:func:`~foxhunt_jax.agent.learner.schedule_values` of the config, replicated on the
        mesh once."""
        if self._schedule_dev is None:
            self._schedule_dev = parallel.put_replicated(
                schedule_values(self.cfg.replay, self.cfg.train), self.mesh)
        return self._schedule_dev

    def _val_starts_device(self) -> jax.Array:
        if self._val_starts_dev is None:
            self._val_starts_dev = jax.device_put(self.val_starts, parallel.local_device(self.mesh))
        return self._val_starts_dev

    def _local_agent(self, state: TrainerState) -> AgentState:
        """This process's first device's copy of the replicated agent (no transfer)."""
        return parallel.local_view(state.agent, parallel.local_device(self.mesh))

    # --- metrics helpers ---------------------------------------------------------------------

    def _metrics(self, paths: dict) -> dict:
        return trading_metrics(paths["equity"], paths["exposure"], paths["traded"],
                               self.market.bars_per_year)

    def _val_buy_and_hold(self) -> dict:
        """Buy-and-hold's metrics on the validation windows (the same every epoch: cached)."""
        if self._val_bh is None:
            lengths = np.full(len(self.val_starts), self.cfg.env.episode_length)
            self._val_bh = self._metrics(validate.buy_and_hold_paths(
                self.tables.close, self.val_starts, lengths, self.cfg.env.cost_bps / 1e4))
        return dict(self._val_bh)

    def evaluate_split(self, agent: AgentState, split: str, seed: int = 0) -> dict:
        """Full-split greedy evaluation vs buy-and-hold and random: metrics and mean equity curves.

        On ``builtin:synthetic`` data an ``oracle`` row (the policy that trades the planted
        signal, :func:`validate.oracle_policy`) is added. Curves are the mean over instruments
        of each one's equity, step by step from the split's first bar (instruments that ended
        drop out of the mean).
        """
        params, starts, lengths = validate.evaluation_params(self.tables, self.cfg.env, split)
        steps, lr, sizes = int(lengths.max()), self.learner, self.cfg.env.branch_sizes
        walk = (jnp.asarray(starts), jnp.asarray(lengths))

        def run(env_p, net_params, key, starts_d, lengths_d):
            return validate.greedy_rollout(lr, self.backend, net_params, env_p, starts_d, steps,
                                           key, lengths_d)

        def run_random(env_p, key, starts_d, lengths_d):
            return validate.policy_rollout(env_p, starts_d, steps, validate.random_policy(sizes),
                                           key, lengths_d)

        def run_oracle(env_p, last_log_return, starts_d, lengths_d):
            oracle = validate.oracle_policy(last_log_return, self.cfg.env)
            return validate.policy_rollout(env_p, starts_d, steps, oracle, jax.random.key(0),
                                           lengths_d)

        def walk_with(name, fn, *args):
            # every array is an argument, so the program is fixed by the config, the walk's
            # length and the argument shapes: the executable cache can serve it
            compiled, _ = compile_cached(jit(fn), args, name=f"evaluate_{name}",
                                         config={"config": self.cfg, "steps": steps})
            return validate.equity_paths(compiled(*args))

        paths = {"agent": walk_with("agent", run, params, agent.params, jax.random.key(seed),
                                    *walk)}
        if validate.is_synthetic(self.market):  # the oracle knows the planted signal
            paths["oracle"] = walk_with("oracle", run_oracle, params,
                                        jnp.asarray(self.tables.last_log_return), *walk)
        paths["buy_and_hold"] = validate.buy_and_hold_paths(self.tables.close, starts, lengths,
                                                            self.cfg.env.cost_bps / 1e4)
        paths["random"] = walk_with("random", run_random, params, jax.random.key(seed + 1),
                                    *walk)
        return {name: {"metrics": self._metrics(p), "curve": np.nanmean(p["equity"], axis=0)}
                for name, p in paths.items()}
