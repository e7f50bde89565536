"""``import deepspeed`` stays cheap (every rank, launcher and subprocess test pays it), and what it
defers still works on first touch. One fresh interpreter runs every check, so that nothing the
test process imported earlier hides an eager import (benchmarks/import_time.py has the timings).

Deferred at import, loaded on first use:
* the engine module (``deepspeed.runtime.engine`` is a lazy module; ``deepspeed.DeepSpeedEngine``
  a lazy name) with its parts: monitors, checkpoint save/load, the strategy factory;
* the optimizer packages ``deepspeed.ops.adam/adagrad/lamb/lion``;
* hjson (only for a config file that is not plain JSON);
* the pydantic schemas of the config models (``defer_build``: built on first validation).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_PROBE = r'''
import json, sys, tempfile, os
import torch
import deepspeed
out = {}
heavy = ["deepspeed.runtime.engine_monitor", "deepspeed.monitor", "deepspeed.runtime.strategy_factory",
         "deepspeed.runtime.checkpoint.engine_checkpoint", "deepspeed.ops.adam", "deepspeed.ops.adagrad",
         "deepspeed.ops.lamb", "deepspeed.ops.lion", "hjson"]
out["loaded_at_import"] = [m for m in heavy if m in sys.modules]
eng = sys.modules.get("deepspeed.runtime.engine")
# any attribute of a LazyLoader module (even __dict__) runs it: look at its type only
out["engine_placeholder"] = eng is not None and type(eng).__name__ == "_LazyModule"
from deepspeed.config.ds_config import DeepSpeedConfigModel
out["schema_built_at_import"] = bool(DeepSpeedConfigModel.__pydantic_complete__)

# first touch: the engine class, reached both documented ways, is the real nn.Module subclass
E = deepspeed.runtime.engine.DeepSpeedEngine
out["engine_same"] = E is deepspeed.DeepSpeedEngine and issubclass(E, torch.nn.Module)
out["engine_loaded_parts"] = all(m in sys.modules for m in heavy[:4])

# the optimizer packages resolve on first touch to the classes their modules define (constructing
# one is left to tests/ops: torch.optim.Optimizer.__init__ imports torch._dynamo, ~1.5 s)
from deepspeed.ops.adam.fused_adam import FusedAdam as _FA
from deepspeed.ops.lion.lion import FusedLion as _FL
out["ops_same"] = (deepspeed.ops.adam.FusedAdam is _FA and deepspeed.ops.lion.FusedLion is _FL
                   and issubclass(_FA, torch.optim.Optimizer)
                   and "adam" in dir(deepspeed.ops) and "deepspeed.ops.lamb" not in sys.modules)
out["lamb_via_attribute"] = deepspeed.ops.lamb.FusedLamb.__module__

# config validation after deferred schema build: same readable error, then the schema exists
try:
    deepspeed.DeepSpeedConfig({"train_batch_size": 4, "train_micro_batch_sizee_per_gpu": 2}, world_size=1)
    out["config_error"] = None
except deepspeed.DeepSpeedConfigError as err:
    out["config_error"] = str(err)
out["schema_built_after_use"] = bool(DeepSpeedConfigModel.__pydantic_complete__)

# an hjson config file (a comment, unquoted string) still loads, importing hjson then
d = tempfile.mkdtemp()
path = os.path.join(d, "ds.hjson")
with open(path, "w") as f:
    f.write("{\n  # hjson comment\n  train_batch_size: 8\n  optimizer: {\n    type: Adam\n  }\n}\n")
out["hjson_cfg"] = deepspeed.config.load_config_source(path)
out["hjson_loaded"] = "hjson" in sys.modules
print(json.dumps(out))
'''


def test_import_defers_heavy_parts_and_they_work_on_first_use():
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded_at_import"] == [], f"import deepspeed loaded these eagerly again: {out['loaded_at_import']}"
    assert out["engine_placeholder"], "deepspeed.runtime.engine should be present but not yet executed"
    assert out["schema_built_at_import"] is False
    assert out["engine_same"] and out["engine_loaded_parts"]
    assert out["ops_same"] and out["lamb_via_attribute"] == "deepspeed.ops.lamb.fused_lamb"
    assert out["config_error"] is not None and "train_micro_batch_sizee_per_gpu" in out["config_error"] \
        and "train_micro_batch_size_per_gpu" in out["config_error"], out["config_error"]
    assert out["schema_built_after_use"] is True
    assert out["hjson_cfg"] == {"train_batch_size": 8, "optimizer": {"type": "Adam"}}
    assert out["hjson_loaded"] is True
