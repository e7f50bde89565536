"""``ds_report``: what this installation can do on this machine.

Every line is measured, not assumed: versions come from the imported packages, the
device count from the accelerator, the communication back-ends from
``torch.distributed``, and each feature row from actually importing the code that
implements it (and, for precisions, asking the accelerator). A feature whose code is
missing or fails to import is reported as not usable, with the reason.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from typing import Callable, List, Tuple

Probe = Callable[[], Tuple[bool, str]]


# --------------------------------------------------------------------------- facts
def versions() -> dict:
    import torch
    import deepspeed
    return {
        "deepspeed": deepspeed.__version__,
        "deepspeed_path": os.path.dirname(os.path.abspath(deepspeed.__file__)),
        "torch": torch.__version__,
        "torch_path": os.path.dirname(os.path.abspath(torch.__file__)),
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def accelerator_info() -> dict:
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    name = acc.device_name()
    info = {"name": name, "communication_backend": acc.communication_backend_name(),
            "cpu_cores": os.cpu_count()}
    if name == "cpu":
        info["device_count"] = 1
        info["note"] = "on CPU each launcher slot is one process; choose the count with --num_procs"
    else:
        info["device_count"] = acc.device_count()
    try:
        info["memory_gib_per_device"] = round(acc.total_memory() / 2**30, 1)
    except Exception as err:  # a report must not die on one missing figure
        info["memory_gib_per_device"] = f"unknown ({err})"
    return info


def comm_backends() -> dict:
    import torch.distributed as dist
    if not dist.is_available():
        return {"torch.distributed": False}
    return {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available()}


# --------------------------------------------------------------------------- feature probes
def _import_probe(target: str, what: str = "") -> Probe:
    """Usable when ``module:attr`` (or a module) imports."""
    def probe():
        mod_name, _, attr = target.partition(":")
        try:
            mod = importlib.import_module(mod_name)
            if attr:
                getattr(mod, attr)
        except Exception as err:
            return False, f"{target} is not available ({type(err).__name__}: {err})"
        return True, what or target
    return probe


def _zero_probe(stage: int) -> Probe:
    def probe():
        try:
            from deepspeed.runtime.strategy_factory import strategy_class
            cls = strategy_class(stage, False)
        except Exception as err:
            return False, str(err)
        return True, f"{cls.__module__}.{cls.__name__}"
    return probe


def _precision_probe(dtype: str) -> Probe:
    def probe():
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        supported = acc.is_fp16_supported() if dtype == "fp16" else acc.is_bf16_supported()
        if not supported:
            return False, f"{acc.device_name()} does not support {dtype}"
        try:
            from deepspeed.runtime.strategy_factory import strategy_class
            strategy_class(0, True)
        except Exception as err:
            return False, f"mixed-precision strategy missing: {err}"
        note = "runs on CPU, slower than fp32 there" if acc.device_name() == "cpu" else acc.device_name()
        return True, note
    return probe


def _nvme_probe() -> Tuple[bool, str]:
    from deepspeed.ops.op_builder import AsyncIOBuilder
    if not AsyncIOBuilder().is_compatible():
        return False, "needs the async I/O engine (deepspeed.ops.aio), which does not import here"
    for target in ("deepspeed.runtime.precision.nvme_master:NvmeMasters",
                   "deepspeed.runtime.zero.stage3_nvme:NvmeMasters",
                   "deepspeed.runtime.swap_tensor.partitioned_param_swapper:AsyncPartitionedParameterSwapper"):
        ok, why = _import_probe(target)()
        if not ok:
            return False, why
    return True, ("offload_optimizer.device 'nvme' (ZeRO 1/2/3), offload_param.device 'nvme' (ZeRO 3), "
                  "zero.Init(remote_device='nvme')")


def _async_io_probe() -> Tuple[bool, str]:
    from deepspeed.ops.op_builder import AsyncIOBuilder
    if not AsyncIOBuilder().is_compatible():
        return False, "deepspeed.ops.aio does not import on this platform (needs os.preadv/os.pwritev)"
    from deepspeed.ops.aio import direct_io_enabled
    return True, ("deepspeed.ops.aio.aio_handle: native threads doing preadv/pwritev, "
                  f"O_DIRECT {'where the filesystem allows it' if direct_io_enabled() else 'switched off'}")


def _gds_probe() -> Tuple[bool, str]:
    from deepspeed.ops.op_builder import GDSBuilder
    b = GDSBuilder()
    return b.is_compatible(), b.ABSENT_WHY or "gds"


def _compiled_kernels_probe() -> Tuple[bool, str]:
    return False, "this build has no custom C++/CUDA kernels; it uses PyTorch's own operators"


def feature_probes() -> List[Tuple[str, Probe]]:
    return [
        ("fp32 training (engine)", _import_probe("deepspeed.runtime.engine:DeepSpeedEngine")),
        ("fp16 mixed precision", _precision_probe("fp16")),
        ("bf16 mixed precision", _precision_probe("bf16")),
        ("ZeRO stage 0 (data parallel)", _zero_probe(0)),
        ("ZeRO stage 1", _zero_probe(1)),
        ("ZeRO stage 2", _zero_probe(2)),
        ("ZeRO stage 3", _zero_probe(3)),
        ("ZeRO optimizer CPU offload", _import_probe("deepspeed.runtime.precision.flat_master:FlatMasterOptimizer")),
        ("ZeRO-3 parameter CPU offload", _import_probe("deepspeed.runtime.zero.parameter_offload")),
        ("ZeRO NVMe offload", _nvme_probe),
        ("async I/O (DeepNVMe aio_handle)", _async_io_probe),
        ("GPUDirect Storage (gds_handle)", _gds_probe),
        ("CPU Adam (DeepSpeedCPUAdam)", _import_probe("deepspeed.ops.adam:DeepSpeedCPUAdam")),
        ("FusedAdam", _import_probe("deepspeed.ops.adam:FusedAdam")),
        ("CPU Adagrad", _import_probe("deepspeed.ops.adagrad:DeepSpeedCPUAdagrad")),
        ("CPU Lion", _import_probe("deepspeed.ops.lion:DeepSpeedCPULion")),
        ("Lamb", _import_probe("deepspeed.ops.lamb:FusedLamb")),
        ("pipeline parallelism", _import_probe("deepspeed.pipe:PipelineModule")),
        ("activation checkpointing", _import_probe("deepspeed.checkpointing:checkpoint")),
        ("activation offload (CheckpointHiddenStatesOffload)",
         _import_probe("deepspeed.runtime.activation_checkpointing.offload_activations:CheckpointHiddenStatesOffload")),
        ("mixture of experts", _import_probe("deepspeed.moe.layer:MoE")),
        ("custom compiled kernels", _compiled_kernels_probe),
    ]


def feature_table() -> List[dict]:
    rows = []
    for name, probe in feature_probes():
        try:
            ok, note = probe()
        except Exception as err:
            ok, note = False, f"probe failed: {type(err).__name__}: {err}"
        rows.append({"feature": name, "usable": bool(ok), "note": note})
    return rows


def collect() -> dict:
    return {"versions": versions(), "accelerator": accelerator_info(),
            "comm_backends": comm_backends(), "features": feature_table()}


# --------------------------------------------------------------------------- output
def format_report(data: dict, show_notes: bool = True) -> str:
    v, a = data["versions"], data["accelerator"]
    lines = ["DeepSpeed environment report", "-" * 60]
    lines += [f"deepspeed version ........ {v['deepspeed']}",
              f"deepspeed install path ... {v['deepspeed_path']}",
              f"torch version ............ {v['torch']}",
              f"torch install path ....... {v['torch_path']}",
              f"torch CUDA version ....... {v['torch_cuda'] or 'none (CPU build)'}",
              f"python version ........... {v['python']}",
              f"platform ................. {v['platform']}",
              "-" * 60,
              f"accelerator .............. {a['name']}",
              f"device count ............. {a['device_count']}",
              f"memory per device (GiB) .. {a['memory_gib_per_device']}",
              f"CPU cores ................ {a['cpu_cores']}",
              f"default comm backend ..... {a['communication_backend']}"]
    if a.get("note"):
        lines.append(f"note: {a['note']}")
    backends = ", ".join(f"{k}={'yes' if ok else 'no'}" for k, ok in data["comm_backends"].items())
    lines.append(f"torch.distributed ........ {backends}")
    if not data["features"]:
        return "\n".join(lines)
    lines += ["-" * 60, "features usable on this machine:"]
    width = max(len(r["feature"]) for r in data["features"])
    for r in data["features"]:
        mark = "[YES]" if r["usable"] else "[NO] "
        note = f"  {r['note']}" if show_notes else ""
        lines.append(f"  {r['feature']:<{width}}  {mark}{note}")
    return "\n".join(lines)


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False,
         as_json: bool = False) -> dict:
    data = collect()
    if hide_operator_status:
        data["features"] = []
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        print(format_report(data, show_notes=not hide_errors_and_warnings))
    return data


def cli_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ds_report", description=__doc__.splitlines()[0])
    p.add_argument("--hide_operator_status", action="store_true", help="leave out the feature table")
    p.add_argument("--hide_errors_and_warnings", action="store_true", help="leave out the reasons column")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    main(a.hide_operator_status, a.hide_errors_and_warnings, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
