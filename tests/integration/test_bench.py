"""``foxhunt-jax bench``: ``--quick`` runs every section on a CPU; the forward section's kernel
checks, and the statistics, tables, roofline and merge checked on recorded phase times."""

from __future__ import annotations

import argparse
import json
import secrets
from pathlib import Path

import numpy as np
import pytest

from foxhunt_jax.bench import cmdbuf, common, compilation, forward, options, report, runner, seed
from foxhunt_jax.bench import train as train_section
from foxhunt_jax.cli import build_parser, cmd_bench
from foxhunt_jax.config import load_config
from foxhunt_jax.errors import FoxhuntError


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"numpy seed {seed}")
    return np.random.default_rng(seed)


def test_forward_section_checks_and_times_the_taken_logits_and_act_forwards():
    """The bf16 rows of the forward section: taken-action logits and ``network.act`` on both
    backends (the kernels interpreted here), with their equality against Flax."""
    import jax
    import jax.numpy as jnp

    from foxhunt_jax.agent.network import QNetwork, support

    net = QNetwork(branch_sizes=(3, 2), trunk=(16,), head=16, atoms=5, dtype="bfloat16")
    params = net.init(jax.random.key(0), jnp.zeros((1, 8), jnp.float32))
    obs = jax.random.normal(jax.random.key(1), (32, 8), jnp.float32)
    out = {"rows": []}
    forward.logits_rows(out, net, params, obs, {32: obs}, 1, 1000)
    forward.act_rows(out, net, params, support(-1.0, 1.0, 5), obs, {32: obs}, 1, 1000)
    checks = {r["kind"]: r for r in out["equality"]}
    assert "error" not in checks["act"] and "error" not in checks["taken_logits"]
    assert checks["taken_logits"]["logits_rel_err"] < 1e-2  # bf16 products, f32 sums
    assert checks["act"]["taken_logits_rel_err"] < 1e-2
    assert checks["act"]["greedy_differ_share"] <= 0.05  # near-ties only
    assert {(r["config"], r["backend"]) for r in out["rows"]} == {
        (c, b) for c in ("taken_logits", "act") for b in ("xla", "pallas")}
    assert all(r["n"] == 32 and r["ms"] > 0 for r in out["rows"])


def test_forward_section_checks_and_times_the_curiosity_kernel():
    """The curiosity rows: XLA against the RND kernel (interpreted here) at the default launch
    shape and at each extra one, with their difference from XLA's novelty."""
    import jax

    from foxhunt_jax.agent.network import F32_PRECISION_MIN_ROWS
    from foxhunt_jax.config import load_config

    cfg = load_config("smoke")
    n = F32_PRECISION_MIN_ROWS  # the kernel runs from here
    obs = jax.random.normal(jax.random.key(1), (n, 10))
    out = {"rows": []}
    extra = common.parse_kernel_configs("grouped:64:4,grouped:128:8")  # the second is the default
    forward.curiosity_rows(out, cfg, obs, {n: obs}, 1, 0, extra)
    checks = {c["kind"]: c for c in out["equality"]}
    assert sorted(checks) == ["curiosity", "rnd:64:4:16"]
    assert all(c["novelty_rel_err"] < 1e-4 for c in checks.values())
    assert sorted((r["config"], r["backend"]) for r in out["rows"]) == [
        ("curiosity", "pallas"), ("curiosity", "xla"), ("rnd:64:4:16", "pallas")]
    assert all(r["ms"] > 0 for r in out["rows"])


class _RecordedTrainer:
    """Replays recorded phase times through the Trainer methods the bench calls."""

    def __init__(self, times: np.ndarray, compile_ms: float, init_ms: float):
        self.times, self.compile_ms, self.init_ms, self.k = times, compile_ms, init_ms, 0

    def init_state(self):
        return 0

    def run_epoch(self, state, queue_next=False):
        exp, trn, val = self.times[self.k]
        ms = {"experience": exp, "training": trn, "validation": val,
              "init": self.init_ms if self.k == 0 else 0.0,
              "compile": self.compile_ms if self.k == 0 else 0.0}
        self.k += 1
        return state + 1, {"phase_ms": ms, "finite_params": True, "loss": 1.0}


def _args(**kw):
    ns = argparse.Namespace(config="seed", overrides=[], epochs=20, warmup=2, quick=False,
                            variants=(("xla", "float32"), ("pallas", "bfloat16")), seed=0,
                            big_batch=4096)
    ns.__dict__.update(kw)
    return ns


def test_seed_section_statistics_and_tables(monkeypatch, rng):
    epochs, warmup = 20, 2
    recorded = {v: rng.uniform(1.0, 50.0, size=(epochs + warmup, 3)) for v in ("xla", "pallas")}
    made = []

    def build(cfg, market):
        tr = _RecordedTrainer(recorded[cfg.network.backend], 4321.0, 123.0)
        made.append((cfg.network.backend, cfg.network.dtype, tr))
        return tr

    monkeypatch.setattr(seed, "build_trainer", build)
    out = {}
    seed.section_seed(_args(), out, common.Deadline(60), market=None)
    assert [(b, d) for b, d, _ in made] == [("xla", "float32"), ("pallas", "bfloat16")]
    for row in out["rows"]:
        t = recorded[row["backend"]][warmup:]
        total = t.sum(axis=1)
        for k, col in (("experience", t[:, 0]), ("training", t[:, 1]), ("validation", t[:, 2]),
                       ("total", total)):
            p = row["phases"][k]
            assert p["median"] == pytest.approx(np.median(col))
            assert (p["p25"], p["p75"]) == pytest.approx(tuple(np.percentile(col, [25, 75])))
            assert (p["min"], p["max"], p["n"]) == (col.min(), col.max(), epochs)
        assert row["compile_ms"] == 4321.0 and row["init_ms"] == 123.0
        assert row["train_step_ms"] == pytest.approx(np.median(t[:, 1]) / 50)  # seed K = 50
        assert (row["num_episodes"], row["episode_length"], row["batch_size"]) == (1024, 100, 64)

    train = {}
    train_section.section_train(_args(variants=()), train, common.Deadline(60), None, out["rows"])
    [t] = train["rows"]  # only the xla row: training does not depend on the forward backend
    assert t["steps_per_s"] == pytest.approx(1e3 / out["rows"][0]["train_step_ms"])
    assert t["samples_per_s"] == pytest.approx(64 * t["steps_per_s"])

    res = {"meta": {"variants": [["xla", "float32"], ["pallas", "bfloat16"]]},
           "seed": {**out, "config": "seed", "epochs": epochs, "warmup": warmup}, "train": train}
    text = report.tables(res)
    med = out["rows"][0]["phases"]["total"]["median"]
    assert "| xla/f32 | " in text and f"{med:.2f}" in text and "| pallas/bf16 |" in text


def test_spread_matches_numpy_percentiles(rng):
    x = rng.standard_normal(int(rng.integers(2, 50)))
    s = common.spread(list(x))
    np.testing.assert_allclose([s["median"], s["p25"], s["p75"], s["min"], s["max"]],
                               [np.median(x), *np.percentile(x, [25, 75]), x.min(), x.max()])
    assert s["n"] == len(x)
    assert common.spread([]) == {}


def test_roofline_from_measured_rates():
    args = _args(config="seed")
    cfg = load_config("seed")
    q_flops, d = 521_000, 40
    res = {"forward": {"obs_dim": d, "flops_per_row": q_flops},
           "device": {"gemm": {"bf16": {"tflops": 500.0}, "f32_bf16x6": {"tflops": 40.0}},
                      "copy": {"gb_per_s": 3000.0}}}
    roof = report.roofline(res, args)
    h, e = cfg.curiosity.hidden, cfg.curiosity.embed
    rnd = 4 * (d * h + h * h + h * e)
    assert roof["rnd_flops"] == rnd
    # a bf16 run multiplies the curiosity pass as three bf16 products (curiosity.precision auto)
    assert roof["floor_steps_per_s_bf16"] == pytest.approx(
        1 / (q_flops / 500e12 + 3 * rnd / 500e12))
    assert roof["floor_steps_per_s_bf16_no_curiosity"] == pytest.approx(500e12 / q_flops)
    assert roof["floor_steps_per_s_f32"] == pytest.approx(1 / ((q_flops + rnd) / 40e12))
    # the bytes include the 4 B greedy action and 11 x 4 B taken logits of each of 3 branches
    assert roof["bytes_per_step"] == 4 * (d - 6) + 40 + 80 + 86 + 3 * 4 + 3 * 44 + 8 * d


def test_merge_joins_runs_that_split_the_sections(tmp_path, capsys):
    """Two runs' JSONs (seed + device, then train + forward) make one result: each section
    once, train's seed-batch rows derived from the other run's seed section, the roofline from
    the device section of one and the forward section of the other, every command listed."""
    phase = {"median": 5.0, "p25": 4.0, "p75": 6.0}
    seed_row = {"backend": "xla", "dtype": "float32", "batch_size": 64, "train_step_ms": 0.08,
                "compile_ms": 1e4, "phases": {k: phase for k in ("experience", "training",
                                                                 "validation", "total")}}
    gemm = {k: {"tflops": t} for k, t in (("bf16", 500.0), ("f32_bf16x6", 40.0),
                                          ("f32_highest", 30.0), ("f32_default", 200.0))}
    first = {"meta": {"commit": "abc1234", "date": "2026-12-01", "command": "bench A",
                      "config": "seed", "overrides": []},
             "seed": {"config": "seed", "epochs": 20, "warmup": 1,
                      "rows": [seed_row, dict(seed_row, backend="pallas", dtype="bfloat16")]},
             "device": {"gemm": gemm, "copy": {"gb_per_s": 3000.0}}}
    second = {"meta": {"commit": "abc1234", "date": "2026-12-01", "command": "bench B"},
              "train": {"rows": [{"dtype": "bfloat16", "batch": 4096, "step_ms": 0.2,
                                  "steps_per_s": 5e3, "samples_per_s": 2.048e7}]},
              "forward": {"obs_dim": 40, "flops_per_row": 521_000, "rows": []}}
    files = []
    for i, r in enumerate((first, second)):
        files.append(tmp_path / f"part{i}.json")
        files[-1].write_text(json.dumps(r))
    out = tmp_path / "merged.json"
    runner.main(["--merge", *map(str, files), "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["meta"]["commit"] == "abc1234"
    assert res["meta"]["command"] == ["bench A", "bench B"]
    assert res["meta"]["sections"] == ["seed", "device", "forward", "train"]
    train = res["train"]["rows"]
    assert [(r["batch"], r.get("source")) for r in train] == [(64, "seed section"), (4096, None)]
    assert train[0]["steps_per_s"] == pytest.approx(12_500.0)
    assert res["roofline"] == report.roofline({"forward": second["forward"],
                                              "device": first["device"]}, _args(config="seed"))
    printed = capsys.readouterr().out
    assert "Seed epoch" in printed
    assert printed.strip().splitlines()[-1] == f"wrote {out} (the results as JSON)"
    second["meta"]["commit"] = "def5678"
    assert report.merge([("a", first), ("b", second)])["meta"]["commit"] == "mixed"
    with pytest.raises(FoxhuntError, match="cannot read"):
        runner.main(["--merge", str(tmp_path / "missing.json")])


def test_argument_parsing_and_cli_entry():
    assert options.parse_variants("xla:f32,pallas:bf16") == (("xla", "float32"),
                                                           ("pallas", "bfloat16"))
    for bad in ("cuda:float32", "xla:float16", "pallas:float32", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            options.parse_variants(bad)
    [kc] = common.parse_kernel_configs("per_action:64:4:32")
    assert (kc.layout, kc.block_rows, kc.num_warps, kc.min_rows) == ("per_action", 64, 4, 32)
    assert (kc.max_chunk, kc.lookahead) == (None, 0)
    for text in ("grouped:128:8:16:128:2", "per_action:64:4:32:0:0"):
        [kc] = common.parse_kernel_configs(text)
        assert common.kernel_config_name(kc) == text
    for bad in ("grouped:100:4", "rows:64:4", "grouped:64", "grouped:64:4:16:x",
                "grouped:64:4:16:64:-1", "grouped:64:4:16:64:1:9"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.parse_kernel_configs(bad)
    assert options.parse_ints("1024,1_048_576") == (1024, 1048576)
    args = build_parser().parse_args(["bench", "--quick", "--sections", "device"])
    assert args._run is cmd_bench and args.quick and args.sections == ("device",)
    assert options.parse_sections("seed, forward") == ("seed", "forward")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown section"):
        options.parse_sections("seed,gpu")


def test_compile_section_skips_the_steps_after_one_that_fails_or_runs_out_of_time(monkeypatch):
    """Each variant's cold, XLA-cache and executable-cache children share one cache folder, so a
    step that fails, or is not started for lack of time, marks that variant's later steps
    skipped; the other variants still run all three."""
    from types import SimpleNamespace

    calls = []

    def child(cmd, env, timeout):
        variant = cmd[cmd.index("--variants") + 1]
        step = Path(cmd[cmd.index("--json") + 1]).stem
        calls.append((variant, step))
        if variant == "xla:bfloat16" and step == "cold":
            return {"error": "exit 1: boom"}
        b, d = variant.split(":")
        return {"rows": [{"backend": b, "dtype": d, "compile_ms": 1.0, "init_ms": 1.0}]}

    monkeypatch.setattr(compilation, "run_child", child)
    variants = [("xla", "float32"), ("xla", "bfloat16"), ("pallas", "bfloat16")]
    args = SimpleNamespace(compile_variants=None, variants=variants, config="seed", overrides=[],
                           quick=False)
    out = {}
    compilation.section_compile(args, out, common.Deadline(600))
    assert [v for v, _ in calls] == (["xla:float32"] * 3 + ["xla:bfloat16"]
                                     + ["pallas:bfloat16"] * 3)
    assert out["cold"]["error"] == "xla/bfloat16: exit 1: boom"
    for step in ("cached_xla_only", "cached"):
        assert out[step]["skipped"] == ["xla/bfloat16"]
        assert [r["backend"] + r["dtype"] for r in out[step]["rows"]] == ["xlafloat32",
                                                                           "pallasbfloat16"]
    assert "skipped" not in out["cold"] and len(out["cold"]["rows"]) == 2

    calls.clear()
    out = {}
    compilation.section_compile(args, out, common.Deadline(10))  # under the 20 s a child needs
    assert calls == []
    for step in ("cold", "cached_xla_only", "cached"):
        assert out[step]["skipped"] == ["xla/float32", "xla/bfloat16", "pallas/bfloat16"]
        assert out[step]["rows"] == []


def test_cmdbuf_section_times_xla_s_own_command_buffer_kinds():
    """The cmdbuf section's child runs with XLA_FLAGS naming XLA's own command-buffer kinds,
    which take precedence over the library's (while loops and conditionals added)."""
    from foxhunt_jax import jitcache

    library = set(jitcache.COMMAND_BUFFER_KINDS.split(","))
    flag, kinds = cmdbuf.CMDBUF_FLAGS.split("=", 1)
    assert flag == f"--{jitcache.COMMAND_BUFFER_OPTION}"
    assert set(kinds.split(",")) == library - {"WHILE", "CONDITIONAL"}


def test_rates_of_a_phase_timed_at_zero_are_missing_not_a_division_by_zero():
    """A tiny workload's phase can measure 0 ms (queued work done before its clock is read):
    its rates are missing, not infinite, and the tables still have its rows."""
    phase = {"median": 0.0, "p25": 0.0, "p75": 0.0}
    row = {"backend": "xla", "dtype": "bfloat16", "batch_size": 16, "train_step_ms": 0.0,
           "phases": {k: phase for k in ("experience", "training", "validation", "total")}}
    [t] = train_section.seed_train_rows([row])
    assert t["steps_per_s"] is None and t["samples_per_s"] is None
    assert common.per_second(16, 4.0) == pytest.approx(4000.0)
    col = {"n": 16, "kind": "experience (seed epoch)", "backend": "xla", "dtype": "bfloat16",
           "ms": 0.0, "env_steps_per_s": None}
    text = report.tables({"meta": {"variants": [["xla", "bfloat16"]]}, "train": {"rows": [t]},
                          "collect": {"episode_length": 8, "rows": [col]}})
    assert "| bfloat16 | 16 | 0.000 | n/a | n/a" in text
    assert "| 16 | experience (seed epoch) | n/a |" in text


def test_quick_runs_every_section_on_a_cpu(tmp_path, capsys):
    """``bench --quick``: every section, no error, every row it measures in the JSON and in the
    printed tables; the GPU-only section says so in one line."""
    out = tmp_path / "quick.json"
    res = runner.main(["--quick", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["meta"]["sections"] == list(options.SECTIONS) and saved["meta"]["quick"]
    assert res["meta"]["command"] == f"foxhunt-jax bench --quick --json {out}"
    for name in options.SECTIONS:
        section = saved[name]
        assert "error" not in section, (name, section["error"])
        rows = section.get("rows", []) + section.get("breakdown", [])
        assert not [r for r in rows if "error" in r], name
    printed = capsys.readouterr().out
    assert printed.strip().splitlines()[-1] == f"wrote {out} (the results as JSON)"
    variants = [tuple(v) for v in saved["meta"]["variants"]]
    assert {b for b, _ in variants} == {"xla", "pallas"}
    assert {d for _, d in variants} == {"float32", "bfloat16"}
    # seed: one row per variant, each timed and in the table
    assert [(r["backend"], r["dtype"]) for r in saved["seed"]["rows"]] == variants
    for r in saved["seed"]["rows"]:
        assert r["phases"]["total"]["n"] == 2 and r["compile_ms"] > 0
        assert f"| {common.vname(r['backend'], r['dtype'])} | " in printed
    # population: P = 1 (the single-agent trainer) and P = 2 (one program), each in the table
    pop = saved["population"]["rows"]
    assert [r["population"] for r in pop] == [1, 2]
    for r in pop:
        assert r["epoch_ms"]["n"] == 2 and r["agent_epochs_per_s"] > 0
        assert r["state_bytes_per_member"] > 0 and f"| {r['population']} | " in printed
        # each phase timed every epoch, its median in the table beside the epoch's
        phases = r["phase_ms"]
        assert set(phases) == {"experience", "training", "validation"}
        assert all(p["n"] == 2 for p in phases.values())
        assert f"| {r['population']} | {r['epoch_ms']['median']:.2f} | " \
               f"{phases['experience']['median']:.2f} | {phases['training']['median']:.2f} | " \
               f"{phases['validation']['median']:.2f} | " in printed
    # compile: the first variant cold, then from each cache
    for step in ("cold", "cached_xla_only", "cached"):
        [r] = saved["compile"][step]["rows"]
        assert (r["backend"], r["dtype"]) == variants[0] and r["compile_ms"] > 0
    assert saved["compile"]["cached"]["rows"][0]["executables_loaded"] > 0
    assert saved["device"]["gemm"]["bf16"]["tflops"] > 0 and "GEMM TFLOP/s" in printed
    fwd = saved["forward"]
    assert fwd["rows"] and all(r["ms"] > 0 for r in fwd["rows"])
    assert {c["kind"] for c in fwd["equality"]} >= {"equality", "curiosity", "taken_logits",
                                                   "act", "bootstrap_loss"}
    assert printed.count("| 64 | ") >= len(fwd["rows"])
    col = saved["collect"]
    assert sorted((r["kind"], r["backend"]) for r in col["rows"]) == [
        ("experience (seed epoch)", "pallas"), ("experience (seed epoch)", "xla"),
        ("rollout", "pallas"), ("rollout", "xla")]
    for r in col["rows"] + col["breakdown"]:
        if r["ms"] == 0:  # a queued phase can finish before its clock is read
            assert r["kind"] == "experience (seed epoch)" and r["env_steps_per_s"] is None
        else:
            assert r["env_steps_per_s"] > 0
    assert {r["kind"] for r in col["breakdown"]} == {"rollout_no_curiosity",
                                                    "env_only_random_actions"}
    assert "error" not in col["equality"] and col["equality"]["n"] == 16
    assert printed.count("breakdown N=16") == 2
    assert "| 16 | rollout | " in printed and "| 16 | experience (seed epoch) | " in printed
    trn = saved["train"]["rows"]
    assert [(r["batch"], r["dtype"]) for r in trn] == [(16, "float32"), (128, "bfloat16"),
                                                       (128, "float32")]
    assert printed.count("| float32 | ") + printed.count("| bfloat16 | ") >= len(trn)
    rep = saved["replay"]["rows"]
    assert {r["op"] for r in rep} == {"add 256", "add 64", "sample 16", "update 16"}
    assert all(r["ours_ms"] is None or r["ours_ms"] > 0 for r in rep)
    assert printed.count("| 1,024 | ") == len(rep)
    pol = saved["policy"]["rows"]  # --quick: the first variant, both paths, 1 and 1,000
    assert sorted((r["path"], r["instruments"]) for r in pol) == [
        ("exported", 1), ("exported", 1000), ("library", 1), ("library", 1000)]
    assert all(0 < r["median_us"] <= r["p99_us"] and r["calls"] == 20 for r in pol)
    assert "A live decision (Policy.step)" in printed
    assert saved["cmdbuf"]["skipped"] == "command buffers are a GPU feature"
    assert "skipped: command buffers are a GPU feature" in printed
    assert saved["roofline"]["q_forward_flops"] == fwd["flops_per_row"]
