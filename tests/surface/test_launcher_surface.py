"""The launcher's module-level names with DeepSpeed's signatures: _parse_hostfile,
parse_resource_filter(host_info, include_str, exclude_str), parse_inclusion_exclusion,
encode/decode_world_info with slot counts, runner constructors and get_cmd(env, active_resources)."""
from collections import OrderedDict

import pytest

from deepspeed.launcher import runner
from deepspeed.launcher.hostfile import ResourceError, decode_world_info, encode_world_info
from deepspeed.launcher.multinode_runner import MPICHRunner, OpenMPIRunner, PDSHRunner, SlurmRunner


def test_parse_hostfile_and_filters():
    pool = runner._parse_hostfile(["worker-0 slots=4", "# comment", "worker-1 slots=2"])
    assert pool == OrderedDict([("worker-0", 4), ("worker-1", 2)])
    lists = OrderedDict([("worker-0", [0, 1, 2, 3]), ("worker-1", [0, 1])])
    assert runner.parse_resource_filter(lists, include_str="worker-0:1,2@worker-1") == \
        OrderedDict([("worker-0", [1, 2]), ("worker-1", [0, 1])])
    assert runner.parse_resource_filter(lists, exclude_str="worker-0:1@worker-1") == \
        OrderedDict([("worker-0", [0, 2, 3])])
    assert runner.parse_resource_filter(lists) == lists
    assert runner.parse_inclusion_exclusion(pool, "worker-1:1", "") == OrderedDict([("worker-1", [1])])
    with pytest.raises(ValueError, match="cannot be used together"):
        runner.parse_resource_filter(lists, include_str="worker-0", exclude_str="worker-1")
    with pytest.raises(ValueError, match="'worker-9' is not in the resource pool"):
        runner.parse_resource_filter(lists, include_str="worker-9")


def test_world_info_accepts_slot_counts():
    assert decode_world_info(encode_world_info({"localhost": 2})) == OrderedDict(localhost=[0, 1])
    assert decode_world_info(encode_world_info({"a": [1, 3], "b": 1})) == OrderedDict([("a", [1, 3]), ("b", [0])])
    with pytest.raises(ResourceError, match="slots must be a count"):
        encode_world_info({"a": "2"})


def test_runner_constructors_and_get_cmd_with_deepspeeds_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = runner.parse_args(["--launcher", "openmpi", "train.py", "--lr", "0.1"])
    args.master_addr = "worker-0"
    world = encode_world_info({"worker-0": 2, "worker-1": 2})
    pdsh = PDSHRunner(args, world)  # DeepSpeed: PDSHRunner(args, world_info_base64)
    assert pdsh.resources == OrderedDict([("worker-0", [0, 1]), ("worker-1", [0, 1])])
    pdsh.add_export("NCCL_DEBUG", " INFO ")
    cmd, kill_cmd, env = pdsh.get_cmd({}, {"worker-0": [0, 1], "worker-1": [0, 1]})  # DeepSpeed's PDSH shape
    assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1"] and env["PDSH_RCMD_TYPE"] == "ssh"
    assert "export NCCL_DEBUG=INFO" in cmd[-1] and f"--world_info={world}" in cmd[-1] and kill_cmd[0] == "pdsh"
    # MPI runners: (args, world_info_base64, resource_pool) with slot counts
    mpi = OpenMPIRunner(args, world, {"worker-0": 2, "worker-1": 2})
    mpi.validate_args()
    argv = mpi.get_cmd({}, {"worker-0": [0, 1], "worker-1": [0, 1]})   # one command line, as in DeepSpeed
    assert argv[0] == "mpirun" and "4" in argv and argv[-3:] == ["train.py", "--lr", "0.1"]
    for cls in (MPICHRunner, SlurmRunner):
        r = cls(args, world, {"worker-0": 2, "worker-1": 2})
        assert r.get_cmd({})[-3:] == ["train.py", "--lr", "0.1"]
    # active resources passed to get_cmd replace the constructor's; MPI cannot pick slot 1 alone
    with pytest.raises(ResourceError, match="cannot use slots \\[1\\]"):
        mpi.get_cmd({}, {"worker-0": [1]})
