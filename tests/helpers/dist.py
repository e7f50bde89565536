"""Run a test function in N spawned processes over gloo, with a hard timeout.

Usage::

    def _body(rank, world_size, x):        # module-level, so spawn can pickle it
        ...
        return something_picklable

    results = run_distributed(_body, world_size=2, args=(3,))   # list indexed by rank

Each rank gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set and a gloo
process group already initialised. If any rank raises, the others are killed and
an AssertionError carries every failing rank's traceback. If the group does not
finish within ``timeout`` seconds, all ranks are killed and the test fails; a
test can never hang.

Start-up cost: each rank is a fresh process (no state carries from one test to the
next), forked from a fork server that imported torch and deepspeed once per test
session (``forkserver`` start method with a preload), so a test pays for a fork,
not for importing torch again (about 2 CPU-seconds per rank). The child gets the
parent's environment as it is at the call (as with ``spawn``).
``DS_TEST_START_METHOD=spawn`` goes back to plain spawn.
"""
from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CTX = None


def _context():
    """The multiprocessing context: a preloaded fork server (fresh process per rank, no
    re-import of torch), or spawn where fork servers are unavailable or asked against."""
    global _CTX
    if _CTX is None:
        method = os.environ.get("DS_TEST_START_METHOD", "forkserver")
        if method == "forkserver" and "forkserver" in mp.get_all_start_methods():
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["tests.helpers._preload"])
        else:
            ctx = mp.get_context("spawn")
        _CTX = ctx
    return _CTX


def _worker(fn, rank, world_size, port, args, kwargs, result_q, init_pg, pg_timeout, env=None):
    if env is not None:  # the parent's environment at the call, as spawn would give it
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    import torch
    torch.set_num_threads(1)
    try:
        if init_pg:
            import torch.distributed as dist
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=pg_timeout))
        out = fn(rank, world_size, *args, **kwargs)
        # Tensors go through torch.save bytes, not shared-memory handles: the worker may
        # exit before the parent reads them.
        buf = io.BytesIO()
        torch.save(out, buf)
        result_q.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result_q.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _decode(payload: bytes):
    import torch
    return torch.load(io.BytesIO(payload), weights_only=False)


def run_distributed(fn, world_size: int, args=(), kwargs=None, timeout: float = 180,
                    init_pg: bool = True, pg_timeout: float = 60):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes."""
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker,
                         args=(fn, r, world_size, port, args, kwargs or {}, q, init_pg, pg_timeout, env),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, failures = {}, {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) + len(failures) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise AssertionError(
                    f"distributed test timed out after {timeout}s; ranks finished: "
                    f"{sorted(results)}; failed: {sorted(failures)}"
                    + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in failures.items()))
            try:
                rank, ok, payload = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if p.exitcode is not None and i not in results and i not in failures]
                # A rank that died without reporting (segfault, os._exit) is a failure.
                for i in dead:
                    try:  # its report may still be in flight
                        rank, ok, payload = q.get(timeout=0.5)
                        if ok:
                            results[rank] = _decode(payload)
                        else:
                            failures[rank] = payload
                    except queue.Empty:
                        failures[i] = f"process exited with code {procs[i].exitcode} without reporting"
                if failures:
                    break
                continue
            if ok:
                results[rank] = _decode(payload)
            else:
                failures[rank] = payload
                break  # one failure: stop the rest rather than wait for their timeouts
    finally:
        for p in procs:
            p.join(timeout=0.2 if failures else 10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if failures:
        msg = "\n".join(f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(failures.items()))
        raise AssertionError(msg)
    return [results[r] for r in range(world_size)]
