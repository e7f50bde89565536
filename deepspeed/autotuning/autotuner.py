"""The autotuner: finds the fastest ZeRO stage, micro-batch size and ZeRO knobs that fit.

``deepspeed --autotuning tune|run script.py --deepspeed_config ds_config.json`` builds an
:class:`Autotuner` from the launcher's arguments and resources and calls, in order,
``tune()``, ``print_tuning_results()``, ``write_optimal_config()`` and, for ``run``,
``run_after_tuning()`` (DeepSpeed's sequence, ``runner.run_autotuning``).

The search (``tune``):

1. **Model info** - from ``autotuning.model_info`` when it gives ``num_params`` and
   ``activation_mem_per_gpu``, else one profile run (``profile_model_info``) of the
   user's script at micro-batch 1 that records the parameter count and the bytes the
   forward saves for backward (``engine_hook.py``).
2. **Prune** - for each ZeRO stage the user allows (``zero_optimization.stage``: a number,
   a list, or ``"all"``), the model-state bytes per rank
   (:meth:`get_instantiation_memory_required_per_gpu`) plus one sample's activations must
   fit the memory per rank; a stage that does not is recorded as pruned, never run.
3. **Micro-batch size** - the largest size that fits by that estimate (capped by
   ``max_train_micro_batch_size_per_gpu`` and ``max_train_batch_size``) runs first; if it
   fails (out of memory, crash, timeout) the size is halved until one runs. Then
   ``num_tuning_micro_batch_sizes`` sizes spread from ``min_train_micro_batch_size_per_gpu``
   up to it are measured and the stage's best is kept.
4. **ZeRO knobs** (not in ``fast`` mode, stages 1-3) - the stage's tuning space
   (``constants.DEFAULT_TUNING_SPACES``, or lists the user wrote in
   ``zero_optimization``) at the stage's best micro-batch size, searched by
   ``tuner_type`` (gridsearch / random / model_based) within ``tuner_num_trials`` and
   ``tuner_early_stopping``.

Every experiment is a short run of the user's script (``scheduler.ResourceManager``)
that stops itself after ``end_profile_step`` and reports ``latency``/``throughput``/
``flops``; a failed one is recorded and skipped. The best by ``metric`` wins.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import time
from typing import Dict, List, Optional

from ..config.ds_config import load_config_source
from ..config.errors import DeepSpeedConfigError
from ..utils.logging import logger
from .config import DeepSpeedAutotuningConfig
from .constants import (AUTOTUNING, AUTOTUNING_TUNER_GRIDSEARCH, AUTOTUNING_TUNER_MODELBASED,
                        AUTOTUNING_TUNER_RANDOM, DEFAULT_EXPERIMENT_TIMEOUT, DEFAULT_MIN_MEM_CONFIG,
                        DEFAULT_TUNING_SPACES, GLOBAL_TUNING_SPACE, GRADIENT_ACCUMULATION_STEPS,
                        PROFILE_EXP_NAME, TRAIN_BATCH_SIZE,
                        TRAIN_MICRO_BATCH_SIZE_PER_GPU, TUNING_MICRO_BATCH_SIZE_PREFIX, ZERO_OPTIMIZATION)
from .scheduler import RESULT_FILE, ResourceManager, _user_config_index, metric_is_better
from .tuner import GridSearchTuner, ModelBasedTuner, RandomTuner
from .utils import (canonical_name, get_all_configs, get_tuning_keys, get_val_by_key, memory_to_string,
                    number_to_string, write_experiments)

#: Bytes of optimizer state per trainable parameter, by optimizer type (Adam-like: two fp32 moments).
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "onebitadam": 8, "zerooneadam": 8, "onebitlamb": 8,
                         "lion": 4, "sgd": 4, "adagrad": 4, "muadam": 8, "muadamw": 8}


class AutotuningError(RuntimeError):
    """The search cannot go on (no config file, failed profile run, nothing fits)."""


def _get_user_config(user_args: List[str]) -> Optional[dict]:
    idx = _user_config_index(list(user_args or []))
    if idx is None:
        return None
    path = user_args[idx]
    if not os.path.isfile(path):
        raise AutotuningError(f"autotuning: the DeepSpeed config file {path!r} does not exist")
    return load_config_source(path)   # JSON or hjson (comments), as the engine reads it


class Autotuner:
    """``args``: the launcher's parsed arguments; ``active_resources``: host -> slot ids."""

    def __init__(self, args, active_resources, experiment_timeout: float = DEFAULT_EXPERIMENT_TIMEOUT,
                 runner=None):
        self.args = args
        self.user_config = _get_user_config(getattr(args, "user_args", []))
        if self.user_config is None:
            raise AutotuningError("autotuning needs the script's DeepSpeed config: pass it as "
                                  "'--deepspeed_config ds_config.json' (or '--deepspeed ds_config.json') after "
                                  "the script name")
        self.autotuning_config = DeepSpeedAutotuningConfig(self.user_config)
        self.exps_dir = self.autotuning_config.exps_dir
        self.results_dir = self.autotuning_config.results_dir
        self.rm = self._get_resource_manager(active_resources, experiment_timeout, runner)
        self.exp_num_nodes, self.exp_num_gpus = self._get_exp_resources(args)
        if self.exp_num_gpus > self.rm.num_gpus_per_node:
            raise AutotuningError(f"autotuning: --num_gpus {self.exp_num_gpus} exceeds the "
                                  f"{self.rm.num_gpus_per_node} slots per node available")
        if self.exp_num_nodes > len(self.rm.nodes):
            raise AutotuningError(f"autotuning: --num_nodes {self.exp_num_nodes} exceeds the "
                                  f"{len(self.rm.nodes)} nodes available")
        self.records: List[dict] = []           # every experiment, in run order
        self.pruned: Dict[int, str] = {}        # stage -> why it was not run
        given = self.autotuning_config.model_info or {}
        complete = "num_params" in given and ("activation_mem_per_gpu" in given or "activation_mem_per_sample" in given)
        #: from autotuning.model_info when it is complete, else measured by the profile run in tune()
        self.model_info: Optional[dict] = dict(given) if complete else None
        self.gpu_mem: Optional[float] = None    # bytes per rank; measured in tune() unless set
        self.optimal_cmd: Optional[List[str]] = None
        self.optimal_ds_config: Optional[dict] = None
        self.start_time = None
        self._planned = 0
        self.rm.on_finish = self._on_finish

    # ------------------------------------------------------------------ setup
    def _get_resource_manager(self, active_resources, timeout, runner) -> ResourceManager:
        if not active_resources:
            raise AutotuningError("autotuning: no resources (hosts/slots) to run experiments on")
        hosts = list(active_resources.keys())
        ngpus = min(len(v) for v in active_resources.values())
        if ngpus < 1:
            raise AutotuningError("autotuning: a host in the active resources has no slots")
        return ResourceManager(args=self.args, hosts=hosts, num_gpus_per_node=ngpus, results_dir=self.results_dir,
                               exps_dir=self.exps_dir, arg_mappings=self.autotuning_config.arg_mappings,
                               timeout=timeout, runner=runner)

    def _get_exp_resources(self, args):
        num_nodes = args.num_nodes if getattr(args, "num_nodes", -1) > 0 else len(self.rm.nodes)
        num_gpus = args.num_gpus if getattr(args, "num_gpus", -1) > 0 else self.rm.num_gpus_per_node
        return num_nodes, num_gpus

    def _prepare_dirs(self) -> None:
        cfg = self.autotuning_config
        for d in (self.exps_dir, self.results_dir):
            if cfg.overwrite and os.path.isdir(d):
                shutil.rmtree(d)
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as err:
                raise AutotuningError(f"autotuning: cannot create {d!r} ({err}); check autotuning.results_dir/"
                                      "exps_dir (every node must be able to write it)") from None
        if not cfg.overwrite:
            old = [n for n in sorted(os.listdir(self.results_dir))
                   if os.path.exists(os.path.join(self.results_dir, n, RESULT_FILE))]
            if old:
                logger.info(f"autotuning: {len(old)} earlier experiment record(s) in {self.results_dir} are kept "
                            "(autotuning.overwrite is false): an experiment whose config matches a record is not "
                            "run again. Set autotuning.overwrite to true to start over.")

    # ------------------------------------------------------------------ settings
    def metric(self) -> str:
        return self.autotuning_config.metric

    def fast_enabled(self) -> bool:
        return self.autotuning_config.fast

    def mp_size(self) -> int:
        return self.autotuning_config.mp_size

    def dp_size(self) -> int:
        return max(1, self.exp_num_gpus * self.exp_num_nodes // self.mp_size())

    def gas(self) -> int:
        g = self.user_config.get(GRADIENT_ACCUMULATION_STEPS, 1)
        return g if isinstance(g, int) and g > 0 else 1

    def precision_bytes(self) -> int:
        half = any(isinstance(self.user_config.get(k), dict) and self.user_config[k].get("enabled")
                   for k in ("fp16", "bf16", "bfloat16"))
        return 2 if half else 4

    def max_train_micro_batch_size_per_gpu(self) -> int:
        cap = self.autotuning_config.max_train_micro_batch_size_per_gpu
        mtbs = self.autotuning_config.max_train_batch_size
        if mtbs is not None:
            cap = min(cap, mtbs // (self.gas() * self.dp_size()))
        return cap

    def min_train_micro_batch_size_per_gpu(self) -> int:
        return self.autotuning_config.min_train_micro_batch_size_per_gpu

    def user_zero_stages(self) -> List[int]:
        stage = self.user_config.get(ZERO_OPTIMIZATION, {}).get("stage", 0)
        stages = [0, 1, 2, 3] if stage == "all" else (stage if isinstance(stage, list) else [stage])
        bad = [s for s in stages if s not in (0, 1, 2, 3)]
        if bad or not stages:
            raise DeepSpeedConfigError(f"autotuning: zero_optimization.stage must be 0-3, a list of them, or "
                                       f"\"all\"; got {stage!r}")
        return sorted(set(stages))

    # ------------------------------------------------------------------ memory model
    def get_model_num_params(self) -> int:
        return int(self.model_info.get("trainable_num_params", self.model_info["num_params"]))

    def get_activation_memory_per_gpu(self) -> float:
        """Bytes of activations per sample of micro-batch on one rank."""
        info = self.model_info
        if "activation_mem_per_sample" in info:
            return float(info["activation_mem_per_sample"])
        return float(info.get("activation_mem_per_gpu", 0)) / max(1, info.get("train_micro_batch_size_per_gpu", 1))

    def get_gpu_memory_info(self) -> float:
        """Memory per rank: the device's total memory; on CPU, where the ranks of a node share
        host memory, the available host memory divided by the ranks per node."""
        from ..accelerator import get_accelerator
        acc = get_accelerator()
        if acc.device_name() == "cpu":
            return acc.available_memory() / max(1, self.exp_num_gpus)
        return acc.total_memory()

    def get_instantiation_memory_required_per_gpu(self, zero_stage: int) -> float:
        """Model-state bytes per rank (parameters, gradients, optimizer state) for a stage, as
        this implementation allocates them (``runtime/zero/estimators.py``): with Ψ trainable
        parameters, N data-parallel ranks, p bytes per parameter and gradient (2 in fp16/bf16,
        4 in fp32) and s optimizer bytes per parameter (Adam: 8 for the moments, plus 4 for the
        fp32 master copy in mixed precision): stage 0 pΨ + pΨ + sΨ; stage 1 divides the
        optimizer state by N; stage 2 also the gradients; stage 3 also the parameters."""
        psi, n, p = self.get_model_num_params(), self.dp_size(), self.precision_bytes()
        opt_type = str((self.user_config.get("optimizer") or {}).get("type", "adam")).lower()
        s = OPTIMIZER_STATE_BYTES.get(opt_type, 8) + (4 if p == 2 else 0)
        params, grads, optim = p * psi, p * psi, s * psi
        if zero_stage >= 1:
            optim /= n
        if zero_stage >= 2:
            grads /= n
        if zero_stage >= 3:
            params /= n
        return params + grads + optim

    def max_micro_batch_size_that_fits(self, stage: int) -> int:
        free = self.gpu_mem - self.get_instantiation_memory_required_per_gpu(stage)
        act = self.get_activation_memory_per_gpu()
        by_mem = int(free // act) if act > 0 else sys.maxsize
        return min(by_mem, self.max_train_micro_batch_size_per_gpu())

    # ------------------------------------------------------------------ experiments
    def _exp_config(self, stage: int, mbs: int, knobs: Optional[dict] = None) -> dict:
        cfg = copy.deepcopy(self.user_config)
        cfg.pop(TRAIN_BATCH_SIZE, None)   # derived from the micro-batch size, gas and the ranks
        cfg[TRAIN_MICRO_BATCH_SIZE_PER_GPU] = mbs
        cfg[GRADIENT_ACCUMULATION_STEPS] = self.gas()
        zo = {k: v for k, v in (cfg.get(ZERO_OPTIMIZATION) or {}).items() if not isinstance(v, list)}
        zo.update(knobs or {})
        zo["stage"] = stage
        cfg[ZERO_OPTIMIZATION] = zo
        a = self.autotuning_config
        cfg[AUTOTUNING] = {"enabled": True, "metric": a.metric, "start_profile_step": a.start_profile_step,
                           "end_profile_step": a.end_profile_step}
        return cfg

    def _exp(self, name: str, ds_config: dict, **extra) -> dict:
        return dict(name=name, ds_config=ds_config, num_gpus=self.exp_num_gpus, num_nodes=self.exp_num_nodes,
                    **extra)

    def _run_exps(self, exps: List[dict]) -> List[dict]:
        self.rm.schedule_experiments(write_experiments(exps, self.exps_dir))
        self.rm.run()
        done = [exp for _, (exp, _) in sorted(self.rm.finished_experiments.items())]
        self.rm.clear()
        return done

    def _metric_of(self, exp: dict):
        if exp.get("error"):
            return None
        return (exp.get("results") or {}).get(self.metric())

    def _on_finish(self, exp, metrics, err) -> None:
        val = None if err else (metrics or {}).get(self.metric())
        rec = {"name": exp["name"], "space": exp.get("space"), "stage": exp.get("stage"), "mbs": exp.get("mbs"),
               "metric_val": val, "error": err, "results": metrics, "ds_config": exp["ds_config"],
               "result_dir": exp["result_dir"], "duration_s": exp.get("duration_s")}
        if exp["name"] == PROFILE_EXP_NAME:
            print(f"[autotuning] model-info profile run: {'FAILED (' + err + ')' if err else 'done'}", flush=True)
            return
        self.records.append(rec)
        best = self.get_best_record()
        k = len(self.records)
        status = f"{self.metric()}={val:.4g}" if val is not None else f"FAILED ({err})"
        best_s = f"{best['metric_val']:.4g} ({best['name']})" if best else "none yet"
        print(f"[autotuning] experiment {k} of at most {self._planned}: {exp['name']}: {status}; "
              f"best so far: {best_s}", flush=True)

    # ------------------------------------------------------------------ the search
    def model_info_profile_run(self) -> dict:
        """The model's parameter count and activation bytes (from the config, else measured)."""
        if self.model_info is not None:
            return self.model_info
        result_dir = os.path.join(self.results_dir, PROFILE_EXP_NAME)
        info_path = os.path.join(result_dir, "model_info.json")
        cfg = self._exp_config(0, 1)
        cfg.update(copy.deepcopy({k: v for k, v in DEFAULT_MIN_MEM_CONFIG.items() if k != ZERO_OPTIMIZATION}))
        cfg[AUTOTUNING].update({"model_info": {"profile": True}, "model_info_path": info_path})
        exp = self._exp(PROFILE_EXP_NAME, cfg, expect_file=info_path, space="profile")
        done = self._run_exps([exp])[0]
        if done.get("error"):
            raise AutotuningError(f"autotuning: the model-info profile run failed: {done['error']} (its logs are in "
                                  f"{result_dir}); fix the script or give autotuning.model_info.num_params and "
                                  "activation_mem_per_gpu in the config")
        if done.get("results") is None and os.path.exists(info_path):
            with open(info_path) as fd:
                done["results"] = json.load(fd)
        return done["results"]

    def tuning_micro_batch_sizes(self, lo: int, hi: int) -> List[int]:
        """``num_tuning_micro_batch_sizes`` sizes from ``lo`` to ``hi`` (both included), evenly spaced."""
        n = self.autotuning_config.num_tuning_micro_batch_sizes
        if hi <= lo or n <= 1:
            return [hi]
        step = (hi - lo) / (n - 1)
        return sorted({int(round(lo + i * step)) for i in range(n)})

    def _plan_size(self, stages: List[int]) -> int:
        """The most experiments the search can run (the progress line's "of at most")."""
        lo, n = self.min_train_micro_batch_size_per_gpu(), 0
        for st in stages:
            hi = self.max_micro_batch_size_that_fits(st)
            if hi < lo:
                continue
            halvings = 1
            while hi > lo:
                hi, halvings = max(lo, hi // 2), halvings + 1
            n += halvings + self.autotuning_config.num_tuning_micro_batch_sizes - 1
            if not self.fast_enabled() and st > 0:
                n += min(self.autotuning_config.tuner_num_trials, len(get_all_configs(self.tuning_space(st))))
        return n

    def tuning_space(self, stage: int) -> dict:
        """The stage's knobs: DeepSpeed's defaults, with lists the user wrote in zero_optimization."""
        space = copy.deepcopy(DEFAULT_TUNING_SPACES[stage])
        for k, v in (self.user_config.get(ZERO_OPTIMIZATION) or {}).items():
            if isinstance(v, list) and k != "stage":
                space[ZERO_OPTIMIZATION][k] = v
        return space

    def tune(self) -> None:
        """Run the search; the results are in ``self.records`` and on disk."""
        self.start_time = time.time()
        self._prepare_dirs()
        stages = self.user_zero_stages()
        lo = self.min_train_micro_batch_size_per_gpu()
        if self.max_train_micro_batch_size_per_gpu() < lo:
            raise AutotuningError(
                f"autotuning: no micro-batch size satisfies min_train_micro_batch_size_per_gpu={lo} and "
                f"max_train_batch_size={self.autotuning_config.max_train_batch_size} with "
                f"gradient_accumulation_steps={self.gas()} on {self.dp_size()} data-parallel rank(s) "
                f"(max micro-batch {self.max_train_micro_batch_size_per_gpu()}); raise max_train_batch_size or "
                "lower min_train_micro_batch_size_per_gpu")
        if self.fast_enabled():
            logger.info("autotuning: fast mode: tuning the ZeRO stage and micro-batch size only")
        self.model_info = self.model_info_profile_run()
        if self.gpu_mem is None:
            self.gpu_mem = self.get_gpu_memory_info()
        self._planned = self._plan_size(stages)
        print(f"[autotuning] model: {number_to_string(self.get_model_num_params())} trainable parameters, "
              f"{memory_to_string(self.get_activation_memory_per_gpu())} activations per sample; memory per rank "
              f"{memory_to_string(self.gpu_mem)}; stages {stages}", flush=True)
        for stage in stages:
            need = self.get_instantiation_memory_required_per_gpu(stage) + lo * self.get_activation_memory_per_gpu()
            if need > self.gpu_mem:
                self.pruned[stage] = (f"needs {memory_to_string(need)} per rank at micro-batch {lo}, more than the "
                                      f"{memory_to_string(self.gpu_mem)} available")
                print(f"[autotuning] ZeRO stage {stage} pruned: {self.pruned[stage]}", flush=True)
                continue
            self.tune_space(stage)
        if self.get_best_record() is None:
            logger.error("autotuning: no experiment succeeded; see the stderr.log of each experiment in "
                         f"{self.results_dir}")

    def tune_space(self, stage: int) -> Optional[dict]:
        """Tune one stage; returns its best record (``None`` when nothing ran)."""
        space_name = f"{TUNING_MICRO_BATCH_SIZE_PREFIX}{stage}"
        lo, hi = self.min_train_micro_batch_size_per_gpu(), self.max_micro_batch_size_that_fits(stage)
        # 1. the largest micro-batch size that runs: the estimate first, halving on failure
        if hi < lo:
            self.pruned[stage] = f"the largest micro-batch size that fits by the estimate ({hi}) is below {lo}"
            return None
        max_ok, mbs = None, hi
        while True:
            exp = self._run_exps([self._exp(f"{space_name}_mbs{mbs}", self._exp_config(stage, mbs), stage=stage,
                                            mbs=mbs, space=space_name)])[0]
            if self._metric_of(exp) is not None:
                max_ok = mbs
                break
            if mbs == lo:
                break
            mbs = max(lo, mbs // 2)
        if max_ok is None:
            self.pruned[stage] = f"no micro-batch size from {hi} down to {lo} ran"
            return None
        # 2. the sizes around it
        sizes = [m for m in self.tuning_micro_batch_sizes(lo, max_ok) if m != max_ok]
        if sizes:
            self._run_exps([self._exp(f"{space_name}_mbs{m}", self._exp_config(stage, m), stage=stage, mbs=m,
                                      space=space_name) for m in sizes])
        best = self.get_best_record(space_name)
        # 3. the stage's knobs at its best micro-batch size
        space = self.tuning_space(stage)
        keys = get_tuning_keys(space)
        if self.fast_enabled() or stage == 0 or not keys:
            return best
        best_mbs = best["mbs"]
        knob_space = f"{space_name}_knobs"
        exps = []
        for c in get_all_configs(space):
            knobs = {k: v for k, v in c[ZERO_OPTIMIZATION].items() if k != "stage"}
            name = canonical_name(c, keys, prefix=f"{space_name}_mbs{best_mbs}")
            exps.append(self._exp(name, self._exp_config(stage, best_mbs, knobs), stage=stage, mbs=best_mbs,
                                  space=knob_space))
        tuner = self._make_tuner(exps, space)
        a = self.autotuning_config
        tuner.tune(sample_size=1, n_trials=a.tuner_num_trials, early_stopping=a.tuner_early_stopping)
        self.tuner = tuner
        return self.get_best_record(space_name)

    def _make_tuner(self, exps, space):
        kind = self.autotuning_config.tuner_type
        if kind == AUTOTUNING_TUNER_GRIDSEARCH:
            return GridSearchTuner(exps, self.rm, self.metric())
        if kind == AUTOTUNING_TUNER_RANDOM:
            return RandomTuner(exps, self.rm, self.metric(), seed=0)
        if kind == AUTOTUNING_TUNER_MODELBASED:
            return ModelBasedTuner(exps, self.rm, self.metric(), space)
        raise DeepSpeedConfigError(f"autotuning.tuner_type {kind!r}: use gridsearch, random or model_based")

    # ------------------------------------------------------------------ results
    def get_best_record(self, space_prefix: Optional[str] = None) -> Optional[dict]:
        """The best successful record by the metric (of the spaces starting with ``space_prefix``;
        all when None): the choice is always the best measured."""
        best = None
        for r in self.records:
            if r["metric_val"] is None:
                continue
            if space_prefix is not None and not (r["space"] or "").startswith(space_prefix):
                continue
            if best is None or metric_is_better(r["metric_val"], best["metric_val"], self.metric()):
                best = r
        return best

    def get_best_space_records(self) -> Dict[str, tuple]:
        """space name -> (best record, its metric value, experiments in the space); plus ``global``."""
        out = {}
        for r in self.records:
            space = r["space"]
            best, val, n = out.get(space, (None, None, 0))
            if r["metric_val"] is not None and metric_is_better(r["metric_val"], val, self.metric()):
                best, val = r, r["metric_val"]
            out[space] = (best, val, n + 1)
        g = self.get_best_record()
        out[GLOBAL_TUNING_SPACE] = (g, g["metric_val"] if g else None, len(self.records))
        return out

    def summary_table(self) -> str:
        rows = [("tuning_space", "num_experiments", f"best_{self.metric()}", "best_exp_name")]
        for space, (best, val, n) in self.get_best_space_records().items():
            rows.append((space, str(n), f"{val:.6g}" if val is not None else "-", best["name"] if best else "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
        exps = ["", "experiments:"]
        for r in self.records:
            st = f"{self.metric()}={r['metric_val']:.6g}" if r["metric_val"] is not None else f"FAILED: {r['error']}"
            exps.append(f"  {r['name']}: {st}")
        for stage, why in sorted(self.pruned.items()):
            exps.append(f"  ZeRO stage {stage} not tuned: {why}")
        return "\n".join(lines + exps)

    def print_tuning_results(self) -> None:
        summary = self.summary_table()
        best = self.get_best_record()
        took = time.time() - self.start_time if self.start_time else 0.0
        tail = (f"\n\nTuning completed in {took:.1f} s. Total number of experiments: {len(self.records)}."
                + (f" Best: {best['name']} ({self.metric()} = {best['metric_val']:.6g})." if best else
                   " No experiment succeeded."))
        print(summary + tail, flush=True)
        os.makedirs(self.results_dir, exist_ok=True)
        with open(os.path.join(self.results_dir, "summary.txt"), "w") as fd:
            fd.write(summary + tail + "\n")

    def optimal_command(self, ds_config_path: str) -> List[str]:
        """The ``deepspeed`` command that trains the user's script with ``ds_config_path``."""
        a = self.args
        user_args = list(a.user_args)
        user_args[_user_config_index(user_args)] = ds_config_path
        for key, flag in self.rm.arg_mappings.items():
            val = get_val_by_key(self.optimal_ds_config, key)
            if val is None or str(val) == "auto":
                continue
            if flag in user_args and user_args.index(flag) + 1 < len(user_args):
                user_args[user_args.index(flag) + 1] = str(val)
            else:
                user_args += [flag, str(val)]
        launcher = [sys.executable, "-m", "deepspeed.launcher.runner"]
        for flag in ("hostfile", "include", "exclude"):
            if getattr(a, flag, None):
                launcher += [f"--{flag}", str(getattr(a, flag))]
        for flag in ("num_nodes", "num_gpus"):
            if getattr(a, flag, -1) > 0:
                launcher += [f"--{flag}", str(getattr(a, flag))]
        launcher += ["--master_port", str(getattr(a, "master_port", 29500))]
        for flag in ("module", "no_python", "no_local_rank"):
            if getattr(a, flag, False):
                launcher.append(f"--{flag}")
        return launcher + [a.user_script] + user_args

    def write_optimal_config(self) -> Optional[str]:
        """Write ``results_dir/ds_config_optimal.json`` (the best experiment's config without the
        ``autotuning`` section) and ``cmd_optimal.txt``; returns the config's path."""
        best = self.get_best_record()
        if best is None:
            logger.info("autotuning: no optimal configuration: no experiment succeeded")
            return None
        ds_config = copy.deepcopy(best["ds_config"])
        ds_config.pop(AUTOTUNING, None)
        self.optimal_ds_config = ds_config
        path = os.path.join(self.results_dir, "ds_config_optimal.json")
        with open(path, "w") as fd:
            json.dump(ds_config, fd, indent=2)
        self.optimal_cmd = self.optimal_command(os.path.abspath(path))
        with open(os.path.join(self.results_dir, "cmd_optimal.txt"), "w") as fd:
            fd.write(" ".join(self.optimal_cmd) + "\n")
        print(f"[autotuning] wrote the optimal configuration ({best['name']}) to {path} and its command to "
              f"{os.path.join(self.results_dir, 'cmd_optimal.txt')}", flush=True)
        return path

    def run_after_tuning(self) -> int:
        """Train with the optimal configuration (``--autotuning run``); returns the exit code."""
        if not self.optimal_cmd:
            logger.error("autotuning: no optimal configuration found, nothing to run")
            return 1
        import subprocess
        print(f"[autotuning] launching training with the optimal configuration: {' '.join(self.optimal_cmd)}",
              flush=True)
        return subprocess.call(self.optimal_cmd)


def run_autotuning(args, active_resources) -> int:
    """What ``deepspeed --autotuning tune|run`` does; returns the exit code (2: bad input,
    printed as one ``deepspeed --autotuning: error:`` line)."""
    try:
        tuner = Autotuner(args, active_resources)
        tuner.tune()
    except (AutotuningError, DeepSpeedConfigError) as err:
        print(f"deepspeed --autotuning: error: {err}", file=sys.stderr, flush=True)
        return 2
    tuner.print_tuning_results()
    path = tuner.write_optimal_config()
    if path is None:
        return 1
    if args.autotuning == "run":
        return tuner.run_after_tuning()
    return 0
