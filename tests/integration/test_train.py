"""End-to-end trainer: run directory, resume after SIGKILL, NaN/Inf guard, CLI errors, README."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax import api, jitcache
from foxhunt_jax.agent.learner import beta_at, epsilon_at
from foxhunt_jax.backend import resolve
from foxhunt_jax.cli import main
from foxhunt_jax.config import load_config, read_yaml
from foxhunt_jax.errors import NonFiniteError
from foxhunt_jax.training import checkpoint, phases, pipeline
from foxhunt_jax.training.trainer import Trainer
from foxhunt_jax.training.rundir import read_metrics
from records import without_timing
from test_report import read_events, visible_scalars

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["--config", "smoke", "--no-progress"]
PHASES = {"init", "compile", "experience", "training", "validation", "total"}
TRADING = {"total_return", "sharpe", "sortino", "max_drawdown", "turnover", "trades"}


def cli(*args, timeout=400, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "foxhunt_jax", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, **kw)


def test_run_directory_holds_config_metrics_tensorboard_checkpoints_report(tmp_path):
    out = tmp_path / "run"
    cfg = load_config("smoke")
    res = api.train(cfg, out, progress=False, log=lambda s: None)
    assert (out / "config.yaml").exists()
    # the run records what it resolved on this device: network.dtype auto is float32 on a CPU,
    # network.support auto the range derived from the training split
    # the final report's numbers in TensorBoard too, at the last epoch
    shown = visible_scalars(read_events(out / "tb"))
    assert shown["report/test/agent/sharpe"] == {3: pytest.approx(
        res.summary["test"]["agent"]["sharpe"], rel=1e-5, abs=1e-6)}
    assert 3 in shown["report/test/agent_percentile/sharpe"]
    assert 3 in shown["report/validation/random/p50/sharpe"]
    saved = read_yaml(out / "config.yaml")["network"]
    assert cfg.network.dtype == "auto" and saved["dtype"] == "float32"
    assert cfg.network.support == "auto" and saved["support"] == "explicit"
    assert saved["v_min"] < 0 < saved["v_max"]
    recs = read_metrics(out)
    assert [r["epoch"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert set(r["phase_ms"]) == PHASES
        assert r["env_steps"] == r["epoch"] * 32 * 20
        assert TRADING <= set(r["val"]) and TRADING <= set(r["val_buy_and_hold"])
        assert np.isfinite(r["loss"]) and 0 <= r["epsilon"] <= 1
        # the rates the programs used (computed on the device from the epoch counter)
        assert r["epsilon"] == pytest.approx(epsilon_at(cfg.train, r["epoch"] - 1), rel=1e-6)
        assert r["beta"] == pytest.approx(beta_at(cfg.replay, cfg.train, r["epoch"] - 1),
                                          rel=1e-6)
    assert recs[0]["epsilon"] != recs[-1]["epsilon"]
    assert recs[0]["phase_ms"]["compile"] > 0 and recs[1]["phase_ms"]["compile"] == 0
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert checkpoint.latest_step(out / "checkpoints") == 3
    summary = json.loads((out / "report" / "summary.json").read_text())
    for split in ("validation", "test"):
        assert {"agent", "buy_and_hold", "flat", "random", "agent_percentile",
                "per_instrument"} <= set(summary[split])
        random = summary[split]["random"]
        assert random["policies"] == cfg.eval.random_policies == 200
        assert random["p5"]["sharpe"] <= random["p50"]["sharpe"] <= random["p95"]["sharpe"]
        assert 0 <= summary[split]["agent_percentile"]["sharpe"] <= 100
    for png in ("equity_validation.png", "equity_test.png", "training.png", "phases.png"):
        assert (out / "report" / png).stat().st_size > 10_000
    assert res.history == recs


def test_resume_after_sigkill_equals_uninterrupted_run(tmp_path, capsys):
    # the uninterrupted run and the refused resume through cli.main in this process; the killed
    # run and the resume after it in processes of their own
    args = SMOKE + ["--set", "train.epochs=12"]
    assert main(["train", *args, "--out", str(tmp_path / "full")]) == 0

    killed = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "foxhunt_jax", "train", *args, "--out", str(killed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 4:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(read_metrics(killed))
    assert 4 <= done_before < 12

    # another config than the run's is refused, with one line, before anything is written
    capsys.readouterr()
    assert main(["train", *args, "--set", "train.batch_size=16", "--out", str(killed),
                 "--resume"]) == 2
    assert "only train.epochs and data.min_table_rows may change" in capsys.readouterr().err
    assert len(read_metrics(killed)) == done_before
    # without --config the run continues with its own DIR/config.yaml
    resumed = cli("train", "--no-progress", "--out", str(killed), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from epoch" in resumed.stdout
    a, b = read_metrics(tmp_path / "full"), read_metrics(killed)
    assert [r["epoch"] for r in b] == list(range(1, 13))
    assert without_timing(a) == without_timing(b)


@pytest.mark.parametrize("every,bad_epoch", [(1, 2), (2, 3)])
def test_non_finite_params_stop_the_run_and_keep_last_good_checkpoint(tmp_path, monkeypatch,
                                                                      every, bad_epoch):
    # every=2: epoch 3 is not checkpointed, so it queues epoch 4's Experience before its
    # metrics are read; the guard still stops at epoch 3 and keeps epoch 2's checkpoint
    real = phases.train_steps

    def poisoned(learner, decode, agent, buffer, key, beta, num_steps):
        agent, buffer, m = real(learner, decode, agent, buffer, key, beta, num_steps)
        bad = agent.step > (bad_epoch - 1) * num_steps
        params = jax.tree.map(lambda p: jnp.where(bad, jnp.nan, p), agent.params)
        return agent.replace(params=params), buffer, m

    monkeypatch.setattr(phases, "train_steps", poisoned)
    out = tmp_path / "poisoned"
    cfg = load_config("smoke", [f"train.checkpoint_every={every}", "train.epochs=5"])
    with pytest.raises(NonFiniteError, match=rf"^epoch {bad_epoch}: params contain NaN"):
        api.train(cfg, out, progress=False, log=lambda s: None)
    good = bad_epoch - 1
    assert checkpoint.latest_step(out / "checkpoints") == good
    trainer = Trainer.build(cfg)
    state, meta = checkpoint.restore(out / "checkpoints", good, trainer.init_state())
    assert meta["epoch"] == good and int(state.epoch) == good
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.agent.params))
    assert [r["epoch"] for r in read_metrics(out)] == list(range(1, bad_epoch))


def test_queued_experience_gives_the_same_epochs():
    """run_epoch(queue_next=True) queues the next Experience early; the numbers do not change."""
    def run(queue):
        trainer = Trainer.build(load_config("smoke"))
        state, recs = trainer.init_state(), []
        for e in range(3):
            state, rec = trainer.run_epoch(state, queue_next=queue and e < 2)
            recs.append(rec)
        return state, recs, trainer

    (s0, r0, _), (s1, r1, trainer) = run(False), run(True)
    assert trainer.pipeline.ahead is None
    assert without_timing(r0) == without_timing(r1)
    assert [r["epoch"] for r in r1] == [1, 2, 3]
    # each phase from the previous one's completion (a queued Experience from the previous
    # epoch's Validation): never negative (on the CPU a queued Experience may end before the
    # Validation queued ahead of it), and they add up to the total
    for r in r1:
        ms = r["phase_ms"]
        assert min(ms["experience"], ms["training"], ms["validation"]) >= 0
        assert ms["total"] == pytest.approx(sum(v for k, v in ms.items() if k != "total"))
    for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state, rec = trainer.run_epoch(trainer.init_state(), queue_next=True)
    assert trainer.pipeline.ahead is not None and trainer.pipeline.ahead.state is state
    assert int(state.epoch) == rec["epoch"] + 1  # ahead: the next epoch's Training is queued
    # a state that is not the queued one runs its own Experience (the queued one is dropped)
    fresh, rec = trainer.run_epoch(trainer.init_state())
    assert trainer.pipeline.ahead is None and rec["epoch"] == 1


@pytest.mark.patches_host_code_only  # pairs_rollouts picks programs, not what they compute
def test_paired_validation_and_experience_give_the_same_epochs(monkeypatch):
    """A queued epoch that runs Validation and the next Experience as one program gives the same
    numbers as the epochs run one phase at a time. (Pairing applies to the Pallas backend; the
    program's composition does not depend on it, so the cheaper XLA backend is paired here.)"""
    cfg = load_config("smoke", ["network.trunk=[16]", "network.head=16", "network.atoms=5",
                                "curiosity.hidden=8", "curiosity.embed=4", "env.episode_length=8",
                                "train.num_episodes=16", "train.train_steps=2"])
    trainer = Trainer.build(cfg)
    monkeypatch.setattr(pipeline, "pairs_rollouts", lambda *a: True)

    def run(queues):
        state, recs = trainer.init_state(), []
        for queue in queues:
            state, rec = trainer.run_epoch(state, queue_next=queue)
            recs.append(rec)
        return state, recs

    (s0, r0), (s1, r1) = run([0, 0, 0, 0]), run([1, 2, 1, 0])
    # compiled when the first queued epoch needed it, and reported as that epoch's Compile
    assert trainer.pairs_rollouts and "validation_experience" in trainer.pipeline.programs
    assert r1[0]["phase_ms"]["compile"] > 0 and r1[1]["phase_ms"]["compile"] == 0
    assert without_timing(r0) == without_timing(r1)
    for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # two ahead: the next epoch's Validation and the Experience after it are queued too; that
    # state holds the following epoch's Experience, so it must be run queueing the next
    state, rec = trainer.run_epoch(trainer.init_state(), queue_next=2)
    ahead = trainer.pipeline.ahead
    assert ahead.state is state and ahead.epoch.validation is not None
    assert ahead.epoch.collected is not None and rec["epoch"] == 1
    with pytest.raises(ValueError, match="queue_next >= 1"):
        trainer.run_epoch(state, queue_next=0)
    monkeypatch.undo()
    # paired by default where both rollouts are kernels on one device; not with the XLA
    # backend, the setting off, or a mesh of several devices (Validation runs on one)
    kernels = load_config("smoke", ["network.dtype=bfloat16", "network.backend=pallas"])
    pallas = resolve(kernels.network)
    assert pipeline.pairs_rollouts(pallas, kernels, SimpleNamespace(size=1))
    assert not pipeline.pairs_rollouts(pallas, kernels, SimpleNamespace(size=2))
    switched_off = load_config("smoke", ["network.dtype=bfloat16", "network.backend=pallas",
                                         "train.pair_rollouts=false"])
    assert not pipeline.pairs_rollouts(pallas, switched_off, None)
    assert not trainer.pairs_rollouts  # XLA
    # the setting keys only the paired program: the others load from the executable cache
    off = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, pair_rollouts=False))
    for name in ("experience", "training", "validation"):
        assert pipeline.program_key_config(cfg, name) == \
            pipeline.program_key_config(off, name)
    assert pipeline.program_key_config(cfg, "validation_experience") != \
        pipeline.program_key_config(off, "validation_experience")


@pytest.mark.patches_host_code_only  # pairs_rollouts picks programs, not what they compute
def test_paired_program_compiled_in_the_background_gives_the_same_epochs(monkeypatch):
    """With ``paired_in_background`` the first queued epochs run Validation alone while the
    paired program compiles in a thread; the epochs after it is taken up run it, and the
    numbers equal epochs run one phase at a time."""
    cfg = load_config("smoke", ["network.trunk=[16]", "network.head=16", "network.atoms=5",
                                "curiosity.hidden=8", "curiosity.embed=4", "env.episode_length=8",
                                "train.num_episodes=16", "train.train_steps=2"])
    monkeypatch.setattr(pipeline, "pairs_rollouts", lambda *a: True)
    plain, paired = Trainer.build(cfg), Trainer.build(cfg)
    s0, r0 = plain.init_state(), []
    for _ in range(4):
        s0, rec = plain.run_epoch(s0, queue_next=0)
        r0.append(rec)
    s1 = paired.init_state()
    paired.compile(s1, queued=True, paired_in_background=True)
    assert "validation_experience" not in paired.pipeline.programs
    s1, rec = paired.run_epoch(s1, queue_next=2)
    r1 = [rec]
    paired.pipeline.wait_for_background_compile()
    assert "validation_experience" in paired.pipeline.programs
    for queue in (2, 1, 0):
        s1, rec = paired.run_epoch(s1, queue_next=queue)
        r1.append(rec)
    assert paired.pipeline.ahead is None
    assert r1[0]["phase_ms"]["compile"] > 0 and r1[1]["phase_ms"]["compile"] == 0
    assert without_timing(r0) == without_timing(r1)
    for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.patches_host_code_only  # pairs_rollouts picks programs, not what they compute
def test_programs_compiled_beside_the_init_are_those_compiled_after_it(monkeypatch):
    """``init_and_compile`` compiles the phase programs from the abstract state while the state
    is built: every program's arguments describe the real state's exactly (shapes, dtypes,
    weak types, placements: the executable cache's key), and the epochs equal those of a state
    built first and compiled after."""
    cfg = load_config("smoke", ["network.trunk=[16]", "network.head=16", "network.atoms=5",
                                "curiosity.hidden=8", "curiosity.embed=4", "env.episode_length=8",
                                "train.num_episodes=16", "train.train_steps=2"])
    monkeypatch.setattr(pipeline, "pairs_rollouts", lambda *a: True)
    after, beside = Trainer.build(cfg), Trainer.build(cfg)
    abstract, real = after.abstract_state(), after.init_state()
    described = [after.pipeline.jitted_programs(s, queued=True) for s in (abstract, real)]
    assert list(described[0]) == list(described[1]) and len(described[0]) == 4
    for name in described[0]:
        assert jitcache._signature(described[0][name][1]) == \
            jitcache._signature(described[1][name][1]), name
    s1 = beside.init_and_compile(queued=True)
    beside.pipeline.wait_for_background_compile()
    assert set(beside.pipeline.programs) == set(described[0])
    s0, r0, r1 = real, [], []
    for queue in (2, 1, 0):
        s0, rec = after.run_epoch(s0, queue_next=queue)
        r0.append(rec)
        s1, rec = beside.run_epoch(s1, queue_next=queue)
        r1.append(rec)
    assert without_timing(r0) == without_timing(r1)
    for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.patches_host_code_only  # pairs_rollouts picks programs; run_epoch is host code
def test_train_queues_two_epochs_ahead_only_between_checkpoints(tmp_path, monkeypatch):
    """api.train queues the next epoch, and the one after it where rollouts are paired, only
    where no checkpoint falls in between; the records and checkpoints equal an unqueued run's."""
    cfg = load_config("smoke", ["network.trunk=[16]", "network.head=16", "network.atoms=5",
                                "curiosity.hidden=8", "curiosity.embed=4", "env.episode_length=8",
                                "train.num_episodes=16", "train.train_steps=2", "train.epochs=6",
                                "train.checkpoint_every=3"])
    queues, run_epoch = [], Trainer.run_epoch

    def recording(self, state, queue_next=0):
        queues.append(int(queue_next))
        return run_epoch(self, state, queue_next)

    monkeypatch.setattr(Trainer, "run_epoch", recording)
    monkeypatch.setattr(pipeline, "pairs_rollouts", lambda *a: True)
    paired = api.train(cfg, tmp_path / "paired", progress=False, log=lambda s: None,
                       final_report=False)
    assert queues == [2, 1, 0, 2, 1, 0]  # queueing starts again after the checkpoint
    monkeypatch.setattr(pipeline, "pairs_rollouts", lambda *a: False)
    del queues[:]
    plain = api.train(cfg, tmp_path / "plain", progress=False, log=lambda s: None,
                      final_report=False)
    assert queues == [2, 1, 0, 2, 1, 0]  # where nothing is paired, 2 acts as 1
    assert without_timing(paired.history) == without_timing(plain.history)
    for step in (3, 6):
        saved = [checkpoint.restore(tmp_path / run / "checkpoints", step,
                                    paired.trainer.init_state())[0] for run in ("paired", "plain")]
        for a, b in zip(*map(jax.tree.leaves, saved)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cli_diverging_run_exits_nonzero_with_one_line(tmp_path):
    r = cli("train", *SMOKE, "--set", "train.learning_rate=1e30", "--out", str(tmp_path / "d"))
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(r"error: epoch \d+: ", lines[0]), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["train", "--set", "train.bogus=1"], "unknown config key 'train.bogus'"),
    (["train", "--set", "train.epochs=0"], "train.epochs"),
    (["train", "--set", "network.dtype=float16"], "network.dtype"),
    (["train", "--config", "no_such_config.yaml"], "no_such_config.yaml"),
    (["train", "--data", "/no/such/file.csv"], "/no/such/file.csv"),
    (["evaluate", "--run", "/no/such/run"], "/no/such/run"),
])
def test_cli_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, args, needle):
    # in-process through cli.main (the subprocess path is covered by the data-check and
    # diverging-run tests); nothing may be written
    code = main([*args, "--out", str(tmp_path / "x")] if args[0] == "train" else args)
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not (tmp_path / "x").exists()


def test_evaluate_command_writes_report(tmp_path):
    out = tmp_path / "run"
    api.train(load_config("smoke"), out, progress=False, log=lambda s: None, final_report=False)
    r = cli("evaluate", "--run", str(out), "--split", "validation")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "buy_and_hold" in r.stdout
    payload = json.loads((out / "report" / "evaluate_validation.json").read_text())
    assert {"agent", "buy_and_hold", "random"} <= set(payload["metrics"])


def test_readme_library_example_runs(in_tmp_path):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## As a library\s+```python\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})
    assert (in_tmp_path / "runs" / "library-example" / "report" / "summary.json").exists()


class _Fails:
    """A leaf whose wait fails, as a program that failed on the device does."""

    def block_until_ready(self):
        raise RuntimeError("device program failed")


def test_phase_ready_time_is_after_the_results_and_passes_a_failure_on():
    x = jnp.arange(1000.0) * 2.0
    t0 = time.perf_counter()
    done = pipeline.ready_clock({"x": x})
    assert t0 <= done() <= time.perf_counter()
    with pytest.raises(RuntimeError, match="device program failed"):
        pipeline.ready_clock([_Fails()])()


def test_run_settings_leave_the_phase_programs_unchanged():
    """Two configs that differ in every ``pipeline.RUN_SETTINGS`` entry lower each phase program
    and the initial state's two programs to the same text, so the executable cache may serve one
    run's programs to the other (their keys are equal)."""
    sizes = ["network.trunk=[16]", "network.head=16", "network.atoms=5", "curiosity.hidden=8",
             "curiosity.embed=4", "env.episode_length=8", "train.num_episodes=16",
             "train.train_steps=2", "train.batch_size=16", "train.validation_windows=4",
             "replay.capacity=1024", "network.support=explicit"]
    run = ["train.seed=5", "train.epochs=9", "train.epsilon_start=0.5", "train.epsilon_end=0.2",
           "train.epsilon_decay_epochs=3", "train.select_by=loss", "train.patience=2",
           "train.checkpoint_every=3", "train.log_every=2", "replay.beta_start=0.3",
           "replay.beta_end=0.9", "eval.random_policies=7", "population.seed=4",
           # another window of the market: other bars, tables of the same padded size
           "data.window=[2000-06-01,2013-12-31]"]
    base, other = load_config("smoke", sizes), load_config("smoke", sizes + run)
    for entry in pipeline.RUN_SETTINGS:  # the second config changes every entry
        section, _, key = entry.partition(".")
        a, b = getattr(base, section), getattr(other, section)
        assert (getattr(a, key) != getattr(b, key)) if key else a != b, entry
    texts = []
    for cfg in (base, other):
        trainer = Trainer.build(cfg)
        programs = trainer.pipeline.jitted_programs(trainer.init_state(), queued=True)
        texts.append({name: program.lower(*args).as_text()
                      for name, (program, args) in programs.items()})
        # the two programs of init_state, the key an argument
        make = trainer.init_programs()
        args = (trainer.env_params["train"], jax.random.PRNGKey(0))
        agent = make["init_agent"](args)(*args)
        texts[-1]["init_agent"] = make["init_agent"](args).lower(*args).as_text()
        args = args + (agent,)
        texts[-1]["init_state"] = make["init_state"](args).lower(*args).as_text()
        assert all(pipeline.program_key_config(cfg, name) ==
                   pipeline.program_key_config(base, name) for name in texts[-1])
    assert texts[0].keys() == texts[1].keys() and texts[0] == texts[1]


def test_run_settings_and_data_leave_the_walk_programs_unchanged():
    """Two configs that differ in run settings and in the market's config (the same bars)
    lower the final report's walk programs to the same text, under equal keys
    (``Trainer.walk_key_config``): a walk-forward's folds may share them."""
    run = ["train.seed=5", "train.epochs=9", "train.select_by=loss", "train.patience=2",
           "replay.beta_start=0.3", "population.seed=4", "data.window=[1900-01-01,2100-01-01]"]
    texts, keys = [], []
    for cfg in (load_config("smoke"), load_config("smoke", run)):
        trainer = Trainer.build(cfg)
        agent = trainer.init_state(seed=0).agent
        programs = trainer.walk_programs(agent, "test")
        assert set(programs) == {"agent", "random"}
        texts.append({name: jitted.lower(*args).as_text()
                      for name, (jitted, args) in programs.items()})
        keys.append(trainer.walk_key_config(programs["agent"][1][0].episode_length))
    assert texts[0] == texts[1] and keys[0] == keys[1]


# validation shorter than test, so the validation walks run past their own length
UNEQUAL_SPLITS = ["data.splits=[0.7,0.12,0.18]"]


def _walk_results(trainer, agent, split):
    res = trainer.evaluate_split(agent, split)
    return res["metrics"], res["paths"], res["curves"]


def test_validation_and_test_walks_share_their_programs(tmp_path):
    """Both splits walk ``validate.walk_length`` steps and ``walk_rows`` instruments, so the test
    split's walks load the programs the validation split's stored: one entry a program in the
    executable cache."""
    from foxhunt_jax import jitcache
    from foxhunt_jax.training import validate

    trainer = Trainer.build(load_config("smoke", UNEQUAL_SPLITS))
    tables = trainer.tables
    own = {s: int(validate.evaluation_params(tables, trainer.cfg.env, s)[2].max())
           for s in ("validation", "test")}
    assert own["validation"] < own["test"]
    assert validate.walk_length(tables, "validation") == validate.walk_length(tables, "test") \
        == own["test"]
    assert validate.walk_rows(tables, "validation") == validate.walk_rows(tables, "test")
    agent = trainer.init_state().agent
    before = jitcache.executable_cache_folder()
    jitcache.set_executable_cache(tmp_path)
    try:
        for split in ("validation", "test"):
            _walk_results(trainer, agent, split)
    finally:
        jitcache.set_executable_cache(before)
    names = sorted(p.name.split("-")[0] for p in tmp_path.glob(f"*{jitcache.ENTRY_SUFFIX}"))
    assert names == ["evaluate_agent", "evaluate_random"]


def test_walks_compiled_in_background_are_what_the_report_runs(monkeypatch):
    """``Trainer.compile_walks_in_background`` (what ``train`` starts once its phase programs
    are ready) leaves both splits' walks nothing to compile, and they walk as a trainer that
    compiles them itself does."""
    from foxhunt_jax import parallel
    from foxhunt_jax.training import trainer as trainer_module

    cfg = load_config("smoke", UNEQUAL_SPLITS)
    agent = parallel.to_host(Trainer.build(cfg).init_state(seed=3).agent)
    alone = Trainer.build(cfg)
    expected = {s: _walk_results(alone, agent, s) for s in ("validation", "test")}

    ahead = Trainer.build(cfg)
    ahead.compile_walks_in_background(agent)
    ahead._walks_compiling.join()

    def no_compile(*args, **kw):
        raise AssertionError("a walk program compiled after compile_walks_in_background")

    monkeypatch.setattr(trainer_module, "compile_cached", no_compile)
    for split in ("validation", "test"):
        jax.tree.map(np.testing.assert_array_equal, _walk_results(ahead, agent, split),
                     expected[split])


def test_a_walk_past_the_split_s_end_gives_the_split_s_own_walk(monkeypatch):
    """The validation split walked for the test split's length and instruments, its results
    cut to its own: the same paths, curves and metrics as a walk of its own."""
    from foxhunt_jax.training import validate

    trainer = Trainer.build(load_config("smoke", UNEQUAL_SPLITS))
    agent = trainer.init_state(seed=5).agent
    shared = _walk_results(trainer, agent, "validation")
    own = validate.walk_length
    _, starts, lengths = validate.evaluation_params(trainer.tables, trainer.cfg.env, "validation")
    assert int(lengths.max()) < own(trainer.tables, "validation")
    assert len(starts) < validate.walk_rows(trainer.tables, "validation")
    monkeypatch.setattr(validate, "walk_length", lambda tables, split: int(lengths.max()))
    monkeypatch.setattr(validate, "walk_rows", lambda tables, split: len(starts))
    alone = _walk_results(trainer, agent, "validation")
    jax.tree.map(np.testing.assert_array_equal, shared, alone)


@pytest.mark.patches_host_code_only  # padded_size sets the tables' shapes, in the key
def test_padded_tables_leave_the_epochs_unchanged(monkeypatch):
    """The env params' tables and starts padded to ``trading.padded_size``, or further to
    ``data.min_table_rows``, give the epochs that unpadded ones give, bit for bit."""
    from foxhunt_jax.env import trading

    def epochs(*overrides):
        trainer = Trainer.build(load_config("smoke", ["train.epochs=2", *overrides]))
        state, records = trainer.init_state(), []
        for _ in range(2):
            state, rec = trainer.run_epoch(state)
            records.append(rec)
        rows = {split: (p.close.shape[0], p.starts.shape[0])
                for split, p in trainer.env_params.items()}
        return without_timing(records), jax.tree.map(np.asarray, state.agent.params), rows

    padded = epochs()
    floor = 4 * max(r for r, _ in padded[2].values())
    larger = epochs(f"data.min_table_rows={floor - 3}")  # padded up to the power of two
    assert larger[2] == {split: (floor, floor) for split in padded[2]}
    monkeypatch.setattr(trading, "padded_size", lambda n: int(n))
    unpadded = epochs()
    for other in (larger, unpadded):
        assert padded[0] == other[0]
        jax.tree.map(np.testing.assert_array_equal, padded[1], other[1])
