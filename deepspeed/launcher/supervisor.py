"""Start a set of processes and keep them as one unit.

The rule: the group succeeds only if every process exits 0. The first process to exit
non-zero or die from a signal makes the supervisor stop all the others (SIGTERM to each
one's process group, SIGKILL after a grace period) and report who failed and how.
SIGINT/SIGTERM/SIGHUP sent to the supervisor are forwarded the same way. Each child
runs in its own process group (so its own children are stopped with it) and, on Linux,
asks the kernel to SIGKILL it if the supervisor dies, so nothing outlives the launcher.
A process that reports failures of its parts on stderr (pdsh: one host's command failed,
while pdsh waits for the others) counts as failed at that report (``Member.stderr_failure``).
"""
from __future__ import annotations

import ctypes
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from .constants import DEFAULT_KILL_GRACE_S, KILL_GRACE_ENV

_PR_SET_PDEATHSIG = 1
_FORWARDED_SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None),
                                       getattr(signal, "SIGHUP", None)) if s is not None)
_POLL_S = 0.05


def kill_grace_seconds() -> float:
    raw = os.environ.get(KILL_GRACE_ENV)
    if raw is None:
        return DEFAULT_KILL_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"{KILL_GRACE_ENV}={raw!r} must be a non-negative number of seconds")
    return value


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_returncode(rc: int) -> str:
    """``exited with code 3`` / ``was killed by signal SIGKILL (9)``."""
    if rc < 0:
        return f"was killed by signal {signal_name(-rc)} ({-rc})"
    return f"exited with code {rc}"


def _child_setup_fn():
    """A preexec_fn: own process group, and die with the parent (Linux)."""
    parent = os.getpid()
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork
        except (OSError, AttributeError):
            prctl = None

    def setup():
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os.kill(os.getpid(), signal.SIGKILL)
    return setup


def _watch_stdin() -> None:
    """Turn EOF on our stdin into SIGTERM to ourselves: under ssh it means the
    connection to the runner is gone, and the ranks must not run on unattended."""
    def reader():
        # os.read on the raw descriptor: a thread blocked in sys.stdin.buffer would
        # hold its lock and abort the interpreter at shutdown.
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                continue
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=reader, name="stdin-watchdog", daemon=True).start()


def _relay_stderr(m: "Member") -> None:
    """Pass ``m``'s stderr on to ours, line by line, noting the first failure it reports."""
    for raw in iter(m.proc.stderr.readline, b""):
        with contextlib.suppress(Exception):     # our stderr closed or replaced: keep reading
            out = getattr(sys.stderr, "buffer", None)
            if out is not None:
                out.write(raw)
            else:
                sys.stderr.write(raw.decode(errors="replace"))
            sys.stderr.flush()
        if m.reported is None:
            line = raw.decode(errors="replace").strip()
            code = m.stderr_failure(line)
            if code is not None:
                m.reported = (code, line)
    m.proc.stderr.close()


@dataclass
class Member:
    """One supervised process: ``label`` names it in messages (e.g. ``rank 3``)."""
    label: str
    argv: List[str]
    env: Optional[Dict[str, str]] = None
    stdout: Optional[str] = None  # a log file path; None = inherit
    stdin_pipe: bool = False      # keep a pipe open to its stdin (EOF when we die)
    # Reads each stderr line (which is passed on to ours) and returns an exit code when the line
    # reports that a part of this process's work failed (pdsh: a host's command), else None.
    stderr_failure: Optional[Callable[[str], Optional[int]]] = None
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)
    returncode: Optional[int] = None
    reported: Optional[Tuple[int, str]] = None   # (code, line) from stderr_failure


class Supervisor:
    """Run ``members`` to completion; see the module docstring for the rules."""

    def __init__(self, members: List[Member], logger, grace_s: Optional[float] = None,
                 stop_on_stdin_eof: bool = False):
        self.members = members
        self.stop_on_stdin_eof = stop_on_stdin_eof
        self.log = logger
        self.grace_s = kill_grace_seconds() if grace_s is None else grace_s
        self.failure: Optional[Member] = None
        self.received_signal: Optional[int] = None
        self._kill_deadline: Optional[float] = None
        self._files = []

    # -- lifecycle -----------------------------------------------------------
    def run(self) -> int:
        """Start everything, wait, and return the exit code for the launcher."""
        previous = self._install_signal_handlers()
        try:
            if self.stop_on_stdin_eof:
                _watch_stdin()
            self._start_all()
            self._wait_all()
        finally:
            self._restore_signal_handlers(previous)
            for f in self._files:
                f.close()
        return self.exit_code()

    def exit_code(self) -> int:
        if self.received_signal is not None:
            return 128 + self.received_signal
        if self.failure is not None:
            if self.failure.reported is not None and self.failure.reported[0] > 0:
                return self.failure.reported[0]
            rc = self.failure.returncode
            return rc if rc and rc > 0 else 128 + (-rc if rc else 1)
        return 0

    def _start_all(self) -> None:
        setup = _child_setup_fn() if os.name == "posix" else None
        for m in self.members:
            if self.received_signal is not None:
                return
            out = None
            if m.stdout:
                out = open(m.stdout, "ab")
                self._files.append(out)
            try:
                err = subprocess.STDOUT if out else (subprocess.PIPE if m.stderr_failure else None)
                m.proc = subprocess.Popen(
                    m.argv, env=m.env, stdout=out, stderr=err,
                    stdin=subprocess.PIPE if m.stdin_pipe else subprocess.DEVNULL, preexec_fn=setup)
                if err is subprocess.PIPE:
                    threading.Thread(target=_relay_stderr, args=(m,), name=f"stderr of {m.label}",
                                     daemon=True).start()
            except OSError as err:
                self.log.error(f"could not start {m.label} ({m.argv[0]!r}): {err}")
                m.returncode = 127
                self._note_failure(m)
                return

    def _wait_all(self) -> None:
        while True:
            running = [m for m in self.members if m.proc is not None and m.returncode is None]
            for m in running:
                rc = m.proc.poll()
                if rc is not None:
                    m.returncode = rc
                    if rc != 0:
                        self._note_failure(m)
                elif m.reported is not None and self.failure is None and self.received_signal is None:
                    self.failure = m
                    self.log.error(f"{m.label} reports a failure: {m.reported[1]}; stopping the job")
                    self._begin_stop(signal.SIGTERM)
            if all(m.proc is None or m.returncode is not None for m in self.members):
                break
            if self._kill_deadline is not None and time.monotonic() >= self._kill_deadline:
                left = [m.label for m in self.members if m.proc is not None and m.returncode is None]
                self.log.error(f"still running {self.grace_s:g}s after SIGTERM: {', '.join(left)}; "
                               "sending SIGKILL")
                self._signal_all(signal.SIGKILL)
                self._kill_deadline = None
            time.sleep(_POLL_S)
        if self.failure is not None or self.received_signal is not None:
            self._signal_all(signal.SIGKILL)  # sweep grandchildren left in the groups

    # -- stopping ------------------------------------------------------------
    def _note_failure(self, m: Member) -> None:
        if self.failure is not None or self.received_signal is not None:
            return
        self.failure = m
        others = [o for o in self.members if o is not m and o.proc is not None and o.returncode is None]
        self.log.error(f"{m.label} {describe_returncode(m.returncode)}; "
                       f"stopping the other {len(others)} process(es)")
        self._begin_stop(signal.SIGTERM)

    def _begin_stop(self, signum: int) -> None:
        self._signal_all(signum)
        if signum != signal.SIGKILL and hasattr(signal, "SIGCONT"):
            self._signal_all(signal.SIGCONT)   # a stopped (stalled) rank acts on the signal now, not at SIGKILL
        if self._kill_deadline is None:
            self._kill_deadline = time.monotonic() + self.grace_s

    def _signal_all(self, signum: int) -> None:
        for m in self.members:
            if m.proc is None:
                continue
            try:
                os.killpg(m.proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                if m.returncode is None:
                    with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                        m.proc.send_signal(signum)

    def _on_signal(self, signum, frame) -> None:
        if self.received_signal is not None:  # a second signal: no more patience
            self._signal_all(signal.SIGKILL)
            return
        self.received_signal = signum
        self.log.error(f"launcher received {signal_name(signum)}; forwarding it to "
                       f"{len(self.members)} process(es)")
        self._begin_stop(signum)

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for s in _FORWARDED_SIGNALS:
            previous[s] = signal.signal(s, self._on_signal)
        return previous

    @staticmethod
    def _restore_signal_handlers(previous) -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)
