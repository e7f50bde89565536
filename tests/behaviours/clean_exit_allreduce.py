"""The race behind the gloo exit abort, made frequent: plain collectives through
``deepspeed.init_distributed`` (which installs the clean-exit hook), a reference to the
group kept alive as an engine keeps one, and the script returns right after its last
collective without any shutdown call. Without the hook about 1 run in 4 ends in
"terminate called without an active exception" on this machine (2 cores, torch 2.13).
Used by ``test_clean_exit.py`` and ``benchmarks/clean_exit.py --workload allreduce``."""
import argparse
import sys

import torch
import torch.distributed as dist

import deepspeed

_HELD = []


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--leave", default="return", choices=sorted(LEAVE),
                   help="how the script ends after its collectives")
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    _HELD.append(dist.group.WORLD)   # outlives main(), as the engine's groups do
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    print(f"rank {dist.get_rank()} done", flush=True)
    LEAVE[args.leave]()


def _raise(exc):
    raise exc


LEAVE = {
    "return": lambda: None,
    "sys_exit_3": lambda: sys.exit(3),
    "raise_systemexit_3": lambda: _raise(SystemExit(3)),   # not through sys.exit
    "sys_exit_message": lambda: sys.exit("leaving with a message"),
    "error": lambda: _raise(RuntimeError(f"rank {dist.get_rank()} fails on purpose")),
    "keyboard_interrupt": lambda: _raise(KeyboardInterrupt()),
}


if __name__ == "__main__":
    main()
