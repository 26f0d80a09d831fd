"""The ``cmdbuf`` section (GPU only): the seed epoch in a fresh process with XLA's own
command-buffer kinds, which leave while loops and conditionals out, against the library's
(:data:`foxhunt_jax.jitcache.COMMAND_BUFFER_KINDS`): what putting the loops into CUDA graphs
buys."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import jax

from foxhunt_jax.bench.child import child_cmd, child_env, report_child, run_child
from foxhunt_jax.bench.common import Deadline
from foxhunt_jax.jitcache import COMMAND_BUFFER_KINDS, COMMAND_BUFFER_OPTION

# XLA's own command-buffer kinds (the library's without while loops and conditionals), which
# XLA_FLAGS sets over the library's option
XLA_DEFAULT_KINDS = ",".join(k for k in COMMAND_BUFFER_KINDS.split(",")
                             if k not in ("WHILE", "CONDITIONAL"))
CMDBUF_FLAGS = f"--{COMMAND_BUFFER_OPTION}={XLA_DEFAULT_KINDS}"


def section_cmdbuf(args, out: dict, deadline: Deadline) -> None:
    """The seed epoch with XLA's default command buffers (no while loops), in a fresh process."""
    if jax.default_backend() != "gpu":
        out["skipped"] = "command buffers are a GPU feature"
        print(f"  skipped: command buffers are a GPU feature ({jax.default_backend()} here)",
              flush=True)
        return
    flags = (os.environ.get("XLA_FLAGS", "") + " " + CMDBUF_FLAGS).strip()
    with tempfile.TemporaryDirectory(prefix="foxhunt-bench-cmdbuf-") as tmp:
        epochs = max(3, args.epochs // 2)
        res = run_child(child_cmd(args, args.cmdbuf_variants, Path(tmp) / "out.json", epochs),
                        child_env(FOXHUNT_JAX_CACHE="off", XLA_FLAGS=flags),
                        deadline.left() - 5)
    res["xla_flags"] = flags
    res["epochs"] = epochs
    out.update(res)
    report_child("XLA default command buffers", res)


