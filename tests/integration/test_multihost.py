"""Two real processes on localhost (jax.distributed, CPU collectives over gloo) train one model in
lockstep: the same numbers on both every epoch, and only process 0 writes the run directory's
files. (That the result depends on the shards, not on the devices, is tested in
tests/integration/test_parallel.py.)"""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from foxhunt_jax.training import checkpoint
from foxhunt_jax.training.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[2]
# Small programs; XLA's slow CPU optimizations off (compiling is what takes time here).
OVERRIDES = ["env.episode_length=8", "network.trunk=[16]", "network.head=8", "network.atoms=5",
             "train.num_episodes=16", "train.batch_size=16", "replay.capacity=1024",
             "train.train_steps=3", "train.validation_windows=8", "curiosity.hidden=8",
             "curiosity.embed=4", "train.epsilon_decay_epochs=2", "train.epochs=2",
             "train.shards=2"]
FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

WORKER = textwrap.dedent('''
    import json, sys
    from foxhunt_jax import parallel
    joined = parallel.initialize(parallel.distributed_spec())  # FOXHUNT_* variables
    import jax
    from foxhunt_jax import api
    from foxhunt_jax.config import load_config
    from foxhunt_jax.jitcache import enable_compilation_cache
    enable_compilation_cache()
    cfg = load_config("smoke", json.loads(sys.argv[2]))
    res = api.train(cfg, sys.argv[1], progress=False, final_report=False)
    keys = ("loss", "grad_norm", "rnd_loss", "reward", "bonus", "val_loss")
    print("RESULT " + json.dumps({
        "joined": joined, "process": jax.process_index(), "processes": jax.process_count(),
        "devices": jax.device_count(), "history": [[r[k] for k in keys] for r in res.history],
        "val": [r["val"] for r in res.history]}))
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: str, extra_env: dict) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=FLAGS,
               **extra_env)
    return subprocess.Popen([sys.executable, "-c", WORKER, out, json.dumps(OVERRIDES)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def result(proc: subprocess.Popen) -> tuple[dict, str]:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.split("RESULT ", 1)[1]), stdout


def test_two_processes_train_in_lockstep_and_only_process_0_writes(tmp_path):
    run = tmp_path / "run"
    coordinator = {"FOXHUNT_COORDINATOR": f"127.0.0.1:{free_port()}", "FOXHUNT_NUM_PROCESSES": "2"}
    procs = [launch(str(run), dict(coordinator, FOXHUNT_PROCESS_ID=str(i))) for i in (0, 1)]
    (r0, out0), (r1, out1) = result(procs[0]), result(procs[1])

    assert (r0["process"], r1["process"]) == (0, 1) and r0["joined"] and r1["joined"]
    assert r0["processes"] == r1["processes"] == 2 and r0["devices"] == r1["devices"] == 2
    # lockstep: the same (replicated) numbers on both processes every epoch; validation runs on
    # each process's own device with its copy of the agent and agrees too
    assert len(r0["history"]) == 2 and r0["history"] == r1["history"] and r0["val"] == r1["val"]
    assert np.all(np.isfinite(r0["history"])) and r0["history"][0] != r0["history"][1]

    # process 0 alone writes: each epoch once in metrics.jsonl, one TensorBoard file, and prints
    recs = read_metrics(run)
    assert [r["epoch"] for r in recs] == [1, 2]
    np.testing.assert_allclose([recs[i]["loss"] for i in (0, 1)], [h[0] for h in r0["history"]],
                               rtol=1e-7)
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 1
    assert (run / "config.yaml").exists()
    assert "epoch   1/2" in out0 and "epoch" not in out1
    # the checkpoint both processes saved together is complete
    assert checkpoint.latest_step(run / "checkpoints") == 2
