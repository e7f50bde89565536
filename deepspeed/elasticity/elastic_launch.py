"""``deepspeed --elastic_training``: run this node's workers under torch.distributed.elastic.

Each node's ``deepspeed`` process becomes a :class:`DSElasticAgent` that joins a
``c10d`` rendezvous at ``--master_addr:--master_port`` (the rendezvous store; workers get
their own free port for ``torch.distributed``) with between ``--min_elastic_nodes`` and
``--max_elastic_nodes`` nodes. When a worker fails or a node leaves or joins, every agent
stops its workers and starts them again at the new world size (up to ``MAX_RESTARTS``
times); the training script resumes from its latest checkpoint and the elastic config
(``elasticity`` section) keeps the global batch size. ``$DEEPSPEED_ELASTICITY_CONFIG``
is passed through to the workers when set. Nodes of one job share ``$ELASTIC_RUN_ID``;
``$DS_ELASTIC_RDZV_CONF`` tunes the rendezvous (see :func:`rendezvous_config`).
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List

#: DeepSpeed's launcher allows 100 restarts of an elastic job.
MAX_RESTARTS = 100
#: Seconds between the agent's health checks of its workers (DeepSpeed: 5).
MONITOR_INTERVAL = 1.0
#: DeepSpeed's default rendezvous id (``ELASTIC_TRAINING_ID_DEFAULT``).
ELASTIC_TRAINING_ID_DEFAULT = "123456789"
#: Extra rendezvous options, ``key=value,...``.
RDZV_CONF_ENV = "DS_ELASTIC_RDZV_CONF"


def worker_command(args) -> List[str]:
    """The argv every worker runs (``--local_rank`` filled in per worker by the agent)."""
    from torch.distributed.elastic.utils import macros
    if args.no_python:
        cmd = [args.user_script]
    elif args.module:
        cmd = [sys.executable, "-u", "-m", args.user_script]
    else:
        cmd = [sys.executable, "-u", args.user_script]
    if not args.no_local_rank:
        cmd.append(f"--local_rank={macros.local_rank}")
    return cmd + list(args.user_args)


def run_id(environ) -> str:
    """The rendezvous id every node of one job shares: ``$ELASTIC_RUN_ID`` (DeepSpeed's
    variable; ``$DS_ELASTIC_RUN_ID`` is read too), default DeepSpeed's ``123456789``."""
    return environ.get("ELASTIC_RUN_ID") or environ.get("DS_ELASTIC_RUN_ID") or ELASTIC_TRAINING_ID_DEFAULT


def rendezvous_config(environ) -> Dict[str, str]:
    """Options for torch's c10d rendezvous: DeepSpeed's ``timeout=100``, then
    ``$DS_ELASTIC_RDZV_CONF`` (``key=value,...`` as torchrun's ``--rdzv_conf``), e.g.
    ``last_call_timeout=2`` (seconds a complete-enough round waits for more nodes; torch's
    default 30), ``join_timeout``, ``close_timeout``, ``keep_alive_interval``."""
    conf = {"timeout": "100"}
    raw = environ.get(RDZV_CONF_ENV, "").strip()
    for item in filter(None, (x.strip() for x in raw.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{RDZV_CONF_ENV}={raw!r}: expected key=value[,key=value...], got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def node_range(args, num_nodes: int):
    """``(min_nodes, max_nodes)`` from the arguments (defaults: 1 and the nodes in use)."""
    lo = args.min_elastic_nodes if args.min_elastic_nodes > 0 else 1
    hi = args.max_elastic_nodes if args.max_elastic_nodes > 0 else max(num_nodes, lo)
    if lo > hi:
        raise ValueError(f"--min_elastic_nodes ({lo}) must not exceed --max_elastic_nodes ({hi})")
    return lo, hi


def run_elastic(args, procs_per_node: int, num_nodes: int, env: Dict[str, str]) -> int:
    """Run this node's ``procs_per_node`` workers under the elastic agent; the exit code."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from ..utils.logging import logger
    from .elastic_agent import DSElasticAgent

    lo, hi = node_range(args, num_nodes)
    cmd = worker_command(args)
    # torch shares the rendezvous TCP store with the workers by default, and then writes the
    # workers' MASTER_ADDR/PORT only in the first round a node is rank 0: a node that joins
    # later waits for that key in the new round forever (torch 2.13; found on the multi-host
    # test bed). Without sharing every round publishes a fresh address and port.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    params = RendezvousParameters(backend="c10d", endpoint=f"{args.master_addr}:{args.master_port}",
                                  run_id=run_id(os.environ), min_nodes=lo, max_nodes=hi,
                                  # the rendezvous store lives with node 0 (--master_addr), never elsewhere:
                                  # a node that leaves must not take the store with it
                                  is_host=max(getattr(args, "node_rank", -1), 0) == 0,
                                  **rendezvous_config(os.environ))
    spec = WorkerSpec(role="trainer", local_world_size=procs_per_node, entrypoint=cmd[0], args=tuple(cmd[1:]),
                      rdzv_handler=get_rendezvous_handler(params), max_restarts=MAX_RESTARTS,
                      monitor_interval=MONITOR_INTERVAL)
    logger.info(f"elastic training: {procs_per_node} worker(s) on this node, {lo}..{hi} nodes, rendezvous "
                f"{args.master_addr}:{args.master_port}; worker command: {cmd}")
    agent = DSElasticAgent(spec, env)
    try:
        result = agent.run()
    finally:
        spec.rdzv_handler.shutdown()
    if result.state == WorkerState.SUCCEEDED:
        return 0
    for rank, failure in sorted(result.failures.items()):
        logger.error(f"elastic worker (global rank {rank}) failed with exit code {failure.exitcode}: "
                     f"{failure.message}")
    return 1
