"""Run folders under hostile and careless use: guarded, locked, records that match the
checkpoints, checkpoints that fall back, evaluations on other data kept apart."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_report import read_events

from foxhunt_jax import api
from foxhunt_jax.cli import main
from foxhunt_jax.config import load_config
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.training import checkpoint
from foxhunt_jax.training.rundir import (LOCK_FILE, RUN_FILE, RunWriter, check_run_folder,
                                         open_run, read_metrics)
from foxhunt_jax.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TINY = ["network.trunk=[16]", "network.head=16", "network.atoms=5", "curiosity.hidden=8",
        "curiosity.embed=4", "env.episode_length=8", "train.num_episodes=16",
        "train.train_steps=2", "replay.capacity=512", "train.batch_size=16",
        "train.validation_windows=4"]
CLI_TINY = ["--config", "smoke", "--no-progress"] + [a for o in TINY for a in ("--set", o)]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def tiny(epochs: int):
    return load_config("smoke", TINY + [f"train.epochs={epochs}"])


def quiet_train(cfg, out, **kw):
    return api.train(cfg, out, progress=False, log=lambda s: None, final_report=False, **kw)


def snapshot(folder: Path) -> dict:
    """Every path under ``folder`` with its bytes (files) and mode: what "nothing changed" means."""
    if not folder.exists():
        return {}
    if folder.is_file():
        return {"": (folder.read_bytes(), folder.stat().st_mode)}
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None,
                                         p.stat().st_mode) for p in sorted(folder.rglob("*"))}


def loss_steps(out: Path) -> list[int]:
    """Steps of the ``loss`` scalar in every event file of the run, in order."""
    return sorted(ev.step for ev in read_events(out / "tb") for v in ev.summary.value
                  if v.tag == "loss")


def epochs(out: Path) -> list[int]:
    return [r["epoch"] for r in read_metrics(out)]


def error_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    assert "Traceback" not in text
    return lines[0]


def warnings_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("warning:")]


@pytest.fixture
def no_setup(monkeypatch):
    """A refusal must come before any data or compile work: building a trainer fails the test."""
    def build(*args, **kwargs):
        raise AssertionError("the trainer was built before the run folder was checked")

    monkeypatch.setattr(Trainer, "build", build)


def damage(step_dir: Path, how: str) -> None:
    """Truncates or garbles the largest array file of a checkpoint step, or its layout JSON."""
    if how == "layout":
        path = step_dir / "layout" / "metadata"
        path.write_text(path.read_text()[:-40] + "}{")
        return
    path = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[:len(data) // 2])
    else:
        path.write_bytes(data[:100] + bytes(b ^ 0x5A for b in data[100:300]) + data[300:])


# ---------------------------------------------------------------------------------------------
# A run killed after its first record and before its first checkpoint, then started again


KILL_AT_SAVE = textwrap.dedent("""
    import os, signal, sys
    from foxhunt_jax.training import checkpoint
    real, kill_at = checkpoint.save, int(sys.argv[1])
    def save(ckpt_dir, step, *args, **kwargs):
        if step == kill_at:  # the epoch's record is written, its checkpoint is not
            os.kill(os.getpid(), signal.SIGKILL)
        return real(ckpt_dir, step, *args, **kwargs)
    checkpoint.save = save
    from foxhunt_jax.cli import main
    sys.exit(main(sys.argv[2:]))
""")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny run killed (SIGKILL) at its first checkpoint, then started again fresh into the
    same folder for 2 epochs: a complete run with checkpoints 1 and 2."""
    out = tmp_path_factory.mktemp("base") / "run"
    killed = subprocess.run([sys.executable, "-c", KILL_AT_SAVE, "1", "train", *CLI_TINY,
                             "--set", "train.epochs=2", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env=ENV)
    after_kill = SimpleNamespace(rc=killed.returncode, stderr=killed.stderr, epochs=epochs(out),
                                 steps=checkpoint.all_steps(out / "checkpoints"),
                                 loss_steps=loss_steps(out),
                                 lock=json.loads((out / LOCK_FILE).read_text()))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        quiet_train(tiny(2), out)
    return SimpleNamespace(out=out, after_kill=after_kill, stderr=err.getvalue())


def copy_run(base, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(base.out, out)
    return out


def test_killed_before_first_checkpoint_then_fresh_start_has_each_epoch_once(base):
    killed = base.after_kill
    assert killed.rc == -signal.SIGKILL, killed.stderr[-2000:]
    # the kill left epoch 1's record, no checkpoint, and the dead process's lock
    assert killed.epochs == [1] and killed.loss_steps == [1] and killed.steps == []
    assert killed.lock["host"] == socket.gethostname() and killed.lock["pid"] > 0
    # the fresh start took the dead process's lock over with one warning and dropped epoch 1
    warnings = warnings_in(base.stderr)
    assert len(warnings) == 1 and f"took over the lock of pid {killed.lock['pid']}" in warnings[0]
    assert epochs(base.out) == [1, 2] and loss_steps(base.out) == [1, 2]
    assert checkpoint.all_steps(base.out / "checkpoints") == [1, 2]
    marker = json.loads((base.out / RUN_FILE).read_text())
    assert {"format", "created", "package_version", "config_sha256"} <= set(marker)
    assert (base.out / LOCK_FILE).read_text() == ""  # released


def test_resume_drops_later_records_and_falls_back_past_a_damaged_checkpoint(base, tmp_path,
                                                                            capsys):
    out = copy_run(base, tmp_path)
    damage(out / "checkpoints" / "2", "truncate")
    # what a kill after epoch 3's record and before its checkpoint leaves, torn writes included
    with RunWriter(out) as w:
        w.log({"epoch": 3, "loss": 123.0})
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 4, "lo')
    events = sorted((out / "tb").glob("events.out.tfevents.*"))[-1]
    with open(events, "ab") as f:
        f.write(b"\x20\x00\x00\x00\x00\x00\x00\x00\x01\x02")
    assert epochs(out) == [1, 2, 3] and loss_steps(out) == [1, 2, 3]

    logged = []
    api.train(tiny(3), out, resume=True, progress=False, log=logged.append, final_report=False)
    warnings = warnings_in(capsys.readouterr().err)
    assert len(warnings) == 1 and str(out / "checkpoints" / "2") in warnings[0], warnings
    assert "resumed from epoch 1" in logged
    assert epochs(out) == [1, 2, 3] and loss_steps(out) == [1, 2, 3]
    assert read_metrics(out)[2]["loss"] != 123.0
    assert checkpoint.all_steps(out / "checkpoints") == [2, 3]


@pytest.mark.parametrize("case", ["file", "under_a_file", "user_folder", "user_folder_resume",
                                  "run_with_checkpoint", "resume_nothing", "legacy_fresh"])
def test_bad_out_is_refused_before_setup_with_one_line_and_nothing_changed(
        case, base, tmp_path, capsys, no_setup):
    resume = case.endswith("resume") or case == "resume_nothing"
    if case == "file":
        out = target = tmp_path / "notes.txt"
        out.write_text("my notes\n")
    elif case == "under_a_file":
        target = tmp_path / "notes.txt"
        target.write_text("my notes\n")
        out = target / "run"
    elif case.startswith("user_folder"):
        out = target = tmp_path / "mine"
        (out / "report").mkdir(parents=True)
        (out / "config.yaml").write_text("mine: 1\n")
        (out / "report" / "summary.json").write_text("{}\n")
        (out / "metrics.jsonl").write_text('{"epoch": 1}\n')
    elif case == "resume_nothing":
        out = target = tmp_path / "empty"
        out.mkdir()
    else:
        out = target = copy_run(base, tmp_path)
        if case == "legacy_fresh":  # a run from before run.json existed
            (out / RUN_FILE).unlink()
            (out / LOCK_FILE).unlink()
    before = snapshot(tmp_path)
    code = main(["train", *CLI_TINY, "--out", str(out), *(["--resume"] if resume else [])])
    line = error_line(capsys.readouterr().err)
    assert code == 2 and str(out) in line
    assert snapshot(tmp_path) == before
    # the library refuses the same way
    with pytest.raises(ConfigError):
        api.train(tiny(2), out, resume=resume)
    assert snapshot(tmp_path) == before
    assert target.exists()


def _immutable(folder: Path):
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)


def _no_permission(folder: Path):
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):  # root: permissions do not stop it
        folder.chmod(0o755)
        pytest.skip("permissions do not stop this user (root); the other cases cover it")
    return lambda: folder.chmod(0o755)


@pytest.mark.parametrize("how", ["immutable", "no_permission"])
@pytest.mark.parametrize("where", ["folder", "parent"])
def test_unwritable_out_is_refused_with_one_line(how, where, tmp_path, capsys, no_setup):
    folder = tmp_path / "locked"
    folder.mkdir()
    restore = {"immutable": _immutable, "no_permission": _no_permission}[how](folder)
    try:
        out = folder if where == "folder" else folder / "run"
        code = main(["train", *CLI_TINY, "--out", str(out)])
        line = error_line(capsys.readouterr().err)
        assert code == 2 and "cannot write" in line and str(out) in line
        assert list(folder.iterdir()) == []
    finally:
        restore()


def test_read_only_file_system_is_refused_with_one_line(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            f"mount --bind -o ro '{folder}' '{folder}' && touch '{folder}/x'"],
                           capture_output=True, text=True)
    if "Read-only file system" not in probe.stderr:
        pytest.skip("no mount namespace for a read-only bind mount here")
    cmd = (f"mount --bind -o ro '{folder}' '{folder}' && exec '{sys.executable}' -m foxhunt_jax "
           f"train --config smoke --out '{folder}/run'")
    r = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True,
                       timeout=300, env=ENV)
    line = error_line(r.stderr)
    assert r.returncode == 2 and "read-only file system" in line, r.stderr
    assert list(folder.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# One writer per run


HOLD = textwrap.dedent("""
    import sys, time
    from foxhunt_jax.training.rundir import open_run
    writer = open_run(sys.argv[1], "held: 1\\n", resume=sys.argv[2] == "resume")
    print("held", flush=True)
    time.sleep(600)
""")


def test_second_writer_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(
        base, tmp_path, capsys, no_setup):
    out = copy_run(base, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out), "resume"], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        before = snapshot(out)
        for args in (["--resume"], []):
            code = main(["train", *CLI_TINY, "--set", "train.epochs=3", "--out", str(out), *args])
            line = error_line(capsys.readouterr().err)
            assert code == 2 and re.search(rf"in use by pid {holder.pid} on host "
                                           rf"{re.escape(socket.gethostname())} since \d{{4}}-",
                                           line), line
        with pytest.raises(ConfigError, match=f"in use by pid {holder.pid}"):
            api.train(tiny(3), out, resume=True)
        assert snapshot(out) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lines = []
    writer = open_run(out, "held: 1\n", resume=True, warn=lines.append)
    try:
        assert len(lines) == 1 and f"took over the lock of pid {holder.pid}" in lines[0]
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        writer.close()
    assert (out / LOCK_FILE).read_text() == ""


def test_second_fresh_start_into_a_new_folder_is_refused(tmp_path, capsys, no_setup):
    out = tmp_path / "new"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out), "fresh"], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        before = snapshot(out)
        code = main(["train", *CLI_TINY, "--out", str(out)])
        assert code == 2 and f"in use by pid {holder.pid}" in error_line(capsys.readouterr().err)
        assert snapshot(out) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_run_from_before_the_marker_is_adopted_on_resume(base, tmp_path):
    out = copy_run(base, tmp_path)
    (out / RUN_FILE).unlink()
    (out / LOCK_FILE).unlink()
    assert check_run_folder(out, resume=True) == "legacy"
    with open_run(out, "x: 1\n", resume=True):
        marker = json.loads((out / RUN_FILE).read_text())
    assert marker["adopted"] is True and marker["format"] == 1
    assert check_run_folder(out, resume=True) == "run"
    assert epochs(out) == [1, 2]  # the caller truncates to the restored checkpoint


# ---------------------------------------------------------------------------------------------
# Checkpoints that fall back; evaluations on other data


def test_evaluate_falls_back_past_damaged_checkpoints_and_fails_cleanly_without_one(
        base, tmp_path, capsys):
    out = copy_run(base, tmp_path)
    damage(out / "checkpoints" / "2", "garble")
    _, state = api.load_run(out)
    assert int(state.epoch) == 1
    warnings = warnings_in(capsys.readouterr().err)
    assert len(warnings) == 1 and str(out / "checkpoints" / "2") in warnings[0]
    damage(out / "checkpoints" / "1", "layout")
    (out / "checkpoints" / "1" / checkpoint.DIGESTS_FILE).unlink()  # read, not digest, catches it
    code = main(["evaluate", "--run", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(warnings_in(err)) == 2
    line = error_line("\n".join(x for x in err.splitlines() if not x.startswith("warning:")))
    assert "no intact checkpoint" in line


def test_evaluate_on_other_data_never_replaces_the_runs_own_evaluation(base, tmp_path, capsys):
    out = copy_run(base, tmp_path)
    own = out / "report" / "evaluate_test.json"
    own.write_text('{"the run": "own evaluation"}\n')
    other = "builtin:synthetic?instruments=2&bars=400&seed=3"
    assert main(["evaluate", "--run", str(out), "--data", other]) == 0
    printed = capsys.readouterr().out
    assert own.read_text() == '{"the run": "own evaluation"}\n'
    written = [p for p in (out / "report").glob("evaluate_test_*.json")]
    assert len(written) == 1 and re.fullmatch(r"evaluate_test_synthetic-[0-9a-f]{8}\.json",
                                              written[0].name)
    assert f"evaluation written to {written[0]}" in printed
    payload = json.loads(written[0].read_text())
    assert payload["data"] == [other] and "agent" in payload["metrics"]
    # the name follows the data: the run's own data keeps the plain name
    run_data = load_config("smoke").data.source
    assert api.evaluation_path(out, "test", None, run_data) == own
    assert api.evaluation_path(out, "test", list(run_data), run_data) == own
    names = {api.evaluation_path(out, "validation", d, run_data).name
             for d in (["a/prices.csv"], ["b/prices.csv"], ["a/prices.csv", "b/prices.csv"])}
    assert len(names) == 3 and all(n.startswith("evaluate_validation_prices") for n in names)



@pytest.mark.parametrize("existing", [False, True])
def test_start_that_fails_on_bad_data_leaves_nothing(existing, tmp_path, capsys):
    out = tmp_path / "empty" if existing else tmp_path / "new" / "run"
    if existing:
        out.mkdir()
    code = main(["train", *CLI_TINY, "--data", str(tmp_path / "missing.csv"), "--out", str(out)])
    assert code == 2 and "missing.csv" in error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["empty"] if existing else [])
    assert not existing or list(out.iterdir()) == []
