"""A/B of two amanda checkouts on the same benchmark suites, in alternating processes.

``python -m benchmarks.ab --a OLD_ROOT --b NEW_ROOT --only eager,points --rounds 3``

Each round runs ``python -m benchmarks.run --only <suite> --quick`` once from
each checkout's root (so each imports its own ``amanda`` and its own suite
code), A then B in odd rounds and B then A in even ones, so neither side
always runs first on a warm or a cold machine. Every ratio to the
uninstrumented run (key ``ratio``) and every per-point cost (``per_point_us``
medians) is read from the suites' JSON, and the report gives, per figure,
the median over rounds for A and for B and B / A. Ratios against the
uninstrumented run taken in the same process are what is compared: absolute
times drift with the machine between processes, ratios much less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def figures(data, path=()):
    """``{path: value}`` for every comparable figure in a suite's JSON."""
    found = {}
    if isinstance(data, dict):
        for key, value in data.items():
            here = path + (str(key),)
            if key == "ratio" and isinstance(value, (int, float)):
                found[path] = float(value)
            elif key == "median" and "per_point_us" in path and isinstance(value, (int, float)):
                found[path] = float(value)
            else:
                found.update(figures(value, here))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            name = value.get("model", index) if isinstance(value, dict) else index
            found.update(figures(value, path + (str(name),)))
    return found


def run_side(root, suite, out, python):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("PYTHONPATH", None)
    subprocess.run([python, "-m", "benchmarks.run", "--only", suite, "--quick", "--out", out],
                   cwd=root, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    with open(Path(out) / f"{suite}.json") as handle:
        return figures(json.load(handle)["results"])


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab")
    parser.add_argument("--a", required=True, help="root of checkout A (the old one)")
    parser.add_argument("--b", required=True, help="root of checkout B (the new one)")
    parser.add_argument("--only", default="eager,points,tf_graph,onnx_graph")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    suites = [s for s in args.only.split(",") if s]
    seen = {suite: {"A": [], "B": []} for suite in suites}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            order = ("A", "B") if round_ % 2 == 0 else ("B", "A")
            for suite in suites:
                for side in order:
                    root = args.a if side == "A" else args.b
                    out = os.path.join(scratch, f"{side}{round_}")
                    seen[suite][side].append(run_side(root, suite, out, args.python))
                    print(f"round {round_ + 1}, {suite}, {side} done", file=sys.stderr,
                          flush=True)
    lines = ["| suite | figure | A median | B median | B / A |", "|---|---|---|---|---|"]
    for suite in suites:
        keys = sorted(set().union(*seen[suite]["A"]) & set().union(*seen[suite]["B"]))
        for key in keys:
            a = statistics.median(r[key] for r in seen[suite]["A"] if key in r)
            b = statistics.median(r[key] for r in seen[suite]["B"] if key in r)
            lines.append(f"| {suite} | {' / '.join(key)} | {a:.3f} | {b:.3f} | "
                         f"{b / a if a else float('nan'):.3f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
