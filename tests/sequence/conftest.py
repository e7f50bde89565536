import pytest

from tests.helpers.dist import run_distributed


@pytest.fixture(scope="package")
def sp2_world(tmp_path_factory):
    """The fast checks of tests/sequence share one spawned world of 2 ranks (sp=2):
    (per-rank results, the checkpoint directory written at sp=2, ZeRO-3)."""
    from tests.sequence.test_sequence_parallel import combined_body
    ckpt = str(tmp_path_factory.mktemp("sp_ckpt"))
    return run_distributed(combined_body, world_size=2, args=(ckpt,), timeout=300), ckpt
