"""The run folder: its marker, its lock, config.yaml, metrics.jsonl and TensorBoard events.

Layout of ``out_dir``::

    run.json          the marker, written first: format, created, package version, config digest
    run.lock          the writer's lock: pid, host and start time of the process that holds it
    config.yaml       the resolved configuration of the run
    metrics.jsonl     one JSON object per epoch (strict JSON: NaN and Inf are written as null)
    tb/               TensorBoard event files (the same scalars, nested keys joined with "/";
                      not written when the writers, LOG_WRITERS, leave tensorboard out)
    checkpoints/      orbax checkpoints (foxhunt_jax.training.checkpoint)
    report/           summary.json and plots (foxhunt_jax.training.report)

:func:`open_run` guards a folder before anything is computed (:func:`check_run_folder`): a file,
a folder that cannot be written, a non-empty folder without ``run.json`` and a fresh start into
a run that holds a checkpoint are refused with one :class:`~foxhunt_jax.errors.ConfigError`,
and nothing is written. A folder from before the marker (``config.yaml`` beside a
``checkpoints/`` folder) is adopted: ``run.json`` is added to it. One process writes a run:
``run.lock`` is held with ``fcntl.flock`` for the run's life; a lock left by a process that is
gone is taken over with one warning.

An epoch record is a nested dict of numbers with an integer ``"epoch"``, for example
``{"epoch": 3, "loss": 0.41, "epsilon": 0.8, "val": {"sharpe": 1.2, ...},
"val_buy_and_hold": {...}, "phase_ms": {"experience": 48.0, ...}}``; TensorBoard sees
``loss``, ``val/sharpe``, ``phase_ms/experience`` at step ``epoch``.

Each line is flushed and fsynced as it is written, so a killed run loses at most the line being
written; :func:`read_metrics` skips such a partial last line. Records always run ahead of
checkpoints; on resume ``truncate_after(e)`` drops the records of epochs after the restored
checkpoint's epoch ``e`` from metrics.jsonl and rewrites the event files without their events
of those epochs (and without a record torn by a kill), so every epoch appears once in both; a
fresh start into a run folder without a checkpoint drops every record (``truncate_after(0)``).

Only process 0 of a multi-host run writes; a writer with ``process_index != 0`` does nothing.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import socket
import struct
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from foxhunt_jax.files import write_atomic
from foxhunt_jax.version import __version__
from foxhunt_jax.errors import ConfigError, DataError

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
# The writers of a run's epoch records: metrics.jsonl is always written (resume and the report
# read it); the others are chosen (train --log, api.train(log_to=...)).
LOG_WRITERS = ("jsonl", "tensorboard")
RUN_FILE = "run.json"
STATISTICS_FILE = "normalization.json"  # the train split's feature statistics (policy/spec.py)
LOCK_FILE = "run.lock"
CHECKPOINT_DIR = "checkpoints"
RUN_FORMAT = 1


def to_jsonable(value: Any) -> Any:
    """Nested dicts/lists of NumPy/JAX scalars and arrays -> plain JSON (non-finite -> None)."""
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (str, type(None))):
        return value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # np.ndarray, jax.Array
        arr = np.asarray(value)
        if arr.dtype.kind == "V" and np.dtype(arr.dtype).name in ("bfloat16", "float16"):
            arr = arr.astype(np.float64)  # ml_dtypes floats (bfloat16) are not kind "f"
        if arr.dtype.kind in "biuf":
            return to_jsonable(arr.item() if arr.ndim == 0 else arr.tolist())
    raise TypeError(f"cannot write {type(value).__name__} to JSON: {value!r}")


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"val": {"sharpe": 1}}`` -> ``{"val/sharpe": 1}`` (leaves kept as they are)."""
    out: dict[str, Any] = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def _drop_partial_line(path: Path) -> None:
    """Cuts an unterminated last line (a write killed midway) so appends start on a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())


def _parse_lines(path: Path) -> list[dict]:
    """Complete records of a metrics.jsonl; a partial last line (killed mid-write) is skipped."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    records = []
    # The piece after the last "\n" is "" when the file is complete, else a line whose write
    # never finished: it is left out.
    for i, line in enumerate(lines[:-1]):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise DataError(str(path), "is not valid JSON lines", row=i + 1) from None
    return records


def read_metrics(out_dir: str | os.PathLike) -> list[dict]:
    """Epoch records of a run directory in file order (``[]`` if there are none yet)."""
    return _parse_lines(Path(out_dir) / METRICS_FILE)


# ---------------------------------------------------------------------------------------------
# TensorBoard event files


def _masked_crc(data: bytes) -> int:
    from tensorboardX.record_writer import masked_crc32c  # late: only a truncation needs it

    return masked_crc32c(data)


def _event_records(data: bytes) -> list[tuple[bytes, bytes]]:
    """The complete records of a TFRecord event file as ``(framed bytes, payload)``; reading stops
    at the first record that is torn (a write killed midway) or whose checksums fail."""
    records, pos = [], 0
    while pos + 12 <= len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        end = pos + 12 + length + 4
        if end > len(data):
            break
        (header_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        payload = data[pos + 12:pos + 12 + length]
        (payload_crc,) = struct.unpack("<I", data[end - 4:end])
        if header_crc != _masked_crc(header) or payload_crc != _masked_crc(payload):
            break
        records.append((data[pos:end], payload))
        pos = end
    return records


def truncate_events(path: Path, epoch: int) -> None:
    """Rewrites one event file without its events of steps after ``epoch`` (and without a torn
    last record); a file left with no scalar is removed. Atomic: a kill leaves the old file or
    the new one."""
    from tensorboardX.proto import event_pb2  # late: only process 0 reads events

    data = Path(path).read_bytes()
    records = _event_records(data)
    if not records:  # torn within its first record, or not an event file: left as it is
        return
    kept, scalars, dropped = [], 0, False
    for framed, payload in records:
        event = event_pb2.Event.FromString(payload)
        if event.step > epoch and (event.HasField("summary") or event.HasField("session_log")):
            dropped = True
            continue
        scalars += event.HasField("summary")
        kept.append(framed)
    if not scalars:
        Path(path).unlink()
    elif dropped or sum(map(len, kept)) != len(data):
        write_atomic(path, b"".join(kept))


# ---------------------------------------------------------------------------------------------
# Guarding a run folder


def checkpoint_steps(out_dir: str | os.PathLike) -> list[int]:
    """Steps of the checkpoint folders in ``out_dir/checkpoints`` (orbax renames a step's folder
    to its number when the save is complete), ascending."""
    folder = Path(out_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir())


def _folder_kind(out: Path) -> str:
    """``"run"`` (marked), ``"legacy"`` (a run from before the marker), ``"empty"`` or
    ``"other"`` (a non-empty folder that is no run)."""
    if (out / RUN_FILE).is_file():
        return "run"
    if (out / CONFIG_FILE).is_file() and (out / CHECKPOINT_DIR).is_dir():
        return "legacy"
    return "other" if any(out.iterdir()) else "empty"


def _probe_writable(folder: Path, out: Path) -> None:
    """Creates and removes a file in ``folder``: catches read-only file systems, immutable
    folders and missing permissions alike (``os.access`` misses the first two, and root)."""
    probe = folder / f".foxhunt-write-test-{os.getpid()}-{time.time_ns()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as e:
        raise ConfigError(f"run folder {out}: cannot write in {folder} "
                          f"({(e.strerror or str(e)).lower()})") from None
    os.close(fd)
    os.unlink(probe)


def check_run_folder(out: str | os.PathLike, resume: bool, *, locked: bool = False) -> str:
    """Whether a run may be started (``resume=False``) or resumed in ``out``; writes nothing.

    Returns ``"new"`` (absent or empty), ``"run"`` or ``"legacy"`` (a folder with config.yaml
    and checkpoints/ but no run.json, written before the marker existed: it is adopted). Raises
    ConfigError for a path that is not a folder, a folder that cannot be written, a non-empty
    folder without run.json, a folder whose lock a live process holds (``locked``: this
    process holds it), a fresh start into a run that holds a checkpoint and a resume without a
    checkpoint.
    """
    out = Path(out)
    try:
        return _check_run_folder(out, resume, locked)
    except PermissionError as e:
        raise ConfigError(f"run folder {out}: cannot read {e.filename} (permission denied)") \
            from None


def _check_run_folder(out: Path, resume: bool, locked: bool) -> str:
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise ConfigError(f"run folder {out} exists and is not a folder")
        kind = _folder_kind(out)
    else:
        parent = out.absolute().parent
        while not (parent.exists() or parent.is_symlink()):
            parent = parent.parent
        if not parent.is_dir():
            raise ConfigError(f"run folder {out}: {parent} is not a folder")
        kind = "empty"
        _probe_writable(parent, out)
    if kind == "other":
        raise ConfigError(f"run folder {out} is not empty and holds no run (no {RUN_FILE}); "
                          "choose a new or empty folder")
    if kind in ("run", "legacy") and not locked:
        _refuse_if_held(out)
    steps = checkpoint_steps(out) if kind != "empty" else []
    if resume and kind == "empty":
        raise ConfigError(f"--resume: no run in {out}")
    if resume and not steps:
        raise ConfigError(f"--resume: no checkpoint found in {out / CHECKPOINT_DIR}")
    if not resume and steps:
        raise ConfigError(f"run folder {out} already holds a run (checkpoint of epoch "
                          f"{steps[-1]}); use --resume or another folder")
    if out.is_dir():
        for folder in (out, out / CHECKPOINT_DIR, out / "report", out / "tb"):
            if folder.is_dir():
                _probe_writable(folder, out)
    return "new" if kind == "empty" else kind


def _in_use(out: Path, holder: dict | None) -> ConfigError:
    return ConfigError(f"run folder {out} is in use by {_holder_text(holder)}; wait for it to "
                       "end or choose another folder")


def _refuse_if_held(out: Path) -> None:
    """ConfigError naming the holder when a live process holds ``out``'s lock (a shared flock,
    taken and dropped at once, tells without writing anything)."""
    path = out / LOCK_FILE
    if not path.is_file():
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # RunLock.acquire reports it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(out, _read_holder(fd)) from None
    finally:
        os.close(fd)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


class RunLock:
    """``run.lock``, held with ``fcntl.flock`` while a process writes the run; it holds that
    process's pid, host and start time (empty once released). The kernel drops the flock of a
    process that dies, so a lock file that names a process but is not locked was left by a
    killed run on this host, and is taken over."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, out: Path, warn: Callable[[str], None]) -> "RunLock":
        path = out / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"run folder {out}: cannot open {path} "
                              f"({(e.strerror or str(e)).lower()})") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _in_use(out, _read_holder(fd)) from None
            holder = _read_holder(fd)
            host = socket.gethostname()
            if holder is not None and holder.get("host") not in (None, host):
                # a flock taken on another host may not reach this one (network file systems)
                raise ConfigError(f"run folder {out} is locked by {_holder_text(holder)}; if "
                                  f"that process has ended, delete {path}")
            if holder is not None:
                warn(f"warning: {out}: took over the lock of {_holder_text(holder)}, which is "
                     "no longer running")
            info = {"pid": os.getpid(), "host": host, "since": _now()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        """Empties the lock file, then releases the flock."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None


def _read_holder(fd: int) -> dict | None:
    """The holder a lock file names (None when empty; unreadable contents name no pid)."""
    text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    if not text:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _holder_text(holder: dict | None) -> str:
    holder = holder or {}
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since "
            f"{holder.get('since', '?')}")


def _run_marker(config_text: str, **extra) -> str:
    return json.dumps({"format": RUN_FORMAT, "created": _now(), "package_version": __version__,
                       "config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
                       **extra}, indent=2) + "\n"


def _create_exclusive(path: Path, text: str) -> None:
    """Writes ``path`` unless it exists (a concurrent start made it first)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    write_atomic(tmp, text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


class RunWriter:
    """Writes one run directory; see the module docstring for the layout.

    Usage: ``w = RunWriter(out_dir); w.write_config(dump_yaml(cfg)); w.log({"epoch": 1, ...});
    w.close()`` (or ``with RunWriter(out_dir) as w: ...``).
    """

    def __init__(self, out_dir: str | os.PathLike, process_index: int = 0,
                 tensorboard: bool = True):
        self.out_dir = Path(out_dir)
        self.active = process_index == 0
        self.tensorboard = tensorboard  # also write the scalars as TensorBoard events
        self.checkpoint_dir = self.out_dir / "checkpoints"
        self.report_dir = self.out_dir / "report"
        self._metrics = None
        self._tb = None
        self._lock: RunLock | None = None
        self._made: list[Path] | None = None  # set by open_run in a new or empty folder
        if self.active:
            for d in (self.out_dir, self.checkpoint_dir, self.report_dir):
                d.mkdir(parents=True, exist_ok=True)

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / METRICS_FILE

    def write_config(self, text: str) -> None:
        """Writes config.yaml (replacing it atomically)."""
        if self.active:
            write_atomic(self.out_dir / CONFIG_FILE, text)

    def log(self, record: Mapping[str, Any]) -> None:
        """Appends one epoch record to metrics.jsonl (fsynced) and, with :attr:`tensorboard`,
        its scalars to TensorBoard."""
        if not self.active:
            return
        rec = to_jsonable(record)
        epoch = rec.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise ValueError(f"an epoch record needs an integer 'epoch', got {epoch!r}")
        if self._metrics is None:
            _drop_partial_line(self.metrics_path)
            self._metrics = open(self.metrics_path, "a")
        self._metrics.write(json.dumps(rec, allow_nan=False) + "\n")
        self._metrics.flush()
        os.fsync(self._metrics.fileno())
        if not self.tensorboard:
            return
        tb = self._writer()
        for key, value in flatten(rec).items():
            if key == "epoch" or isinstance(value, (str, list)) or value is None:
                continue
            tb.add_scalar(key, float(value), global_step=epoch)
        tb.flush()

    def log_report(self, summary: Mapping[str, Any], epoch: int) -> None:
        """With :attr:`tensorboard`, the final report's numbers at step ``epoch``: each split's
        portfolio metrics by policy, the random band and the agent's percentile, as
        ``report/<split>/<policy>/<metric>`` (``per_instrument`` stays in summary.json)."""
        if not (self.active and self.tensorboard):
            return
        tb = self._writer()
        for split in ("validation", "test"):
            metrics = {k: v for k, v in summary.get(split, {}).items() if k != "per_instrument"}
            for key, value in flatten(to_jsonable(metrics), f"report/{split}/").items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    tb.add_scalar(key, float(value), global_step=epoch)
        tb.flush()

    def _writer(self):
        if self._tb is None:
            from tensorboardX import SummaryWriter  # imported late: only process 0 needs it

            # Event files are named by the second they were opened: a suffix keeps a writer
            # reopened within the same second (a quick resume) from overwriting the last file.
            self._tb = SummaryWriter(logdir=str(self.out_dir / "tb"), flush_secs=30,
                                     filename_suffix=f".{time.time_ns()}")
        return self._tb

    def truncate_after(self, epoch: int) -> None:
        """On resume from the checkpoint of ``epoch``: drops later records and TensorBoard events.

        Rewrites metrics.jsonl atomically with the records whose epoch is ``<= epoch`` (a partial
        last line is dropped too), and every event file without its events of later steps.
        """
        if not self.active:
            return
        self._close_files()
        kept = [r for r in read_metrics(self.out_dir) if int(r.get("epoch", 0)) <= epoch]
        if self.metrics_path.exists():
            write_atomic(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        for path in sorted((self.out_dir / "tb").glob("events.out.tfevents.*")):
            truncate_events(path, epoch)

    def _close_files(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def discard_if_unused(self) -> None:
        """After a run failed before its first record and checkpoint (bad data, say): removes
        what :func:`open_run` made in a folder that was new or empty, lock included, so a failed
        start leaves nothing behind. Does nothing in any other case."""
        if not self.active or self._made is None:
            return
        self._close_files()
        if read_metrics(self.out_dir) or checkpoint_steps(self.out_dir):
            return
        for name in (RUN_FILE, CONFIG_FILE, METRICS_FILE, STATISTICS_FILE):
            (self.out_dir / name).unlink(missing_ok=True)
        for name in ("tb", CHECKPOINT_DIR, "report"):
            shutil.rmtree(self.out_dir / name, ignore_errors=True)
        if self._lock is not None:
            self._lock.path.unlink(missing_ok=True)
            self._lock.release()
            self._lock = None
        for folder in self._made:
            try:
                folder.rmdir()
            except OSError:
                break
        self._made = None

    def close(self) -> None:
        """Closes the files and releases the run's lock (if :func:`open_run` took it)."""
        self._close_files()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_run(out_dir: str | os.PathLike, config_text: str, *, resume: bool = False,
             process_index: int = 0, warn: Callable[[str], None] | None = None,
             tensorboard: bool = True) -> RunWriter:
    """Checks, marks and locks a run folder; returns its writer, which holds the lock until
    :meth:`RunWriter.close`. ``tensorboard``: :attr:`RunWriter.tensorboard`.

    On process 0 (other processes get a writer that writes nothing, and no check):
    :func:`check_run_folder` first (nothing is written when it refuses), then
    ``run.json`` (created if missing), the lock (:class:`RunLock`; ConfigError naming the
    holder when a live process holds it), the check again under the lock, and for a fresh start
    ``run.json`` and ``config.yaml`` of this run and no records (:meth:`RunWriter.truncate_after`
    ``(0)``: a run folder without a checkpoint keeps no epoch). A resume keeps its records; the
    caller truncates them to the restored checkpoint's epoch.
    """
    out = Path(out_dir)
    warn = warn or (lambda line: None)
    if process_index != 0:  # process 0 alone checks and writes
        return RunWriter(out, process_index=process_index, tensorboard=tensorboard)
    kind = check_run_folder(out, resume)
    made, folder = [], out.absolute()  # the folders mkdir creates, deepest first
    while not folder.exists():
        made.append(folder)
        folder = folder.parent
    out.mkdir(parents=True, exist_ok=True)
    # a resumed folder without run.json is a run from before the marker: it is adopted
    _create_exclusive(out / RUN_FILE, _run_marker(config_text, **({"adopted": True} if resume
                                                                   else {})))
    lock = RunLock.acquire(out, warn)
    try:
        # another process may have saved a checkpoint meanwhile
        check_run_folder(out, resume, locked=True)
        writer = RunWriter(out, tensorboard=tensorboard)
        if not resume:
            write_atomic(out / RUN_FILE, _run_marker(config_text))
            writer.write_config(config_text)
            writer.truncate_after(0)
    except BaseException:
        lock.release()
        raise
    writer._lock = lock
    if kind == "new" and not resume:
        writer._made = made
    return writer


__all__ = ["LOG_WRITERS", "RunWriter", "RunLock", "open_run", "check_run_folder",
           "checkpoint_steps", "truncate_events", "read_metrics", "to_jsonable", "flatten",
           "METRICS_FILE", "CONFIG_FILE", "RUN_FILE", "LOCK_FILE"]
