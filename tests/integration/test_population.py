"""Populations: member i of one vmapped program trains as a single-agent run of member i's seed
and hyperparameters would; exact resume of every member; the run folder's records."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from foxhunt_jax import api
from foxhunt_jax.config import load_config, member_config, population_members
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.training.population import PopulationTrainer
from foxhunt_jax.training.rundir import read_metrics
from foxhunt_jax.training.trainer import Trainer
from records import without_timing

ROOT = Path(__file__).resolve().parents[2]
TINY = ["network.backend=xla", "network.dtype=float32", "network.trunk=[16]", "network.head=8",
        "env.episode_length=8", "train.num_episodes=4", "train.train_steps=3",
        "train.batch_size=8", "replay.capacity=256", "train.validation_windows=4",
        "eval.random_policies=8", "curiosity.hidden=8", "curiosity.embed=4",
        "network.support=explicit", "network.v_min=-5", "network.v_max=5"]


def tiny(*extra):
    return load_config("smoke", TINY + list(extra))


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_each_member_trains_as_its_single_agent_run():
    # hard target copies at steps 2, 4 and 6: the members' shared step and its conditional
    cfg = tiny("train.population=2", "train.target_period=2",
               'population.grid=["train.learning_rate=1e-4,1e-3"]',
               'population.random=["train.gamma=0.8..0.99", "env.cost_bps=0..20", '
               '"curiosity.coef=0.001..0.1:log", "train.n_step=1..5", '
               '"train.epsilon_end=0.0..0.2"]')
    pop = PopulationTrainer.build(cfg)
    state = pop.init_state()
    for _ in range(2):
        state, records, _ = pop.run_epoch(state)
    assert [r["member"] for r in records] == [0, 1]
    members = population_members(cfg)
    assert len({m["train.n_step"] for m in members}) > 1  # a traced n is exercised
    for i, hparams in enumerate(members):
        single = Trainer.build(member_config(cfg, hparams, i))
        s = single.init_state()
        for _ in range(2):
            s, rec = single.run_epoch(s)
        member = jax.tree.map(lambda x: x[i], (state.agent.params, state.agent.target_params))
        for a, b in zip(leaves((s.agent.params, s.agent.target_params)), leaves(member)):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
        np.testing.assert_allclose(rec["loss"], records[i]["loss"], rtol=1e-4)
        np.testing.assert_allclose(rec["val_loss"], records[i]["val_loss"], rtol=1e-4)
        assert rec["reward"] == pytest.approx(records[i]["reward"], rel=1e-4, abs=1e-6)
        assert rec["epsilon"] == pytest.approx(records[i]["epsilon"])
        assert rec["val"]["sharpe"] == pytest.approx(records[i]["val"]["sharpe"], rel=1e-3,
                                                     abs=1e-4)


def test_resume_is_exact_for_every_member(tmp_path):
    cfg = tiny("train.population=2", "train.epochs=3",
               'population.grid=["train.gamma=0.9,0.99"]')
    quiet = dict(progress=False, log=lambda s: None, final_report=False, compile_cache=False)
    whole = api.train(cfg, tmp_path / "whole", **quiet)

    class Stop(Exception):
        pass

    def stop_after_two(record):  # a stop after epoch 2's checkpoint, as a kill would leave it
        if record["epoch"] == 2 and record["member"] == 1:
            raise Stop
    with pytest.raises(Stop):
        api.train(cfg, tmp_path / "split", callbacks=[stop_after_two], **quiet)
    resumed = api.train(cfg, tmp_path / "split", resume=True, **quiet)
    for a, b in zip(leaves(whole.state), leaves(resumed.state)):
        np.testing.assert_array_equal(a, b)
    assert [s.to_json() for s in whole.selections] == [s.to_json() for s in resumed.selections]
    records = lambda run: without_timing(read_metrics(tmp_path / run))
    assert records("whole") == records("split")
    assert sorted({(r["member"], r["epoch"]) for r in records("whole")}) == [
        (m, e) for m in (0, 1) for e in (1, 2, 3)]


def test_population_json_holds_every_member(tmp_path):
    cfg = tiny("train.population=2", "train.epochs=1", 'population.grid=["env.cost_bps=1,30"]')
    res = api.train(cfg, tmp_path / "run", progress=False, log=lambda s: None,
                    compile_cache=False)
    saved = json.loads((tmp_path / "run" / "population.json").read_text())["members"]
    assert [m["hparams"] for m in saved] == [{"env.cost_bps": 1.0}, {"env.cost_bps": 30.0}]
    assert [m["seed"] for m in saved] == [cfg.train.seed, cfg.train.seed + 1]
    for m, kept in zip(saved, res.members):
        assert m["selected_epoch"] == 1
        assert len(m["validation_window_returns"]) == cfg.train.validation_windows
        assert len(m["test_equity"]) == len(m["test_dates"]) >= 2
        assert m["test"]["agent"]["sharpe"] == pytest.approx(kept["test"]["agent"]["sharpe"])
        assert "sharpe" in m["test_percentile"]
    # the two members pay different costs on the same walk: the buy-and-hold rows differ
    assert saved[0]["test"]["buy_and_hold"] != saved[1]["test"]["buy_and_hold"]
    first, second = res.history
    assert first["val_buy_and_hold"]["total_return"] > second["val_buy_and_hold"]["total_return"]
    with pytest.raises(ConfigError, match="population.json"):  # not one agent to evaluate
        api.evaluate(tmp_path / "run", compile_cache=False)
    # the population report of the same members, in the run's report folder
    report = json.loads((tmp_path / "run" / "report" / "population_report.json").read_text())
    assert [row["member"] for row in report["members"]] == [0, 1]
    sharpes = [m["validation"]["agent"]["sharpe"] for m in saved]
    assert report["chosen"]["member"] == int(np.argmax(sharpes)) == res.chosen
    assert all((tmp_path / "run" / "report" / name).stat().st_size > 0
               for name in report["files"])


@pytest.mark.parametrize("override, named", [
    ("train.population=0", "train.population"),
    ('population.grid=["train.nonsense=1,2"]', "train.nonsense"),
    ('population.grid=["train.gamma=0.9,0.99"]', "multiple of the 2 cells"),
    ('population.random=["train.gamma=0.5..1.5"]', "train.gamma"),
])
def test_bad_population_config_is_one_error_line(tmp_path, capsys, override, named):
    from foxhunt_jax.cli import main
    code = main(["train", "--config", "smoke", "--set", "train.population=3", "--set", override,
                 "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error:") and named in err[0]
    assert not (tmp_path / "run").exists()


def test_members_split_over_two_devices_give_the_one_device_numbers(tmp_path):
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from foxhunt_jax.jitcache import enable_compilation_cache
        enable_compilation_cache(executables=False)  # the suite's persistent cache
        from foxhunt_jax.config import load_config
        from foxhunt_jax.training.population import PopulationTrainer
        cfg = load_config("smoke", {TINY!r} + ["train.population=2",
                          'population.grid=["train.gamma=0.9,0.99"]'])
        runs = []
        for devices in (jax.devices()[:1], jax.devices()):
            pop = PopulationTrainer.build(cfg, devices=devices)
            state = pop.init_state()
            for _ in range(2):
                state, records, _ = pop.run_epoch(state)
            runs.append((pop.mesh.size, [r["loss"] for r in records],
                         [np.asarray(x) for x in jax.tree.leaves(state)]))
        (one, loss_one, leaves_one), (two, loss_two, leaves_two) = runs
        assert (one, two) == (1, 2), (one, two)
        np.testing.assert_allclose(loss_one, loss_two, rtol=1e-6)
        # integers (replay slots, actions, keys, counters) equal; floats to float32 rounding:
        # with fewer members a device, XLA may sum a member's reductions in another order
        for a, b in zip(leaves_one, leaves_two):
            if np.issubdtype(a.dtype, np.floating):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
            else:
                np.testing.assert_array_equal(a, b)
        print("same")
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-3000:]


def test_evaluate_act_and_export_take_a_member(tmp_path, capsys):
    """A member's selected agent, walked by `evaluate --member K` under its own config, gives
    the test figures population.json holds for it; act and export take the member too; a
    population without --member, or a member outside 0..P-1, is one error line."""
    from foxhunt_jax.cli import main
    from foxhunt_jax.policy import Policy

    cfg = tiny("train.population=2", "train.epochs=2", 'population.grid=["env.cost_bps=1,30"]')
    run = tmp_path / "run"
    api.train(cfg, run, progress=False, log=lambda s: None, compile_cache=False)
    saved = json.loads((run / "population.json").read_text())["members"]
    capsys.readouterr()
    assert main(["evaluate", "--run", str(run), "--member", "1"]) == 0
    walked = json.loads((run / "report" / "evaluate_test_member1.json").read_text())
    assert walked["metrics"]["agent"]["sharpe"] == pytest.approx(
        saved[1]["test"]["agent"]["sharpe"], rel=1e-5, abs=1e-7)
    assert walked["agent"]["member"] == 1
    assert main(["act", "--run", str(run), "--member", "0"]) == 0
    assert "member 0's selected agent" in capsys.readouterr().out
    policy = Policy.load(run, member=1)
    assert policy.cfg.env.cost_bps == 30.0 and policy.cfg.train.seed == cfg.train.seed + 1
    assert main(["export", "--run", str(run), "--member", "1", "--out",
                 str(tmp_path / "exported")]) == 0
    for argv, needle in ((["act", "--run", str(run)], "pass --member K (0..1"),
                         (["evaluate", "--run", str(run), "--member", "2"],
                          "--member must be in 0..1")):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


def test_run_settings_leave_the_population_programs_unchanged():
    """Two populations of the same size and varying keys that differ in the run settings (seeds,
    epochs, schedules, the members' drawn values, another window of the market) lower their
    four programs to the same text, so their executable-cache keys may be equal."""
    grid = 'population.random=["train.learning_rate=1e-4..1e-3:log"]'
    base = tiny("train.population=2", grid)
    other = tiny("train.population=2", grid, "train.seed=7", "train.epochs=9",
                 "train.epsilon_start=0.5", "train.epsilon_decay_epochs=3", "population.seed=3",
                 "replay.beta_start=0.2", "eval.random_policies=5",
                 "data.window=[2000-06-01,2013-12-31]")
    texts, keys = [], []
    for cfg in (base, other):
        pop = PopulationTrainer.build(cfg)
        state_keys = jax.numpy.stack([jax.random.PRNGKey(pop.seed(i)) for i in range(pop.size)])
        programs = pop.jitted_programs(pop.init_state(), keys=state_keys)
        assert set(programs) == {"init_state", "experience", "training", "validation"}
        texts.append({name: program.lower(*args).as_text()
                      for name, (program, args) in programs.items()})
        keys.append(pop.key_config)
    assert population_members(base) != population_members(other)
    assert keys[0] == keys[1] and texts[0] == texts[1]


def test_a_population_s_per_transition_passes_share_the_row_chunk():
    """The members of a population share ``tuning.ROW_CHUNK`` rows a pass (``row_chunk`` of
    the backend resolved for P copies), so the Experience program of 64 seed-sized members
    (102,400 transitions each) holds 5.9 GiB of temporaries on this CPU, not the 25 GiB of
    every member's transitions in one pass (which ran out of memory on a 24 GiB machine).
    Compiled only."""
    import jax.numpy as jnp

    pop = PopulationTrainer.build(load_config("seed", ["train.population=64"]))
    assert pop.backend.tuning.row_chunk == (1 << 20) // 64
    keys = jax.device_put(jnp.stack([jax.random.PRNGKey(i) for i in range(pop.size)]),
                          pop._split)
    build, args = pop.jitted_programs(keys=keys)["init_state"]
    experience, args = pop.jitted_programs(jax.eval_shape(build, *args))["experience"]
    memory = experience.lower(*args).compile().memory_analysis()
    assert memory.temp_size_in_bytes < 8 * 2**30
