"""ZeRO's own pinned host buffers go through the accelerator (``DS_PIN_MEMORY_BACKEND=native``, CPU).

With ``offload_param`` / ``offload_optimizer`` and ``pin_memory: true``, the host buffers ZeRO keeps
(stage 3: the chunks' parameter partitions, fp32 masters and gradient partitions; stages 1/2: the
flat fp32 masters) are pinned by ``get_accelerator().pin_memory``: the native backend page-locks
them even without a device, ``get_accelerator().is_pinned`` sees them, the pin-memory tracker counts
their bytes and the kernel's ``VmLck`` grows by at least as much. Training still equals plain
PyTorch AdamW, and ``engine.destroy()`` unpins all of them (``VmLck`` back to where it was), while
the module stays readable afterwards.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.runtime.zero3._models import lm_batches, make_lm, plain_reference, stage3_config, train_engine

LR, STEPS, MB = 0.02, 3, 2


def _locked_kib() -> int:
    """The kernel's count of this process's page-locked memory (/proc/self/status VmLck), in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))


def _configs():
    pin = {"device": "cpu", "pin_memory": True}
    z2 = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": 2, "offload_optimizer": dict(pin)}}
    return {
        # fp32 with both on the host: the chunk's partitions are the master (one buffer) + gradients
        "z3_offload_param_and_optimizer": stage3_config(mb=MB, offload_param=dict(pin), offload_optimizer=dict(pin)),
        # partitions in compute memory; fp32 master and gradient partitions pinned on the host
        "z3_offload_optimizer": stage3_config(mb=MB, offload_optimizer=dict(pin)),
        "z2_offload_optimizer": z2,
    }


def _pinned_buffers(eng, cfg):
    """(the host buffers ZeRO should have pinned, the parameters' partitions)."""
    st = eng.strategy
    if hasattr(st, "parts"):   # stage 3: chunk partitions (offload_param), fp32 masters and gradients
        off_param = "offload_param" in cfg["zero_optimization"]
        out = {}   # fp32 with both offloaded: the master is the partitions' buffer itself
        for c in st.parts.chunks:
            out.update((t.data_ptr(), t) for t in ((c.lp,) if off_param else ()) + (c.master, c.grad))
        return list(out.values()), [p.ds_tensor for p in eng.module.parameters()]
    return [m for m in eng.optimizer.masters if m is not None], []


def _body(rank, ws):
    os.environ["DS_PIN_MEMORY_BACKEND"] = "native"
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import pin_memory_tracker as pmt
    from deepspeed.utils.pin_memory import get_active_native_pinned_memory
    acc, native = get_accelerator(), get_active_native_pinned_memory()
    out = {}
    for name, cfg in _configs().items():
        base_kib, base_ranges = _locked_kib(), len(native._ranges)
        pmt._tracker.reset()
        eng = train_engine(make_lm(seed=0), cfg, lm_batches(STEPS, MB), rank, ws, lr=LR)
        bufs, partitions = _pinned_buffers(eng, cfg)
        pinned_bytes = sum(t.numel() * t.element_size() for t in bufs)
        r = {"n_bufs": len(bufs), "bufs_pinned": [acc.is_pinned(t) for t in bufs],
             "partitions_pinned": [acc.is_pinned(t) for t in partitions],
             "pinned_bytes": pinned_bytes, "tracked_bytes": pmt._tracker.total_bytes,
             "locked_kib_grown": _locked_kib() - base_kib, "ranges_grown": len(native._ranges) - base_ranges,
             "sd": {k: v.float().clone() for k, v in eng.module_state_dict().items()}}
        eng.destroy()
        r["bufs_pinned_after"] = [acc.is_pinned(t) for t in bufs]
        r["partitions_pinned_after"] = [acc.is_pinned(t) for t in partitions]
        r["locked_kib_after"] = _locked_kib() - base_kib
        r["ranges_after"] = len(native._ranges) - base_ranges
        # the module is still readable after destroy (the memory went back to ordinary pages)
        r["sd_after"] = {k: v.float().clone() for k, v in eng.module_state_dict().items()}
        del eng, bufs, partitions
        out[name] = r
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the kernel's VmLck count (Linux)")
def test_offload_pin_memory_buffers_pinned_by_accelerator_train_like_pytorch_and_unpinned_by_destroy():
    res = run_distributed(_body, 1, timeout=150)[0]
    ref = plain_reference(make_lm(seed=0), lm_batches(STEPS, MB), LR)
    for name, r in res.items():
        assert r["n_bufs"] > 0 and all(r["bufs_pinned"]), (name, r["bufs_pinned"])
        if name == "z3_offload_param_and_optimizer":   # the parameters' partitions are views of pinned chunks
            assert r["partitions_pinned"] and all(r["partitions_pinned"]), (name, r["partitions_pinned"])
        elif name == "z3_offload_optimizer":           # partitions not offloaded: not pinned
            assert not any(r["partitions_pinned"]), name
        assert r["tracked_bytes"] >= r["pinned_bytes"] > 0, (name, r["tracked_bytes"], r["pinned_bytes"])
        assert r["locked_kib_grown"] * 1024 >= r["pinned_bytes"] and r["ranges_grown"] >= r["n_bufs"], (name, r)
        # engine.destroy(): every buffer unpinned, the kernel's page-locked count back to its start
        assert not any(r["bufs_pinned_after"]) and not any(r["partitions_pinned_after"]), name
        assert r["locked_kib_after"] == 0 and r["ranges_after"] == 0, (name, r["locked_kib_after"], r["ranges_after"])
        assert set(r["sd"]) == set(ref), name
        for k, v in ref.items():
            torch.testing.assert_close(r["sd"][k], v, rtol=1e-5, atol=2e-6, msg=f"{name}: {k}")
            torch.testing.assert_close(r["sd_after"][k], v, rtol=1e-5, atol=2e-6, msg=f"{name} after destroy: {k}")
