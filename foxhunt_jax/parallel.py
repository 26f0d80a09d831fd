"""Data parallelism over devices and hosts: one code path for 1 to n devices.

The training state carries a fixed number of *shards* ``S`` (``train.shards``): the rollout holds
``[S, N/S, ...]`` episodes, the replay buffer ``[S, C/S, ...]`` slots (each shard its own ring
with its own prioritized sampling), and every random draw of shard ``s`` comes from
``fold_in(key, s)``. The phase functions ``vmap`` over the shard axis; under ``jax.jit`` that
axis is placed on a 1-D mesh ``("data",)`` of ``n`` devices (``NamedSharding(P("data"))``) while
parameters and optimizer state are replicated (``NamedSharding(P())``), so XLA partitions the
``vmap`` and inserts the all-reduce of the gradient (the loss is a mean over the global batch).

Experience collection is the exception: its Pallas kernels are opaque to XLA's partitioner, so
the collector runs under ``jax.shard_map`` (:func:`per_device`), each device over its own shards.

``S`` fixes the algorithm; the device count only places it. A run therefore gives the same result
on 1, 2 or 8 devices up to the order of float reductions, and a checkpoint restores onto another
device count (the shapes depend on ``S`` alone). ``S`` must be a multiple of the device count.

Several hosts join through :func:`initialize` (``jax.distributed.initialize``): every process
runs the same program over the global mesh; process 0 alone writes metrics, TensorBoard, config
and report, and every process calls the (synchronizing) checkpoint save.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from foxhunt_jax.errors import ConfigError

DATA = "data"  # the one mesh axis: shards of episodes, replay and batch
ENV_COORDINATOR = "FOXHUNT_COORDINATOR"
ENV_NUM_PROCESSES = "FOXHUNT_NUM_PROCESSES"
ENV_PROCESS_ID = "FOXHUNT_PROCESS_ID"
ENV_DISTRIBUTED = "FOXHUNT_DISTRIBUTED"
# How long a process waits at a barrier for the others (wait_for_all_processes)
BARRIER_TIMEOUT_S = 3600


# --- mesh and shardings --------------------------------------------------------------------------

def make_mesh(shards: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ``("data",)`` mesh over ``devices``.

    The default is :func:`fitting_devices`: in one process the most local devices whose count
    divides ``shards`` (so ``train.shards=1`` runs on one device of a host that has several, and
    the result stays defined by ``shards``, not by the host); in a multi-process run every device
    of every process. Raises ConfigError when ``shards`` is not a multiple of the device count:
    the shard axis is split evenly, so each device holds ``shards / n`` whole shards.
    """
    if shards < 1:
        raise ConfigError(f"config key 'train.shards' must be at least 1, got {shards}")
    devs = list(fitting_devices(shards) if devices is None else devices)
    n = len(devs)
    if n < 1:
        raise ConfigError("no devices to build the data mesh from")
    if shards < 1 or shards % n:
        raise ConfigError(f"config key 'train.shards' must be a multiple of the device count {n} "
                          f"(each device holds whole shards), got {shards}")
    # Auto axes: XLA partitions the vmapped shard axis and places the collectives itself.
    return jax.make_mesh((n,), (DATA,), axis_types=(AxisType.Auto,), devices=devs)


def fitting_devices(shards: int) -> list[jax.Device]:
    """The most local devices that divide ``shards`` (single process), else all devices.

    For reading a run back (evaluate): a run trained with ``S`` shards then works on a machine
    whose device count does not divide ``S``.
    """
    if jax.process_count() > 1:
        return list(jax.devices())
    devs = list(jax.local_devices())
    n = max(k for k in range(1, len(devs) + 1) if shards % k == 0)
    return devs[:n]


def sharded(mesh: Mesh) -> NamedSharding:
    """Leading axis split over the data axis (rollout, replay, per-shard keys)."""
    return NamedSharding(mesh, P(DATA))


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device (parameters, optimizer state, scalars, env tables)."""
    return NamedSharding(mesh, P())


def shard_keys(key: jax.Array, shards: int) -> jax.Array:
    """``[S]`` keys: shard ``s`` draws from ``fold_in(key, s)`` (raw ``uint32[2]`` keys too)."""
    shard = jnp.arange(shards, dtype=jnp.uint32)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, shard)


def per_device(fn: Callable, mesh: Mesh, sharded: int, replicated: int) -> Callable:
    """``fn`` run by each device of ``mesh`` on its own shards (``jax.shard_map``).

    The first ``sharded`` arguments (leading shard axis ``S``) are split along :data:`DATA`,
    the next ``replicated`` are passed whole, and every output is split along :data:`DATA`;
    ``fn`` sees ``S / devices`` shards. Pallas kernels need this: to XLA's partitioner a kernel
    is an opaque custom call, so under plain ``jit`` it gathers the operands and every device
    runs the kernel over all ``S`` shards. (``check_vma`` is off: ``pallas_call`` has no
    replication rule, and nothing inside communicates.)
    """
    specs = (P(DATA),) * sharded + (P(),) * replicated
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(DATA), check_vma=False)


def local_device(mesh: Mesh) -> jax.Device:
    """This process's first device of ``mesh``."""
    return next(d for d in mesh.devices.flat if d.process_index == jax.process_index())


def abstract(x: Any, sharding=None) -> jax.ShapeDtypeStruct:
    """``x``'s shape, dtype and weak type as a ``ShapeDtypeStruct`` placed by ``sharding``
    (default: ``x``'s own): what lowering a program for ``x`` reads of it."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False),
                                sharding=x.sharding if sharding is None else sharding)


def local_view(tree: Any, device: jax.Device) -> Any:
    """The copy that ``device`` holds of each replicated array of ``tree`` (no transfer).

    Arrays on one device only (already local) must be on ``device``. Of an abstract leaf
    (``ShapeDtypeStruct``), the same leaf placed on ``device`` alone, as the copy would be.
    """

    def get(x):
        # an array that lives on ``device`` alone (a one-device mesh) is its own copy; this check
        # is cheap, while walking addressable_shards costs Python work per leaf
        if x.sharding.device_set == {device}:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            if not x.sharding.is_fully_replicated:
                raise ValueError(f"local_view: array {x.shape} is split over devices")
            return abstract(x, jax.sharding.SingleDeviceSharding(device))
        for shard in x.addressable_shards:
            if shard.device == device:
                if not x.sharding.is_fully_replicated:
                    raise ValueError(f"local_view: array {x.shape} is split over devices")
                return shard.data
        raise ValueError(f"local_view: no copy of an array {x.shape} on {device}")

    return jax.tree.map(get, tree)


def put_replicated(tree: Any, mesh: Mesh) -> Any:
    """Host (or local) arrays -> global arrays replicated on ``mesh``.

    Built with ``make_array_from_callback`` so it works when the mesh spans several processes
    (each process fills its own devices from its own identical host copy).
    """
    sharding = replicated(mesh)

    def put(x):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, tree)


def to_host(tree: Any) -> Any:
    """Global arrays that are replicated (or fully addressable) -> host NumPy arrays.

    On several processes a replicated array is not fully addressable; its local copy is exact.
    """

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if not x.is_fully_replicated:
                raise ValueError(f"to_host: array {x.shape} is split over processes")
            return np.asarray(x.addressable_data(0))
        return np.asarray(x)

    return jax.tree.map(get, tree)


# --- several processes ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DistributedSpec:
    """How this process joins a multi-process run (None fields: detected from the cluster)."""

    coordinator: str | None = None  # "host:port" of process 0's coordination service
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False  # let jax.distributed.initialize detect the rest (Slurm, Open MPI, ...)


def _int_arg(value: Any, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None


def distributed_spec(coordinator: str | None = None, num_processes: int | str | None = None,
                     process_id: int | str | None = None, mode: str | None = None,
                     environ: Mapping[str, str] | None = None) -> DistributedSpec | None:
    """The multi-process settings from arguments, else ``FOXHUNT_*`` environment variables.

    Arguments win over ``FOXHUNT_COORDINATOR``, ``FOXHUNT_NUM_PROCESSES``,
    ``FOXHUNT_PROCESS_ID`` and ``FOXHUNT_DISTRIBUTED`` (``auto``). Returns None for a plain
    single-process run. Without ``auto`` the coordinator, the process count and the process id
    are all required; with ``auto`` any of them may be left to cluster detection.
    """
    env = os.environ if environ is None else environ
    coordinator = coordinator or env.get(ENV_COORDINATOR) or None
    count = _int_arg(num_processes if num_processes is not None else env.get(ENV_NUM_PROCESSES),
                     "--num-processes")
    pid = _int_arg(process_id if process_id is not None else env.get(ENV_PROCESS_ID),
                   "--process-id")
    mode = mode or env.get(ENV_DISTRIBUTED) or None
    if mode not in (None, "auto", "off"):
        raise ConfigError(f"--distributed must be auto or off, got {mode!r}")
    auto = mode == "auto"
    if mode == "off" or (not auto and coordinator is None and count is None and pid is None):
        return None
    if not auto:
        missing = [name for name, v in (("--coordinator", coordinator),
                                        ("--num-processes", count), ("--process-id", pid))
                   if v is None]
        if missing:
            raise ConfigError(f"a multi-process run needs {', '.join(missing)} too "
                              "(or --distributed auto to detect them from the cluster)")
    if coordinator is not None and (":" not in coordinator or
                                    not coordinator.rsplit(":", 1)[1].isdigit()):
        raise ConfigError(f"--coordinator must look like HOST:PORT, got {coordinator!r}")
    if count is not None and count < 1:
        raise ConfigError(f"--num-processes must be >= 1, got {count}")
    if pid is not None and (pid < 0 or (count is not None and pid >= count)):
        raise ConfigError(f"--process-id must be in 0..{(count or 1) - 1}, got {pid}")
    return DistributedSpec(coordinator, count, pid, auto)


def initialize(spec: DistributedSpec | None) -> bool:
    """Joins the multi-process run described by ``spec`` (no-op for None); True if it joined.

    Must run before any JAX computation. CPU processes exchange collectives through gloo.
    """
    if spec is None:
        return False
    if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=spec.coordinator,
                                   num_processes=spec.num_processes, process_id=spec.process_id)
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"jax.distributed.initialize failed: {first}") from None
    return True


_barrier_ids = itertools.count()


def _coordination_client():
    """The client of the coordination service this process joined (None if it joined none):
    the barrier JAX's own checkpointing waits at, which no public API offers."""
    from jax._src import distributed

    return distributed.global_state.client


def wait_for_all_processes(what: str, timeout_s: int = BARRIER_TIMEOUT_S) -> None:
    """Returns once every process of a multi-process run has reached this call for ``what``
    (at once in a run of one process); raises if they have not all come within ``timeout_s``.

    The processes compile their programs each for itself, and one can take minutes longer than
    another (a cold compile cache beside a warm one, a busier host). The first collective of a
    program then waits for the late process, but on a CPU gloo gives up after 30 s. So a caller
    waits here, at the coordination service's barrier, after compiling and before running.
    Every process makes the same calls in the same order, so the barriers' numbers agree.
    """
    client = _coordination_client()
    if jax.process_count() == 1 or client is None:
        return
    client.wait_at_barrier(f"foxhunt_jax/{next(_barrier_ids)}/{what}",
                           timeout_in_ms=int(timeout_s * 1000))


def unused_devices_note(mesh: Mesh, shards: int) -> str | None:
    """One line when this process sees more devices than ``mesh`` uses, saying how to use them
    all; None when it uses every one."""
    local = jax.local_devices()
    used = [d for d in mesh.devices.ravel() if d.process_index == jax.process_index()]
    if len(used) >= len(local):
        return None
    names = ", ".join(f"{d.platform}:{d.id}" for d in used)
    return (f"using {len(used)} of this host's {len(local)} devices ({names}) for "
            f"train.shards={shards}; to use all of them set train.shards to a multiple of "
            f"{len(local)} (results are defined by train.shards, not by the device count)")


def describe(mesh: Mesh) -> str:
    """One line: processes, devices and their platform."""
    devs = mesh.devices.ravel()
    return (f"{jax.process_count()} process(es), {len(devs)} {devs[0].platform} device(s), "
            f"mesh {dict(mesh.shape)}")


__all__ = ["DATA", "make_mesh", "fitting_devices", "unused_devices_note", "sharded", "replicated",
           "shard_keys", "local_device", "abstract", "local_view", "put_replicated", "to_host",
           "DistributedSpec", "distributed_spec", "initialize", "describe"]
