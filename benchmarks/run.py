"""Run amanda's benchmark suites: ``python -m benchmarks.run`` (``make bench``).

Each suite is a sibling module exposing ``NAME`` and
``run(repeats=None, quick=False) -> (markdown, raw)``. This entry point runs
the selected suites, prints their reports and writes
``benchmarks/results/<NAME>.md`` and ``<NAME>.json``. To add a suite (e.g.
TensorFlow or ONNX graph mode), add its module name to ``SUITES``.

Options:
  --only NAME[,NAME]  run only these suites (default: all)
  --repeats N         timed runs per configuration, for every model
  --quick             few repeats, one warm-up round (a fast sanity run)
  --out DIR           where to write results (default: benchmarks/results)
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from benchmarks import harness

SUITES = ("eager", "tf_graph", "flops", "onnx_graph", "points", "memory", "compiled",
          "counting", "session_creation")  # module names under benchmarks/


def parse_args(argv=None):
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run",
                                     description="amanda instrumentation overhead benchmarks")
    parser.add_argument("--only", default=",".join(SUITES),
                        help="comma-separated suites to run (" + ", ".join(SUITES) + ")")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per configuration (overrides each model's default)")
    parser.add_argument("--quick", action="store_true",
                        help="few repeats and one warm-up round")
    parser.add_argument("--out", default=str(harness.RESULTS_DIR),
                        help="directory for <suite>.md and <suite>.json")
    args = parser.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in args.only if s not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s): {', '.join(unknown)}; known: {', '.join(SUITES)}")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def run_suite(name, repeats, quick, out):
    """Run one suite, print its report and write its results."""
    suite = importlib.import_module(f"benchmarks.{name}")
    markdown, raw = suite.run(repeats=repeats, quick=quick)
    print(markdown, flush=True)
    md_path, json_path = harness.write_results(suite.NAME, markdown, raw, out)
    print(f"wrote {md_path} and {json_path}", flush=True)
    return raw


def main(argv=None):
    """Entry point; returns the process exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = parse_args(argv)
    for name in args.only:
        run_suite(name, args.repeats, args.quick, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
