"""Hostfile, --include/--exclude/--num_nodes/--num_gpus, world info and .deepspeed_env parsing."""
from collections import OrderedDict

import pytest

from deepspeed.launcher import hostfile as hf
from deepspeed.launcher import runner
from deepspeed.launcher.hostfile import ResourceError, select_resources

POOL = OrderedDict([("worker-0", [0, 1, 2, 3]), ("worker-1", [0, 1, 2, 3]),
                    ("worker-2", [0, 1, 2, 3]), ("worker-3", [0, 1, 2, 3])])


def _write(tmp_path, text, name="hostfile"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ----------------------------------------------------------------------------- hostfile
def test_hostfile_parses_in_order_with_comments_and_blank_lines(tmp_path):
    path = _write(tmp_path, "# cluster\n\nworker-1 slots=4\n  worker-0   slots=2  # half node\n\n")
    hosts = hf.parse_hostfile(path)
    assert list(hosts.items()) == [("worker-1", 4), ("worker-0", 2)]
    assert hf.pool_from_slot_counts(hosts) == OrderedDict([("worker-1", [0, 1, 2, 3]), ("worker-0", [0, 1])])


@pytest.mark.parametrize("text, lineno, words", [
    ("worker-0 slots=4\nworker-1 4\n", 2, ["cannot parse", "'worker-1 4'", "hostname slots=N"]),
    ("worker-0 slots=4\nworker-1 slots=4 extra\n", 2, ["cannot parse"]),
    ("worker-0 slots=four\n", 1, ["slot count 'four'", "positive integer"]),
    ("# c\nworker-0 slots=0\n", 2, ["slot count '0'", "positive integer"]),
    ("worker-0 slots=-2\n", 1, ["slot count '-2'"]),
    ("worker-0 slots=2\n\nworker-0 slots=2\n", 3, ["'worker-0' is listed twice"]),
])
def test_hostfile_errors_name_file_and_line(tmp_path, text, lineno, words):
    path = _write(tmp_path, text)
    with pytest.raises(ResourceError) as e:
        hf.parse_hostfile(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:{lineno}:"), msg
    for w in words:
        assert w in msg


def test_empty_hostfile_is_an_error(tmp_path):
    path = _write(tmp_path, "# nothing here\n\n")
    with pytest.raises(ResourceError, match="lists no hosts"):
        hf.parse_hostfile(path)


def test_explicit_missing_hostfile_is_an_error(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ResourceError, match=r"--hostfile .*nope.* does not exist"):
        hf.fetch_hostfile(missing)


def test_default_hostfile_used_only_when_present(tmp_path, monkeypatch):
    default = tmp_path / "job_hostfile"
    monkeypatch.setattr(hf, "DEFAULT_HOSTFILE", str(default))
    assert hf.fetch_hostfile(None) is None  # absent: this machine only
    default.write_text("node-a slots=2\n")
    assert hf.fetch_hostfile(None) == OrderedDict([("node-a", 2)])


# ----------------------------------------------------------------------------- include / exclude
def test_include_readme_example_keeps_pool_order():
    # Pool order (not filter order) decides node ranks.
    got = select_resources(POOL, include="worker-2:0,1@worker-1")
    assert got == OrderedDict([("worker-1", [0, 1, 2, 3]), ("worker-2", [0, 1])])


def test_exclude_readme_example():
    got = select_resources(POOL, exclude="worker-2:0@worker-3:0,1")
    assert got == OrderedDict([("worker-0", [0, 1, 2, 3]), ("worker-1", [0, 1, 2, 3]),
                               ("worker-2", [1, 2, 3]), ("worker-3", [2, 3])])


def test_exclude_whole_host_and_include_merge():
    assert list(select_resources(POOL, exclude="worker-0@worker-3")) == ["worker-1", "worker-2"]
    assert select_resources(POOL, include="worker-1:3@worker-1:1,1") == OrderedDict([("worker-1", [1, 3])])


def test_num_nodes_and_num_gpus():
    got = select_resources(POOL, num_nodes=2, num_gpus=3)
    assert got == OrderedDict([("worker-0", [0, 1, 2]), ("worker-1", [0, 1, 2])])
    assert select_resources(POOL, num_gpus=1) == OrderedDict((h, [0]) for h in POOL)
    assert select_resources(POOL) == POOL


@pytest.mark.parametrize("kwargs, words", [
    (dict(include="worker-0", exclude="worker-1"), ["--include and --exclude cannot be used together"]),
    (dict(include="worker-0", num_nodes=1), ["--num_nodes/--num_gpus cannot be combined with --include"]),
    (dict(exclude="worker-0", num_gpus=2), ["cannot be combined with --exclude"]),
    (dict(include="worker-9:0"), ["--include", "host 'worker-9' is not in the resource pool",
                                  "worker-0, worker-1"]),
    (dict(exclude="worker-9"), ["--exclude", "'worker-9'"]),
    (dict(include="worker-0:4"), ["slot 4 is not available on host 'worker-0'", "[0, 1, 2, 3]"]),
    (dict(include="worker-0:a"), ["slot 'a'", "not a non-negative integer"]),
    (dict(include="worker-0:"), ["slot ''"]),
    (dict(include="worker-0@@worker-1"), ["empty entry"]),
    (dict(include=":0"), ["has no host name"]),
    (dict(num_nodes=5), ["--num_nodes 5", "more nodes than the 4 available"]),
    (dict(num_nodes=0), ["--num_nodes must be a positive integer"]),
    (dict(num_gpus=0), ["--num_gpus must be a positive integer"]),
    (dict(num_gpus=5), ["--num_gpus 5 is more than the slots", "worker-0 (4)"]),
])
def test_resource_selection_errors(kwargs, words):
    with pytest.raises(ResourceError) as e:
        select_resources(POOL, **kwargs)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_uneven_pool_num_gpus_names_short_host():
    pool = OrderedDict([("a", [0, 1, 2, 3]), ("b", [0, 1])])
    with pytest.raises(ResourceError, match=r"b \(2\)"):
        select_resources(pool, num_gpus=3)


# ----------------------------------------------------------------------------- world info
def test_world_info_round_trip_is_shell_safe():
    res = OrderedDict([("worker-1", [1, 3]), ("worker-0", [0])])
    blob = hf.encode_world_info(res)
    assert set(blob) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=")
    assert list(hf.decode_world_info(blob).items()) == [("worker-1", [1, 3]), ("worker-0", [0])]


@pytest.mark.parametrize("blob", ["!!!", hf.encode_world_info({}), "eyJhIjogWy0xXX0="])  # last: {"a": [-1]}
def test_bad_world_info(blob):
    with pytest.raises(ResourceError, match="--world_info"):
        hf.decode_world_info(blob)


# ----------------------------------------------------------------------------- runner resources
def _cpu_only():
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cpu":
        pytest.skip("checks the CPU default pool")


def test_runner_local_pool_on_cpu(tmp_path, monkeypatch):
    _cpu_only()
    monkeypatch.setattr(hf, "DEFAULT_HOSTFILE", str(tmp_path / "absent"))
    res = runner.resolve_resources(runner.parse_args(["train.py"]))
    assert res == OrderedDict(localhost=[0])  # CPU default: one process
    res = runner.resolve_resources(runner.parse_args(["--num_procs", "3", "train.py"]))
    assert res == OrderedDict(localhost=[0, 1, 2])
    res = runner.resolve_resources(runner.parse_args(["--num_gpus", "2", "train.py"]))
    assert res == OrderedDict(localhost=[0, 1])
    with pytest.raises(ResourceError, match="slot 1 is not available on host 'localhost'"):
        runner.resolve_resources(runner.parse_args(["--include", "localhost:1", "train.py"]))
    with pytest.raises(ResourceError, match="'worker-0' is not in the resource pool"):
        runner.resolve_resources(runner.parse_args(["--include", "worker-0", "train.py"]))


def test_runner_uses_hostfile(tmp_path):
    path = _write(tmp_path, "a slots=2\nb slots=2\nc slots=2\n")
    args = runner.parse_args(["--hostfile", path, "--exclude", "b@c:1", "train.py", "--x", "1"])
    assert runner.resolve_resources(args) == OrderedDict([("a", [0, 1]), ("c", [0])])
    assert args.user_script == "train.py" and args.user_args == ["--x", "1"]


def _cli(monkeypatch, *argv):
    """The `deepspeed` command: runner.main() reading sys.argv (errors printed, exit code 2)."""
    monkeypatch.setattr("sys.argv", ["deepspeed", *argv])
    return runner.main()


def test_exclude_everything_is_empty_for_the_helper_and_an_error_for_the_launcher(tmp_path):
    # DeepSpeed's parse_resource_filter returns {} when everything is excluded; launching on it
    # is refused.
    assert runner.parse_resource_filter({"worker-0": [0, 1]}, exclude_str="worker-0") == {}
    path = _write(tmp_path, "a slots=2\nb slots=2\n")
    with pytest.raises(ResourceError, match="removes every slot"):
        runner.resolve_resources(runner.parse_args(["--hostfile", path, "--exclude", "a@b", "train.py"]))


def test_runner_main_with_args_raises_like_deepspeed():
    # DeepSpeed's runner.main(args=[...]) raises ValueError for contradictory requests
    with pytest.raises(ValueError, match="cannot be combined with --include"):
        runner.main(args="--num_nodes 1 -i localhost foo.py".split())


def test_runner_cli_reports_errors_without_traceback(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, "a slots=2\na slots=2\n")
    assert _cli(monkeypatch, "--hostfile", path, "train.py") == 2
    err = capsys.readouterr().err
    assert err.startswith("deepspeed: error: ") and f"{path}:2:" in err and "Traceback" not in err


def test_node_rank_without_no_ssh_is_rejected(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, "a slots=1\n")
    assert _cli(monkeypatch, "--hostfile", path, "--node_rank", "0", "train.py") == 2
    assert "--node_rank is only used with --no_ssh" in capsys.readouterr().err


# ----------------------------------------------------------------------------- .deepspeed_env
def test_read_env_file(tmp_path):
    path = _write(tmp_path, "# comment\n\nNCCL_DEBUG=INFO\nOPTS=--a=1 --b=2\n EMPTY=\n", ".deepspeed_env")
    assert list(runner.read_env_file(path).items()) == [
        ("NCCL_DEBUG", "INFO"), ("OPTS", "--a=1 --b=2"), ("EMPTY", "")]


@pytest.mark.parametrize("line", ["JUSTANAME", "1BAD=x", "A B=c", "=value"])
def test_env_file_errors_name_file_and_line(tmp_path, line):
    path = _write(tmp_path, f"GOOD=1\n{line}\n", ".deepspeed_env")
    with pytest.raises(ResourceError) as e:
        runner.read_env_file(path)
    assert str(e.value).startswith(f"{path}:2:") and "NAME=VALUE" in str(e.value)


def test_env_file_search_home_then_cwd(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("B=cwd\nC=cwd\n")
    monkeypatch.chdir(cwd)
    got = runner.load_deepspeed_env(environ={"HOME": str(home)})
    assert got == {"A": "home", "B": "cwd", "C": "cwd"}  # the current directory wins
    explicit = _write(tmp_path, "ONLY=this\n", "my_env")
    assert runner.load_deepspeed_env(environ={"HOME": str(home), "DS_ENV_FILE": explicit}) == {"ONLY": "this"}
    with pytest.raises(ResourceError, match="DS_ENV_FILE"):
        runner.load_deepspeed_env(environ={"DS_ENV_FILE": str(tmp_path / "missing")})
    assert runner.DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"


def test_collect_exports_prefixes_and_file_vars():
    environ = {"NCCL_DEBUG": "WARN", "PYTHONPATH": "/x", "UCX_TLS": "tcp", "MV2_X": "1", "HOME": "/h",
               "SECRET": "no", "MY_NCCL": "no"}
    got = runner.collect_exports(environ, {"NCCL_DEBUG": "INFO", "FROM_FILE": "1"})
    assert list(got.items()) == [("MV2_X", "1"), ("NCCL_DEBUG", "INFO"), ("PYTHONPATH", "/x"),
                                 ("UCX_TLS", "tcp"), ("FROM_FILE", "1")]


def test_missing_user_script_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(hf, "DEFAULT_HOSTFILE", str(tmp_path / "absent"))
    monkeypatch.chdir(tmp_path)
    assert _cli(monkeypatch, "no_such_train.py") == 2
    assert "user_script 'no_such_train.py' does not exist" in capsys.readouterr().err
