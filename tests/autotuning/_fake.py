"""A stand-in experiment runner for the autotuner's search logic: no process is started;
each experiment's "measurement" is a known function of its config."""
import json
import os

from deepspeed.autotuning.autotuner import Autotuner
from deepspeed.launcher import runner as dsrun


class FakeRunner:
    """``metric(cfg) -> float``; ``fails(cfg) -> error str or None``. Records what ran."""

    def __init__(self, metric, fails=None, model_info=None):
        self.metric, self.fails, self.model_info = metric, fails or (lambda cfg: None), model_info
        self.ran = []

    def __call__(self, exp):
        cfg = exp["ds_config"]
        self.ran.append(exp["name"])
        if exp["name"] == "profile_model_info":
            return dict(self.model_info), None
        err = self.fails(cfg)
        if err:
            return None, err
        v = self.metric(cfg)
        return {"throughput": v, "latency": 1000.0 / v, "flops": 10 * v}, None


def make_autotuner(tmp_path, ds_config, runner, num_slots=2, extra_args=()):
    ds_config = json.loads(json.dumps(ds_config))
    at = ds_config.setdefault("autotuning", {})
    at.setdefault("enabled", True)
    at.setdefault("results_dir", os.path.join(tmp_path, "autotuning_results"))
    at.setdefault("exps_dir", os.path.join(tmp_path, "autotuning_exps"))
    os.makedirs(tmp_path, exist_ok=True)
    path = os.path.join(tmp_path, "ds_config.json")
    with open(path, "w") as f:
        json.dump(ds_config, f)
    args = dsrun.parse_args(list(extra_args) + ["--autotuning", "tune", "train.py", "--deepspeed_config", path])
    return Autotuner(args, {"localhost": list(range(num_slots))}, runner=runner)
