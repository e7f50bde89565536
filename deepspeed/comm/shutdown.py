"""Clean process exit when the script never destroys the process group.

Users' training scripts return without ``destroy_process_group()``. With torch 2.13
on gloo, such a process now and then aborts at exit with "terminate called without an
active exception" (SIGABRT, exit 134), and the launcher reports a finished job as failed.

Cause (core dumps, plain torch as well as DeepSpeed): a ``ProcessGroupGloo`` worker
thread (``pt_gloo_runloop``) drops its reference to a finished collective *after* the
caller's ``wait()`` returned. If the op's tensors have Python objects, that release
needs the GIL, so the worker queues for it while the main thread runs on. When the
main thread reaches interpreter finalization first, CPython (3.11: ``take_gil``) ends
any other thread that wants the GIL with ``pthread_exit``; the forced unwind passes
through the noexcept ``~AsyncWork`` destructor and ``std::terminate`` aborts the
process. Destroying the group does not help while anything (the engine's strategy and
comm objects do) still references it: its threads live on, and so does the race.

``install()`` (called by ``deepspeed.init_distributed``, hence by ``initialize``)
registers one ``atexit`` hook that:

1. if the default group is still initialised, **waits for the other ranks to reach
   their exit** (an arrival counter in the group's key-value store, not a collective:
   it works whatever state the group's collectives are in, and a rank that arrived and
   already left still counts), at most ``DEEPSPEED_EXIT_BARRIER_TIMEOUT`` seconds
   (default 60), so a peer that is still busy or dead never makes it hang; then
   **destroys the process groups** and collects garbage (a group nothing references
   any more is freed here, which joins its threads);
2. **drains the gloo worker threads** of groups that are still referenced: it lets go of
   the GIL, then runs Python code for several switch intervals (a thread waiting for the
   GIL asks for it every interval and gets it), and repeats until no worker thread has
   woken up in a whole round (Linux: their context-switch counts in ``/proc``), at most
   ``DEEPSPEED_EXIT_DRAIN_TIMEOUT`` seconds (default 2). After that no worker waits for
   the GIL when finalization begins.

The hook never changes the exit status: the interpreter exits normally afterwards, with
the code the script gave it (0, ``sys.exit(n)``, 1 after an uncaught exception, ...).
A rank leaving because of an uncaught exception (or ``sys.exit`` with a failure code)
does not wait in the barrier: it marks itself arrived (the others do not wait for it
either) and tears its groups down.
``DEEPSPEED_CLEAN_EXIT=0`` turns the hook off (to measure what it fixes);
``DEEPSPEED_CLEAN_EXIT_DEBUG=1`` prints one line per rank about what it did at exit.
"""
from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time
from typing import Dict, Optional, Tuple

_installed = False
_exception_seen = False
_ARRIVED_KEY = "deepspeed_exit_arrived"


def enabled() -> bool:
    return os.environ.get("DEEPSPEED_CLEAN_EXIT", "1").strip().lower() not in ("0", "false", "no", "off")


def exit_barrier_timeout() -> float:
    return float(os.environ.get("DEEPSPEED_EXIT_BARRIER_TIMEOUT", "60"))


def drain_timeout() -> float:
    return float(os.environ.get("DEEPSPEED_EXIT_DRAIN_TIMEOUT", "2"))


def install() -> bool:
    """Register the exit hook once per process; returns whether it is active."""
    global _installed
    if _installed or not enabled():
        return _installed
    atexit.register(_at_exit)
    previous = sys.excepthook

    def _note_exception(exc_type, exc, tb):
        global _exception_seen
        _exception_seen = True
        previous(exc_type, exc, tb)

    sys.excepthook = _note_exception
    previous_thread_hook = threading.excepthook

    def _note_thread_exception(args):
        global _exception_seen
        if args.thread is threading.main_thread():
            _exception_seen = True
        previous_thread_hook(args)

    threading.excepthook = _note_thread_exception
    previous_exit = sys.exit

    def _note_exit(code=None):
        # sys.exit(<failure>) is not an uncaught exception to the excepthook; a rank leaving
        # with a failure code must not wait for peers that may be blocked waiting for it.
        global _exception_seen
        if code not in (None, 0):
            _exception_seen = True
        previous_exit(code)

    sys.exit = _note_exit
    _installed = True
    return True


def _default_store():
    import torch.distributed.distributed_c10d as c10d
    getter = getattr(c10d, "_get_default_store", None)
    return getter() if getter is not None else None


def exit_barrier(timeout: float, wait: bool = True, key: str = _ARRIVED_KEY) -> bool:
    """Mark this rank as exiting; if ``wait``, wait until every rank has (or ``timeout``).

    Returns True when all ranks arrived in time. Never raises: a store that is gone
    (rank 0, its host, already left after everyone arrived) counts as done.
    """
    import torch.distributed as dist
    world = dist.get_world_size()
    try:
        store = _default_store()
        if store is None:
            return False
        arrived = store.add(key, 1)  # a re-initialised env:// group comes with a fresh store
        deadline = time.monotonic() + timeout
        delay = 0.005
        while wait and arrived < world:
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
            arrived = store.add(key, 0)
        return arrived >= world
    except Exception:  # noqa: BLE001 - the store's host left: nothing left to wait for
        return True


# ProcessGroupGloo names its worker threads "pt_gloo_runloop" (Linux thread names are
# cut at 15 characters). Its transport thread ("gloo_tcp_loop") never takes the GIL.
_GLOO_WORKER_PREFIX = "pt_gloo_runloop"


def _gloo_worker_wakeups() -> Optional[Dict[str, int]]:
    """Context switches of each gloo worker thread of this process (thread id -> count),
    or None where ``/proc`` cannot tell. An idle worker sleeps on its queue and does not
    switch; one waiting for the GIL wakes every switch interval."""
    base = "/proc/self/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return None
    counts = {}
    for tid in tids:
        try:
            with open(f"{base}/{tid}/comm") as f:
                if not f.read().startswith(_GLOO_WORKER_PREFIX):
                    continue
            with open(f"{base}/{tid}/status") as f:
                counts[tid] = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return counts


def _run_python_for(seconds: float) -> None:
    """Keep the interpreter busy: a thread waiting for the GIL gets it after one switch
    interval (the eval loop honours its drop request), unlike during a blocking call."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def drain_gloo_workers(timeout: float) -> Tuple[int, bool]:
    """Let every gloo worker thread that waits for the GIL have it, before finalization.

    Returns (rounds, quiet): quiet is True when a whole round passed in which no worker
    woke up (or ``/proc`` cannot tell, after one round).
    """
    deadline = time.monotonic() + timeout
    hold = min(max(4 * sys.getswitchinterval(), 0.02), 0.5)
    rounds = 0
    while True:
        rounds += 1
        time.sleep(0.005)             # the GIL is free: a waiting worker takes it now
        before = _gloo_worker_wakeups()
        _run_python_for(hold)         # or after its next wake-up, through a forced switch
        after = _gloo_worker_wakeups()
        if before is None or after is None or before == after:
            return rounds, True
        if time.monotonic() >= deadline:
            return rounds, False


def _leave_after_collective_failure(t0: float) -> None:
    """A collective timed out or lost a peer and the script is exiting with that error: the
    process group is broken (a peer may be stopped, holding the store), so neither the exit
    barrier nor destroying the group can complete promptly. Flush what was written and
    leave now with the failure status (skipping finalization, hence also the gloo worker
    race described above)."""
    import logging
    try:
        logging.shutdown()
    except Exception:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed
            pass
    if os.environ.get("DEEPSPEED_CLEAN_EXIT_DEBUG", "0") not in ("", "0"):
        try:
            print(f"deepspeed clean exit (pid {os.getpid()}): collective failed, leaving at once "
                  f"{time.monotonic() - t0:.3f}s", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001
            pass
    os._exit(1)


def _at_exit() -> None:
    t0 = time.monotonic()
    notes = []
    from .timeouts import failed
    if failed() and _exception_seen:
        _leave_after_collective_failure(t0)
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() > 1:
                notes.append(f"barrier={exit_barrier(exit_barrier_timeout(), wait=not _exception_seen)}")
            dist.destroy_process_group()
            gc.collect()    # frees (and joins the threads of) groups only garbage referenced
    except Exception as e:  # noqa: BLE001 - exiting anyway; never turn a clean exit into a traceback
        notes.append(f"teardown error {type(e).__name__}")
    try:
        workers = _gloo_worker_wakeups()
        rounds, quiet = drain_gloo_workers(drain_timeout())
        n = None if workers is None else len(workers)
        notes.append(f"gloo_workers={n} drain_rounds={rounds} quiet={quiet}")
    except Exception as e:  # noqa: BLE001
        notes.append(f"drain error {type(e).__name__}")
    if os.environ.get("DEEPSPEED_CLEAN_EXIT_DEBUG", "0") not in ("", "0"):
        try:
            print(f"deepspeed clean exit (pid {os.getpid()}): {' '.join(notes)} "
                  f"{time.monotonic() - t0:.3f}s", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - stderr closed
            pass
