"""A multi-host test bed on one Linux machine: network namespaces that act as hosts.

Layout (``TestBed(n)``, all names carry a per-session prefix so nothing collides):

* a *switch* namespace holding a Linux bridge;
* ``n`` *node* namespaces ``worker-0 .. worker-{n-1}``, each joined to the bridge by a
  veth pair (``eth0`` inside the node) with a private address ``10.77.0.(10+i)/24``;
  only ``lo`` and ``eth0`` exist inside, so traffic between nodes can only take the
  private bridge, and no outside address is reachable;
* per node, ``/etc/netns/<ns>/`` (which ``ip netns exec`` bind-mounts over ``/etc``)
  holds the node's ``hosts`` file (every worker's name and address) and an ``ssh``
  directory: the client config (the test key, ``StrictHostKeyChecking no``) and the
  sshd config; an OpenSSH server listens on the node's address, in its own UTS
  namespace whose hostname is the worker's name, so a command run over ssh sees
  ``hostname`` = ``worker-i`` and resolves every worker by name;
* keys are generated per session in a temporary directory.

The filesystem is shared (as with NFS on a cluster): the virtual environment, the
repository and pytest's ``tmp_path`` are the same paths on every node.

``teardown`` kills every process in every namespace, deletes the namespaces (and with
them the veths and the bridge) and the ``/etc/netns`` entries; it runs also after a
failed setup; a bed left by a killed session is swept by the next ``setup``.
``unavailable_reason()`` says why a bed cannot be built here (not root, no
``ip``/``sshd``/``pdsh``/``mpirun``, namespaces forbidden), so tests skip with that reason.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, List, Optional, Sequence

SUBNET = "10.77.0"
TOOLS = {"ip": "iproute2", "unshare": "util-linux", "sshd": "openssh-server", "ssh": "openssh-client",
         "ssh-keygen": "openssh-client", "pdsh": "pdsh", "mpirun": "openmpi-bin"}
SBIN = ("/usr/sbin", "/sbin")


def which(tool: str) -> Optional[str]:
    found = shutil.which(tool)
    if found:
        return found
    for d in SBIN:
        p = os.path.join(d, tool)
        if os.access(p, os.X_OK):
            return p
    return None


def _run(argv: Sequence[str], timeout: float = 20, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def unavailable_reason() -> Optional[str]:
    """None when a bed can be built here, else why not (the tests' skip reason)."""
    if not os.path.isdir("/proc/self/ns"):
        return "not Linux: network namespaces are unavailable"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run as root, or in a container with CAP_SYS_ADMIN)"
    missing = sorted({pkg for tool, pkg in TOOLS.items() if which(tool) is None})
    if missing:
        return (f"missing Debian package(s) {', '.join(missing)}: run tests/multinode/setup_packages.sh "
                "(make test does) as root with apt-get")
    probe = f"dsmnprobe{os.getpid()}"
    try:
        res = _run([which("ip"), "netns", "add", probe], check=False)
        if res.returncode != 0:
            return f"this machine forbids network namespaces ('ip netns add' failed: {res.stderr.strip()})"
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"cannot create network namespaces: {err}"
    finally:
        subprocess.run([which("ip"), "netns", "del", probe], capture_output=True, timeout=20)
    return None


def sweep_stale(ip: Optional[str] = None) -> List[str]:
    """Remove the namespaces (and /etc/netns entries, temporary directories) of beds whose
    process is gone (a test session killed with SIGKILL cannot tear down); returns their names."""
    ip = ip or which("ip")
    res = subprocess.run([ip, "netns", "list"], capture_output=True, text=True, timeout=20)
    removed = []
    for line in res.stdout.splitlines():
        m = re.match(r"^(dsmn(\d+)-\S+)", line.strip())
        if not m or os.path.exists(f"/proc/{m.group(2)}"):
            continue
        name = m.group(1)
        pids = subprocess.run([ip, "netns", "pids", name], capture_output=True, text=True, timeout=20).stdout
        for pid in pids.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run([ip, "netns", "del", name], capture_output=True, timeout=20)
        shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        for d in glob.glob(os.path.join(tempfile.gettempdir(), f"dsmn{m.group(2)}-*")):
            shutil.rmtree(d, ignore_errors=True)
        removed.append(name)
    return removed


class TestBed:
    __test__ = False  # not a pytest class

    def __init__(self, n_nodes: int = 3, prefix: Optional[str] = None):
        self.n = n_nodes
        self.prefix = prefix or f"dsmn{os.getpid()}"
        self.ip = which("ip")
        self.hosts = [f"worker-{i}" for i in range(n_nodes)]
        self.addrs = {h: f"{SUBNET}.{10 + i}" for i, h in enumerate(self.hosts)}
        self.ns = {h: f"{self.prefix}-{h}" for h in self.hosts}
        self.switch = f"{self.prefix}-sw"
        self.dir = tempfile.mkdtemp(prefix=f"{self.prefix}-")
        self.sshd: Dict[str, subprocess.Popen] = {}
        self._etc: List[str] = []

    # -- setup -----------------------------------------------------------------
    def setup(self) -> "TestBed":
        sweep_stale(self.ip)
        try:
            self._network()
            self._keys_and_configs()
            for h in self.hosts:
                self._start_sshd(h)
            for h in self.hosts:
                self._wait_ssh(h)
        except BaseException:
            self.teardown()
            raise
        return self

    def _network(self) -> None:
        ip = self.ip
        _run([ip, "netns", "add", self.switch])
        _run([ip, "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run([ip, "-n", self.switch, "link", "set", "br0", "up"])
        for i, h in enumerate(self.hosts):
            ns = self.ns[h]
            _run([ip, "netns", "add", ns])
            # Both ends are created inside their namespaces: no interface ever exists outside.
            _run([ip, "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.switch])
            _run([ip, "-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up"])
            _run([ip, "-n", ns, "addr", "add", f"{self.addrs[h]}/24", "dev", "eth0"])
            _run([ip, "-n", ns, "link", "set", "eth0", "up"])
            _run([ip, "-n", ns, "link", "set", "lo", "up"])

    def _keys_and_configs(self) -> None:
        keygen = which("ssh-keygen")
        key, host_key = os.path.join(self.dir, "id_ed25519"), os.path.join(self.dir, "host_ed25519")
        _run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", key])
        _run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", host_key])
        shutil.copy(key + ".pub", os.path.join(self.dir, "authorized_keys"))
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in self.addrs.items())
        os.makedirs("/run/sshd", exist_ok=True)          # sshd's privilege-separation directory
        for h in self.hosts:
            etc = f"/etc/netns/{self.ns[h]}"
            self._etc.append(etc)
            os.makedirs(os.path.join(etc, "ssh"), exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(hosts)
            with open(os.path.join(etc, "hostname"), "w") as f:
                f.write(h + "\n")
            with open(os.path.join(etc, "ssh", "ssh_config"), "w") as f:
                f.write(f"Host *\n  IdentityFile {key}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
                        "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n  ConnectTimeout 5\n")
            with open(os.path.join(etc, "ssh", "sshd_config"), "w") as f:
                f.write(f"ListenAddress {self.addrs[h]}\nPort 22\nHostKey {host_key}\n"
                        f"AuthorizedKeysFile {self.dir}/authorized_keys\nPermitRootLogin prohibit-password\n"
                        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                        "PidFile none\nMaxStartups 100:30:200\nMaxSessions 100\nUseDNS no\n")

    def _start_sshd(self, h: str) -> None:
        self.sshd[h] = subprocess.Popen(
            self.wrap(h, [which("sshd"), "-D", "-e", "-f", "/etc/ssh/sshd_config"]),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self.dir, f"sshd-{h}.log"), "wb"), start_new_session=True)

    def _wait_ssh(self, h: str, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.sshd[h].poll() is not None:
                raise RuntimeError(f"sshd on {h} exited: {self.log(h)[-2000:]}")
            res = self.exec(self.hosts[0], ["ssh", h, "hostname"], timeout=10, check=False)
            if res.returncode == 0 and res.stdout.strip() == h:
                return
            last = res.stderr.strip()
            time.sleep(0.1)
        raise RuntimeError(f"ssh to {h} did not come up in {timeout}s: {last}; sshd log: {self.log(h)[-2000:]}")

    def log(self, h: str) -> str:
        with open(os.path.join(self.dir, f"sshd-{h}.log"), errors="replace") as f:
            return f.read()

    # -- running ---------------------------------------------------------------
    def wrap(self, h: str, argv: Sequence[str]) -> List[str]:
        """``argv`` as run on node ``h``: its network namespace (and /etc/netns files) and a UTS
        namespace with the node's hostname."""
        return [self.ip, "netns", "exec", self.ns[h], which("unshare"), "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', h] + list(argv)

    def exec(self, h: str, argv: Sequence[str], timeout: float = 60, check: bool = True, **kw):
        return _run(self.wrap(h, argv), timeout=timeout, check=check, **kw)

    def popen(self, h: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        kw.setdefault("start_new_session", True)
        return subprocess.Popen(self.wrap(h, argv), **kw)

    def pids(self, h: str) -> List[int]:
        res = _run([self.ip, "netns", "pids", self.ns[h]], check=False)
        return [int(p) for p in res.stdout.split()]

    def job_pids(self, h: str) -> List[int]:
        """Processes on ``h`` other than its sshd listener (what a job left behind)."""
        keep = {self.sshd[h].pid} if h in self.sshd else set()
        out = []
        for pid in self.pids(h):
            if pid in keep:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            # sshd's own listener appears as "sshd: ... [listener]" after exec; keep it only
            if cmd.startswith("sshd: /usr/sbin/sshd") or cmd.startswith("/usr/sbin/sshd -D"):
                continue
            out.append(pid)
        return out

    def cmdline(self, pid: int) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return "<gone>"

    def wait_quiet(self, timeout: float = 10) -> Dict[str, List[str]]:
        """Wait until no job process is left on any node; returns what is left (empty = clean)."""
        deadline = time.monotonic() + timeout
        while True:
            left = {h: [f"{p}: {self.cmdline(p)}" for p in self.job_pids(h)] for h in self.hosts}
            left = {h: v for h, v in left.items() if v}
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.1)

    def kill_jobs(self) -> None:
        for h in self.hosts:
            for pid in self.job_pids(h):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def hostfile(self, path: str, slots: int = 1, hosts: Optional[Sequence[str]] = None) -> str:
        with open(path, "w") as f:
            f.write("".join(f"{h} slots={slots}\n" for h in (hosts or self.hosts)))
        return path

    # -- teardown --------------------------------------------------------------
    def teardown(self) -> None:
        for name in [self.ns[h] for h in self.hosts] + [self.switch]:
            for _ in range(3):
                res = subprocess.run([self.ip, "netns", "pids", name], capture_output=True, text=True, timeout=20)
                pids = [int(p) for p in res.stdout.split()]
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.2)
        for p in self.sshd.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if p.stderr:
                p.stderr.close()
        for name in [self.ns[h] for h in self.hosts] + [self.switch]:
            subprocess.run([self.ip, "netns", "del", name], capture_output=True, timeout=20)
        for etc in self._etc:
            shutil.rmtree(etc, ignore_errors=True)
        try:
            os.rmdir("/etc/netns")            # only when empty (another bed may be using it)
        except OSError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def leftovers(self) -> List[str]:
        """Namespaces or /etc/netns entries of this bed still present (empty after teardown)."""
        res = subprocess.run([self.ip, "netns", "list"], capture_output=True, text=True, timeout=20)
        names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
        left = [n for n in names if n.startswith(self.prefix + "-")]
        left += [e for e in self._etc if os.path.exists(e)]
        return left
