"""One process per tensor-parallel rank: start them, hand back rank 0's result, and end them all
cleanly when one fails.

:func:`run_parallel` calls ``fn(shard, *args)`` in ``world`` spawned processes (gloo on the CPU,
NCCL with one GPU per rank on CUDA). The calling process takes no part in the collectives: it
waits on a queue, so it can always stop the ranks. The first rank to fail reports its exception
(a :class:`~specdec.errors.SpecdecError` keeps its class, with ``rank N:`` before its message);
the others, possibly blocked in a collective, are terminated, then killed. A rank that dies
without a word (a crash) ends the run the same way. Ranks other than 0 write nothing to the
terminal; a rank whose parent disappears exits by itself. Under ``torchrun`` (``WORLD_SIZE`` in
the environment) the process group is taken from the environment and ``fn`` runs in place.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

from ..errors import ConfigError, SpecdecError
from .tp import Shard

# No NVLink multicast (NVLS) and no multicast symmetric memory: both are unavailable on some
# hosts and hang or fail at communicator setup there.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
COLLECTIVE_TIMEOUT_S = 300.0  # a rank waiting this long in one collective gives up (a backstop)


class ParallelError(SpecdecError):
    """A rank failed with an unexpected exception or died; ``detail`` holds its traceback."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def check_world(world: int, device: str | None) -> str:
    """The device type ranks run on ("cpu" or "cuda") for ``world`` ranks, or a ConfigError."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ConfigError(f"--tensor-parallel must be an integer >= 1, got {world!r}")
    kind = "cuda" if device in (None, "auto") and torch.cuda.is_available() else str(device or "cpu")
    if kind.startswith("cuda:"):
        raise ConfigError(f"--device {kind} with --tensor-parallel {world}: give --device cuda (rank r uses cuda:r)")
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device '{kind}' is not supported with tensor parallelism; use cpu or cuda")
    if kind == "cuda":
        n = torch.cuda.device_count()
        if world > n:
            raise ConfigError(f"--tensor-parallel {world} needs {world} GPUs, but {n} are visible")
    return kind


def run_parallel(fn: Callable[..., Any], world: int, *args, device: str | None = "cpu",
                 timeout_s: float = COLLECTIVE_TIMEOUT_S, deadline_s: float | None = None) -> Any:
    """Run ``fn(shard, *args)`` on ``world`` ranks and return rank 0's result. ``fn`` and
    ``args`` must be picklable (a module-level function); so must the result. ``timeout_s``
    bounds one collective; ``deadline_s`` (default none) the whole run, after which every rank
    is stopped and a :class:`ParallelError` raised (tests)."""
    kind = check_world(world, device)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return _run_torchrun(fn, world, args, kind, timeout_s)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tempfile.mkdtemp(prefix="specdec-tp-")
    procs = [ctx.Process(target=_worker, name=f"specdec-tp-rank{r}", daemon=True,
                         args=(r, world, kind, os.path.join(store, "store"), timeout_s, os.getpid(), fn, args, results))
             for r in range(world)]
    grace = 1.0  # on a failure the ranks still running are stopped soon
    try:
        for p in procs:
            p.start()
        out = _collect(procs, results, None if deadline_s is None else time.monotonic() + deadline_s)
        grace = 10.0
        return out
    finally:
        _stop(procs, grace)
        results.close()
        shutil.rmtree(store, ignore_errors=True)


def _collect(procs: list, results, deadline: float | None) -> Any:
    """Wait for every rank's report and return rank 0's result. On a failure, wait a moment for
    the other ranks' reports (a bad checkpoint fails them all) and raise the most telling one."""
    done: dict[int, Any] = {}
    errors: dict[int, tuple] = {}
    dead_since: dict[int, float] = {}
    until = None
    while len(done) + len(errors) < len(procs) and (until is None or time.monotonic() < until):
        try:
            status, rank, payload = results.get(timeout=0.2)
        except queue.Empty:
            now = time.monotonic()
            for r, p in enumerate(procs):  # a rank that died without a report (its last one may be in flight)
                if r not in done and r not in errors and p.exitcode is not None:
                    if now - dead_since.setdefault(r, now) > 0.5:
                        errors[r] = (None, f"exited with code {p.exitcode} without reporting", "")
            status, rank, payload = None, None, None
        if status == "ok":
            done[rank] = payload
        elif status == "error":
            errors[rank] = payload
        if errors and until is None:
            until = time.monotonic() + 1.0
        if deadline is not None and time.monotonic() > deadline and not errors:
            raise ParallelError(f"the {len(procs)} ranks did not finish in time (deadline_s)")
    if errors:
        # the most telling failure: a user-facing error (lowest rank), else a rank that died (its peers
        # then fail in their collectives), else the first report
        for r, p in enumerate(procs):
            if r not in done and r not in errors and p.exitcode is not None:
                errors[r] = (None, f"exited with code {p.exitcode} without reporting", "")
                dead_since[r] = 0.0
        ours = [r for r, e in errors.items() if e[0] is not None]
        died = [r for r in errors if r in dead_since]
        r = min(ours) if ours else died[0] if died else next(iter(errors))
        raise _rebuild(r, errors[r])
    return pickle.loads(done[0])


def _rebuild(rank: int, payload: tuple) -> SpecdecError:
    """The exception to raise for a rank's failure report."""
    cls, message, tb = payload
    if cls is not None:  # a SpecdecError: the same class, its message after the rank
        try:
            return cls(f"rank {rank}: {message}")
        except TypeError:  # a subclass with another signature
            pass
    return ParallelError(f"rank {rank} failed: {message}", tb)


def _stop(procs: list, grace: float) -> None:
    """Join the ranks that end within ``grace`` seconds; terminate, then kill, the rest."""
    deadline = time.monotonic() + grace
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


def _worker(rank: int, world: int, kind: str, store: str, timeout_s: float, parent: int, fn, args, results) -> None:
    os.environ.update(NCCL_ENV)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    if rank:
        _silence()
    try:
        shard = _init(rank, world, kind, f"file://{store}", timeout_s)
        out = fn(shard, *args)
        results.put(("ok", rank, pickle.dumps(out) if rank == 0 else None))
    except BaseException as e:  # reported to the parent, which ends every rank
        cls = type(e) if isinstance(e, SpecdecError) else None
        message = str(e) if cls is not None else f"{type(e).__name__}: {e}"
        results.put(("error", rank, (cls, " ".join(message.split()), traceback.format_exc())))
    finally:
        results.close()
        results.join_thread()  # the report is in the pipe before the process ends
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _init(rank: int, world: int, kind: str, init_method: str, timeout_s: float, local: int | None = None) -> Shard:
    """Join the process group; returns this rank's :class:`Shard` (on GPU ``local``, default ``rank``)."""
    import torch.distributed as dist

    if kind == "cuda":
        local = rank if local is None else local
        torch.cuda.set_device(local)
        device, backend = f"cuda:{local}", "nccl"
    else:
        device, backend = "cpu", "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    shard = Shard(rank, world, device)
    if kind == "cuda":
        from .tp import enable_symmetric_memory
        enable_symmetric_memory(shard, torch.bfloat16)
    return shard


def _run_torchrun(fn, world: int, args, kind: str, timeout_s: float) -> Any:
    """Launched by torchrun: this process is one rank; the group comes from the environment."""
    env_world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if env_world != world:
        raise ConfigError(f"--tensor-parallel {world} but torchrun started WORLD_SIZE={env_world} processes")
    os.environ.update(NCCL_ENV)
    if rank:
        _silence()
    shard = _init(rank, world, kind, "env://", timeout_s, int(os.environ.get("LOCAL_RANK", rank)))
    try:
        return fn(shard, *args)
    finally:
        torch.distributed.destroy_process_group()


def _silence() -> None:
    """Ranks other than 0 print nothing (rank 0 speaks for all)."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    sys.stdout = open(os.devnull, "w")
    sys.stderr = open(os.devnull, "w")


def _exit_with_parent(parent: int) -> None:
    """A rank must not outlive the process that started it (it would wait in a collective)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)
