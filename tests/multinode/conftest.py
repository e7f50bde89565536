"""The session's multi-host test bed (see testbed.py): three namespace hosts worker-0..2,
built once for the session, torn down at its end (also after failures), and checked to be
gone. After each test no job process may be left on any host."""
import os
import sys

import pytest

from tests.multinode.testbed import TestBed, unavailable_reason

BIN = os.path.dirname(sys.executable)
DEEPSPEED = os.path.join(BIN, "deepspeed")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def bed():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-node test bed unavailable: {reason}")
    tb = TestBed(3).setup()
    try:
        yield tb
    finally:
        tb.teardown()
        left = tb.leftovers()
        assert not left, f"test bed not torn down: {left}"


@pytest.fixture
def clean_bed(bed):
    """The bed, with a check after the test that nothing the test started is still running."""
    yield bed
    left = bed.wait_quiet(10)
    if left:
        bed.kill_jobs()
    assert not left, f"processes left on the hosts after the test: {left}"


@pytest.fixture
def job_env(tmp_path):
    """The environment a user's shell would give ``deepspeed``: a private HOME (no stray
    ~/.deepspeed_env), the repository on PYTHONPATH (forwarded to the nodes, as PYTHON*
    variables are), and OpenMPI's consent to run as root (the bed's sshd logs in as root)."""
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), PYTHONPATH=REPO, DEEPSPEED_KILL_GRACE_S="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("DS_ENV_FILE", None)
    return env
