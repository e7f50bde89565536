"""``DSElasticAgent``: torch.distributed.elastic's local agent, with the launcher's environment.

The agent (``LocalElasticAgent``) does the work: it joins the rendezvous, starts the
node's workers with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``... for the current
membership, watches them, and on a failure or a membership change stops them and starts
them again (up to ``max_restarts``) at the new world size. The only addition is DeepSpeed's
``env``: the variables the launcher collected (``.deepspeed_env``, exports), given to
every worker it starts.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Dict, Optional

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs


@contextmanager
def _environ(extra: Dict[str, str]):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update({k: str(v) for k, v in extra.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class DSElasticAgent(LocalElasticAgent):
    """``LocalElasticAgent`` whose workers also get ``env`` (DeepSpeed's signature:
    ``DSElasticAgent(spec, env, start_method="spawn", exit_barrier_timeout=300, log_dir=None)``)."""

    def __init__(self, spec: WorkerSpec, env: Dict[str, str], start_method: str = "spawn",
                 exit_barrier_timeout: float = 300, log_dir: Optional[str] = None):
        super().__init__(spec, DefaultLogsSpecs(log_dir=log_dir), start_method=start_method,
                         exit_barrier_timeout=exit_barrier_timeout)
        self.ds_env = dict(env)

    def _start_workers(self, worker_group):
        # Worker processes inherit this process's environment plus the agent's per-worker
        # variables (which take precedence), so DeepSpeed's go in underneath those.
        elastic_owned = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                         "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE"}
        with _environ({k: v for k, v in self.ds_env.items() if k not in elastic_owned}):
            return super()._start_workers(worker_group)
