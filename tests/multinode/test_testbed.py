"""The test bed itself: hosts with their own names and addresses that reach each other over
ssh and nothing outside, and a setup that fails half-way leaves nothing behind."""
import os
import socket
import subprocess
import sys

import pytest

from tests.multinode.testbed import TestBed, sweep_stale, unavailable_reason


def test_hosts_names_addresses_and_isolation(clean_bed):
    bed = clean_bed
    for h in bed.hosts:
        out = bed.exec("worker-0", ["ssh", h, "hostname; hostname -I; ip -o -4 route"]).stdout.split("\n")
        assert out[0] == h
        assert out[1].split() == [bed.addrs[h]]
        # one route: the private subnet; no default route, so no outside address is reachable
        assert [line.split()[0] for line in out[2:] if line.strip()] == ["10.77.0.0/24"]
    res = bed.exec("worker-1", ["getent", "hosts", "worker-2"])
    assert res.stdout.split() == [bed.addrs["worker-2"], "worker-2"]
    res = bed.exec("worker-1", [sys.executable, "-S", "-c", "import socket; s = socket.socket(); s.settimeout(2); "
                                "s.connect(('192.0.2.1', 80))"], check=False)
    assert res.returncode != 0 and "Network is unreachable" in res.stderr


def test_failed_setup_leaves_nothing(monkeypatch):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-node test bed unavailable: {reason}")
    bed = TestBed(2, prefix=f"dsmnfail{os.getpid() % 10000}")

    def broken(h):
        if h == "worker-1":
            raise RuntimeError("sshd failed to start (simulated)")
        TestBed._start_sshd(bed, h)
    monkeypatch.setattr(bed, "_start_sshd", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        bed.setup()
    assert bed.leftovers() == []
    assert not os.path.exists(bed.dir)
    assert bed.sshd["worker-0"].poll() is not None         # the sshd that did start is gone
    assert socket.gethostname() != "worker-0"              # this machine's own name untouched


def test_stale_bed_of_a_killed_session_is_swept():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-node test bed unavailable: {reason}")
    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read()) + 1                            # no process can have this id
    name = f"dsmn{dead}-worker-0"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=20)
    os.makedirs(f"/etc/netns/{name}", exist_ok=True)
    assert name in sweep_stale()
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not os.path.exists(f"/etc/netns/{name}")
