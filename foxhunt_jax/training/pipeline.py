"""Compiling, queueing, pairing and timing the phase programs of :mod:`.phases`.

**Programs.** Each phase is one jitted program: ``experience``, ``training`` and ``validation``,
and, where :func:`pairs_rollouts` holds, ``validation_experience`` (one epoch's Validation and
the next epoch's Experience). The state keeps its placement from program to program
(:func:`state_shardings`), so donation reuses its buffers; stats and metrics come back
replicated. Validation runs on this process's first device of the mesh with its copy of the
replicated agent, so its program is the same for every mesh. Programs are compiled ahead of time
through the executable cache (:func:`~foxhunt_jax.jitcache.compile_cached`, keyed by the program
name and :func:`program_key_config`), in threads at once.

**Queueing and timing.** An epoch queues its programs back to back and waits only afterwards, so
each program's launch overlaps the device work before it. A thread per phase notes the moment
that phase's results are ready (:func:`ready_clock`). A phase's time runs from the previous
phase's completion to its own; Experience's from the call, or from the previous epoch's
Validation when that epoch queued it. A phase seen to end before the one before it counts as
0 ms (a CPU may run a queued Experience beside the Validation queued before it).

**The ahead state.** ``Pipeline.run_epoch(state, queue_next=1)`` also queues the next
epoch's Experience and Training behind this epoch's Validation, before this epoch's results are
read, and keeps them in :attr:`Pipeline.ahead` (an :class:`Ahead`); ``queue_next=2``, where the
rollouts are paired, also queues the next epoch's Validation, paired with the Experience of the
epoch after it, so the device holds two programs' work (Training, then Validation + Experience)
while the host reads this epoch's results and writes its record:

- what it holds: the state after the queued phases (after the next epoch's Training, or with
  ``queue_next=2`` after the following epoch's Experience; its epoch counter is one more than
  the epoch just reported), the queued phases' results (device arrays, possibly still being
  computed) and their completion clocks (a :class:`QueuedEpoch`), and the moment this epoch's
  Validation was seen complete (where the next epoch's time starts).
- ``run_epoch`` returns ``ahead.state``: the caller passes it, the same object, to the next
  ``run_epoch``, which takes up the queued phases instead of queueing them again, then queues
  what is left of that epoch (and, if asked, of the epochs after it). Any other state drops the
  ahead phases and runs its own. A state that already holds the following epoch's Experience
  (queued with ``queue_next=2``) must be run with ``queue_next`` of at least 1.
- never checkpoint an ahead state: its counter counts an epoch whose Validation has not been
  read and whose record has not been written, so a resume from it would not reproduce the run.
- draining: ``run_epoch(ahead.state, queue_next=0)`` finishes the queued epoch and queues
  nothing, so the state it returns is at its epoch and may be checkpointed.
  :func:`foxhunt_jax.api.train` queues an epoch only where neither it nor the one before it is
  checkpointed, and none of them is the last or may stop early.

With ``validation_experience`` the queued Experience is part of the Validation program: the
Validation time then includes the next epoch's Experience, whose own time reads about 0.

**Overlap** (``train.overlap``, :attr:`Pipeline.overlaps`). An epoch is one program,
``overlapped`` (:func:`~foxhunt_jax.training.phases.overlapped`: this epoch's Training beside the
next epoch's collection, then this epoch's Validation of the trained agent), where the phases
run on one device; on a mesh of several devices Validation stays its own program (it runs on
the first device). ``training`` is not compiled and ``validation_experience`` is not used. A
state at epoch 0 (fresh) first runs the ``experience`` program once, epoch 1's collection;
every later state is overlapped: its replay and episodes already hold the next epoch's
collection, and so does a checkpoint of it, so a resume continues without that first
collection. Queueing ahead queues the next epoch's program right behind this one's, the same
rules as above. Timing: ``experience`` is that first collection (0 on every other epoch),
``training`` the ``overlapped`` program, ``validation`` about 0 when it is part of that program.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from foxhunt_jax import parallel
from foxhunt_jax.agent.learner import AgentState, Learner
from foxhunt_jax.backend import Backend
from foxhunt_jax.config import Config
from foxhunt_jax.jitcache import compile_cached, compile_programs, jit
from foxhunt_jax.training import phases
from foxhunt_jax.training.collect import EnvAdapter
from foxhunt_jax.training.phases import TrainerState

# the device phases of an epoch, in order: the keys of phase_times and of the records' phase_ms
PHASES = ("experience", "training", "validation")
PAIRED_PROGRAM = "validation_experience"
OVERLAPPED_PROGRAM = "overlapped"


def state_shardings(state: TrainerState, mesh) -> TrainerState:
    """Shardings of a (possibly abstract) state: rollout and replay split along the shard axis,
    the agent, key and epoch replicated."""
    whole, split = parallel.replicated(mesh), parallel.sharded(mesh)
    return TrainerState(agent=jax.tree.map(lambda _: whole, state.agent),
                        buffer=jax.tree.map(lambda _: split, state.buffer),
                        rollout=jax.tree.map(lambda _: split, state.rollout), key=whole,
                        epoch=whole)


def pairs_rollouts(backend: Backend, cfg: Config, mesh) -> bool:
    """Whether queued epochs run Validation and the next Experience as one program: the setting
    ``train.pair_rollouts`` is on, both rollouts are kernels
    (:meth:`~foxhunt_jax.backend.Backend.runs_rollout_kernel`), and the phases run on one device
    (Validation runs on the mesh's first device, Experience on the whole mesh), and
    ``train.overlap`` is off (its Experience is part of Training's program). Two rollout
    kernels run at once on a GPU; two ``lax.scan`` rollouts do not (docs/training.md)."""
    return (cfg.train.pair_rollouts and not cfg.train.overlap
            and backend.runs_rollout_kernel(cfg.train.num_episodes)
            and backend.runs_rollout_kernel(cfg.train.validation_windows)
            and (mesh is None or mesh.size == 1))


# Settings no phase program reads: the epoch schedules reach the programs as an argument
# (learner.schedule_values), the run's key is part of the state, the market data only as the
# env params' tables (arguments, padded to trading.padded_size; their shapes are in the key),
# and the rest concerns the run around the programs (selection, stopping, checkpoints,
# printing, the final report, the population's members). Runs that differ only in these share
# their phase programs; tests/integration/test_train.py lowers the programs of two such configs
# and compares them.
RUN_SETTINGS = ("train.seed", "train.epochs", "train.epsilon_start", "train.epsilon_end",
                "train.epsilon_decay_epochs", "train.select_by", "train.patience",
                "train.checkpoint_every", "train.log_every", "replay.beta_start",
                "replay.beta_end", "eval", "population", "data")


def without_run_settings(cfg: Config) -> Config:
    """``cfg`` with every :data:`RUN_SETTINGS` entry (a key, or a whole section) at its
    default."""
    default = Config()
    sections = {}
    for entry in RUN_SETTINGS:
        section, _, key = entry.partition(".")
        if not key:
            sections[section] = getattr(default, section)
            continue
        current = sections.get(section, getattr(cfg, section))
        sections[section] = dataclasses.replace(
            current, **{key: getattr(getattr(default, section), key)})
    return dataclasses.replace(cfg, **sections)


def program_key_config(cfg: Config, name: str) -> Config:
    """The config that keys phase program ``name`` in the executable cache: without its
    :data:`RUN_SETTINGS` (:func:`without_run_settings`).

    The training program leaves ``network.backend`` out: the update always runs the Flax layers,
    so both backends lower it to the same program (a test compares them) and a run of either
    backend loads the one the other compiled. ``train.pair_rollouts`` and ``train.overlap``
    only decide whether the ``validation_experience`` and ``overlapped`` programs exist, so the
    other programs' keys leave them out.
    """
    cfg = without_run_settings(cfg)
    if name != PAIRED_PROGRAM:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, pair_rollouts=False))
    if name != OVERLAPPED_PROGRAM:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, overlap=False))
    if name != "training":
        return cfg
    return dataclasses.replace(cfg, network=dataclasses.replace(cfg.network, backend="any"))


def ready_clock(tree) -> Callable[[], float]:
    """Starts a thread that waits until ``tree``'s arrays are ready; the returned function joins
    it and gives that moment (``time.perf_counter``), or raises what the wait raised (a failed
    program). The thread waits in JAX's C++ code without the GIL, so the caller may keep
    queueing programs meanwhile without delaying the reading."""
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


@dataclass(frozen=True)
class ProgramInputs:
    """The device arrays the phase programs read besides the state, placed once."""

    train_env_params: Any  # replicated on the mesh
    validation_env_params: Any  # on this process's first device of the mesh
    window_starts: jax.Array  # [W] int32 validation window starts, on that device
    schedule: jax.Array  # [6] float32 schedule_values, replicated on the mesh


def with_params_copy(state: TrainerState, *outputs) -> tuple:
    """A phase's outputs (the state first) and a copy of the network parameters it leaves, in
    new buffers that the next epoch's donation of ``state`` does not take."""
    return (state, *outputs, jax.tree.map(jnp.copy, state.agent.params))


class Queued(NamedTuple):
    """A queued program's results and the clock of their completion (:func:`ready_clock`)."""

    results: Any
    ready: Callable[[], float]


class QueuedEpoch(NamedTuple):
    """One epoch's queued phases: Experience's stats, Training's metrics and parameter copy,
    Validation's paths and loss once queued (None before), and ``collected``: the following
    epoch's Experience stats where this epoch's Validation program also collected it."""

    experience: Queued
    training: Queued
    validation: Queued | None = None
    collected: Queued | None = None


@dataclass(frozen=True)
class Ahead:
    """Phases queued by ``run_epoch(..., queue_next=1 or 2)`` (the module docstring says when
    such a state may be used and checkpointed)."""

    state: TrainerState  # the state after them
    epoch: QueuedEpoch  # the next epoch's queued phases
    since: float  # when this epoch's Validation was seen complete: the next epoch's start


def phase_times(start: float, queued: QueuedEpoch) -> tuple[dict, float]:
    """``({experience, training, validation}: ms, validation_end)`` of ``queued`` (its
    Validation queued too): each phase from the previous one's completion, Experience from
    ``start``; a phase seen to end before the one before it counts 0 ms (module docstring).
    Waits for the three completion clocks."""
    ends = [start]
    for phase in (queued.experience, queued.training, queued.validation):
        ends.append(max(phase.ready(), ends[-1]))
    ms = {name: (end - begin) * 1e3 for name, begin, end in zip(PHASES, ends, ends[1:])}
    return ms, ends[-1]


class EpochResults(NamedTuple):
    """One epoch's device results, read by the trainer after the next epoch is queued."""

    experience_stats: dict  # phases.experience's stats
    training_metrics: dict  # phases.training's metrics
    validation_paths: dict  # [L, W] equity, exposure, traded, fills, turnover
    validation_loss: jax.Array  # []
    # a copy of the validated agent's network parameters (replicated like the agent): the
    # state's own are donated to the next epoch, queued or not
    validated_params: Any


class Pipeline:
    """The compiled phase programs of one trainer, and the epoch that may be queued ahead."""

    def __init__(self, learner: Learner, backend: Backend, cfg: Config, mesh,
                 inputs: ProgramInputs, adapter: EnvAdapter = phases.TRADING_ADAPTER,
                 validate: Callable = phases.validation):
        """``adapter``: the env's (:class:`~foxhunt_jax.training.collect.EnvAdapter`);
        ``validate``: the Validation phase, :func:`~foxhunt_jax.training.phases.validation`'s
        signature (a gymnax env's: :func:`~foxhunt_jax.training.phases.episode_validation`)."""
        self.learner, self.backend, self.cfg, self.mesh = learner, backend, cfg, mesh
        self.inputs, self.adapter, self.validate = inputs, adapter, validate
        self.programs: dict[str, Any] = {}  # name -> compiled program
        self.ahead: Ahead | None = None
        # compile_paired_in_background's compile, until _take_paired takes up its program
        self._paired_compiling: Future | None = None

    @property
    def overlaps(self) -> bool:
        """Whether an epoch runs the ``overlapped`` program (``train.overlap``; module
        docstring)."""
        return self.cfg.train.overlap

    @property
    def validates_in_overlap(self) -> bool:
        """Whether the ``overlapped`` program also runs Validation: :attr:`overlaps` and the
        phases run on one device (module docstring)."""
        return self.overlaps and (self.mesh is None or self.mesh.size == 1)

    @property
    def pairs_rollouts(self) -> bool:
        """Whether queued epochs run the ``validation_experience`` program
        (:func:`pairs_rollouts`)."""
        return pairs_rollouts(self.backend, self.cfg, self.mesh)

    def jitted_programs(self, state: TrainerState, queued: bool = False) -> dict:
        """``{name: (jitted, example_args)}`` of experience, training and validation (with
        :attr:`overlaps`: overlapped in place of training); with ``queued`` (epochs run with
        ``queue_next``) and :attr:`pairs_rollouts` also ``validation_experience``."""
        learner, backend, cfg, mesh = self.learner, self.backend, self.cfg, self.mesh
        inputs = self.inputs
        placed, replicated = state_shardings(state, mesh), parallel.replicated(mesh)
        adapter, validate = self.adapter, self.validate
        experience = jit(lambda p, s, e: phases.experience(learner, backend, cfg, p, s, e, mesh,
                                                           adapter),
                         donate_argnums=1, in_shardings=(replicated, placed, replicated),
                         out_shardings=(placed, replicated))
        # Training also returns a copy of the parameters it leaves (EpochResults.validated_params):
        # made here, it costs no launch of its own and leaves the paired rollouts alone
        training = jit(lambda p, s, e: with_params_copy(*phases.training(learner, cfg, p, s, e,
                                                                         adapter)),
                       donate_argnums=1, in_shardings=(replicated, placed, replicated),
                       out_shardings=(placed, replicated, replicated), training=True)
        validation = jit(lambda p, w, a: validate(learner, backend, cfg, p, w, a))
        train_args = (inputs.train_env_params, state, inputs.schedule)
        validation_args = (inputs.validation_env_params, inputs.window_starts)
        programs = {"experience": (experience, train_args),
                    "training": (training, train_args),
                    "validation": (validation, validation_args + (self._local_agent(state),))}
        if self.validates_in_overlap:
            del programs["training"], programs["validation"]

            def epoch(v, w, p, s, e):
                state, stats, metrics = phases.overlapped(learner, backend, cfg, p, s, e, mesh,
                                                          adapter)
                paths, loss = validate(learner, backend, cfg, v, w, state.agent)
                return with_params_copy(state, stats, metrics, paths, loss)

            overlapped = jit(epoch, donate_argnums=3,
                             in_shardings=(replicated,) * 3 + (placed, replicated),
                             out_shardings=(placed,) + (replicated,) * 5, training=True)
            programs[OVERLAPPED_PROGRAM] = (overlapped, validation_args + train_args)
        elif self.overlaps:
            del programs["training"]
            overlapped = jit(lambda p, s, e: with_params_copy(*phases.overlapped(
                                 learner, backend, cfg, p, s, e, mesh, adapter)),
                             donate_argnums=1, in_shardings=(replicated, placed, replicated),
                             out_shardings=(placed, replicated, replicated, replicated),
                             training=True)
            programs[OVERLAPPED_PROGRAM] = (overlapped, train_args)
        if queued and self.pairs_rollouts:
            paired = jit(lambda v, w, p, s, e: phases.validation_experience(
                             learner, backend, cfg, v, w, p, s, e),
                         donate_argnums=3,
                         in_shardings=(replicated, replicated, replicated, placed, replicated),
                         out_shardings=(replicated, replicated, placed, replicated))
            # first: the longest compile (both rollouts) lowers first (Pipeline._compile)
            programs = {PAIRED_PROGRAM: (paired, validation_args + train_args), **programs}
        return programs

    def compile(self, state: TrainerState, *, threads: bool = True,
                queued: bool = False) -> tuple[float, int]:
        """Compiles (or loads) :meth:`jitted_programs` in place of any compiled before; returns
        the milliseconds it took and how many the executable cache served. ``threads``: one
        thread a program (XLA's compiler and the loading release the GIL)."""
        self.wait_for_background_compile()
        self.programs = {}
        return self._compile(self.jitted_programs(state, queued), threads)

    def compile_paired(self, state: TrainerState) -> float:
        """Compiles ``validation_experience`` where :attr:`pairs_rollouts` holds and it is not
        compiled yet (the first queued epoch of a pipeline compiled without it); returns the
        milliseconds it took, 0.0 when there was nothing to do (also while
        :meth:`compile_paired_in_background` compiles it)."""
        if (not self.pairs_rollouts or PAIRED_PROGRAM in self.programs
                or self._paired_compiling is not None):
            return 0.0
        paired = self.jitted_programs(state, queued=True)[PAIRED_PROGRAM]
        return self._compile({PAIRED_PROGRAM: paired}, threads=False)[0]

    def compile_paired_in_background(self, state: TrainerState) -> None:
        """Compiles ``validation_experience`` (where :meth:`compile_paired` would) in a thread
        while epochs run; epochs queue Validation alone until it is ready, then take it up
        (:meth:`_take_paired`). The numbers are the same either way; only the time to the
        first epoch changes (the paired program compiles both rollouts again). The thread is
        an executor's: a process that ends first waits for the compile, as one cut off by the
        interpreter's exit aborts the process. One process only (:meth:`_compile` waits for
        the others where there are several)."""
        if (not self.pairs_rollouts or PAIRED_PROGRAM in self.programs
                or self._paired_compiling is not None or jax.process_count() > 1):
            return
        program, args = self.jitted_programs(state, queued=True)[PAIRED_PROGRAM]
        # shapes and placements only: the state's buffers are donated by the epochs meanwhile
        args = jax.tree.map(parallel.abstract, args)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-paired")
        self._paired_compiling = pool.submit(
            compile_cached, program, args, name=PAIRED_PROGRAM,
            config=program_key_config(self.cfg, PAIRED_PROGRAM))
        pool.shutdown(wait=False)

    def _take_paired(self, block: bool = False) -> None:
        """Adds the background compile's ``validation_experience`` to :attr:`programs` if it
        is done (with ``block``: after waiting for it), raising what the compile raised."""
        compiling = self._paired_compiling
        if compiling is None or not (block or compiling.done()):
            return
        self._paired_compiling = None
        self.programs[PAIRED_PROGRAM] = compiling.result()[0]

    def wait_for_background_compile(self) -> None:
        """Waits for :meth:`compile_paired_in_background`'s compile, if one runs, and keeps its
        program."""
        self._take_paired(block=True)

    def _compile(self, jitted: dict, threads: bool) -> tuple[float, int]:
        """Adds ``jitted`` (:meth:`jitted_programs`' form) to :attr:`programs`; returns the
        milliseconds it took and how many the executable cache served. With ``threads`` the
        programs lower one at a time, in ``jitted``'s order, each compiling while the next lowers
        (:func:`~foxhunt_jax.jitcache.compile_programs`): that order puts the longest compiles
        first. In a run of several
        processes each then waits until every process has these programs
        (:func:`parallel.wait_for_all_processes`, not counted in the milliseconds), so that none
        starts a collective the others reach only after a longer compile."""
        start = time.perf_counter()
        built = compile_programs({name: (program, args, program_key_config(self.cfg, name))
                                  for name, (program, args) in jitted.items()},
                                 threads=threads)
        self.programs.update({name: compiled for name, (compiled, _) in built.items()})
        ms = (time.perf_counter() - start) * 1e3
        parallel.wait_for_all_processes("compiled " + ",".join(jitted))
        return ms, sum(int(loaded) for _, loaded in built.values())

    def run_epoch(self, state: TrainerState, queue_next: int = 0
                  ) -> tuple[TrainerState, EpochResults, dict]:
        """Runs one epoch through the compiled programs; returns ``(state, results, phase_ms)``
        with ``phase_ms`` the experience, training and validation milliseconds.

        ``queue_next``: 1 (or True) queues the next epoch's Experience and Training before
        waiting, 2 also its Validation paired with the following Experience (where
        :attr:`pairs_rollouts`; otherwise as 1); the returned state is then ahead (module
        docstring).
        """
        self._take_paired()
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.state is state:
            start, queued = ahead.since, ahead.epoch
        else:
            start = time.perf_counter()
            state, queued = self._queue_epoch(state)
        if queued.collected is not None and queue_next < 1:
            raise ValueError("the state holds the next epoch's Experience (queued with "
                             "queue_next=2): run this epoch with queue_next >= 1")
        if queued.validation is None:
            state, queued = self._queue_validation(state, queued, pair=queue_next >= 1)
        following = None
        if queue_next >= 1:  # queued after this Validation, which reads `state` first
            state, following = self._queue_epoch(state, queued.collected, fresh=False)
            if queue_next >= 2 and following.validation is None and self.pairs_rollouts:
                state, following = self._queue_validation(state, following, pair=True)

        phase_ms, validation_end = phase_times(start, queued)
        if following is not None:
            self.ahead = Ahead(state, following, since=validation_end)
        metrics, validated_params = queued.training.results
        paths, loss = queued.validation.results
        results = EpochResults(queued.experience.results, metrics, paths, loss,
                               validated_params)
        return state, results, phase_ms

    def _queue_validation(self, state: TrainerState, queued: QueuedEpoch, pair: bool
                          ) -> tuple[TrainerState, QueuedEpoch]:
        """Queues the Validation of the epoch whose Training produced ``state``; with ``pair``
        and the ``validation_experience`` program compiled, beside the next epoch's Experience
        (which then advances the state and is kept in ``collected``)."""
        inputs = self.inputs
        if pair and PAIRED_PROGRAM in self.programs:
            paths, loss, state, stats = self.programs[PAIRED_PROGRAM](
                inputs.validation_env_params, inputs.window_starts, inputs.train_env_params,
                state, inputs.schedule)
            collected = Queued(stats, ready_clock(stats))
        else:
            paths, loss = self.programs["validation"](
                inputs.validation_env_params, inputs.window_starts, self._local_agent(state))
            collected = None
        validation = Queued((paths, loss), ready_clock((paths, loss)))
        return state, queued._replace(validation=validation, collected=collected)

    def _queue_epoch(self, state: TrainerState, collected: Queued | None = None,
                     fresh: bool | None = None) -> tuple[TrainerState, QueuedEpoch]:
        """Queues an epoch's programs before Validation: Experience (unless ``collected``: its
        stats, already queued) and Training, or with :attr:`overlaps` the ``overlapped``
        program, behind the first collection where ``state`` is fresh (``fresh``: known by the
        caller; None reads ``state.epoch == 0``, which waits for the state). Validation is
        queued too where the program holds it (:attr:`validates_in_overlap`)."""
        inputs = self.inputs
        if not self.overlaps:
            if collected is None:
                state, stats = self.programs["experience"](inputs.train_env_params, state,
                                                           inputs.schedule)
                collected = Queued(stats, ready_clock(stats))
            # Training right behind Experience, so its launch overlaps Experience's device work
            # (Training donates the state, not the stats waited on)
            state, metrics, params = self.programs["training"](inputs.train_env_params, state,
                                                               inputs.schedule)
            return state, QueuedEpoch(collected, Queued((metrics, params), ready_clock(metrics)))
        first_collection = None
        if int(state.epoch) == 0 if fresh is None else fresh:
            state, first_stats = self.programs["experience"](inputs.train_env_params, state,
                                                             inputs.schedule)
            first_collection = ready_clock(first_stats)
        validation = None
        if self.validates_in_overlap:
            state, stats, metrics, paths, loss, params = self.programs[OVERLAPPED_PROGRAM](
                inputs.validation_env_params, inputs.window_starts, inputs.train_env_params,
                state, inputs.schedule)
            validation = Queued((paths, loss), ready_clock((paths, loss)))
        else:
            state, stats, metrics, params = self.programs[OVERLAPPED_PROGRAM](
                inputs.train_env_params, state, inputs.schedule)
        # Experience's clock: the first collection's end, else none (it then takes 0 ms);
        # Training's: the program's end, both of its chains, the learner's and the collection's
        return state, QueuedEpoch(Queued(stats, first_collection or (lambda: 0.0)),
                                  Queued((metrics, params), ready_clock((metrics, stats))),
                                  validation)

    def _local_agent(self, state: TrainerState) -> AgentState:
        """This process's first device's copy of the replicated agent (no transfer)."""
        return parallel.local_view(state.agent, parallel.local_device(self.mesh))
