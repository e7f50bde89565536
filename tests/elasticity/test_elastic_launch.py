"""``deepspeed --elastic_training``: a 2-process job on this machine under
torch.distributed.elastic; rank 1 fails in the first attempt, the agent restarts both
workers, and the second attempt all-reduces over gloo and finishes with exit code 0."""
import json
import os
import sys
import textwrap
from types import SimpleNamespace

import pytest

from deepspeed.elasticity.elastic_launch import node_range, rendezvous_config, run_id, worker_command
from tests.helpers.dist import free_port

DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")

WORKER = textwrap.dedent("""
    import argparse, json, os, sys
    import torch
    import torch.distributed as dist
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int)
    p.add_argument("--out")
    a = p.parse_args()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    if restart == 0 and rank == 1:
        sys.exit(3)                      # a worker dies in the first attempt
    dist.init_process_group("gloo")
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump({"restart": restart, "sum": t.item(), "world": dist.get_world_size(),
                   "local_rank": a.local_rank, "env_file_var": os.environ.get("FROM_DS_ENV")}, f)
    dist.destroy_process_group()
""")


def test_node_range_and_command():
    a = SimpleNamespace(min_elastic_nodes=-1, max_elastic_nodes=-1, no_python=False, module=False,
                        user_script="train.py", user_args=["--x", "1"], no_local_rank=False)
    assert node_range(a, 3) == (1, 3)
    a.min_elastic_nodes, a.max_elastic_nodes = 2, 4
    assert node_range(a, 3) == (2, 4)
    a.min_elastic_nodes = 5
    with pytest.raises(ValueError, match="min_elastic_nodes"):
        node_range(a, 3)
    assert worker_command(a)[1:] == ["-u", "train.py", "--local_rank=${local_rank}", "--x", "1"]


def test_run_id_and_rendezvous_config():
    assert run_id({}) == "123456789"                                # DeepSpeed's ELASTIC_TRAINING_ID_DEFAULT
    assert run_id({"ELASTIC_RUN_ID": "job7", "DS_ELASTIC_RUN_ID": "x"}) == "job7"
    assert run_id({"DS_ELASTIC_RUN_ID": "x"}) == "x"
    assert rendezvous_config({}) == {"timeout": "100"}              # DeepSpeed's rdzv_configs
    got = rendezvous_config({"DS_ELASTIC_RDZV_CONF": " last_call_timeout=2, keep_alive_interval=1 ,"})
    assert got == {"timeout": "100", "last_call_timeout": "2", "keep_alive_interval": "1"}
    with pytest.raises(ValueError, match="DS_ELASTIC_RDZV_CONF.*key=value.*'join_timeout'"):
        rendezvous_config({"DS_ELASTIC_RDZV_CONF": "join_timeout"})


@pytest.mark.slow
def test_elastic_job_restarts_failed_worker(tmp_path):
    import subprocess
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / ".deepspeed_env").write_text("FROM_DS_ENV=hello\n")
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home))
    env.pop("DS_ENV_FILE", None)
    res = subprocess.run([DEEPSPEED, "--elastic_training", "--num_procs", "2", "--master_port", str(free_port()),
                          str(script), "--out", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [g["restart"] for g in got] == [1, 1]          # finished in the restarted attempt
    assert [g["sum"] for g in got] == [3.0, 3.0]          # 1 + 2 over gloo
    assert [g["world"] for g in got] == [2, 2]
    assert [g["local_rank"] for g in got] == [0, 1]
    assert [g["env_file_var"] for g in got] == ["hello", "hello"]
