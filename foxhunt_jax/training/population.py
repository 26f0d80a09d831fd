"""Populations: ``train.population = P`` agents trained in one jitted program per phase.

Every array of the :class:`~foxhunt_jax.training.phases.TrainerState` gains a leading member
axis ``[P, ...]`` (agent, replay, episodes in flight, key, epoch) and each phase of
:mod:`.phases` runs under ``jax.vmap`` over it: one ``experience``, one ``training`` and one
``validation`` program for the whole population, not P programs.

Member ``i`` starts from ``PRNGKey(train.seed + i)`` and takes the hyperparameters of
:func:`~foxhunt_jax.config.population_members`. A key that varies across members is a traced
``[P]`` array (:func:`member_hparams`): the learning rate feeds the member's Adam
(:func:`~foxhunt_jax.agent.learner.make_optimizer`), gamma and n-step its n-step targets and
validation loss, ``curiosity.coef`` its novelty bonus, ``env.cost_bps`` its env params' cost
rate, and the epsilon schedule its row of the ``[P, 6]`` schedule. A key that all members share
stays a Python constant of the shared config (:func:`shared_config`), so member ``i`` computes
what a single-agent run of :func:`~foxhunt_jax.config.member_config` computes (to float32
rounding where a traced value replaces a constant; a test compares them).

**Devices.** The member axis is split over the most local devices whose count divides P
(:func:`member_devices`): each device trains its own members, and the env tables are copied to
every one. The members' numbers do not depend on the device count. ``train.shards`` still
splits each member's episodes and replay into shards, on the member's device.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from foxhunt_jax import parallel
from foxhunt_jax.agent.learner import Learner, make_optimizer, schedule_values
from foxhunt_jax.agent.value_range import resolve_trading
from foxhunt_jax.backend import Backend, resolve
from foxhunt_jax.config import Config, member_config, population_members
from foxhunt_jax.data.market import MarketData
from foxhunt_jax.jitcache import compile_cached, compile_programs, jit
from foxhunt_jax.training import phases, validate
from foxhunt_jax.training.phases import TrainerState
from foxhunt_jax.training.pipeline import (Ahead, Queued, QueuedEpoch, phase_times,
                                            ready_clock, without_run_settings)
from foxhunt_jax.training.trainer import Trainer

# keys traced as [P] arrays when they vary (the epsilon schedule always is: one row a member)
TRACED_KEYS = ("train.learning_rate", "train.gamma", "train.n_step", "curiosity.coef",
               "env.cost_bps")


def varying_keys(members: list[dict]) -> tuple[str, ...]:
    """The keys whose value is not the same for every member, in :data:`TRACED_KEYS` order
    (epsilon keys excluded: the schedule array carries them)."""
    return tuple(k for k in TRACED_KEYS
                 if len({repr(m.get(k)) for m in members}) > 1)


def shared_config(cfg: Config, members: list[dict]) -> Config:
    """The config every member's programs share: ``cfg`` with the hyperparameters that all
    members give the same value set, and, where ``curiosity.coef`` varies, its largest value
    (so every member carries the novelty networks; a member with coefficient 0 gets no bonus)."""
    shared = {k: members[0][k] for k in members[0]
              if all(repr(m.get(k)) == repr(members[0][k]) for m in members)}
    if "curiosity.coef" in varying_keys(members):
        shared["curiosity.coef"] = max(m["curiosity.coef"] for m in members)
    return member_config(cfg, shared, 0)


def member_hparams(members: list[dict], keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """``{key: [P] array}`` of the varying ``keys``: float32, int32 for ``train.n_step``, and
    ``env.cost_bps`` as the env's cost rate ``cost_bps / 1e4`` (rounded as the env rounds it)."""
    out = {}
    for key in keys:
        values = [m[key] for m in members]
        if key == "train.n_step":
            out[key] = np.asarray(values, np.int32)
        elif key == "env.cost_bps":
            out[key] = np.asarray([np.float32(v / 1e4) for v in values], np.float32)
        else:
            out[key] = np.asarray(values, np.float32)
    return out


def member_view(learner: Learner, hparams: dict, *env_params) -> tuple:
    """``(learner, *env_params)`` of one member inside a vmapped program: ``hparams`` holds
    that member's ``[]`` tracers of the varying keys; the rest is the shared constants."""
    t = learner.train_cfg
    if "train.learning_rate" in hparams:
        learner = dataclasses.replace(learner,
                                      optimizer=make_optimizer(t, hparams["train.learning_rate"]))
    if "train.gamma" in hparams or "train.n_step" in hparams:
        learner = dataclasses.replace(learner, train_cfg=dataclasses.replace(
            t, gamma=hparams.get("train.gamma", t.gamma),
            n_step=hparams.get("train.n_step", t.n_step)))
    if "curiosity.coef" in hparams:
        learner = dataclasses.replace(learner, curiosity_cfg=dataclasses.replace(
            learner.curiosity_cfg, coef=hparams["curiosity.coef"]))
    if "env.cost_bps" in hparams:
        env_params = tuple(p.replace(cost_rate=hparams["env.cost_bps"]) for p in env_params)
    return (learner,) + tuple(env_params)


def population_experience(learner, backend, cfg, train_env_params, state, schedules, hparams):
    """:func:`~foxhunt_jax.training.phases.experience` of every member: state leaves
    ``[P, ...]``, ``schedules [P, 6]``, ``hparams`` ``{key: [P]}``; stats ``[P]``."""
    def one(state, schedule, hp):
        member, params = member_view(learner, hp, train_env_params)
        return phases.experience(member, backend, cfg, params, state, schedule)
    return jax.vmap(one)(state, schedules, hparams)


def population_training(learner, cfg, train_env_params, state, schedules, hparams):
    """:func:`~foxhunt_jax.training.phases.training` of every member; metrics ``[P]``.

    The members take their learner steps in lockstep, so their step counters are equal and
    each reads the first's: with that step unbatched, the hard target copy stays a conditional
    (:attr:`~foxhunt_jax.agent.learner.Learner.target_copy`) that writes the P networks only
    at a copy step, where a select would read and write them at every step."""
    step = state.agent.step[0]
    learner = dataclasses.replace(learner, target_copy="conditional")

    def one(state, schedule, hp):
        member, params = member_view(learner, hp, train_env_params)
        state = state.replace(agent=state.agent.replace(step=step))
        return phases.training(member, cfg, params, state, schedule)
    return jax.vmap(one)(state, schedules, hparams)


def population_validation(learner, backend, cfg, validation_env_params, window_starts, agent,
                          hparams):
    """:func:`~foxhunt_jax.training.phases.validation` of every member's agent: paths
    ``[P, L, W]``, loss ``[P]``, and a copy of the validated parameters."""
    def one(agent, hp):
        member, params = member_view(learner, hp, validation_env_params)
        return phases.validation(member, backend, cfg, params, window_starts, agent)
    paths, loss = jax.vmap(one)(agent, hparams)
    return paths, loss, jax.tree.map(jnp.copy, agent.params)


MEMBERS = "members"  # the mesh axis the member axis is split over
# the varying keys network.support auto's range depends on (agent/value_range.py)
RANGE_KEYS = ("train.gamma", "env.cost_bps")


def member_devices(size: int, devices=None) -> list:
    """The most of ``devices`` (default: this process's) whose count divides ``size``."""
    devices = list(devices if devices is not None else jax.local_devices())
    count = max(d for d in range(1, len(devices) + 1) if size % d == 0)
    return devices[:count]


def window_returns(equity: np.ndarray) -> np.ndarray:
    """``[..., W]`` total return of each validation window from ``equity [..., W, L+1]``
    (starting at 1)."""
    return equity[..., -1] / equity[..., 0] - 1.0


@dataclass
class PopulationTrainer:
    """The shared :class:`~foxhunt_jax.training.trainer.Trainer` (data, tables, env params,
    learner, backend of :func:`shared_config`, on one device), the members and their programs.
    """

    cfg: Config  # the population's config as given (network.support resolved)
    trainer: Trainer
    # the trainer's backend with the device's launches shared among its members (the phase
    # programs run them all at once; the trainer's own serves one member's walks)
    backend: Backend
    members: list[dict]  # population_members(cfg)
    hparams: dict  # varying key -> [P] device array
    schedules: jax.Array  # [P, 6] schedule_values of each member
    programs: dict
    mesh: Mesh  # 1-D over member_devices, axis MEMBERS
    train_env_params: Any  # replicated on the mesh
    validation_env_params: Any  # replicated on the mesh
    window_starts: jax.Array  # [W], replicated on the mesh
    init_ms: float = 0.0
    compile_ms: float = 0.0
    executables_loaded: int = 0  # programs the last compile() loaded from the executable cache
    validated_params: Any = None  # [P, ...] network parameters of the last validated epoch
    _ahead: Ahead | None = None  # the next epoch's phases, queued by run_epoch(queue_next=True)
    _env_trainers: dict = dataclasses.field(default_factory=dict)  # member_trainer's, by env

    @classmethod
    def build(cls, cfg: Config, market: MarketData | None = None,
              devices: list | None = None) -> "PopulationTrainer":
        """``devices`` (default: this process's) hold the members (:func:`member_devices`)."""
        start = time.perf_counter()
        members = population_members(cfg)
        mesh = Mesh(np.asarray(member_devices(len(members), devices)), (MEMBERS,))
        device = mesh.devices.flat[0]
        shared = shared_config(cfg, members)
        trainer = Trainer.build(shared, market=market, devices=[device])
        if cfg.network.support == "auto":  # one support that holds every member's returns
            # the range depends on gamma and the costs: once for each of their combinations
            distinct = {repr(sorted((k, v) for k, v in m.items() if k in RANGE_KEYS)): m
                        for m in members}
            ranges = [resolve_trading(member_config(shared, m, 0), trainer.tables).network
                      for m in distinct.values()]
            low, high = min(n.v_min for n in ranges), max(n.v_max for n in ranges)
            if (low, high) != (trainer.cfg.network.v_min, trainer.cfg.network.v_max):
                explicit = {"network.support": "explicit", "network.v_min": low,
                            "network.v_max": high}
                trainer = Trainer.build(member_config(shared, explicit, 0),
                                        market=trainer.market, devices=[device])
            cfg = dataclasses.replace(cfg, network=dataclasses.replace(
                cfg.network, support="explicit", v_min=trainer.cfg.network.v_min,
                v_max=trainer.cfg.network.v_max))
        keys = varying_keys(members)
        schedules = np.stack([schedule_values(c.replay, c.train) for c in
                              (member_config(cfg, m, i) for i, m in enumerate(members))])
        split, whole = NamedSharding(mesh, PartitionSpec(MEMBERS)), NamedSharding(mesh,
                                                                                PartitionSpec())
        put = lambda x: jax.device_put(jnp.asarray(x), split)  # noqa: E731
        copy = lambda tree: jax.device_put(tree, whole)  # noqa: E731
        backend = resolve(trainer.cfg.network, device, copies=len(members) // mesh.size)
        out = cls(cfg, trainer, backend, members, {k: put(v) for k, v in
                                          member_hparams(members, keys).items()},
                  put(schedules), {}, mesh, copy(trainer.env_params["train"]),
                  copy(trainer.env_params["validation"]),
                  copy(jnp.asarray(trainer.validation_starts)))
        out.init_ms = (time.perf_counter() - start) * 1e3
        return out

    @property
    def _split(self) -> NamedSharding:
        """Leading (member) axis split over the mesh."""
        return NamedSharding(self.mesh, PartitionSpec(MEMBERS))

    @property
    def size(self) -> int:
        return len(self.members)

    def seed(self, index: int) -> int:
        return self.cfg.train.seed + index

    def member_config(self, index: int) -> Config:
        """Member ``index``'s single-agent config (:func:`~foxhunt_jax.config.member_config`)."""
        return member_config(self.cfg, self.members[index], index)

    def init_state(self) -> TrainerState:
        """Every member's :func:`~foxhunt_jax.training.phases.initial_state` from
        ``PRNGKey(train.seed + i)``, stacked: leaves ``[P, ...]``."""
        start = time.perf_counter()
        keys = jax.device_put(jnp.stack([jax.random.PRNGKey(self.seed(i))
                                         for i in range(self.size)]), self._split)
        program, args = self.jitted_programs(keys=keys)["init_state"]
        build, _ = compile_cached(program, args, name="population_init_state",
                                  config=self.key_config)
        state = jax.block_until_ready(build(*args))
        self.init_ms += (time.perf_counter() - start) * 1e3
        return state

    @property
    def key_config(self) -> Config:
        """What keys the population's programs in the executable cache: the shared config
        without :data:`~foxhunt_jax.training.pipeline.RUN_SETTINGS` (the seeds reach the
        programs as keys, the schedules and the varying hyperparameters as arguments, the
        market as the env params); P, which keys vary and the placement are in the arguments'
        shapes and tree."""
        return without_run_settings(self.trainer.cfg)

    def jitted_programs(self, state: TrainerState | None = None, keys: jax.Array | None = None
                        ) -> dict:
        """``{name: (jitted, args)}``: with ``keys [P, 2]`` the ``init_state`` program, with
        ``state`` the ``experience``, ``training`` and ``validation`` programs. Compiled with
        the single-agent phases' XLA options (:func:`~foxhunt_jax.jitcache.jit`), Training
        with its own."""
        tr = self.trainer
        learner, backend, cfg = tr.learner, self.backend, tr.cfg
        whole, split = NamedSharding(self.mesh, PartitionSpec()), self._split
        programs = {}
        if keys is not None:
            build = jit(jax.vmap(lambda p, k: phases.initial_state(learner, cfg, p, k),
                                 in_axes=(None, 0)), out_shardings=split)
            programs["init_state"] = (build, (self.train_env_params, keys))
        if state is not None:
            placed = dict(in_shardings=(whole, split, split, split),
                          out_shardings=(split, split), donate_argnums=1)
            experience = jit(lambda p, s, e, h: population_experience(
                learner, backend, cfg, p, s, e, h), **placed)
            training = jit(lambda p, s, e, h: population_training(learner, cfg, p, s, e, h),
                           training=True, **placed)
            validation = jit(lambda p, w, a, h: population_validation(
                learner, backend, cfg, p, w, a, h), in_shardings=(whole, whole, split, split),
                out_shardings=split)
            args = (self.train_env_params, state, self.schedules, self.hparams)
            programs.update(experience=(experience, args), training=(training, args),
                            validation=(validation, (self.validation_env_params,
                                                     self.window_starts, state.agent,
                                                     self.hparams)))
        return programs

    def compile(self, state: TrainerState) -> None:
        """Compiles (or loads from the executable cache,
        :func:`~foxhunt_jax.jitcache.compile_cached`) the three population programs, timed as
        Compile: in a thread each, lowering one at a time in :meth:`jitted_programs`' order, as
        the single agent's (:meth:`~foxhunt_jax.training.pipeline.Pipeline.compile`)."""
        start = time.perf_counter()
        jitted = self.jitted_programs(state)
        built = dict(zip(jitted, compile_programs(
            {f"population_{name}": (program, program_args, self.key_config)
             for name, (program, program_args) in jitted.items()}).values()))
        self.programs = {name: compiled for name, (compiled, _) in built.items()}
        self.executables_loaded = sum(int(loaded) for _, loaded in built.values())
        self.compile_ms += (time.perf_counter() - start) * 1e3

    def run_epoch(self, state: TrainerState, queue_next: bool = False
                  ) -> tuple[TrainerState, list[dict], dict]:
        """One epoch of every member; returns the state, one record a member (the single-agent
        record with ``member`` and ``seed``), and the validation returns per window ``[P, W]``
        under ``"window_returns"`` beside the phase times in ``"phase_ms"``.

        ``queue_next``: also queue the next epoch's Experience, Training and Validation behind
        this epoch's Validation, before the members' records are built on the host (so the
        device works while the host builds them); the returned state is then ahead, with the
        single-agent pipeline's rules (:mod:`.pipeline`: pass it to the next ``run_epoch``,
        never checkpoint it).
        """
        if not self.programs:
            self.compile(state)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.state is state:
            start, queued = ahead.since, ahead.epoch
        else:
            start = time.perf_counter()
            state, queued = self._queue_learning(state)
            queued = self._queue_validation(state, queued)
        if queue_next:  # queued after Validation, which reads `state` first
            state, following = self._queue_learning(state)
            following = self._queue_validation(state, following)
        ms, validation_end = phase_times(start, queued)
        if queue_next:
            self._ahead = Ahead(state, following, since=validation_end)
        ms["init"], ms["compile"] = self.init_ms, self.compile_ms
        self.init_ms = self.compile_ms = 0.0
        ms["total"] = sum(ms.values())
        paths, loss, self.validated_params = queued.validation.results
        stats, metrics, paths, loss = jax.device_get((queued.experience.results,
                                                      queued.training.results, paths, loss))
        # every member's validation metrics from [P, ...] arrays in a few passes, so that the
        # host's records stay shorter than the device's queued epoch (docs/performance.md)
        walks = validate.equity_paths(paths)
        val = self.trainer.validation_metrics(walks)
        records = []
        for i in range(self.size):
            pick = lambda tree: jax.tree.map(lambda x: x[i], tree)  # noqa: E731
            rec = self.member_trainer(i).epoch_record(pick(stats), pick(metrics), None, loss[i],
                                                      dict(ms), val=val[i])
            records.append({"member": i, "seed": self.seed(i), **rec})
        return state, records, {"phase_ms": ms, "window_returns": window_returns(walks["equity"])}

    def _queue_validation(self, state: TrainerState, queued: QueuedEpoch) -> QueuedEpoch:
        """``queued`` with every member's Validation of ``state.agent`` queued behind it: its
        results are the paths, the loss and a copy of the validated parameters."""
        results = self.programs["validation"](self.validation_env_params, self.window_starts,
                                              state.agent, self.hparams)
        return queued._replace(validation=Queued(results, ready_clock(results)))

    def _queue_learning(self, state: TrainerState) -> tuple[TrainerState, QueuedEpoch]:
        """Queues every member's Experience and then Training; Validation is queued by the
        caller."""
        state, stats = self.programs["experience"](self.train_env_params, state,
                                                   self.schedules, self.hparams)
        experience = Queued(stats, ready_clock(stats))
        state, metrics = self.programs["training"](self.train_env_params, state, self.schedules,
                                                   self.hparams)
        return state, QueuedEpoch(experience, Queued(metrics, ready_clock(metrics)))

    def member_params(self, params, index: int):
        """Member ``index``'s slice of ``[P, ...]`` parameters, on the host."""
        return parallel.to_host(jax.tree.map(lambda x: x[index], params))

    def member_trainer(self, index: int) -> Trainer:
        """The shared trainer with member ``index``'s environment (its ``env.cost_bps``): what
        its epoch records' buy-and-hold and
        :meth:`~foxhunt_jax.training.trainer.Trainer.evaluate_split` walk with (the other
        varying keys do not change a greedy walk). Members with the same env share one."""
        env = dataclasses.replace(self.trainer.cfg.env, **{
            k.split(".")[1]: v for k, v in self.members[index].items() if k.startswith("env.")})
        if env == self.trainer.cfg.env:
            return self.trainer
        if env not in self._env_trainers:  # each caches its own buy-and-hold metrics
            self._env_trainers[env] = dataclasses.replace(
                self.trainer, cfg=dataclasses.replace(self.trainer.cfg, env=env),
                _validation_buy_and_hold=None)
        return self._env_trainers[env]


__all__ = ["PopulationTrainer", "TRACED_KEYS", "MEMBERS", "member_devices", "varying_keys",
           "shared_config", "member_hparams",
           "member_view", "population_experience", "population_training",
           "population_validation", "window_returns"]
