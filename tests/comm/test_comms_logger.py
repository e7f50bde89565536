"""The communication logger: sizes, counts and bandwidths of deepspeed.comm ops, a
known ZeRO-2 step's traffic, log_summary's table, prof_ops filtering, and nothing
recorded while off. Everything runs in one spawned group of 2 ranks."""
import re

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.comm.comms_logging import bandwidths_gbps, comms_logger, configure
from tests.helpers.dist import run_distributed
from tests.helpers.models import make_model

N_PARAMS = 8 * 16 + 16 + 16 * 4 + 4  # TinyMLP(8, 16, 4): 212 fp32 parameters, even, so no padding at 2 ranks


def _records():
    return {label: {size: (rec[0], list(rec[1]), list(rec[2]), list(rec[3])) for size, rec in sizes.items()}
            for label, sizes in comms_logger.comms_dict.items()}


def _ops(rank, world_size):
    out = {}
    # Off (the default): nothing is recorded.
    comms_logger.reset()
    dist.all_reduce(torch.ones(10))
    out["off"] = _records()

    configure(enabled=True, prof_all=True)
    comms_logger.reset()
    dist.all_reduce(torch.ones(1000))                                   # 4000 B
    dist.broadcast(torch.ones(250, dtype=torch.float64), src=0)         # 2000 B
    dist.all_gather_into_tensor(torch.empty(2 * 64), torch.ones(64))    # output: 512 B
    dist.reduce_scatter_tensor(torch.empty(32), torch.ones(64))         # input: 256 B
    if rank == 0:
        dist.send(torch.ones(16), dst=1)                                # 64 B
        dist.isend(torch.ones(8), dst=1).wait()                         # 32 B, timed to wait()
    else:
        dist.recv(torch.empty(16), src=0)
        dist.irecv(torch.empty(8), src=0).wait()
    dist.all_reduce(torch.ones(1000), log_name="my_reduce")
    dist.all_reduce_coalesced([torch.ones(10), torch.ones(5)])         # 60 B in one launch
    dist.inference_all_reduce(torch.ones(3))                            # 12 B
    dist.barrier()
    out["ops"] = _records()
    out["summary"] = dist.log_summary(show_straggler=True)

    configure(prof_all=False, prof_ops=["broadcast"])
    comms_logger.reset()
    dist.all_reduce(torch.ones(4))
    dist.broadcast(torch.ones(4), src=0)
    dist.all_reduce(torch.ones(4), prof=True)  # DeepSpeed's per-call override
    out["filtered"] = _records()
    comms_logger.reset()
    dist.broadcast(torch.ones(4), src=0, debug=True)  # the label names the caller
    out["debug_labels"] = list(comms_logger.comms_dict)
    with pytest.raises(ValueError, match="unknown op"):
        configure(prof_ops=["allreduce"])
    configure(enabled=False, prof_all=True, prof_ops=[])

    # A known ZeRO-2 step, logger switched on from the config section.
    for native in (False, True):
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "zero_optimization": {"stage": 2}, "comms_logger": {"enabled": True}}
        engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
        if native:  # the NCCL path: real reduce-scatter and all-gather (gloo runs them too)
            engine.optimizer.comm.via_all_reduce = False
        comms_logger.reset()
        for _ in range(2):
            x, y = torch.randn(2, 8), torch.randn(2, 4)
            engine.backward(engine(x, y))
            engine.step()
        out[f"zero2_native={native}"] = _records()
        engine.destroy()
        configure(enabled=False)
    # Stages 0 and 3 go through deepspeed.comm too.
    for stage in (0, 3):
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "zero_optimization": {"stage": stage}, "comms_logger": {"enabled": True}}
        engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
        comms_logger.reset()
        x, y = torch.randn(2, 8), torch.randn(2, 4)
        engine.backward(engine(x, y))
        engine.step()
        out[f"stage{stage}"] = _records()
        engine.destroy()
        configure(enabled=False)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_ops, world_size=2, timeout=240)


def test_off_records_nothing(results):
    assert results[0]["off"] == {} and results[1]["off"] == {}


def test_sizes_counts_and_bandwidth_formulas(results):
    for rank in (0, 1):
        r = results[rank]["ops"]
        sizes = {label: sorted(v) for label, v in r.items()}
        assert sizes == {"all_reduce": [4000], "broadcast": [2000], "all_gather_into_tensor": [512],
                         "reduce_scatter_tensor": [256], ("send" if rank == 0 else "recv"): [64],
                         ("isend" if rank == 0 else "irecv"): [32], "my_reduce": [4000], "barrier": [0],
                         "all_reduce_coalesced": [60], "inference_all_reduce": [12]}
        for label, by_size in r.items():
            for size, (count, lats, algbw, busbw) in by_size.items():
                assert count == 1 and lats[0] > 0
                if size:
                    assert algbw[0] == pytest.approx(size * 8 / (lats[0] / 1e3) / 1e9)
        # nccl-tests bus factors at n = 2: all-reduce 2(n-1)/n = 1, gather-like (n-1)/n = 0.5, p2p 1
        a = r["all_reduce"][4000]
        assert a[3][0] == pytest.approx(a[2][0])
        g = r["all_gather_into_tensor"][512]
        assert g[3][0] == pytest.approx(0.5 * g[2][0])
    assert bandwidths_gbps("all_reduce", 10 ** 9, 1.0, 4) == pytest.approx((8.0, 12.0))
    assert bandwidths_gbps("reduce_scatter_tensor", 10 ** 9, 2.0, 4) == pytest.approx((4.0, 3.0))
    assert bandwidths_gbps("broadcast", 10 ** 9, 1.0, 8) == pytest.approx((8.0, 8.0))


def test_log_summary_parses(results):
    text = results[0]["summary"]
    lines = text.splitlines()
    header = re.split(r"\s{2,}", lines[0].strip())
    assert header == ["Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
                      "tput_avg (Gbps)", "busbw_avg (Gbps)", "straggler (ms)"]
    rows = {}
    for line in lines[1:]:
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == len(header), line
        rows[cells[0]] = cells
        assert int(cells[2]) >= 1 and all(float(c) >= 0 for c in cells[3:])
    assert rows["all_reduce"][1] == "3.91 KB" and rows["broadcast"][1] == "1.95 KB"
    assert set(rows) == set(results[0]["ops"])


def test_prof_ops_filter(results):
    r = results[0]["filtered"]
    assert set(r) == {"broadcast", "all_reduce"}
    assert r["all_reduce"][16][0] == 1  # only the prof=True call
    [label] = results[0]["debug_labels"]
    assert label.startswith("broadcast | [Caller Func: _ops@test_comms_logger.py:"), label


@pytest.mark.parametrize("native", [False, True])
def test_zero2_step_traffic(results, native):
    """Stage 2, 2 ranks, one micro-batch per step, one bucket: per step the gradients are
    reduce-scattered once (on gloo carried by an all-reduce of the whole flat region) and
    the updated parameters all-gathered once; 212 fp32 values each time."""
    nbytes = N_PARAMS * 4
    for rank in (0, 1):
        r = results[rank][f"zero2_native={native}"]
        if native:
            assert r == {"reduce_scatter_tensor": {nbytes: r["reduce_scatter_tensor"][nbytes]},
                         "all_gather_into_tensor": {nbytes: r["all_gather_into_tensor"][nbytes]}}
            counts = (r["reduce_scatter_tensor"][nbytes][0], r["all_gather_into_tensor"][nbytes][0])
        else:
            assert set(r) == {"all_reduce[reduce_scatter]", "all_reduce[all_gather]"}
            assert set(r["all_reduce[reduce_scatter]"]) == {nbytes} and set(r["all_reduce[all_gather]"]) == {nbytes}
            counts = (r["all_reduce[reduce_scatter]"][nbytes][0], r["all_reduce[all_gather]"][nbytes][0])
        assert counts == (2, 2)  # two steps


def test_stage0_and_stage3_traffic(results):
    """Stage 0 (fp32): one all-reduce of the 212 gradients per step. Stage 3: the gradients
    are reduced once (212 fp32, in buckets: on gloo each bucket is all-reduced in place, elsewhere
    reduce-scattered; the 8-byte all-reduce is the float64 gradient norm) and the parameters
    all-gathered in whole-model multiples (how often depends on stage 3's fetch/release policy)."""
    for rank in (0, 1):
        r0 = results[rank]["stage0"]
        assert {label: {size: v[0] for size, v in sizes.items()} for label, sizes in r0.items()} == \
            {"all_reduce": {N_PARAMS * 4: 1}}
        r3 = results[rank]["stage3"]
        gathered = sum(size * v[0] for label, sizes in r3.items() if label.startswith("all_gather")
                       for size, v in sizes.items())
        reduced = sum(size * v[0] for label, sizes in r3.items()
                      if label.startswith("reduce_scatter") or label == "all_reduce"
                      for size, v in sizes.items() if size > 8)
        assert reduced == N_PARAMS * 4, r3
        assert gathered >= N_PARAMS * 4 and gathered % (N_PARAMS * 4) == 0, r3


def test_log_summary_prints_with_logger_quiet(capsys):
    """DeepSpeed prints the summary table (rank 0): it must reach stdout even when the user has set
    the DeepSpeed logger to ERROR (it went through logger.info before, and printed nothing)."""
    import logging
    from deepspeed.utils.logging import logger
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        configure(enabled=True, prof_all=True)
        comms_logger.reset()
        comms_logger.append("all_reduce", "all_reduce", 4000, 0.002, 1)
        text = dist.log_summary()
    finally:
        configure(enabled=False)
        comms_logger.reset()
        logger.setLevel(level)
    out = capsys.readouterr().out
    assert "Communication summary" in out and "all_reduce" in out and text in out


def test_runtime_switches_and_queries():
    """DeepSpeed 0.19's CommsLogger API: prof_all switches, prof_ops edits, raw data and summaries
    (10%-trimmed averages, hand-computed; the recorded lists keep their order)."""
    from deepspeed.utils.comms_logging import CommsLogger
    cl = CommsLogger()
    cl.stop_profiling_comms()
    assert cl.prof_all is False and not cl.should_log("all_reduce", False)
    cl.start_profiling_op(["all_reduce", "broadcast"])
    assert cl.should_log("all_reduce", False) and cl.should_log("broadcast", False)
    cl.stop_profiling_op(["broadcast"])
    assert cl.prof_ops == ["all_reduce"]
    cl.start_profiling_comms()
    assert cl.prof_all is True
    assert not cl.has_data() and cl.get_operation_summary("all_reduce") is None
    lats = [10.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 100.0]   # ms; trim 1 from each end
    for ms in lats:
        cl.append("all_reduce", "all_reduce", 1000, ms / 1e3, 2)
    s = cl.get_operation_summary("all_reduce")[1000]
    assert s["count"] == 10 and s["total_latency_ms"] == sum(lats)
    assert abs(s["avg_latency_ms"] - sum(sorted(lats)[1:9]) / 8) < 1e-9
    raw = cl.get_raw_data()["all_reduce"][1000]
    assert [round(x, 6) for x in raw[1]] == lats   # not sorted in place
    # algbw = 1000 bytes * 8 / latency in Gbps; busbw = algbw * 2(n-1)/n = algbw at n=2
    assert all(abs(a * ms - 8e3 / 1e9 * 1e3) < 1e-12 for a, ms in zip(raw[2], raw[1]))
    assert cl.get_total_operations() == 10 and cl.get_operation_names() == ["all_reduce"]
    cl.reset_data()
    assert not cl.has_data()
