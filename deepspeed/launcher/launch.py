"""The per-node launcher: ``python -m deepspeed.launcher.launch --world_info=... script args``.

It starts one process per local slot of this node, each with the variables
``torch.distributed``'s ``env://`` needs (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE`` (and DeepSpeed's ``LOCAL_SIZE``), ``MASTER_ADDR``, ``MASTER_PORT``; also ``CROSS_RANK``/``CROSS_SIZE``
= node rank / node count), and passes ``--local_rank=<i>`` unless ``--no_local_rank``.
Then it supervises them: one failing rank stops the node (see ``supervisor``).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional

from .constants import DEFAULT_MASTER_ADDR, TORCH_DISTRIBUTED_DEFAULT_PORT
from .hostfile import ResourceError, decode_world_info
from .supervisor import Member, Supervisor


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deepspeed.launcher.launch",
                                description="Start and supervise the ranks of one node.")
    p.add_argument("--world_info", required=True,
                   help="base64-encoded JSON {host: [slot ids]} for the whole job, in node order")
    p.add_argument("--node_rank", type=int, default=0, help="index of this node in --world_info")
    p.add_argument("--master_addr", default=DEFAULT_MASTER_ADDR, help="address of the rank-0 node")
    p.add_argument("--master_port", type=int, default=TORCH_DISTRIBUTED_DEFAULT_PORT)
    p.add_argument("--no_local_rank", action="store_true",
                   help="do not pass --local_rank=<i> to the script (read LOCAL_RANK instead)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--module", action="store_true", help="run the script as 'python -m <module>'")
    g.add_argument("--no_python", action="store_true", help="run the script directly, without python")
    p.add_argument("--enable_each_rank_log", default=None, metavar="DIR",
                   help="write each rank's stdout/stderr to DIR/rank<N>.log")
    p.add_argument("--exit_on_stdin_eof", action="store_true",
                   help="stop all ranks when stdin closes (used under ssh so a lost "
                        "connection does not leave ranks behind)")
    p.add_argument("training_script", help="the script (or module) each rank runs")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def rank_command(args, local_rank: int) -> List[str]:
    if args.no_python:
        cmd = [args.training_script]
    elif args.module:
        cmd = [sys.executable, "-u", "-m", args.training_script]
    else:
        cmd = [sys.executable, "-u", args.training_script]
    if not args.no_local_rank:
        cmd.append(f"--local_rank={local_rank}")
    return cmd + list(args.training_script_args)


def rank_environments(world, node_rank: int, master_addr: str, master_port: int,
                      base_env: Dict[str, str]) -> List[Dict[str, str]]:
    """One environment per local rank of ``node_rank``."""
    hosts = list(world)
    if not 0 <= node_rank < len(hosts):
        raise ResourceError(f"--node_rank {node_rank} is out of range: --world_info has "
                            f"{len(hosts)} node(s) ({', '.join(hosts)})")
    local_slots = world[hosts[node_rank]]
    first_rank = sum(len(world[h]) for h in hosts[:node_rank])
    world_size = sum(len(s) for s in world.values())
    common = dict(base_env)
    common.update(MASTER_ADDR=str(master_addr), MASTER_PORT=str(master_port), WORLD_SIZE=str(world_size),
                  LOCAL_WORLD_SIZE=str(len(local_slots)), LOCAL_SIZE=str(len(local_slots)),
                  CROSS_RANK=str(node_rank),
                  CROSS_SIZE=str(len(hosts)))
    _set_visible_devices(common, local_slots)
    envs = []
    for local_rank in range(len(local_slots)):
        env = dict(common)
        env.update(RANK=str(first_rank + local_rank), LOCAL_RANK=str(local_rank))
        envs.append(env)
    return envs


def _set_visible_devices(env: Dict[str, str], slots: List[int]) -> None:
    """Restrict the node's ranks to the chosen devices (CUDA_VISIBLE_DEVICES on CUDA, and on
    CPU too, as DeepSpeed's CPU accelerator names that variable).

    Slot ids count the devices this node can see: when the variable is already set
    (say ``4,5,6,7``), slot 1 means device ``5``, not physical device 1.
    """
    from ..accelerator import get_accelerator
    acc = get_accelerator()
    ids: List = list(slots)
    for name in acc.visible_devices_envs():
        current = [d.strip() for d in env.get(name, "").split(",") if d.strip()]
        if current:
            too_big = [s for s in slots if s >= len(current)]
            if too_big:
                raise ResourceError(f"slot(s) {too_big} do not exist: {name}={env[name]!r} makes only "
                                    f"{len(current)} device(s) visible on this node")
            ids = [current[s] for s in slots]
            break
    acc.set_visible_devices_envs(env, ids)


def build_members(args, base_env: Optional[Dict[str, str]] = None) -> List[Member]:
    world = decode_world_info(args.world_info)
    envs = rank_environments(world, args.node_rank, args.master_addr, args.master_port,
                             dict(os.environ) if base_env is None else base_env)
    if args.enable_each_rank_log:
        os.makedirs(args.enable_each_rank_log, exist_ok=True)
    host = list(world)[args.node_rank]
    members = []
    for local_rank, env in enumerate(envs):
        log = (os.path.join(args.enable_each_rank_log, f"rank{env['RANK']}.log")
               if args.enable_each_rank_log else None)
        members.append(Member(label=f"rank {env['RANK']} (local_rank {local_rank}, node {args.node_rank}, "
                                    f"host {host})",
                              argv=rank_command(args, local_rank), env=env, stdout=log))
    return members


def run(args, base_env: Optional[Dict[str, str]] = None) -> int:
    """Start this node's ranks, supervise them, and return the exit code."""
    from ..utils.logging import logger
    members = build_members(args, base_env)
    logger.info(f"launching {len(members)} process(es) on node {args.node_rank}: "
                f"{' '.join(members[0].argv)}")
    code = Supervisor(members, logger, stop_on_stdin_eof=args.exit_on_stdin_eof).run()
    if code != 0:
        logger.error(f"node {args.node_rank} launcher exiting with code {code}")
    return code


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ResourceError as err:
        parser.error(str(err))
    return 2


if __name__ == "__main__":
    sys.exit(main())
