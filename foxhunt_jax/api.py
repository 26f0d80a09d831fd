"""Library entry points: :func:`train` and :func:`evaluate` (the CLI is a thin layer over them).

    from foxhunt_jax import load_config, train, evaluate
    result = train(load_config("smoke"), out_dir="runs/smoke",
                   callbacks=[lambda record: print(record["epoch"], record["val"]["sharpe"])])
    report = evaluate("runs/smoke", split="test")

Both turn on the same compilation caches as the CLI (``compile_cache=False`` leaves JAX's cache
settings as they are) and print one line naming every file they wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from foxhunt_jax import parallel
from foxhunt_jax.agent.learner import AgentState
from foxhunt_jax.agent.value_range import edge_mass_warning
from foxhunt_jax.backend import resolve_config
from foxhunt_jax.config import (Config, differences, dump_yaml, from_dict, read_yaml, replace,
                                to_dict)
from foxhunt_jax.env.gymnax_task import TRADING, make_task
from foxhunt_jax.errors import ConfigError, FoxhuntError, NonFiniteError
from foxhunt_jax.files import write_atomic
from foxhunt_jax.jitcache import enable_compilation_cache
from foxhunt_jax.policy.policy import check_agent, restore_params, run_member_config
from foxhunt_jax.policy.spec import write_statistics
from foxhunt_jax.research.population import chosen_lines, population_report
from foxhunt_jax.training import checkpoint, report, validate
from foxhunt_jax.training.phases import TrainerState, all_finite, initial_agent
from foxhunt_jax.training.population import PopulationTrainer
from foxhunt_jax.training.rundir import (LOG_WRITERS, RunWriter, check_run_folder,
                                         checkpoint_steps, open_run, read_metrics, to_jsonable)
from foxhunt_jax.training.selection import Selection
from foxhunt_jax.training.trades import walk_trades, write_trades_csv
from foxhunt_jax.training.gymnax_trainer import GymnaxTrainer
from foxhunt_jax.training.trainer import Trainer


@dataclass
class TrainResult:
    state: TrainerState
    trainer: Trainer
    history: list[dict]
    summary: dict  # final validation/test metrics (metrics.evaluation_results' layout)
    selection: Selection | None = None  # the agent chosen on validation (train.select_by)
    selected_agent: AgentState | None = None  # that agent on the host (its network selected)


EpochCallback = Callable[[dict], None]


def phase_line(rec: dict, epochs: int) -> str:
    """One epoch: phase times, loss, epsilon, validation against buy-and-hold (a gymnax env:
    the validation episodes' mean return). Init and Compile are shown only on the epoch that
    paid them (they are 0 on the others)."""
    ms = rec["phase_ms"]
    val = rec["val"]
    head = " | ".join(f"{k.capitalize()} {ms[k]:8.1f}" for k in
                      ("init", "compile", "experience", "training", "validation", "total")
                      if k not in ("init", "compile") or ms[k] > 0)
    if "val_buy_and_hold" not in rec:  # a gymnax env (GymnaxTrainer's record)
        tail = f"val return {val['return']:.2f} (min {val['return_min']:.2f})"
    else:
        bh = rec["val_buy_and_hold"]
        tail = (f"val sharpe {val['sharpe']:+.2f} (B&H {bh['sharpe']:+.2f}) "
                f"return {val['total_return']:+.2%} (B&H {bh['total_return']:+.2%})")
    return (f"epoch {rec['epoch']:>3}/{epochs} | {head} ms | loss {rec['loss']:.4f} | "
            f"eps {rec['epsilon']:.2f} | {tail}")


def compile_line(trainer: Trainer) -> str:
    """How the phase programs were obtained: compiled, or loaded from the executable cache."""
    loaded = trainer.executables_loaded
    how = (f"{loaded} of {len(trainer.pipeline.programs)} loaded from the executable cache"
           if loaded
           else "compiled; none was in the executable cache")
    beside = " beside the compile" if trainer.init_beside_compile else ""
    return (f"phase programs ready in {trainer.compile_ms / 1e3:.1f} s ({how}); state init "
            f"{trainer.init_ms / 1e3:.1f} s{beside}")


def use_compile_cache(enabled: bool) -> None:
    """The CLI's caches (:func:`~foxhunt_jax.jitcache.enable_compilation_cache`: JAX's persistent
    cache and the executable cache, in ``$FOXHUNT_JAX_CACHE`` or ``~/.cache/foxhunt-jax/xla``)
    unless ``enabled`` is False or this process already chose a JAX compilation cache folder."""
    if enabled and not jax.config.jax_compilation_cache_dir:
        enable_compilation_cache()


def _check_finite(state: TrainerState, rec: dict) -> None:
    """NonFiniteError when the epoch's loss, parameters or optimizer state hold a NaN or Inf.

    The training program computes the two flags on the device; only a failed one reads the
    tree, to name its first bad leaf (``state`` may already hold the next epoch's Experience
    and Training; a NaN or Inf there stays there, and if it did not, the message names no leaf).
    """
    epoch = rec["epoch"]
    if not np.isfinite(rec["loss"]):
        raise NonFiniteError(f"epoch {epoch}: training loss is {rec['loss']}; stopped, last good "
                             "checkpoint kept")
    for flag, tree, what in (("finite_params", state.agent.params, "params"),
                             ("finite_opt_state", state.agent.opt_state, "optimizer state")):
        if not rec[flag]:
            checkpoint.assert_finite(tree, what, epoch)  # raises, naming the leaf
            raise NonFiniteError(f"epoch {epoch}: {what} not finite; stopped, last good "
                                 "checkpoint kept")


def _metadata(cfg: Config, epoch: int, selection: Selection) -> dict:
    return {"epoch": epoch, "config": to_dict(cfg), "selection": selection.to_json()}


def train(cfg: Config, out_dir: str | Path | None = None, *, resume: bool = False,
          progress: bool | None = None, log: Callable[[str], None] | None = None,
          callbacks: Sequence[EpochCallback] = (), log_to: Sequence[str] = LOG_WRITERS,
          compile_cache: bool = True, final_report: bool = True,
          devices: list | None = None) -> TrainResult:
    """Trains for ``cfg.train.epochs`` epochs; with ``out_dir`` writes the run directory.

    ``callbacks``: each is called on process 0 after every epoch (once its checkpoint, if any,
    is saved) as ``callback(record)`` with the epoch's record, the dict written as one line of
    ``metrics.jsonl`` (JSON types; nested: ``record["val"]["sharpe"]``;
    :func:`foxhunt_jax.training.rundir.flatten` gives the TensorBoard names such as
    ``"val/sharpe"``). An exception in a callback stops the run with the epoch recorded.
    ``log_to``: the run folder's writers, from ``("jsonl", "tensorboard")``; ``metrics.jsonl``
    is written whatever it says (resume and the report read it), so it chooses whether
    TensorBoard event files are written too. ``compile_cache``: :func:`use_compile_cache`.
    ``log``: where the text lines go (default: print on process 0).

    ``out_dir`` is checked, marked and locked first (:func:`foxhunt_jax.training.rundir.open_run`):
    a file, a folder that cannot be written, a non-empty folder that holds no run, a fresh start
    into a run with a checkpoint and a folder another live process writes raise ConfigError
    before any data is loaded, and nothing is written. A fresh start into a run folder without
    a checkpoint drops its records. ``resume`` continues from the newest intact checkpoint in
    ``out_dir`` (a damaged one is skipped with a warning; the config must be the one the run was
    started with, apart from ``train.epochs``) and drops the records of later epochs; the
    checkpoint may come from another device count. Raises NonFiniteError when the loss or
    parameters become NaN/Inf; the last good checkpoint stays as it was.

    Every epoch's validation metric ``train.select_by`` chooses the agent
    (:mod:`~foxhunt_jax.training.selection`); ``train.patience`` > 0 stops the run early. The
    selected agent's network is saved to ``out_dir/selected/<epoch>/`` before the checkpoint
    that names it, the final report walks it, and ``TrainResult.selected_agent`` holds it.

    ``train.population`` > 1 trains every member in one program per phase and returns a
    :class:`PopulationResult` (docs/population.md): one record a member an epoch (with
    ``member`` and ``seed``), per-member selections and selected networks
    (:func:`member_selected_dir`), and ``population.json`` in ``out_dir``.

    ``devices`` (default: every device of every process) run the ``train.shards`` shards; their
    count must divide it. In a multi-process run (:func:`foxhunt_jax.parallel.initialize` first)
    every process calls ``train``; process 0 alone writes the run directory's files (all take part
    in checkpoint saves) and, by default, prints.
    """
    lead = jax.process_index() == 0
    log = log or ((lambda s: print(s, flush=True)) if lead else (lambda s: None))
    if not lead:
        progress = False
    unknown = sorted(set(log_to) - set(LOG_WRITERS))
    if unknown:
        raise ConfigError(f"--log: unknown writer {', '.join(unknown)} (known: "
                          f"{', '.join(LOG_WRITERS)})")
    out = Path(out_dir) if out_dir is not None else None
    if resume and out is None:
        raise ConfigError("--resume needs the run folder (--out)")
    cfg = resolve_config(cfg, devices[0] if devices else None)  # config.yaml records it
    if cfg.env.name != TRADING:
        make_task(cfg.env.name)  # an unknown id or a missing gymnax fails before any writing
    if out is not None:
        # process 0, the writer, checks, marks and locks the folder before any data or compile
        # work (the others would race with its first writes)
        if lead:
            check_run_folder(out, resume)
        if resume:
            saved = from_dict(read_yaml(out / "config.yaml"))
            if cfg.network.support == "auto":  # config.yaml records the range auto derived
                cfg = replace(cfg, network={k: getattr(saved.network, k)
                                            for k in ("support", "v_min", "v_max")})
            # data.min_table_rows pads shapes and changes no number
            changed = differences(replace(saved, train={"epochs": cfg.train.epochs},
                                          data={"min_table_rows": cfg.data.min_table_rows}), cfg)
            if changed:
                keys = "; ".join(f"{k}: {a!r} in the run, {b!r} now" for k, a, b in changed)
                raise ConfigError(f"--resume: the config differs from {out}/config.yaml ({keys}); "
                                  "only train.epochs and data.min_table_rows may change")
        # a population writes P records an epoch: metrics.jsonl only (a member field each)
        writer = open_run(out, dump_yaml(cfg), resume=resume,
                          tensorboard="tensorboard" in log_to and cfg.train.population == 1,
                          process_index=jax.process_index(), warn=_warn if lead else None)
    else:
        writer = None
    use_compile_cache(compile_cache)
    try:
        return _train(cfg, out, writer, resume=resume, progress=progress, log=log,
                      callbacks=tuple(callbacks) if lead else (), final_report=final_report,
                      devices=devices)
    except BaseException:
        if writer is not None:  # a start that failed before its first epoch leaves nothing
            writer.discard_if_unused()
        raise
    finally:
        if writer is not None:
            writer.close()


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _train(cfg: Config, out: Path | None, writer: RunWriter | None, *, resume: bool,
           progress: bool | None, log: Callable[[str], None],
           callbacks: tuple[EpochCallback, ...], final_report: bool,
           devices: list | None) -> TrainResult:
    """:func:`train` in a checked, locked run folder (``writer``), or without one."""
    if cfg.train.population > 1:
        return _train_population(cfg, out, writer, resume=resume, log=log, callbacks=callbacks,
                                 final_report=final_report, devices=devices)
    trainer = build_trainer(cfg, devices)
    cfg = trainer.cfg  # network.support auto resolved: the run records the range it uses
    if writer is not None and not resume:
        writer.write_config(dump_yaml(cfg))
    if trainer.mesh.devices.size > 1 or jax.process_count() > 1:
        log(f"data parallel: {cfg.train.shards} shards on {parallel.describe(trainer.mesh)}")
    note = parallel.unused_devices_note(trainer.mesh, cfg.train.shards)
    if note is not None and devices is None:
        log(note)
    selection = Selection(cfg.train.select_by)
    epochs, patience = cfg.train.epochs, cfg.train.patience

    def queue_after(epoch: int, selection: Selection) -> tuple[bool, int]:
        """(save, queue_next) of the epoch after ``epoch``. Its ``queue_next``
        (:meth:`~foxhunt_jax.training.trainer.Trainer.run_epoch`) counts the epochs after it
        that may start before it is read, so their launches overlap GPU work: none where its
        state is to be checkpointed or it may be the last (early stopping), one where that
        holds for the epoch after it too."""
        def may_follow(ahead: int) -> bool:  # epoch + ahead + 1 may start after epoch + ahead
            upcoming = epoch + ahead
            may_stop = patience > 0 and selection.stale + ahead >= patience
            return (upcoming < epochs and not _checkpointed(out, cfg, upcoming)
                    and not may_stop)

        return (_checkpointed(out, cfg, epoch + 1),
                (2 if may_follow(2) else 1) if may_follow(1) else 0)

    if not resume and writer is not None and jax.process_index() == 0 and \
            trainer.tables is not None:  # what a policy of this run normalizes its inputs with
        write_statistics(out, trainer.tables, trainer.market)
    # a fresh run always compiles: its phase programs compile beside the state's init
    fresh = not resume and cfg.train.epochs > 0
    if fresh:
        log("compiling the phase programs (or loading them from the executable cache) ...")
        state = trainer.init_and_compile(queued=queue_after(0, selection)[1] >= 1)
        log(compile_line(trainer))
    else:
        state = trainer.init_state()
    if resume:
        state, meta, _ = checkpoint.restore_latest(out / "checkpoints", state, warn=_warn)
        writer.truncate_after(int(state.epoch))  # records run ahead of checkpoints
        if "selection" in meta:
            selection = Selection.from_json(meta["selection"])
        else:
            log("the checkpoint holds no selection (a run from before it): agents are "
                "selected from the resumed epochs on")
        log(f"resumed from epoch {int(state.epoch)}")
    if out is not None:  # agents selected after the state (a killed run's) are selected again
        checkpoint.drop_after(out / checkpoint.SELECTED_DIR, int(state.epoch))
    history = read_metrics(out) if (resume and out is not None) else []

    epoch = int(state.epoch)
    selected_params, unsaved = None, False  # the selected agent's parameters, once seen here

    if epoch < epochs and not selection.stops(patience):
        if not fresh:
            log("compiling the phase programs (or loading them from the executable cache) ...")
            # the paired rollouts' program compiles while the first epochs run without it
            trainer.compile(state, queued=queue_after(epoch, selection)[1] >= 1,
                            paired_in_background=True)
            log(compile_line(trainer))
        if final_report and not isinstance(trainer, GymnaxTrainer) and jax.process_count() == 1:
            # the report's walk programs compile while the epochs run
            trainer.compile_walks_in_background(parallel.to_host(state.agent))
    bar = _progress(progress, epochs, epoch)
    warned = False
    try:
        while epoch < epochs and not selection.stops(patience):
            scheduled, queue_next = queue_after(epoch, selection)
            state, rec = trainer.run_epoch(state, queue_next=queue_next)
            epoch = rec["epoch"]
            _check_finite(state, rec)
            selection, improved = selection.update(rec)
            if improved:
                selected_params, unsaved = trainer.validated_params, True
            rec.update(selection.record_fields(rec))
            history.append(rec)
            warning = None if warned else edge_mass_warning(
                rec["epoch"], rec["support_edge_mass"], cfg.network.v_min, cfg.network.v_max)
            if warning:  # once a run: the record of every epoch holds the number
                (bar.console.print if bar else log)(warning)
                warned = True
            if writer is not None:
                writer.log(rec)
            if rec["epoch"] % cfg.train.log_every == 0 or rec["epoch"] == epochs:
                (bar.console.print if bar else log)(phase_line(rec, epochs))
            stop = selection.stops(patience)
            if out is not None and (scheduled or stop):
                # every process calls save: orbax synchronizes them and process 0 writes. The
                # selected agent goes first: a checkpoint never names one that is not on disk.
                if unsaved:
                    checkpoint.save(out / checkpoint.SELECTED_DIR, selection.epoch,
                                    selected_params, _selected_metadata(cfg, selection),
                                    keep=checkpoint.KEEP + 1)
                    unsaved = False
                checkpoint.save(out / "checkpoints", rec["epoch"], state,
                                _metadata(cfg, rec["epoch"], selection))
            if callbacks:
                record = to_jsonable(rec)  # the metrics.jsonl line
                for callback in callbacks:
                    callback(record)
            if stop:
                (bar.console.print if bar else log)(
                    f"early stop after epoch {epoch}: validation {selection.metric} has not "
                    f"improved for {patience} epochs (train.patience); selected epoch "
                    f"{selection.epoch}")
            if bar:
                bar.advance(bar.task_ids[0])
    finally:
        if bar:
            bar.stop()
    summary, written = {}, []
    agent = _selected_agent(trainer, state, out, selection, selected_params)
    if final_report:
        report_of = _episode_report if isinstance(trainer, GymnaxTrainer) else _final_report
        summary, written = report_of(trainer, agent, state, selection, history, out, log)
        if writer is not None:
            writer.log_report(summary, int(state.epoch))
    if out is not None and jax.process_index() == 0:
        log(wrote_line(out, written, tensorboard=writer is not None and writer.tensorboard,
                       normalization=trainer.tables is not None))
    return TrainResult(state=state, trainer=trainer, history=history, summary=summary,
                       selection=selection, selected_agent=agent)


def _selected_metadata(cfg: Config, selection: Selection) -> dict:
    return {"epoch": selection.epoch, "select_by": selection.metric, "value": selection.value,
            "config": to_dict(cfg)}


def _selected_agent(trainer: Trainer, state: TrainerState, out: Path | None,
                    selection: Selection, selected_params) -> AgentState:
    """The selected agent on the host: its parameters from this process's run, or, for a
    resumed run whose selection came before the resume, from the run folder."""
    agent = parallel.to_host(state.agent)
    if selected_params is not None:
        return agent.replace(params=parallel.to_host(selected_params))
    if out is None or selection.epoch == 0:
        return agent
    return run_agent(out, state, "selected")[0]


def wrote_line(out: Path, report_files: Sequence[Path], tensorboard: bool,
               normalization: bool = True) -> str:
    """The last line of a run: every file and folder it wrote in ``out`` (``normalization``:
    normalization.json, a trading run's). Reads the folder only (process 0 calls it alone:
    opening an orbax manager would wait for the others)."""
    steps = checkpoint_steps(out)
    parts = ["config.yaml"] + (["normalization.json"] if normalization else [])
    parts += ["metrics.jsonl", f"checkpoints/ (latest epoch {steps[-1] if steps else None})"]
    parts += ["tb/ (TensorBoard events)"] if tensorboard else []
    parts += [str(Path(p).relative_to(out)) for p in report_files]
    return f"wrote {out}: " + ", ".join(parts)


def _progress(enabled: bool | None, total: int, done: int):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    bar = Progress("[bold]training", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    bar.add_task("epochs", total=total, completed=done)
    bar.start()
    return bar


def _final_report(trainer: Trainer, agent: AgentState, state: TrainerState,
                  selection: Selection, history: list[dict], out: Path | None,
                  log) -> tuple[dict, list[Path]]:
    """Full walks of the validation and test splits by ``agent`` (the selected one, on the
    host: every process evaluates its own copy), the summary and the report files written
    (process 0)."""
    summary: dict[str, Any] = {"epochs": int(state.epoch),
                               "bars_per_year": trainer.market.bars_per_year,
                               "agent": "selected", "selected_epoch": selection.epoch,
                               "select_metric": selection.metric,
                               f"best_{selection.metric}": selection.value,
                               "stopped_early": selection.stops(trainer.cfg.train.patience)}
    log(f"selected agent: epoch {selection.epoch} of {int(state.epoch)} (validation "
        f"{selection.metric} {selection.value:+.4g}, train.select_by)")
    evaluations = {}
    for split in ("validation", "test"):
        log(f"final walk of the {split} split (agent, baselines) ...")
        evaluations[split] = trainer.evaluate_split(agent, split)
        summary[split] = evaluations[split]["metrics"]
        log(report.evaluation_table(summary[split], title=f"{split} split (full walk, "
                                                           "equal-weight portfolio)"))
    if out is not None and jax.process_index() == 0:
        return summary, report.write_report(out, summary, evaluations, history)
    return summary, []


def build_trainer(cfg: Config, devices: list | None = None) -> Trainer:
    """The trainer of ``cfg.env.name``: :class:`Trainer` for ``trading``, else a
    :class:`~foxhunt_jax.training.gymnax_trainer.GymnaxTrainer`."""
    if cfg.env.name == TRADING:
        return Trainer.build(cfg, devices=devices)
    return GymnaxTrainer.build(cfg, devices=devices)


def _episode_report(trainer: GymnaxTrainer, agent: AgentState, state: TrainerState,
                    selection: Selection, history: list[dict], out: Path | None,
                    log) -> tuple[dict, list[Path]]:
    """A gymnax run's final report: the mean return of ``FINAL_EPISODES`` greedy episodes of
    ``agent`` (the selected one) from resets Validation never used, and the report files
    (process 0): summary.json, returns.png, phases.png."""
    log(f"selected agent: epoch {selection.epoch} of {int(state.epoch)} (validation "
        f"{selection.metric} {selection.value:.2f}, train.select_by)")
    log(f"final greedy episodes of {trainer.cfg.env.name} ...")
    final = trainer.evaluate_episodes(agent)
    log(f"final: mean return {final['mean_return']:.2f} over {final['episodes']} greedy "
        f"episodes (std {final['std_return']:.2f}, min {final['min_return']:.2f}, max "
        f"{final['max_return']:.2f}, mean length {final['mean_length']:.1f})")
    summary = {"env": trainer.cfg.env.name, "epochs": int(state.epoch),
               "env_steps": history[-1]["env_steps"] if history else 0,
               "agent": "selected", "selected_epoch": selection.epoch,
               "select_metric": selection.metric, f"best_{selection.metric}": selection.value,
               "stopped_early": selection.stops(trainer.cfg.train.patience), "final": final}
    if out is not None and jax.process_index() == 0:
        return summary, report.write_episode_report(out, summary, history)
    return summary, []


def read_run_config(run_dir: str | Path) -> Config:
    """The config a run directory was trained with; ConfigError when it holds none."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    return from_dict(read_yaml(path))


def load_run(run_dir: str | Path, data: list[str] | None = None) -> tuple[Trainer, TrainerState]:
    """Rebuilds the trainer of a run directory and restores its newest intact checkpoint (a
    damaged one is skipped with a warning line; none intact: FoxhuntError). The state's agent
    is the last one; :func:`run_agent` gives the selected one."""
    run = Path(run_dir)
    cfg = read_run_config(run)
    if cfg.env.name != TRADING:
        raise ConfigError(f"{run} trained env.name {cfg.env.name}: evaluate, act and export "
                          "serve trading runs (its report/summary.json holds the final greedy "
                          "episodes' return)")
    if cfg.train.population > 1:
        raise ConfigError(f"{run} holds a population of {cfg.train.population} agents: "
                          f"evaluate, act and export take one with --member K (its members' "
                          f"evaluations are in {run}/population.json)")
    if data:
        cfg = replace(cfg, data={"source": list(data)})
    if checkpoint.latest_step(run / "checkpoints") is None:
        raise ConfigError(f"{run}/checkpoints holds no checkpoint")
    # the devices of this machine that divide train.shards: a run reads back anywhere
    trainer = Trainer.build(cfg, devices=parallel.fitting_devices(cfg.train.shards))
    state, _, _ = checkpoint.restore_latest(run / "checkpoints", trainer.init_state(), warn=_warn)
    return trainer, state


def run_agent(run_dir: str | Path, state: TrainerState, agent: str = "selected"
              ) -> tuple[AgentState, dict]:
    """The agent of a run (:func:`load_run`'s ``state``) on the host, and what it is.

    ``agent="selected"``: the network of the epoch chosen on validation (``train.select_by``),
    read from ``DIR/selected/`` (:func:`~foxhunt_jax.training.checkpoint.restore_selected`; a
    damaged step is skipped with a warning line); a run from before selection gives its last
    agent, and the description says so. ``"last"``: the state's own. The description holds
    ``agent``, ``epoch`` and, for a selected agent, ``select_metric`` and ``select_value``.
    """
    check_agent(agent)
    host, epoch = parallel.to_host(state.agent), int(state.epoch)
    if agent == "last":
        return host, {"agent": "last", "epoch": epoch}
    found = checkpoint.restore_selected(Path(run_dir) / checkpoint.SELECTED_DIR, epoch,
                                        host.params, warn=_warn)
    if found is None:
        return host, {"agent": "last", "epoch": epoch,
                      "note": "the run records no selected agent (it predates selection)"}
    params, meta, step = found
    return host.replace(params=params), {"agent": "selected", "epoch": step,
                                         "select_metric": meta.get("select_by"),
                                         "select_value": meta.get("value")}


def agent_text(info: dict) -> str:
    """:func:`run_agent`'s description in words, e.g. ``selected agent (epoch 4, validation
    sharpe +1.23)``; a population member's names the member."""
    if info.get("member") is not None:
        return f"member {info['member']}'s {info['text']}"
    if info["agent"] == "selected":
        value = info.get("select_value")
        shown = "n/a" if value is None else f"{value:+.4g}"
        return (f"selected agent (epoch {info['epoch']}, validation {info['select_metric']} "
                f"{shown})")
    return f"last agent (epoch {info['epoch']})" + (f"; {info['note']}" if "note" in info else "")


def evaluation_path(run_dir: str | Path, split: str, data: list[str] | None,
                    run_data: list[str], agent: str = "selected",
                    member: int | None = None) -> Path:
    """Where :func:`evaluate` writes: ``report/evaluate_<split>.json`` on the run's own data,
    ``report/evaluate_<split>_<names>-<digest>.json`` on other data (``names``: the sources'
    file or builtin names; ``digest``: 8 hex digits of SHA-256 of the source list), so an
    evaluation on other data never replaces the run's own; ``agent="last"`` adds ``_last``,
    a population's ``member`` ``_member<K>``."""
    name = (f"evaluate_{split}" + ("" if member is None else f"_member{member}")
            + ("_last" if agent == "last" else ""))
    if data and list(data) != list(run_data):
        stems = [Path(d.split(":", 1)[-1].split("?", 1)[0]).stem for d in data]
        names = re.sub(r"[^A-Za-z0-9._-]+", "_", "+".join(stems))[:40].strip("._") or "data"
        digest = hashlib.sha256(json.dumps(list(data)).encode()).hexdigest()[:8]
        name += f"_{names}-{digest}"
    return Path(run_dir) / "report" / f"{name}.json"


def _member_agent(run_dir: str | Path, run_cfg: Config, data: list[str] | None, agent: str,
                  member: int | None) -> tuple[Trainer, AgentState, dict]:
    """A population member's trainer (its own config, :func:`~foxhunt_jax.policy.policy.
    run_member_config`) and agent (:func:`~foxhunt_jax.policy.policy.restore_params`), with
    :func:`run_agent`'s description."""
    run = Path(run_dir)
    cfg = run_member_config(run, run_cfg, member)
    if data:
        cfg = replace(cfg, data={"source": list(data)})
    trainer = Trainer.build(cfg, devices=parallel.fitting_devices(cfg.train.shards))
    params, epoch, which, note = restore_params(run, run_cfg, trainer.learner, agent, _warn,
                                                member)
    # the agent's structure around the restored network (no episodes or replay are built)
    host = parallel.to_host(initial_agent(trainer.learner, trainer.env_params["train"],
                                          jax.random.PRNGKey(0))).replace(params=params)
    return trainer, host, {"agent": which, "epoch": epoch, "member": member, "text": note}


def evaluate(run_dir: str | Path, split: str = "test", data: list[str] | None = None,
             log: Callable[[str], None] | None = None, agent: str = "selected",
             compile_cache: bool = True, member: int | None = None) -> dict:
    """Greedy full-split evaluation of a trained run against buy-and-hold, flat and the random
    policies.

    ``data`` evaluates the trained agent on other market data (same features and config).
    ``agent``: ``"selected"`` (the epoch chosen on validation) or ``"last"`` (:func:`run_agent`).
    Writes :func:`evaluation_path` (``report/evaluate_<split>.json`` on the run's own data)
    and beside it, with the same name: ``.png``, the equity (with the random band), drawdown
    and exposure of the split's portfolios by date, and ``_trades.csv``, the agent's trades
    (:func:`foxhunt_jax.training.metrics.trade_log`); names them in a line and returns its
    ``metrics``: the layout of :func:`~foxhunt_jax.training.metrics.evaluation_results`
    (portfolio metrics by policy, ``random`` percentiles, ``agent_percentile``,
    ``per_instrument``). ``compile_cache``: :func:`use_compile_cache`. ``member``: of a
    population run (required there), member K's agent under its own config, written to
    ``report/evaluate_<split>_member<K>.*``.
    """
    if split not in ("validation", "test"):
        raise ConfigError(f"--split must be validation or test, got {split!r}")
    check_agent(agent)
    log = log or print
    use_compile_cache(compile_cache)
    t0 = time.perf_counter()
    run_cfg = read_run_config(run_dir)
    if run_cfg.train.population > 1 or member is not None:
        trainer, policy, info = _member_agent(run_dir, run_cfg, data, agent, member)
    else:
        trainer, state = load_run(run_dir, data)
        policy, info = run_agent(run_dir, state, agent)
    log(f"walking the {split} split greedily (agent, baselines) ...")
    res = trainer.evaluate_split(policy, split)
    metrics = res["metrics"]
    log(report.evaluation_table(metrics, title=f"{split} split (full walk, equal-weight "
                                              f"portfolio), {agent_text(info)}"))
    path = evaluation_path(run_dir, split, data, run_cfg.data.source, agent, member)
    params, starts, lengths = validate.evaluation_params(trainer.tables, trainer.cfg.env, split)
    trades = walk_trades(params, starts, lengths, res["paths"]["agent"]["action"],
                         trainer.tables, trainer.cfg)
    payload = {"split": split, "data": data or list(trainer.cfg.data.source), "agent": info,
               "instruments": [trainer.tables.instrument_names[int(trainer.tables.instrument[s])]
                               for s in starts],
               "seconds": time.perf_counter() - t0, "metrics": metrics}
    written = []
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        written.append(write_atomic(path, json.dumps(to_jsonable(payload), indent=2)))
        written.append(report.plot_equity(path.with_suffix(".png"), res,
                                          f"Equal-weight portfolio on the {split} split"))
        written.append(write_trades_csv(path.with_name(path.stem + "_trades.csv"), trades))
    except OSError as e:
        raise FoxhuntError(f"cannot write {e.filename or path} "
                           f"({(e.strerror or str(e)).lower()})") from None
    log(f"evaluation written to {', '.join(map(str, written))} ({len(trades)} trades)")
    return metrics


# ---------------------------------------------------------------------------------------------
# Populations (train.population > 1): one program trains every member (training/population.py)

POPULATION_FILE = "population.json"


@dataclass
class PopulationResult:
    """What :func:`train` returns for ``train.population`` > 1."""

    state: TrainerState  # every leaf [P, ...]
    trainer: PopulationTrainer
    history: list[dict]  # every member's epoch records (each with ``member`` and ``seed``)
    members: list[dict]  # one dict a member: what population.json holds
    selections: list[Selection]
    # each member's selected agent's test walk (Trainer.evaluate_split); empty without the
    # final report
    test_evaluations: list[dict] = dataclasses.field(default_factory=list)

    @property
    def chosen(self) -> int:
        """The member chosen by its full validation walk's Sharpe, the first on ties (the rule
        of :func:`~foxhunt_jax.research.population.chosen_member`); no test figure takes
        part."""
        sharpes = [m["validation"]["agent"]["sharpe"] for m in self.members]
        return int(np.argmax(np.nan_to_num(np.asarray(sharpes, np.float64), nan=-np.inf)))


def member_selected_dir(out: Path, index: int) -> Path:
    """Where member ``index``'s selected networks are saved: ``selected/member_<index>/``."""
    return out / checkpoint.SELECTED_DIR / f"member_{index}"


def _population_metadata(cfg: Config, epoch: int, selections: list[Selection],
                         window_returns: list) -> dict:
    return {"epoch": epoch, "config": to_dict(cfg),
            "selections": [s.to_json() for s in selections],
            "window_returns": [None if w is None else np.asarray(w).tolist()
                               for w in window_returns]}


def _check_member_finite(rec: dict) -> None:
    if not (np.isfinite(rec["loss"]) and rec["finite_params"] and rec["finite_opt_state"]):
        raise NonFiniteError(f"epoch {rec['epoch']}: member {rec['member']}'s loss, parameters "
                             "or optimizer state are not finite; stopped, last good checkpoint "
                             "kept")


def population_line(records: list[dict], epochs: int) -> str:
    """One epoch of a population: phase times and the members' validation Sharpe ratios."""
    ms = records[0]["phase_ms"]
    head = " | ".join(f"{k.capitalize()} {ms[k]:8.1f}" for k in
                      ("init", "compile", "experience", "training", "validation", "total")
                      if k not in ("init", "compile") or ms[k] > 0)
    sharpe = np.asarray([r["val"]["sharpe"] for r in records], np.float64)
    best = int(np.nanargmax(sharpe)) if np.isfinite(sharpe).any() else 0
    return (f"epoch {records[0]['epoch']:>3}/{epochs} | {head} ms | {len(records)} members | "
            f"val sharpe mean {np.nanmean(sharpe):+.2f} min {np.nanmin(sharpe):+.2f} max "
            f"{np.nanmax(sharpe):+.2f} (member {best})")


def _checkpointed(out: Path | None, cfg: Config, epoch: int) -> bool:
    """Whether a run writing to ``out`` checkpoints its state after ``epoch``: every
    ``train.checkpoint_every`` epochs and the last (an early stop checkpoints too)."""
    return out is not None and (epoch % cfg.train.checkpoint_every == 0
                                or epoch == cfg.train.epochs)


def _train_population(cfg: Config, out: Path | None, writer: RunWriter | None, *, resume: bool,
                      log: Callable[[str], None], callbacks: tuple[EpochCallback, ...],
                      final_report: bool, devices: list | None) -> PopulationResult:
    """:func:`train` of a population: every member's records, selection, selected networks and
    final evaluation; the checkpoint holds every member (resume is exact for each). The
    members are split over ``devices`` (default: this process's) whose count divides P."""
    if jax.process_count() > 1:
        raise ConfigError("train.population > 1 runs in one process (its members are split "
                          "over that process's devices)")
    pop = PopulationTrainer.build(cfg, devices=devices)
    cfg, size = pop.cfg, pop.size
    if writer is not None and not resume:
        writer.write_config(dump_yaml(cfg))
    varied = sorted({k for m in pop.members for k in m})
    log(f"population: {size} members (seeds {cfg.train.seed}..{cfg.train.seed + size - 1}"
        f"{'; varying ' + ', '.join(varied) if varied else ''}) in one program on "
        f"{pop.mesh.size} device(s)")
    state = pop.init_state()
    selections = [Selection(cfg.train.select_by) for _ in range(size)]
    window_returns: list = [None] * size  # each member's selected epoch's [W] window returns
    if resume:
        state, meta, _ = checkpoint.restore_latest(out / "checkpoints", state, warn=_warn)
        writer.truncate_after(int(state.epoch[0]))
        selections = [Selection.from_json(s) for s in meta["selections"]]
        window_returns = [None if w is None else np.asarray(w) for w in meta["window_returns"]]
        log(f"resumed from epoch {int(state.epoch[0])}")
    elif writer is not None:
        write_statistics(out, pop.trainer.tables, pop.trainer.market)
    epoch, epochs, patience = int(state.epoch[0]), cfg.train.epochs, cfg.train.patience
    if out is not None:
        for i in range(size):
            checkpoint.drop_after(member_selected_dir(out, i), epoch)
    history = read_metrics(out) if (resume and out is not None) else []
    selected_params: list = [None] * size
    unsaved: set[int] = set()
    if epoch < epochs and not all(s.stops(patience) for s in selections):
        log("compiling the population's phase programs ...")
        pop.compile(state)
        log(f"phase programs ready in {pop.compile_ms / 1e3:.1f} s ({pop.executables_loaded} "
            f"of 3 loaded from the executable cache); state init {pop.init_ms / 1e3:.1f} s")
        if final_report and jax.process_count() == 1:  # every member walks these programs
            pop.trainer.compile_walks_in_background(
                parallel.to_host(jax.tree.map(lambda x: x[0], state.agent)))

    def queues_after(epoch: int) -> bool:
        """Whether the epoch after ``epoch`` queues the one after it (the single-agent rule:
        not where its state is to be checkpointed or it may be the last)."""
        upcoming = epoch + 1
        may_stop = patience > 0 and all(s.stops(patience) or s.stale + 1 >= patience
                                        for s in selections)
        return upcoming < epochs and not _checkpointed(out, cfg, upcoming) and not may_stop

    while epoch < epochs and not all(s.stops(patience) for s in selections):
        state, records, extra = pop.run_epoch(state, queue_next=queues_after(epoch))
        epoch = records[0]["epoch"]
        for i, rec in enumerate(records):
            _check_member_finite(rec)
            if not selections[i].stops(patience):  # a member out of patience keeps its choice
                selections[i], improved = selections[i].update(rec)
                if improved:
                    selected_params[i] = pop.member_params(pop.validated_params, i)
                    window_returns[i] = extra["window_returns"][i]
                    unsaved.add(i)
            rec.update(selections[i].record_fields(rec))
            history.append(rec)
            if writer is not None:
                writer.log(rec)
        if epoch % cfg.train.log_every == 0 or epoch == epochs:
            log(population_line(records, epochs))
        stop = all(s.stops(patience) for s in selections)
        if _checkpointed(out, cfg, epoch) or (out is not None and stop):
            for i in sorted(unsaved):  # selected networks first: a checkpoint names saved ones
                checkpoint.save(member_selected_dir(out, i), selections[i].epoch,
                                selected_params[i],
                                dict(_selected_metadata(cfg, selections[i]), member=i),
                                keep=checkpoint.KEEP + 1)
            unsaved.clear()
            checkpoint.save(out / "checkpoints", epoch, state,
                            _population_metadata(cfg, epoch, selections, window_returns))
        for rec in records if callbacks else ():
            for callback in callbacks:
                callback(to_jsonable(rec))
        if stop:
            log(f"early stop after epoch {epoch}: no member's validation {cfg.train.select_by} "
                f"improved for {patience} epochs (train.patience)")
    members: list[dict] = []
    written: list[Path] = []
    tests: list[dict] = []
    if final_report:
        members, tests = _population_report(pop, state, out, selections, selected_params,
                                            window_returns, log)
        if out is not None and jax.process_index() == 0:
            written = [out / POPULATION_FILE] + _write_population_report(
                members, out / "report", pop.trainer.market.bars_per_year, log)
    if out is not None:
        log(wrote_line(out, written, tensorboard=False))
    return PopulationResult(state=state, trainer=pop, history=history, members=members,
                            selections=selections, test_evaluations=tests)


def _population_report(pop: PopulationTrainer, state: TrainerState, out: Path | None,
                       selections: list[Selection], selected_params: list,
                       window_returns: list, log) -> tuple[list[dict], list[dict]]:
    """Full validation and test walks of every member's selected agent (one member at a time on
    the host); writes ``population.json``: one dict a member (docs/population.md). Returns
    those dicts and each member's test walk."""
    members, tests = [], []
    for i in range(pop.size):
        agent = parallel.to_host(jax.tree.map(lambda x: x[i], state.agent))
        if selected_params[i] is not None:
            agent = agent.replace(params=selected_params[i])
        elif out is not None and selections[i].epoch:
            found = checkpoint.restore_selected(member_selected_dir(out, i), int(state.epoch[0]),
                                                agent.params, warn=_warn)
            if found is not None:
                agent = agent.replace(params=found[0])
        trainer = pop.member_trainer(i)
        walks = {split: trainer.evaluate_split(agent, split) for split in ("validation", "test")}
        test = walks["test"]
        tests.append(test)
        members.append({
            "member": i, "seed": pop.seed(i), "hparams": dict(pop.members[i]),
            "select_metric": selections[i].metric, "selected_epoch": selections[i].epoch,
            "select_value": selections[i].value,
            "validation": walks["validation"]["metrics"], "test": test["metrics"],
            "test_percentile": test["metrics"]["agent_percentile"],
            "validation_window_returns": window_returns[i],
            "test_equity": test["curves"]["agent"],
            "test_dates": [str(d) for d in np.asarray(test["dates"]).astype("datetime64[s]")]})
        agent_metrics = test["metrics"]["agent"]
        log(f"member {i} (seed {pop.seed(i)}): selected epoch {selections[i].epoch}, test "
            f"sharpe {agent_metrics['sharpe']:+.2f}, percentile vs random "
            f"{test['metrics']['agent_percentile'].get('sharpe', float('nan')):.0f}")
    if out is not None and jax.process_index() == 0:
        path = out / POPULATION_FILE
        try:
            write_atomic(path, json.dumps(to_jsonable({
                "bars_per_year": pop.trainer.market.bars_per_year, "members": members}),
                indent=1))
        except OSError as e:
            raise FoxhuntError(f"cannot write {e.filename or path} "
                               f"({(e.strerror or str(e)).lower()})") from None
    return members, tests


def _write_population_report(members: list[dict], out: Path, bars_per_year: float,
                             log) -> list[Path]:
    """The population report's files (:func:`~foxhunt_jax.research.population.
    population_report`) and its chosen-member lines; a member it cannot score (a non-finite
    metric) leaves it unwritten with one warning line, the trained run intact."""
    try:
        summary = population_report(report_rows(members), out, bars_per_year)
    except ValueError as e:
        _warn(f"warning: population report not written: {e}")
        return []
    for line in chosen_lines(summary["chosen"], len(members)):
        log(line)
    return [Path(p) for p in summary["written"]]


def report_rows(members: list[dict]) -> list[dict]:
    """``population.json``'s members in the input form of
    :func:`~foxhunt_jax.research.population.population_report`: the agent's own metrics, its
    Sharpe percentile against the random band and its per-bar test log returns."""
    return [dict(m, validation=m["validation"]["agent"], test=m["test"]["agent"],
                 test_percentile=m["test_percentile"]["sharpe"],
                 test_returns=np.diff(np.log(np.asarray(m["test_equity"], np.float64))).tolist())
            for m in members]


__all__ = ["train", "evaluate", "load_run", "build_trainer", "run_agent", "agent_text",
           "evaluation_path", "TrainResult", "PopulationResult", "POPULATION_FILE",
           "member_selected_dir", "phase_line", "all_finite"]
