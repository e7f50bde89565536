"""benchmarks/zero_infinity_headline.py at a tiny size: the ZeRO-Infinity run (zero.Init into
NVMe-backed partitions, stage 3 with parameters and optimizer state on NVMe) trains, its
swap files hold the model states and are gone afterwards, and its first loss matches plain
PyTorch on the same model; plain PyTorch under an address-space cap too small for its
states fails with an allocation error after construction, which the script reports."""
import importlib.util
import math
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "zero_infinity_headline.py")


def _bench():
    spec = importlib.util.spec_from_file_location("zero_infinity_headline", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow   # the headline benchmark's own check (make test-all)
def test_tiny_nvme_run_trains_and_matches_plain_pytorch(tmp_path):
    bench = _bench()
    r = bench.main(["--size", "tiny", "--run", "both", "--offload", "nvme", "--nvme-path", str(tmp_path),
                    "--steps", "3", "--timeout", "300", "--as-limit-gib", "8", "--sample-s", "0.2"])
    d, n_layer, n_head, vocab, seq = bench.SIZES["tiny"]
    n = bench.gpt_param_count(d, n_layer, vocab, seq)
    ds, plain = r["deepspeed"], r["plain"]
    assert ds["returncode"] == 0 and ds["killed"] is None, ds
    child = ds["child"]
    assert child["params"] == n == plain["child"]["params"]
    losses = [s["loss"] for s in child["steps"]]
    assert len(losses) == 3
    # one fixed batch: every step lowers the loss
    assert losses[0] > losses[1] > losses[2], losses
    # near-uniform logits at initialisation: the loss starts near ln(vocab)
    assert abs(losses[0] - math.log(vocab)) < 1.0, losses
    # bf16 ZeRO-3 vs fp32 + autocast plain PyTorch, same model shape and batch (different init draws)
    assert abs(losses[0] - plain["child"]["losses"][0]) < 0.1, (losses, plain["child"]["losses"])
    # the swap files held the fp32 master and both Adam moments (12 B/param) and bf16 params
    disk_peak = max([child["phases"][k]["disk"]["allocated"] for k in ("construction", "initialize")]
                    + [s["disk"]["allocated"] for s in child["steps"]])
    assert disk_peak >= 14 * n, (disk_peak, n)
    assert child["phases"]["construction"]["disk"]["allocated"] >= 2 * n     # zero.Init wrote the params
    assert ds["left_on_disk_after_exit"]["files"] == 0, ds["left_on_disk_after_exit"]
    assert ds["parent_view_maxrss_bytes"] >= 0.9 * child["final_status"]["VmHWM"] > 0
    assert plain["returncode"] == 0 and plain["child"]["failed_in"] is None


@pytest.mark.slow   # the headline benchmark's own check (make test-all)
def test_plain_pytorch_under_a_small_cap_fails_after_construction():
    bench = _bench()
    # 134M parameters: 0.54 GB of fp32 weights fit under the cap; gradients and Adam moments do not
    a = {"shape": [256, 1, 4, 262144, 32], "steps": 1, "lr": 1e-3}
    r = bench.run_child("plain", a, as_limit=int(1.5 * bench.GiB), timeout=240, sample_s=0.2,
                        guard_bytes=int(0.5 * bench.GiB), disk_path=None)
    assert r["returncode"] == 0 and r["killed"] is None, r
    c = r["child"]
    assert c["phases"]["construction"]["VmRSS"] > 4 * c["params"], c
    assert c["failed_in"] in ("forward_0", "backward_0", "step_0"), c
    assert "alloc" in c["error"].lower() or "memory" in c["error"].lower(), c["error"]
