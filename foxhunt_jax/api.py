"""Library entry points: :func:`train` and :func:`evaluate` (the CLI is a thin layer over them).

    from foxhunt_jax import load_config, train, evaluate
    result = train(load_config("smoke"), out_dir="runs/smoke")
    report = evaluate("runs/smoke", split="test")
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from foxhunt_jax import parallel
from foxhunt_jax.agent.value_range import edge_mass_warning
from foxhunt_jax.config import Config, dump_yaml, from_dict, read_yaml, replace, to_dict
from foxhunt_jax.errors import ConfigError, FoxhuntError, NonFiniteError
from foxhunt_jax.policy.spec import write_statistics
from foxhunt_jax.training import checkpoint, report
from foxhunt_jax.training.phases import TrainerState, all_finite
from foxhunt_jax.training.rundir import (RunWriter, check_run_folder, open_run, read_metrics,
                                         to_jsonable)
from foxhunt_jax.training.trainer import Trainer


@dataclass
class TrainResult:
    state: TrainerState
    trainer: Trainer
    history: list[dict]
    summary: dict  # final validation/test metrics of agent, buy-and-hold and random


def phase_line(rec: dict, epochs: int) -> str:
    """One epoch in the seed's phase form."""
    ms = rec["phase_ms"]
    val, bh = rec["val"], rec["val_buy_and_hold"]
    head = " | ".join(f"{k.capitalize()} {ms[k]:8.1f}" for k in
                      ("init", "compile", "experience", "training", "validation", "total"))
    return (f"epoch {rec['epoch']:>3}/{epochs} | {head} ms | loss {rec['loss']:.4f} | "
            f"eps {rec['epsilon']:.2f} | val sharpe {val['sharpe']:+.2f} (B&H {bh['sharpe']:+.2f}) "
            f"return {val['total_return']:+.2%} (B&H {bh['total_return']:+.2%})")


def compile_line(rec: dict, trainer: Trainer) -> str:
    """How the phase programs were obtained: compiled, or loaded from the executable cache."""
    ms, loaded = rec["phase_ms"], trainer.executables_loaded
    how = (f"{loaded} of {len(trainer.pipeline.programs)} loaded from the executable cache"
           if loaded
           else "compiled; none was in the executable cache")
    return (f"phase programs ready in {ms['compile'] / 1e3:.1f} s ({how}); state init "
            f"{ms['init'] / 1e3:.1f} s")


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


def _metadata(cfg: Config, epoch: int) -> dict:
    return {"epoch": epoch, "config": to_dict(cfg)}


def train(cfg: Config, out_dir: str | Path | None = None, *, resume: bool = False,
          progress: bool | None = None, log: Callable[[str], None] | None = None,
          final_report: bool = True, devices: list | None = None) -> TrainResult:
    """Trains for ``cfg.train.epochs`` epochs; with ``out_dir`` writes the run directory.

    ``out_dir`` is checked, marked and locked first (:func:`foxhunt_jax.training.rundir.open_run`):
    a file, a folder that cannot be written, a non-empty folder that holds no run, a fresh start
    into a run with a checkpoint and a folder another live process writes raise ConfigError
    before any data is loaded, and nothing is written. A fresh start into a run folder without
    a checkpoint drops its records. ``resume`` continues from the newest intact checkpoint in
    ``out_dir`` (a damaged one is skipped with a warning; the config must be the one the run was
    started with, apart from ``train.epochs``) and drops the records of later epochs; the
    checkpoint may come from another device count. Raises NonFiniteError when the loss or
    parameters become NaN/Inf; the last good checkpoint stays as it was.

    ``devices`` (default: every device of every process) run the ``train.shards`` shards; their
    count must divide it. In a multi-process run (:func:`foxhunt_jax.parallel.initialize` first)
    every process calls ``train``; process 0 alone writes the run directory's files (all take part
    in checkpoint saves) and, by default, prints.
    """
    lead = jax.process_index() == 0
    log = log or ((lambda s: print(s, flush=True)) if lead else (lambda s: None))
    if not lead:
        progress = False
    out = Path(out_dir) if out_dir is not None else None
    if resume and out is None:
        raise ConfigError("--resume needs the run folder (--out)")
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
            if replace(saved, train={"epochs": cfg.train.epochs}) != cfg:
                raise ConfigError(f"--resume: the config differs from {out}/config.yaml "
                                  "(only train.epochs may change)")
        writer = open_run(out, dump_yaml(cfg), resume=resume,
                          process_index=jax.process_index(), warn=_warn if lead else None)
    else:
        writer = None
    try:
        return _train(cfg, out, writer, resume=resume, progress=progress, log=log,
                      final_report=final_report, devices=devices)
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
           progress: bool | None, log: Callable[[str], None], final_report: bool,
           devices: list | None) -> TrainResult:
    """:func:`train` in a checked, locked run folder (``writer``), or without one."""
    trainer = Trainer.build(cfg, devices=devices)
    cfg = trainer.cfg  # network.support auto resolved: the run records the range it uses
    if writer is not None and not resume:
        writer.write_config(dump_yaml(cfg))
    if trainer.mesh.devices.size > 1 or jax.process_count() > 1:
        log(f"data parallel: {cfg.train.shards} shards on {parallel.describe(trainer.mesh)}")
    state = trainer.init_state()
    if resume:
        state, _, _ = checkpoint.restore_latest(out / "checkpoints", state, warn=_warn)
        writer.truncate_after(int(state.epoch))  # records run ahead of checkpoints
        log(f"resumed from epoch {int(state.epoch)}")
    elif writer is not None and jax.process_index() == 0:
        # what a policy of this run normalizes its inputs with
        write_statistics(out, trainer.tables, trainer.market)
    history = read_metrics(out) if (resume and out is not None) else []

    epochs = cfg.train.epochs
    bar = _progress(progress, epochs, int(state.epoch))
    epoch = int(state.epoch)
    warned = False
    try:
        while epoch < epochs:
            # Queue the next epoch's Experience and Training behind this epoch (their launches
            # then overlap GPU work) unless this epoch's state is to be checkpointed.
            save = out is not None and ((epoch + 1) % cfg.train.checkpoint_every == 0
                                        or epoch + 1 == epochs)
            state, rec = trainer.run_epoch(state, queue_next=epoch + 1 < epochs and not save)
            epoch = rec["epoch"]
            _check_finite(state, rec)
            if rec["phase_ms"]["compile"] > 0:  # the first epoch of this process
                (bar.console.print if bar else log)(compile_line(rec, trainer))
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
            if save:
                # every process calls save: orbax synchronizes them and process 0 writes
                checkpoint.save(out / "checkpoints", rec["epoch"], state,
                                _metadata(cfg, rec["epoch"]))
            if bar:
                bar.advance(bar.task_ids[0])
    finally:
        if bar:
            bar.stop()
    summary = {}
    if final_report:
        summary = _final_report(trainer, state, history, out, log)
    return TrainResult(state=state, trainer=trainer, history=history, summary=summary)


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


def _final_report(trainer: Trainer, state: TrainerState, history: list[dict], out: Path | None,
                  log) -> dict:
    summary: dict[str, Any] = {"epochs": int(state.epoch),
                               "bars_per_year": trainer.market.bars_per_year}
    curves = {}
    # Every process evaluates a local copy of the (replicated) agent on its own default device.
    agent = parallel.to_host(state.agent)
    for split in ("validation", "test"):
        res = trainer.evaluate_split(agent, split)
        summary[split] = {name: r["metrics"] for name, r in res.items()}
        curves[split] = {name: r["curve"] for name, r in res.items()}
        log(report.metrics_table(summary[split], title=f"{split} split (full walk)"))
    if out is not None and jax.process_index() == 0:
        report.write_report(out, summary, curves, history)
    return summary


def load_run(run_dir: str | Path, data: list[str] | None = None) -> tuple[Trainer, TrainerState]:
    """Rebuilds the trainer of a run directory and restores its newest intact checkpoint (a
    damaged one is skipped with a warning line; none intact: FoxhuntError)."""
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"{run} is not a run directory (no config.yaml)")
    cfg = from_dict(read_yaml(run / "config.yaml"))
    if data:
        cfg = replace(cfg, data={"source": list(data)})
    if checkpoint.latest_step(run / "checkpoints") is None:
        raise ConfigError(f"{run}/checkpoints holds no checkpoint")
    # the devices of this machine that divide train.shards: a run reads back anywhere
    trainer = Trainer.build(cfg, devices=parallel.fitting_devices(cfg.train.shards))
    state, _, _ = checkpoint.restore_latest(run / "checkpoints", trainer.init_state(), warn=_warn)
    return trainer, state


def evaluation_path(run_dir: str | Path, split: str, data: list[str] | None,
                    run_data: list[str]) -> Path:
    """Where :func:`evaluate` writes: ``report/evaluate_<split>.json`` on the run's own data,
    ``report/evaluate_<split>_<names>-<digest>.json`` on other data (``names``: the sources'
    file or builtin names; ``digest``: 8 hex digits of SHA-256 of the source list), so an
    evaluation on other data never replaces the run's own."""
    name = f"evaluate_{split}"
    if data and list(data) != list(run_data):
        stems = [Path(d.split(":", 1)[-1].split("?", 1)[0]).stem for d in data]
        names = re.sub(r"[^A-Za-z0-9._-]+", "_", "+".join(stems))[:40].strip("._") or "data"
        digest = hashlib.sha256(json.dumps(list(data)).encode()).hexdigest()[:8]
        name += f"_{names}-{digest}"
    return Path(run_dir) / "report" / f"{name}.json"


def evaluate(run_dir: str | Path, split: str = "test", data: list[str] | None = None,
             log: Callable[[str], None] | None = None) -> dict:
    """Greedy full-split evaluation of a trained run against buy-and-hold and random.

    ``data`` evaluates the trained agent on other market data (same features and config).
    Writes :func:`evaluation_path` (``report/evaluate_<split>.json`` on the run's own data),
    names it in a line, and returns the metrics by policy.
    """
    if split not in ("validation", "test"):
        raise ConfigError(f"--split must be validation or test, got {split!r}")
    log = log or print
    t0 = time.perf_counter()
    trainer, state = load_run(run_dir, data)
    res = trainer.evaluate_split(parallel.to_host(state.agent), split)
    metrics = {name: r["metrics"] for name, r in res.items()}
    log(report.metrics_table(metrics, title=f"{split} split (full walk)"))
    run_data = from_dict(read_yaml(Path(run_dir) / "config.yaml")).data.source
    path = evaluation_path(run_dir, split, data, run_data)
    payload = {"split": split, "data": data or list(trainer.cfg.data.source),
               "seconds": time.perf_counter() - t0, "metrics": metrics}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(to_jsonable(payload), indent=2))
        os.replace(tmp, path)
    except OSError as e:
        raise FoxhuntError(f"cannot write {path} ({(e.strerror or str(e)).lower()})") from None
    log(f"evaluation written to {path}")
    return metrics


__all__ = ["train", "evaluate", "load_run", "evaluation_path", "TrainResult", "phase_line",
           "all_finite"]
