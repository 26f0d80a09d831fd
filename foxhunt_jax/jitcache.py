"""How the library compiles: XLA options (:func:`jit`) and compilation caches.

The trainer's programs (its phases, its init programs, the evaluation walks) and the ones the
benchmark times are jitted by :func:`jit`, which adds :func:`compiler_options`.

The caches, for the command line and the tests, have two levels, both under one folder
(``FOXHUNT_JAX_CACHE=DIR``, default ``~/.cache/foxhunt-jax/xla``; ``FOXHUNT_JAX_CACHE=off``
turns both off, ``FOXHUNT_JAX_EXECUTABLE_CACHE=off`` only the second):

- JAX's persistent compilation cache (``DIR``): XLA's output keyed by the lowered program, so a
  second run skips XLA's optimization passes but still traces and lowers every program.
- An executable cache (``DIR/executables``, :func:`compile_cached`): each trainer program's
  compiled executable with a JSON description of its call (:mod:`foxhunt_jax.executable_codec`:
  no pickle, a digest checked before anything is parsed), keyed by what determines the program:
  the config, the argument shapes, dtypes and placements, the versions of JAX, jaxlib, Flax and
  optax, the platform's build, JAX's lowering flags, ``XLA_FLAGS``, the compile options, the
  devices and a digest of this package's source files. A hit skips tracing, lowering and
  compiling altogether. The folder keeps at most ``MAX_CACHE_BYTES``
  (``FOXHUNT_JAX_EXECUTABLE_CACHE_MB``), dropping the least recently used entries, since stale
  keys (old code, old versions) are never hit again.

A loaded executable runs machine code, so both caches trust only what the user alone can write:
a cache folder or entry that is not owned by the user, or is writable by group or others, is
ignored with one ``warning:`` line on stderr and the program compiles afresh (nothing is written
there either). Folders the library creates are private (mode 0700).

Library users who import foxhunt_jax keep their own JAX settings: only the CLI, the benchmark and
the test suite call :func:`enable_compilation_cache`; without it :func:`compile_cached` simply
compiles.

JAX (and :mod:`foxhunt_jax.executable_codec`, which imports its internals) is imported inside the
functions that use it, so that importing this module for its constants (the CLI, the benchmark,
which times JAX's start-up) does not start JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import stat
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

from foxhunt_jax.files import write_atomic
from foxhunt_jax.pystack import call_with_reserve

_ROOT = Path(__file__).resolve().parent.parent
# JAX settings that change what a program lowers to
_JAX_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable",
              "jax_default_prng_impl", "jax_numpy_rank_promotion")
_executables: Path | None = None  # set by enable_compilation_cache
# How XLA schedules the kernels of a command buffer (CUDA graph): as a DAG of the program's data
# dependencies, so independent kernels of a launch-bound program overlap (docs/performance.md).
# XLA_FLAGS naming the mode takes precedence.
SCHEDULING_OPTION = "xla_gpu_command_buffer_scheduling_mode"
# Which instructions go into command buffers: XLA's default kinds plus while loops and
# conditionals, so that a loop (the learner's K steps, a rollout's scan) runs as one CUDA graph
# with conditional nodes instead of one graph launch per iteration. XLA_FLAGS naming this option
# takes precedence.
COMMAND_BUFFER_OPTION = "xla_gpu_enable_command_buffer"
COMMAND_BUFFER_KINDS = ",".join(["FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN",
                                 "DYNAMIC_SLICE_FUSION", "WHILE", "CONDITIONAL"])
# Programmatic dependent launch (Hopper and later; XLA ignores it before): a kernel starts while
# the one it waits on finishes, which shortens a chain of small kernels. An XLA without one of
# the options compiles without it; XLA_FLAGS naming one takes precedence.
PDL_OPTIONS = {"xla_gpu_enable_pdl": True, "xla_gpu_enable_pdl_launch": True}
# XLA's dot merger joins GEMMs that share an operand into one and slices the result apart; the
# training program runs faster without it (docs/performance.md), so only it gets this option.
# Optional as PDL's options are; XLA_FLAGS naming it takes precedence.
DOT_MERGER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}
# JAX's XLA-side caches kept with the persistent cache: the autotuning results only, since
# XLA's kernel cache (JAX's "all") broke a second process's programs on a Hopper GPU: its file
# drops the Triton GEMMs' TMA descriptors (openxla/xla#35951; docs/performance.md).
XLA_CACHES = "xla_gpu_per_fusion_autotune_cache_dir"
# Most bytes the executable cache keeps; the least recently used entries go first
# (FOXHUNT_JAX_EXECUTABLE_CACHE_MB overrides).
MAX_CACHE_BYTES = 1 << 30
ENTRY_SUFFIX = ".executable"
# entries of the earlier pickle format: never read, evicted first (they are the oldest)
_LEGACY_SUFFIX = ".pkl"
_warned_folders: set[str] = set()
_warn_lock = threading.Lock()


def warn(message: str) -> None:
    """One ``warning: ...`` line on stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def untrusted_reason(st: os.stat_result) -> str | None:
    """Why a file or folder with status ``st`` cannot be trusted to hold code, or None: it must
    be owned by this user and not writable by group or others."""
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"owned by user id {st.st_uid}, not by you"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "writable by group or others"
    return None


def _warn_once(folder: Path, message: str) -> None:
    with _warn_lock:
        if str(folder) not in _warned_folders:
            _warned_folders.add(str(folder))
            warn(message)


def _folder_trusted(folder: Path, entries: bool = False) -> bool:
    """Whether ``folder`` (which exists) may hold cache entries; warns once per folder if not.
    ``entries``: also every file directly in it and in its subfolders, where others can reach
    them (a folder that group or others may enter) and the reader does not check each one
    (JAX's persistent cache)."""
    reason = untrusted_reason(folder.stat())
    if reason is None and entries and folder.stat().st_mode & (stat.S_IXGRP | stat.S_IXOTH):
        for f in [*folder.iterdir(), *(g for d in folder.iterdir() if d.is_dir()
                                       for g in d.iterdir())]:
            why = untrusted_reason(f.lstat())
            if why is not None:
                reason = f"holding {f.name}, which is {why}"
                break
    if reason is None:
        return True
    _warn_once(folder, f"compilation cache {folder} is {reason}; not using it, compiling "
                       f"afresh (chmod go-w it, or set FOXHUNT_JAX_CACHE to a folder of your own)")
    return False


def executable_cache_folder() -> Path | None:
    """The folder of this process's executable cache, or None while it is off."""
    return _executables


def set_executable_cache(folder: str | Path | None) -> None:
    """Points this process's executable cache at ``folder`` (None: off), JAX's cache left as it
    is: for a caller that must run a while without it (code its keys cannot see, such as a
    monkeypatched function) and then put back what :func:`executable_cache_folder` returned."""
    global _executables
    _executables = None if folder is None else Path(folder)


def enable_compilation_cache(path: str | None = None, executables: bool = True) -> str | None:
    """Turns on JAX's persistent cache and (``executables``) the executable cache in ``path``
    (default: ``$FOXHUNT_JAX_CACHE`` or ``~/.cache/foxhunt-jax/xla``); returns the folder, or
    None when the cache is off or the folder is not trusted (:func:`untrusted_reason`; one
    warning, and JAX's settings stay as they were).

    The executable cache cannot see Python-level changes that leave the source files alone
    (a monkeypatched function): the test suite turns it off for its tests that do that
    (:func:`set_executable_cache`).
    """
    global _executables
    where = path or os.environ.get("FOXHUNT_JAX_CACHE") or str(Path.home() / ".cache/foxhunt-jax/xla")
    _executables = None
    if where.lower() == "off":
        return None
    try:
        Path(where).mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        _warn_once(Path(where), f"cannot create the compilation cache {where} ({e.strerror}); "
                                f"compiling without caches")
        return None
    if not _folder_trusted(Path(where), entries=True):
        return None
    _set_jax_cache({"jax_compilation_cache_dir": where,
                    "jax_persistent_cache_min_compile_time_secs": 0.5,
                    "jax_persistent_cache_min_entry_size_bytes": 0,
                    "jax_persistent_cache_enable_xla_caches": XLA_CACHES})
    if os.environ.get("FOXHUNT_JAX_EXECUTABLE_CACHE", "").lower() == "off":
        executables = False
    _executables = Path(where) / "executables" if executables else None
    return where


_JAX_CACHE_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                       "jax_persistent_cache_min_entry_size_bytes",
                       "jax_persistent_cache_enable_xla_caches")


def _set_jax_cache(settings: dict) -> None:
    """Applies JAX's persistent-cache settings. JAX opens its cache folder once per process,
    at the first compile, so a new folder also resets that (otherwise compiles keep going to
    the old one, deleted or not)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    moved = settings["jax_compilation_cache_dir"] != jax.config.jax_compilation_cache_dir
    for name, value in settings.items():
        jax.config.update(name, value)
    if moved:
        compilation_cache.reset_cache()


@contextlib.contextmanager
def compilation_cache_in(path: str):
    """Both caches in ``path`` (:func:`enable_compilation_cache`) inside the block; the
    process's earlier settings (folder, thresholds, executable cache) after it."""
    import jax

    global _executables
    saved = {name: getattr(jax.config, name) for name in _JAX_CACHE_SETTINGS}, _executables
    enable_compilation_cache(path)
    try:
        yield path
    finally:
        _set_jax_cache(saved[0])
        _executables = saved[1]


def compiler_options(training: bool = False) -> dict:
    """XLA compile options of the trainer's and the benchmark's programs: on a GPU, command
    buffers scheduled as a DAG (``SCHEDULING_OPTION``) that also take while loops and
    conditionals (``COMMAND_BUFFER_OPTION``), programmatic dependent launch (``PDL_OPTIONS``)
    and, for the ``training`` program (the learner loop), no merging of GEMMs
    (``DOT_MERGER_OPTIONS``), each unless ``XLA_FLAGS`` names it or this XLA rejects it;
    elsewhere none."""
    import jax

    if jax.default_backend() not in ("gpu", "cuda"):
        return {}
    flags = os.environ.get("XLA_FLAGS", "")
    wanted = {SCHEDULING_OPTION: "CONCURRENT", COMMAND_BUFFER_OPTION: COMMAND_BUFFER_KINDS,
              **PDL_OPTIONS, **(DOT_MERGER_OPTIONS if training else {})}
    optional = {**PDL_OPTIONS, **DOT_MERGER_OPTIONS}
    return {k: v for k, v in wanted.items()
            if k not in flags and _xla_accepts(((k, v),), quiet=k in optional)}


@functools.lru_cache(maxsize=None)
def _xla_accepts(options: tuple, quiet: bool = False) -> bool:
    """Whether this XLA compiles with ``options`` (an XLA without one rejects every program):
    a trivial program is compiled once per process to find out; if not, a warning says so
    (unless ``quiet``)."""
    import jax
    import numpy as np

    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(options)).lower(np.float32(0)).compile()
        return True
    except Exception as e:  # noqa: BLE001 - XLA reports an unknown option as a runtime error
        if not quiet:
            warnings.warn(f"this XLA does not take the compile options {dict(options)} "
                          f"({type(e).__name__}: {str(e)[:200]}); compiling without them")
        return False


def jit(fun, *, training: bool = False, **kwargs):
    """``jax.jit`` with the library's :func:`compiler_options` (``training``: those of the
    training program)."""
    import jax

    return jax.jit(fun, compiler_options=compiler_options(training) or None, **kwargs)


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 over the source files of ``foxhunt_jax`` and ``pallas_kernels``: any code change
    gives new executable-cache keys."""
    h = hashlib.sha256()
    for pkg in ("foxhunt_jax", "pallas_kernels"):
        for f in sorted((_ROOT / pkg).rglob("*.py")):
            h.update(str(f.relative_to(_ROOT)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _signature(args) -> list:
    """Shape, dtype, weak type and placement of every argument leaf, and the tree structure."""
    import jax

    leaves, tree = jax.tree.flatten(args)
    sig = [str(tree)]
    for x in leaves:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            sharding = getattr(x, "sharding", None)
            ids = sorted(d.id for d in sharding.device_set) if sharding is not None else None
            sig.append([list(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                        str(sharding), ids])
        else:
            sig.append(repr(x))
    return sig


def cache_key(name: str, config: Any, args) -> str:
    """The executable-cache key of program ``name`` built from ``config`` for ``args``."""
    import flax
    import jax
    import jaxlib
    import optax

    cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
    devices = jax.devices()
    flags = {k: getattr(jax.config, k, None) for k in _JAX_FLAGS}
    parts = {"name": name, "config": cfg, "args": _signature(args),
             "versions": [jax.__version__, jaxlib.__version__, flax.__version__,
                          optax.__version__],
             "jax_flags": flags, "xla_flags": os.environ.get("XLA_FLAGS", ""),
             "compiler_options": compiler_options(),
             # the platform build (CUDA version etc. of the GPU plugin), not only jaxlib's
             "backend": [jax.default_backend(), devices[0].client.platform_version],
             "devices": [(d.id, getattr(d, "device_kind", "")) for d in devices],
             "source": source_digest()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def entry_path(name: str, key: str) -> Path | None:
    """The file the executable cache keeps program ``name`` of ``key`` in (None: cache off)."""
    return None if _executables is None else _executables / f"{name}-{key[:40]}{ENTRY_SUFFIX}"


def _max_bytes() -> int:
    mb = os.environ.get("FOXHUNT_JAX_EXECUTABLE_CACHE_MB")
    return int(float(mb) * (1 << 20)) if mb else MAX_CACHE_BYTES


def evict(folder: Path, max_bytes: int) -> list[Path]:
    """Deletes the least recently used entries (oldest modification time; a load touches its
    entry) until the folder's entries take at most ``max_bytes``; returns what was deleted."""
    entries = []
    for f in [*folder.glob(f"*{ENTRY_SUFFIX}"), *folder.glob(f"*{_LEGACY_SUFFIX}")]:
        try:
            st = f.stat()
        except FileNotFoundError:  # another process sharing the folder evicted it meanwhile
            continue
        entries.append((st.st_mtime, st.st_size, f))
    entries.sort(key=lambda e: e[0])
    total = sum(size for _, size, _ in entries)
    gone = []
    for _, size, f in entries:
        if total <= max_bytes:
            break
        total -= size
        f.unlink(missing_ok=True)
        gone.append(f)
    return gone


_HIT = "/jax/compilation_cache/cache_hits"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # JAX ran XLA or read its cache
# Held while a thread traces and lowers a program (Python work, under the GIL): programs
# compiled in threads then lower one after another, so the first one's XLA compile (which
# releases the GIL) starts as soon as it alone is lowered instead of when all of them are.
# Which thread lowers first is the scheduler's choice unless a LoweringOrder sets it.
_lowering = threading.RLock()


class LoweringOrder:
    """The order in which the threads of one compile lower their programs.

    ``order.turn(i)`` is thread ``i``'s place (:func:`compile_cached`'s ``turn``): it lowers
    once every earlier place has lowered or passed (loaded its program from the cache, or
    failed), so the programs listed first, the longest compiles, start compiling first
    whatever order the threads reach the lowering lock in.
    """

    def __init__(self):
        self._changed = threading.Condition()
        self._next = 0
        self._passed: set[int] = set()

    def turn(self, index: int) -> "Turn":
        return Turn(self, index)

    def _wait(self, index: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._next >= index)

    def _pass(self, index: int) -> None:
        with self._changed:
            self._passed.add(index)
            while self._next in self._passed:
                self._next += 1
            self._changed.notify_all()


@dataclasses.dataclass(frozen=True)
class Turn:
    """Place ``index`` of a :class:`LoweringOrder`: entering waits for it, leaving (or
    :meth:`done`, which may be called again) hands the turn on."""

    order: LoweringOrder
    index: int

    def __enter__(self) -> "Turn":
        self.order._wait(self.index)
        return self

    def __exit__(self, *exc) -> None:
        self.done()

    def done(self) -> None:
        self.order._pass(self.index)
_served = threading.local()  # .payloads: a list while this thread compiles through compile_cached
_capture_lock = threading.Lock()


def _capture_served_payloads() -> None:
    """Makes JAX's persistent cache hand each serialized executable it reads to the reading
    thread's ``_served.payloads`` (when that thread set one), once per process.

    The bytes are what XLA serialized when it compiled the program: whole on every platform,
    where an executable built from them and serialized again is not (on the CPU that copy lacks
    its fused functions and fails when run). JAX has no public hook for them, so this wraps the
    module function that splits a cache entry; where that function is missing, nothing is
    captured and served programs are simply not stored."""
    from jax._src import compilation_cache as jax_cache

    with _capture_lock:
        split = getattr(jax_cache, "extract_executable_and_time", None)
        if split is None or getattr(split, "_foxhunt_capture", False):
            return

        def capturing(entry):
            payload, compile_time = split(entry)
            sink = getattr(_served, "payloads", None)
            if sink is not None:
                sink.append(payload)
            return payload, compile_time

        capturing._foxhunt_capture = True
        jax_cache.extract_executable_and_time = capturing


def _lower(make, args, turn: Turn | None = None):
    """``make().lower(*args)``, one thread at a time (:data:`_lowering`), at ``turn`` where
    given, its tracing in a reserved stack chunk (:mod:`foxhunt_jax.pystack`)."""
    with turn or contextlib.nullcontext(), _lowering:
        return call_with_reserve(lambda: make().lower(*args))


def _compile_watching_xla_cache(make, args, turn: Turn | None = None):
    """``make().lower(*args).compile()`` and the bytes to store for it: ``None`` to store the
    executable's own serialization (XLA compiled it in this call: JAX ran its backend compile
    and its persistent cache did not serve it), the serialized executable JAX's persistent cache
    served (captured as it was read, :func:`_capture_served_payloads`), or ``False``: do not
    store (JAX reused an executable it already held in this process, whose origin is unknown,
    or the cache served one whose bytes were not captured)."""
    from jax import monitoring

    _capture_served_payloads()
    hits, compiles, me = [], [], threading.get_ident()

    # JAX records both events in the compiling thread; other threads may compile meanwhile
    def on_event(event, **kwargs):
        if event == _HIT and threading.get_ident() == me:
            hits.append(event)

    def on_duration(event, duration, **kwargs):
        if event == _BACKEND_COMPILE and threading.get_ident() == me:
            compiles.append(duration)

    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_duration)
    _served.payloads = payloads = []
    try:
        compiled = _lower(make, args, turn).compile()
    finally:
        _served.payloads = None
        monitoring.unregister_event_listener(on_event)
        monitoring.unregister_event_duration_listener(on_duration)
    if not compiles:
        return compiled, False
    if not hits:
        return compiled, None
    return compiled, (payloads[0] if len(hits) == 1 and len(payloads) == 1 else False)


def _read_entry(path: Path) -> bytes | None:
    """The bytes of entry ``path`` if it is a regular file this user alone can write; None if
    it does not exist. Raises :class:`PermissionError` naming why an entry is not trusted."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as e:  # a symbolic link (O_NOFOLLOW) or unreadable
        raise PermissionError(f"cannot be opened as a plain file ({e.strerror})") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        reason = "not a regular file" if not stat.S_ISREG(st.st_mode) else untrusted_reason(st)
        if reason:
            raise PermissionError(reason)
        return f.read()


def _load(path: Path, args, key: str):
    """The program stored at ``path`` for ``args``, or None (absent, untrusted or unreadable:
    warned, except absent). ``(compiled, trusted)``: an untrusted entry is not replaced."""
    try:
        blob = _read_entry(path)
    except PermissionError as e:
        warn(f"executable cache: ignoring {path} ({e}); compiling afresh")
        return None, False
    if blob is None:
        return None, True
    from foxhunt_jax import executable_codec

    try:
        compiled = executable_codec.decode(blob, args, key)
    except Exception as e:  # noqa: BLE001 - any unreadable entry is compiled again
        warn(f"executable cache: could not load {path.name} ({type(e).__name__}: "
             f"{str(e)[:200]}); compiling again")
        return None, True
    os.utime(path)  # recently used: evicted last
    return compiled, True


def _store(path: Path, compiled, args, key: str, name: str, payload: bytes | None) -> None:
    """Writes the entry of ``compiled`` whole and readable by its owner only;
    ``payload``: its serialized executable where not its own serialization."""
    from foxhunt_jax import executable_codec

    try:
        blob = executable_codec.encode(compiled, args, key, payload)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(path, blob, mode=0o600)
        evict(path.parent, _max_bytes())
    except Exception as e:  # noqa: BLE001 - a cache that cannot be written only costs time
        warn(f"executable cache: not saving {name} ({type(e).__name__}: {str(e)[:200]})")


def compile_cached(jitted, args: tuple, *, name: str, config: Any, turn: Turn | None = None):
    """``jitted.lower(*args).compile()``, through the executable cache when it is on.

    ``jitted`` may also be a function of no arguments that returns the jitted function, called
    only when the program must be compiled (for work such as an ``eval_shape`` that a cache hit
    makes unnecessary).

    Returns ``(compiled, loaded)``: ``loaded`` is True when the executable came from the cache.
    An entry that fails its digest or cannot be built is compiled again and replaced; an entry
    or cache folder that is not the user's alone is ignored (one warning) and left as it is. A
    program that JAX's persistent cache served is stored with the bytes that cache held, so
    that after a change of this package's code (a new key) the programs JAX still holds are
    traced and lowered once, not on every run; a program JAX reused in this process is not
    stored (see :func:`_compile_watching_xla_cache`), nor one whose call the entry format
    cannot describe.
    Off a single process (multi-host runs) the cache is not used: every process must compile
    the same collective program.

    ``turn``: this program's place in a :class:`LoweringOrder` (programs compiled in threads),
    handed on once it is lowered, loaded or has failed.
    """
    try:
        return _compile_cached(jitted, args, name, config, turn)
    finally:
        if turn is not None:
            turn.done()


def compile_programs(programs: dict, *, threads: bool = True) -> dict:
    """:func:`compile_cached` of each ``{name: (jitted, args, config)}`` (cached under
    ``name``) -> ``{name: (compiled, loaded)}``.

    With ``threads`` each program compiles in a thread of its own (XLA's compiler and the
    loading release the GIL) and they lower one at a time in the dict's order (a
    :class:`LoweringOrder`), each compiling while the next lowers, so the programs listed first
    start compiling first; without, one after another in that order.
    """
    def build(index, name, order):
        jitted, args, config = programs[name]
        return compile_cached(jitted, args, name=name, config=config,
                              turn=order and order.turn(index))

    if not threads:
        return {name: build(i, name, None) for i, name in enumerate(programs)}
    from concurrent.futures import ThreadPoolExecutor

    order = LoweringOrder()
    with ThreadPoolExecutor(max_workers=max(len(programs), 1)) as pool:
        built = pool.map(lambda i, name: build(i, name, order), range(len(programs)), programs)
        return dict(zip(programs, built))


def _compile_cached(jitted, args: tuple, name: str, config: Any, turn: Turn | None):
    import jax

    make = jitted if not hasattr(jitted, "lower") else (lambda: jitted)
    folder = _executables
    if folder is None or jax.process_count() > 1 or (
            folder.exists() and not _folder_trusted(folder)):
        return _lower(make, args, turn).compile(), False
    key = cache_key(name, config, args)
    path = entry_path(name, key)
    compiled, writable = _load(path, args, key)
    if compiled is not None:
        return compiled, True
    compiled, payload = _compile_watching_xla_cache(make, args, turn)
    if writable and payload is not False:
        _store(path, compiled, args, key, name, payload)
    return compiled, False
