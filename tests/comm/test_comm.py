"""deepspeed.comm collectives over gloo, checked against hand-computed values."""
import os
import subprocess
import sys

import torch

from tests.helpers.dist import run_distributed


def _collectives(rank, world_size):
    import deepspeed.comm as dist
    out = {}
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["all_reduce"] = t.item()
    full = torch.zeros(world_size * 2)
    dist.all_gather_into_tensor(full, torch.tensor([rank * 1.0, rank + 0.5]))
    out["all_gather"] = full.tolist()
    lst = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(lst, torch.tensor([float(rank)]))
    out["all_gather_list"] = [x.item() for x in lst]
    inp = torch.arange(world_size * 2, dtype=torch.float32) + rank
    rs = torch.zeros(2)
    dist.reduce_scatter_tensor(rs, inp)
    out["reduce_scatter"] = rs.tolist()
    b = torch.tensor([rank * 10.0])
    dist.broadcast(b, src=1)
    out["broadcast"] = b.item()
    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=1)
    elif rank == 1:
        r = torch.zeros(1)
        dist.recv(r, src=0)
        out["recv"] = r.item()
    g = dist.new_group([0, 1])
    t2 = torch.ones(1)
    if rank in (0, 1):
        dist.all_reduce(t2, group=g)
    out["group"] = t2.item()
    work = dist.all_reduce(torch.ones(1), async_op=True)
    work.wait()
    dist.barrier()
    out["rank"], out["world"] = dist.get_rank(), dist.get_world_size()
    return out


def test_collectives_world_of_4():
    res = run_distributed(_collectives, 4, timeout=120)
    ws = 4
    for r, o in enumerate(res):
        assert o["rank"] == r and o["world"] == ws
        assert o["all_reduce"] == sum(range(1, ws + 1))
        assert o["all_gather"] == [v for k in range(ws) for v in (k * 1.0, k + 0.5)]
        assert o["all_gather_list"] == [float(k) for k in range(ws)]
        # element i of the summed input is sum_k (i + k); rank r gets elements 2r, 2r+1
        assert o["reduce_scatter"] == [sum(2 * r + j + k for k in range(ws)) for j in range(2)]
        assert o["broadcast"] == 10.0
        assert o["group"] == (2.0 if r in (0, 1) else 1.0)
    assert res[1]["recv"] == 42.0


def test_single_process_without_launcher_env():
    """init_distributed with no launcher variables makes a world of one."""
    code = ("import deepspeed, deepspeed.comm as c; deepspeed.init_distributed(); "
            "import torch; t=torch.ones(1); c.all_reduce(t); print(c.get_rank(), c.get_world_size(), t.item())")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 1 1.0"


def test_mpi_style_discovery():
    """OpenMPI-style variables are mapped onto the env:// variables."""
    code = ("import os, deepspeed, deepspeed.comm as c; deepspeed.init_distributed(distributed_port=int(os.environ['P'])); "
            "print(c.get_rank(), c.get_world_size(), os.environ['LOCAL_RANK'])")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "LOCAL_RANK")}
    env.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="1", OMPI_COMM_WORLD_LOCAL_RANK="0", P=str(port))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 1 0"
