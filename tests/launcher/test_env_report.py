"""``ds_report`` runs as a console script and reports what it measures."""
import json
import os
import platform
import subprocess
import sys

import torch
import torch.distributed as dist

import deepspeed
from deepspeed import env_report

DS_REPORT = os.path.join(os.path.dirname(sys.executable), "ds_report")


def test_ds_report_cli_prints_versions_and_table():
    res = subprocess.run([DS_REPORT], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert f"torch version ............ {torch.__version__}" in out
    assert f"deepspeed version ........ {deepspeed.__version__}" in out
    assert f"python version ........... {platform.python_version()}" in out
    assert f"gloo={'yes' if dist.is_gloo_available() else 'no'}" in out
    assert "features usable on this machine:" in out and "ZeRO stage 0" in out


def test_ds_report_json_matches_independent_probes():
    res = subprocess.run([DS_REPORT, "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["versions"]["torch"] == torch.__version__
    assert data["comm_backends"] == {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                                     "mpi": dist.is_mpi_available()}
    expected_devices = torch.cuda.device_count() if torch.cuda.is_available() else 1
    assert data["accelerator"]["device_count"] == expected_devices
    rows = {r["feature"]: r for r in data["features"]}
    # The engine module is importable in this checkout, so that row must say usable;
    # compiled kernels are never built by this implementation.
    assert rows["fp32 training (engine)"]["usable"] is True
    assert rows["custom compiled kernels"]["usable"] is False


def test_feature_rows_follow_imports(monkeypatch):
    """A row is usable exactly when its code imports."""
    good = env_report._import_probe("json:dumps")
    bad = env_report._import_probe("json:no_such_function")
    missing = env_report._import_probe("deepspeed.no_such_module")
    assert good()[0] is True
    assert bad() == (False, "json:no_such_function is not available (AttributeError: module 'json' has no "
                            "attribute 'no_such_function')")
    assert missing()[0] is False and "ModuleNotFoundError" in missing()[1]
    monkeypatch.setattr(env_report, "feature_probes", lambda: [("x", good), ("y", missing),
                                                               ("z", lambda: 1 / 0)])
    rows = env_report.feature_table()
    assert [(r["feature"], r["usable"]) for r in rows] == [("x", True), ("y", False), ("z", False)]
    assert rows[2]["note"].startswith("probe failed: ZeroDivisionError")
