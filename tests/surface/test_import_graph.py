"""The package's import graph stays a tree (DESIGN.md: "the import graph stays a tree"), and the
registries that keep it one are filled by the features that plug into them.

The circle count comes from the project's shared tool (``../shared/tools/import_cycles.py``,
beside the repository), which reads every file with ``ast`` and counts imports inside
functions too."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO.parent / "shared" / "tools" / "import_cycles.py"


@pytest.mark.skipif(not TOOL.is_file(), reason=f"the shared import-cycle tool is not at {TOOL} "
                                               f"(it lives beside the repository, in shared/tools/)")
def test_no_import_circles():
    out = subprocess.run([sys.executable, str(TOOL), "deepspeed"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    m = re.match(r"(\d+) import circle\(s\) in deepspeed/ \((\d+) files\)", last)
    assert m, f"unexpected last line from {TOOL.name}: {last!r}"
    assert int(m.group(2)) > 100, last  # it really read the package
    assert int(m.group(1)) == 0, "import circles (fix the layering, see DESIGN.md):\n" + out.stdout


def test_features_register_with_the_lower_layer():
    # MoE's per-expert checkpoint files: registered by importing deepspeed.moe (as any MoE model does)
    from deepspeed.runtime.checkpoint import module_parts
    import deepspeed.moe  # noqa: F401
    from deepspeed.moe.checkpoint import merge_local_experts, split_and_save_experts
    part = module_parts._PARTS["moe_experts"]
    assert (part.split, part.merge) == (split_and_save_experts, merge_local_experts)
    # DeepSpeed's own checkpoint layout: registered with the fragment index by the checkpoint package
    from deepspeed.runtime.checkpoint import deepspeed_native, universal
    assert deepspeed_native._rank_states_if_native in universal._FOREIGN_READERS
    # a directory that is not DeepSpeed's: the native reader declines, the index reads our own format
    assert deepspeed_native._rank_states_if_native(str(REPO / "docs"), 0) is None


def test_moved_names_keep_their_documented_paths():
    from deepspeed.accelerator import SUPPORTED_ACCELERATOR_LIST, get_accelerator, is_current_accelerator_supported
    from deepspeed.accelerator.real_accelerator import is_current_accelerator_supported as f
    from deepspeed.monitor.base import Monitor as BaseMonitor
    from deepspeed.monitor.monitor import Monitor, MonitorMaster
    from deepspeed.runtime import lr_schedule_names
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES, WARMUP_LR, add_tuning_arguments
    from deepspeed.runtime.swap_tensor import swapper_from_config
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper
    import deepspeed
    from deepspeed import _version, git_version_info
    assert f is is_current_accelerator_supported and "cpu" in SUPPORTED_ACCELERATOR_LIST
    assert is_current_accelerator_supported() is (get_accelerator().device_name().split(":")[0]
                                                  in SUPPORTED_ACCELERATOR_LIST)
    assert Monitor is BaseMonitor and issubclass(MonitorMaster, Monitor)
    assert VALID_LR_SCHEDULES is lr_schedule_names.VALID_LR_SCHEDULES and WARMUP_LR == "WarmupLR"
    assert callable(add_tuning_arguments) and callable(swapper_from_config) and isinstance(OptimizerSwapper, type)
    assert deepspeed.__version__ == _version.__version__ == git_version_info.version == deepspeed.version
