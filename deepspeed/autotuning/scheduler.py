"""Runs autotuning experiments: each one a short training job started through the
``deepspeed`` launcher in its own process group, with a time limit.

``ResourceManager`` keeps the queue and the nodes' free slots (DeepSpeed's names:
``schedule_experiments``, ``run``, ``parse_results``, ``clear``, ``Node``,
``Reservation``). On this implementation experiments run one after another: on a
CPU host concurrent experiments would share the cores and corrupt each other's
timings, and on GPUs an experiment takes all the slots it is measured on anyway.

Per experiment ``results_dir/<name>/`` holds, as in DeepSpeed: ``exp.json`` (the
description), ``ds_config.json`` (the config it ran with), ``cmd.txt``, ``stdout.log``,
``stderr.log`` and, when it measured something, ``metrics.json``. A failure (non-zero
exit, timeout, out of memory, no metric written) is recorded in the experiment's
``error`` and in ``result.json``, and the search goes on.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

from ..utils.logging import logger
from .constants import AUTOTUNING, AUTOTUNING_METRIC_PATH, DEFAULT_EXPERIMENT_TIMEOUT, LOWER_IS_BETTER
from .utils import get_val_by_key, search_error, was_interrupted

RESULT_FILE = "result.json"


class Node:
    """A host and its idle slots (accelerators, or processes on CPU)."""

    def __init__(self, host: str, max_slots: int):
        self.host = host
        self.max_slots = max_slots
        self.idle_slots = list(range(max_slots))

    def reserve_slots(self, slot_request: int) -> Optional[list]:
        if len(self.idle_slots) >= slot_request:
            return [self.idle_slots.pop(0) for _ in range(slot_request)]
        return None

    def restore_slots(self, slots: list) -> None:
        self.idle_slots = sorted(set(self.idle_slots) | set(slots))


class Reservation:
    """Slots of one node held by a running experiment."""

    def __init__(self, node: Node, slots: list):
        self.node = node
        self.slots = slots

    def restore_slots(self) -> None:
        self.node.restore_slots(self.slots)

    def desc(self) -> str:
        return f"{self.node.host}:{','.join(map(str, sorted(self.slots)))}"


def metric_is_better(new, old, metric: str) -> bool:
    """``new`` beats ``old`` for ``metric`` (latency: smaller; throughput, flops: larger)."""
    if new is None:
        return False
    if old is None:
        return True
    return new < old if metric in LOWER_IS_BETTER else new > old


def _user_config_index(user_args: List[str]) -> Optional[int]:
    for flag in ("--deepspeed_config", "--deepspeed"):
        if flag in user_args:
            idx = user_args.index(flag)
            if idx + 1 < len(user_args) and user_args[idx + 1].endswith(".json"):
                return idx + 1
    return None


class ResourceManager:
    """Schedules experiments on the nodes' slots and collects their results."""

    def __init__(self, args, hosts, num_gpus_per_node: int, results_dir, exps_dir, arg_mappings,
                 timeout: float = DEFAULT_EXPERIMENT_TIMEOUT, runner: Optional[Callable] = None):
        self.results_dir = results_dir
        self.exps_dir = exps_dir
        self.args = args
        self.num_gpus_per_node = num_gpus_per_node
        if isinstance(hosts, str):  # "worker-0, worker-1"
            hosts = [h.strip() for h in hosts.split(",") if h.strip()]
        self.nodes = [Node(h, num_gpus_per_node) for h in hosts]
        self.timeout = timeout
        #: ``runner(exp) -> (metrics dict or None, error str or None)``; default: a real launch.
        self.runner = runner or self._launch
        self.experiment_queue: List[dict] = []
        self.finished_experiments: Dict[int, Tuple[dict, Optional[str]]] = {}
        self.experiment_count = 0
        self.exp_paths = set()
        self.arg_mappings: Dict[str, str] = {}
        for k, v in (arg_mappings or {}).items():
            self.arg_mappings.setdefault(k.strip(), str(v).strip())
        #: called after each finished experiment with (exp, metrics, error)
        self.on_finish: Optional[Callable] = None

    # ---------------------------------------------------------------- queue
    def schedule_experiments(self, exp_paths: List[str]) -> None:
        """Queue the experiments described by these files. One whose results already exist
        (a finished record in ``results_dir/<name>/``) is not run again: its record is reused."""
        for exp_path in exp_paths:
            if exp_path in self.exp_paths:
                continue
            self.exp_paths.add(exp_path)
            with open(exp_path) as fd:
                exp = json.load(fd)
            exp["exp_id"] = self.experiment_count
            self.experiment_count += 1
            result_dir = exp["result_dir"] = os.path.join(self.results_dir, exp["name"])
            if AUTOTUNING in exp["ds_config"]:
                exp["ds_config"][AUTOTUNING][AUTOTUNING_METRIC_PATH] = os.path.join(result_dir, "metrics.json")
            record = os.path.join(result_dir, RESULT_FILE)
            if os.path.exists(record) and not was_interrupted(os.path.join(result_dir, "stderr.log")):
                with open(record) as fd:
                    old = json.load(fd)
                if old.get("ds_config") == exp["ds_config"]:
                    logger.info(f"autotuning: reusing the recorded result of {exp['name']} ({record})")
                    exp.update(results=old.get("results"), error=old.get("error"), reused=True,
                               duration_s=old.get("duration_s"))
                    self.finished_experiments[exp["exp_id"]] = (exp, exp["error"])
                    if self.on_finish is not None:
                        self.on_finish(exp, exp["results"], exp["error"])
                    continue
            self.experiment_queue.append(exp)

    def resource_request(self, exp: dict) -> Optional[List[Reservation]]:
        num_gpus, num_nodes = exp["num_gpus"], exp["num_nodes"]
        reservations = []
        for node in self.nodes:
            if num_nodes == 0:
                break
            slots = node.reserve_slots(num_gpus)
            if slots:
                reservations.append(Reservation(node, slots))
                num_nodes -= 1
        if num_nodes == 0:
            return reservations
        for r in reservations:
            r.restore_slots()
        return None

    def run(self) -> None:
        """Run every queued experiment, one at a time."""
        while self.experiment_queue:
            exp = self.experiment_queue.pop(0)
            reservations = self.resource_request(exp)
            if reservations is None:
                err = (f"needs {exp['num_nodes']} node(s) x {exp['num_gpus']} slot(s), more than the "
                       f"{len(self.nodes)} node(s) x {self.num_gpus_per_node} available")
                self._finish(exp, None, err, 0.0)
                continue
            exp["reservations"] = [r.desc() for r in reservations]
            t0 = time.time()
            try:
                metrics, err = self.runner(exp)
            finally:
                for r in reservations:
                    r.restore_slots()
            self._finish(exp, metrics, err, time.time() - t0)

    def _finish(self, exp, metrics, err, duration):
        exp["results"], exp["error"], exp["duration_s"] = metrics, err, round(duration, 3)
        self.finished_experiments[exp["exp_id"]] = (exp, err)
        os.makedirs(exp["result_dir"], exist_ok=True)
        record = {k: exp.get(k) for k in ("name", "exp_id", "ds_config", "results", "error", "duration_s",
                                          "num_gpus", "num_nodes")}
        with open(os.path.join(exp["result_dir"], RESULT_FILE), "w") as fd:
            json.dump(record, fd, indent=2)
        if err:
            logger.warning(f"autotuning: experiment {exp['name']} failed ({err}); recorded in "
                           f"{exp['result_dir']} and skipped")
        if self.on_finish is not None:
            self.on_finish(exp, metrics, err)

    # ---------------------------------------------------------------- launching
    def experiment_command(self, exp: dict) -> List[str]:
        """The ``deepspeed`` command line of one experiment (the user's script and arguments,
        with the config path replaced by the experiment's and ``arg_mappings`` applied)."""
        user_args = list(self.args.user_args)
        idx = _user_config_index(user_args)
        if idx is None:
            raise ValueError("autotuning: the script's arguments must name the DeepSpeed config file "
                             "(--deepspeed_config ds_config.json or --deepspeed ds_config.json)")
        user_args[idx] = exp["ds_config_path"]
        for key, flag in self.arg_mappings.items():
            val = get_val_by_key(exp["ds_config"], key)
            if val is None or str(val) == "auto":
                continue
            if flag in user_args and user_args.index(flag) + 1 < len(user_args):
                user_args[user_args.index(flag) + 1] = str(val)
            else:
                user_args += [flag, str(val)]
        hosts = exp.get("reservations") or []
        launcher = [sys.executable, "-m", "deepspeed.launcher.runner"]
        if getattr(self.args, "hostfile", None):
            launcher += ["--hostfile", self.args.hostfile]
        if hosts and (getattr(self.args, "hostfile", None) or len(hosts) > 1):
            launcher += ["--include", "@".join(hosts)]
        elif exp.get("num_gpus"):
            # this machine only: its pool is sized by --num_gpus (on CPU, the process count)
            launcher += ["--num_gpus", str(exp["num_gpus"])]
        if len(hosts) > 1:
            launcher += ["--master_port", str(int(getattr(self.args, "master_port", 29500)) + exp["exp_id"])]
        else:
            launcher += ["--master_port", "0"]   # one node: any free port
        for flag in ("module", "no_python", "no_local_rank"):
            if getattr(self.args, flag, False):
                launcher.append(f"--{flag}")
        return launcher + [self.args.user_script] + user_args

    def _launch(self, exp: dict):
        exp_dir = exp["result_dir"]
        os.makedirs(exp_dir, exist_ok=True)
        exp["ds_config_path"] = os.path.join(exp_dir, "ds_config.json")
        with open(exp["ds_config_path"], "w") as fd:
            json.dump(exp["ds_config"], fd, indent=2)
        metric_file = get_val_by_key(exp["ds_config"].get(AUTOTUNING, {}), AUTOTUNING_METRIC_PATH)
        expect = exp.get("expect_file") or metric_file
        for stale in {expect, metric_file} - {None}:
            if os.path.exists(stale):
                os.remove(stale)
        cmd = self.experiment_command(exp)
        exp["cmd"] = cmd
        with open(os.path.join(exp_dir, "cmd.txt"), "w") as fd:
            fd.write(" ".join(cmd) + "\n")
        with open(os.path.join(exp_dir, "exp.json"), "w") as fd:
            json.dump(exp, fd, indent=2)
        logger.info(f"autotuning: launching {exp['name']}: {' '.join(cmd)}")
        timed_out = False
        with open(os.path.join(exp_dir, "stdout.log"), "wb") as out, \
                open(os.path.join(exp_dir, "stderr.log"), "wb") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                rc = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)  # the experiment's own process group
                rc = proc.wait()
        stderr_file = os.path.join(exp_dir, "stderr.log")
        if timed_out:
            return None, f"timed out after {self.timeout:g} s"
        if rc != 0:
            return None, f"exit code {rc}: {search_error(stderr_file) or 'see ' + stderr_file}"
        if expect and not os.path.exists(expect):
            return None, (f"finished without writing {os.path.basename(expect)}: the script must run at least "
                          f"end_profile_step + 1 training steps")
        if expect is None:
            return {}, None
        with open(expect) as fd:
            return json.load(fd), None

    # ---------------------------------------------------------------- results
    def parse_results(self, metric: str):
        """``(best experiment, its metric value)`` among the finished experiments that measured
        ``metric``; ``(last experiment, None)`` when none did."""
        best, best_val, last = None, None, None
        for exp_id, (exp, err) in sorted(self.finished_experiments.items()):
            last = exp
            if err or not exp.get("results") or metric not in exp["results"]:
                continue
            val = exp["results"][metric]
            if metric_is_better(val, best_val, metric):
                best, best_val = exp, val
        return (best, best_val) if best is not None else (last, None)

    def clear(self) -> None:
        """Forget the queue and the finished experiments (``experiment_count`` keeps counting)."""
        self.experiment_queue = []
        self.finished_experiments = {}
        self.exp_paths = set()

    def status(self) -> str:
        return ", ".join(f"{n.host} ({len(n.idle_slots)} idle slots)" for n in self.nodes)
