"""What checkpoint checksums cost: save and load time of a ~100M-parameter model with and
without the manifest's CRC-32s, plus the raw speed of candidate checksums on this machine.

Claim (docs/checkpoints.md): verifying every file on load adds at most ~10% to
``load_checkpoint``. Measured in one process, world size 1, ZeRO stage 2, fp32, Adam
(model states 4 bytes/parameter + optimizer states 12 bytes/parameter, ~1.6 GB per tag at
100M parameters), each figure the median of ``--runs`` runs:

* ``save_s`` with the manifest (chunked CRC-32 of every byte as it is written, torch's
  per-record CRCs read back from each file's zip directory) and ``save_plain_s`` with the
  checksum step replaced by a pass-through writer (the manifest still lists the files);
* ``load_verify_s`` with verification (the once-per-process cache of verified files cleared
  before each run, as a fresh process would have it) and ``load_plain_s`` with
  ``set_checkpoint_verification(False)``.

The files are in the page cache for both (just written): this is the CPU cost of
verification, the worst case for the ratio (a cold read costs the same I/O either way).
Wall-clock figures and CPU seconds (all threads, ``time.process_time``) are both reported,
as medians and as the median of each verified load over the plain load just before it
(``*_paired_median``: drifting load on a shared machine cancels); ``load_avg_1min`` says
how busy the machine was. The model-states file is hashed while it is read (in-cache
slices, no second pass); the memory-mapped optimizer file is checked by one pass over the
mapping on a background thread that overlaps the model-file load, so on idle cores the
wall-clock overhead is below the CPU overhead.

    python benchmarks/checkpoint_verify.py [--d 1024 --layers 12 --runs 9 --save-runs 3 --dir /tmp]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchModel, n_params  # noqa: E402


def checksum_speeds(nbytes: int = 256 << 20) -> dict:
    """GB/s of each candidate over the same buffer (the fastest real checksum is the one used)."""
    buf = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
    mv = memoryview(buf)
    cands = {
        "zlib.crc32": lambda: zlib.crc32(mv),
        "isal.isal_zlib.crc32 (same values as zlib.crc32)": lambda: _isal_crc32()(mv),
        "zlib.adler32": lambda: zlib.adler32(mv),
        "hashlib.blake2b": lambda: hashlib.blake2b(mv, digest_size=16).digest(),
        "hashlib.sha1": lambda: hashlib.sha1(mv).digest(),
        "numpy uint64 sum (not a checksum: misses reordering)": lambda: int(buf.view(np.uint64).sum()),
    }
    out = {}
    for name, fn in cands.items():
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = round(nbytes / statistics.median(times) / 1e9, 2)
    return out


def _isal_crc32():
    try:
        from isal.isal_zlib import crc32
        return crc32
    except ImportError:
        return lambda b: None


class _PassThrough:
    """ChecksumFile without the checksums (for the save baseline only)."""

    def __init__(self, f, chunk=0):
        self.f, self.nbytes, self.error, self.crcs = f, 0, None, [0]

    def write(self, data):
        n = self.f.write(data)
        self.nbytes += len(memoryview(data).cast("B"))
        return n

    def flush(self):
        self.f.flush()

    def finish(self):
        return self.crcs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=1024, help="model width (8*d*d parameters per block)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--runs", type=int, default=5, help="load runs (each: one plain, one verified load)")
    ap.add_argument("--save-runs", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    args = ap.parse_args(argv)

    import deepspeed
    from deepspeed.runtime.checkpoint import manifest

    torch.manual_seed(0)
    model = BenchModel(d=args.d, layers=args.layers)
    cfg = {"train_batch_size": 2, "steps_per_print": 0, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
    eng, *_ = deepspeed.initialize(model=model, config=cfg)
    loss = eng(torch.randn(2, args.d), torch.randn(2, 16))
    eng.backward(loss)
    eng.step()

    root = tempfile.mkdtemp(prefix="ckpt_verify_", dir=args.dir)
    save_dir = os.path.join(root, "ckpt")
    real_cf = manifest.ChecksumFile
    try:
        def save(plain):
            manifest.ChecksumFile = _PassThrough if plain else real_cf
            try:
                t0 = time.perf_counter()
                eng.save_checkpoint(save_dir, tag="t")
                return time.perf_counter() - t0
            finally:
                manifest.ChecksumFile = real_cf

        cpu = {False: [], True: []}

        def load(verify):
            manifest._verified.clear()
            with manifest.set_checkpoint_verification(verify):
                t0, c0 = time.perf_counter(), time.process_time()
                eng.load_checkpoint(save_dir, tag="t")
                cpu[verify].append(time.process_time() - c0)   # CPU seconds of all threads
                return time.perf_counter() - t0

        save(False)   # warm-up
        saves = {False: [], True: []}
        for _ in range(args.save_runs):
            for plain in (True, False):
                saves[plain].append(save(plain))
        save(False)   # leave a checksummed tag to load
        tag_bytes = sum(os.path.getsize(os.path.join(save_dir, "t", n)) for n in os.listdir(os.path.join(save_dir, "t")))
        load(False)   # warm-up
        cpu[False].clear()
        loads = {False: [], True: []}
        for _ in range(args.runs):
            for verify in (False, True):
                loads[verify].append(load(verify))
    finally:
        manifest.ChecksumFile = real_cf
        shutil.rmtree(root, ignore_errors=True)
        eng.destroy()
    med = {k: statistics.median(v) for k, v in (("save_s", saves[False]), ("save_plain_s", saves[True]),
                                                 ("load_verify_s", loads[True]), ("load_plain_s", loads[False]))}
    out = {
        "config": {"params": n_params(model), "d": args.d, "layers": args.layers, "zero_stage": 2, "dtype": "fp32",
                   "optimizer": "Adam", "world_size": 1, "runs": args.runs, "save_runs": args.save_runs, "tag_bytes": tag_bytes,
                   "checksum": manifest.CHECKSUM, "crc_impl": manifest.CRC_IMPL, "chunk_bytes": manifest.CHUNK_BYTES, "torch": torch.__version__,
                   "cpus": os.cpu_count(), "page_cache": "warm (just written)"},
        **{k: round(v, 3) for k, v in med.items()},
        "save_overhead": round(med["save_s"] / med["save_plain_s"] - 1, 3),
        "load_overhead": round(med["load_verify_s"] / med["load_plain_s"] - 1, 3),
        # each verified load against the plain load just before it: drifting load on a shared machine cancels
        "load_overhead_paired_median": round(statistics.median(v / p for v, p in zip(loads[True], loads[False])) - 1, 3),
        "load_cpu_overhead_paired_median": round(statistics.median(v / p for v, p in zip(cpu[True], cpu[False])) - 1, 3),
        "load_verify_cpu_s": round(statistics.median(cpu[True]), 3),
        "load_plain_cpu_s": round(statistics.median(cpu[False]), 3),
        "load_cpu_overhead": round(statistics.median(cpu[True]) / statistics.median(cpu[False]) - 1, 3),
        "load_avg_1min": round(os.getloadavg()[0], 1),
        "verify_gb_per_s": round(tag_bytes / max(med["load_verify_s"] - med["load_plain_s"], 1e-9) / 1e9, 2),
        "runs": {"save_s": saves[False], "save_plain_s": saves[True], "load_verify_s": loads[True],
                 "load_plain_s": loads[False], "load_verify_cpu_s": cpu[True], "load_plain_cpu_s": cpu[False]},
        "checksum_gb_per_s": checksum_speeds(),
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
