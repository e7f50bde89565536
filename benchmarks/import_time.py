"""What ``import deepspeed`` costs: wall time of fresh interpreters, ours against torch alone
and (optionally) the real DeepSpeed and an older tree of ours.

Every launched rank, every launcher process and every subprocess test pays this. Each round
starts one fresh interpreter per variant, in an order rotated per round so that drift on a
shared machine hits all variants alike: ``import torch``; ours (``import torch; import
deepspeed``, which also reports the in-process time of the deepspeed import alone), with this
environment's bytecode setting and with the bytecode cached; ``--baseline-tree`` the same for
another copy of the package (before/after in one run); ``--ds-python`` the real DeepSpeed and
that venv's torch. Prints one JSON object: median, min, max and quartiles per variant, ours -
torch, ours / real DeepSpeed, after / before, the top deepspeed modules by cumulative time from
``-X importtime`` (median over ``--importtime-runs`` interpreters) and the load average before
and after.

    python benchmarks/import_time.py [-n 7] [--ds-python /tmp/realds/bin/python]
        [--baseline-tree /tmp/ds_before]   # git archive <commit> deepspeed | tar -x -C /tmp/ds_before
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import shutil
import subprocess
import sys
import tempfile
import time

OURS_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_IMPORTTIME_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")
# "import torch" then "import deepspeed", timed inside the interpreter too: the second figure
# is what deepspeed adds on top of torch (less noisy than the difference of two process walls).
_DS_STMT = ("import time; import torch; t = time.perf_counter(); import deepspeed; "
            "print(time.perf_counter() - t)")


class Variant:
    def __init__(self, python, stmt, tree=None, real_ds=False, pycache=None):
        self.python, self.stmt, self.tree, self.real_ds, self.pycache = python, stmt, tree, real_ds, pycache

    def env(self) -> dict:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        if self.real_ds:
            env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/realds_ext")
            env.setdefault("DS_ACCELERATOR", "cpu")
        elif self.tree:
            env["PYTHONPATH"] = self.tree
        if self.pycache:  # bytecode cached (as after a pip install), kept out of the source tree
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = self.pycache
        return env

    def run(self):
        """(process wall s, in-process seconds of 'import deepspeed' after torch or None)."""
        # cwd away from the repo so that the real DeepSpeed's run cannot pick up our package.
        t0 = time.perf_counter()
        out = subprocess.run([self.python, "-c", self.stmt], check=True, env=self.env(), cwd="/",
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
        wall = time.perf_counter() - t0
        last = out.strip().splitlines()[-1] if out.strip() else ""
        try:
            return wall, float(last)
        except ValueError:
            return wall, None

    def importtime(self) -> dict:
        """{module: (self_us, cumulative_us)} from one ``-X importtime`` interpreter."""
        proc = subprocess.run([self.python, "-X", "importtime", "-c", "import torch; import deepspeed"],
                              check=True, env=self.env(), cwd="/", stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        out = {}
        for line in proc.stderr.splitlines():
            m = _IMPORTTIME_LINE.match(line)
            if m:
                out[m.group(4)] = (int(m.group(1)), int(m.group(2)))
        return out


def _stats(xs: list, scale: float = 1.0, unit: str = "s") -> dict:
    xs = [x * scale for x in xs]
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    nd = 4 if unit == "s" else 1
    return {f"median_{unit}": round(statistics.median(xs), nd), f"min_{unit}": round(min(xs), nd),
            f"max_{unit}": round(max(xs), nd), f"q1_{unit}": round(q[0], nd), f"q3_{unit}": round(q[2], nd)}


def _top_modules(variant: Variant, runs: int, top: int) -> list:
    samples = [variant.importtime() for _ in range(runs)]
    names = set().union(*samples)
    rows = []
    for name in names:
        if name != "deepspeed" and not name.startswith("deepspeed."):
            continue
        cum = [s[name][1] for s in samples if name in s]
        self_ = [s[name][0] for s in samples if name in s]
        rows.append({"module": name, "cumulative_ms": round(statistics.median(cum) / 1e3, 1),
                     "self_ms": round(statistics.median(self_) / 1e3, 1)})
    rows.sort(key=lambda r: -r["cumulative_ms"])
    return rows[:top]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--runs", type=int, default=7, help="fresh interpreters per variant")
    ap.add_argument("--python", default=sys.executable, help="interpreter for torch and ours")
    ap.add_argument("--ds-python", default=None, help="interpreter with the real DeepSpeed")
    ap.add_argument("--baseline-tree", default=None,
                    help="a folder holding another deepspeed/ (e.g. `git archive` of an older commit), "
                         "timed the same way as ours: before/after in one run")
    ap.add_argument("--no-cached", action="store_true",
                    help="skip the variants with bytecode cached (PYTHONPYCACHEPREFIX in a temp dir)")
    ap.add_argument("--importtime-runs", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)

    pycache = tempfile.mkdtemp(prefix="ds_import_pyc_")
    variants = {"torch": Variant(args.python, "import torch"),
                "ours": Variant(args.python, _DS_STMT, tree=OURS_ROOT)}
    if not args.no_cached:
        variants["ours_cached"] = Variant(args.python, _DS_STMT, tree=OURS_ROOT, pycache=pycache + "/ours")
    if args.baseline_tree:
        variants["baseline"] = Variant(args.python, _DS_STMT, tree=args.baseline_tree)
        if not args.no_cached:
            variants["baseline_cached"] = Variant(args.python, _DS_STMT, tree=args.baseline_tree,
                                                  pycache=pycache + "/baseline")
    if args.ds_python:
        variants["real_deepspeed"] = Variant(args.ds_python, _DS_STMT, real_ds=True)
        variants["real_torch"] = Variant(args.ds_python, "import torch", real_ds=True)  # that venv's torch
    names = list(variants)

    load_before = os.getloadavg()
    for v in variants.values():  # warm the page cache (and write the cached bytecode) once, not timed
        v.run()
    walls = {name: [] for name in names}
    incr = {name: [] for name in names}
    for r in range(args.runs):
        for name in names[r % len(names):] + names[:r % len(names)]:
            wall, inc = variants[name].run()
            walls[name].append(wall)
            if inc is not None:
                incr[name].append(inc)
    top = _top_modules(variants["ours"], args.importtime_runs, args.top)
    load_after = os.getloadavg()
    shutil.rmtree(pycache, ignore_errors=True)

    med = {name: statistics.median(xs) for name, xs in walls.items()}
    result = {
        "benchmark": "import_time",
        "python": args.python, "ds_python": args.ds_python, "baseline_tree": args.baseline_tree,
        "runs": args.runs, "cpus": os.cpu_count(),
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
        "note": "'ours'/'baseline' run with this environment's bytecode setting (source compiled on every "
                "start when PYTHONDONTWRITEBYTECODE is set); '*_cached' with the bytecode cached, as after "
                "a pip install. deepspeed_after_torch = in-process time of 'import deepspeed' after "
                "'import torch'. The real DeepSpeed's venv has its bytecode cached.",
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
        "process_wall": {name: _stats(xs) for name, xs in walls.items()},
        "deepspeed_after_torch": {name: _stats(xs, 1e3, "ms") for name, xs in incr.items() if xs},
        "ours_minus_torch_wall_s": round(med["ours"] - med["torch"], 4),
        "top_deepspeed_modules_importtime": top,
    }
    if args.ds_python:
        result["ours_over_real_deepspeed_wall"] = round(med["ours"] / med["real_deepspeed"], 3)
        result["ours_cached_over_real_deepspeed_wall"] = (
            round(med["ours_cached"] / med["real_deepspeed"], 3) if "ours_cached" in med else None)
        result["real_deepspeed_minus_its_torch_wall_s"] = round(med["real_deepspeed"] - med["real_torch"], 4)
    if args.baseline_tree:
        for mode in ("", "_cached"):
            if "ours" + mode in incr and "baseline" + mode in incr:
                result[f"after_over_before{mode}"] = round(
                    statistics.median(incr["ours" + mode]) / statistics.median(incr["baseline" + mode]), 3)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
