"""The ``amanda`` command line.

Subcommands live in :data:`COMMANDS`, a table of :class:`Command` entries
(name, help, description, an example, ``add_arguments(parser)`` and
``run(args)``, which returns the exit status); adding one is a module
holding those two functions and its ``COMMAND`` entry, listed in
:data:`COMMANDS`. Each runs a built-in tool on a model spec
of :mod:`amanda.models` (built-in names, ``keras:NAME``, ``*.onnx``,
``file.py:factory``), prints a table (rich on a terminal, plain text
otherwise) and writes its results to ``--out`` (default ``amanda-out/``).
A subcommand whose tool module is missing fails with :class:`MissingPiece`
naming it. See ``docs/cli.md``.

One module per subcommand (:mod:`amanda.cli.trace`, :mod:`amanda.cli.flops`,
...) holds its ``COMMAND`` entry, its arguments and its run function;
:mod:`amanda.cli.common` what they share (model loading, argparse types,
the missing-extra message); :mod:`amanda.cli.table` the table renderer.
None of them imports torch, TensorFlow or ONNX at import time.

Example::

    amanda flops resnet50 keras:resnet50 --chart
    amanda quantize cnn --weight-bits 4 --qat 20 --export cnn-qdq.onnx
    amanda demo
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

import amanda
from amanda.cli import (
    coverage,
    demo,
    diff,
    flops,
    graph,
    models,
    nan_check,
    prune,
    quantize,
    trace,
)
from amanda.cli.common import (
    DEFAULT_OUT,
    EXTRA_OF_MODULE,
    DISTRIBUTION,
    Command,
    MissingExtra,
    MissingPiece,
    UsageError,
    _require,  # noqa: F401  (tests reach it as amanda.cli._require)
    commit_outputs,
    discard_outputs,
    missing_extra_message,
)
from amanda.cli.coverage import DEFAULT_COVERAGE_MODELS, coverage_table
from amanda.cli.demo import CountOPTool

__all__ = ["COMMANDS", "DEFAULT_COVERAGE_MODELS", "DEFAULT_OUT", "DISTRIBUTION",
           "EXTRA_OF_MODULE", "Command", "CountOPTool", "MissingExtra", "MissingPiece",
           "UsageError", "build_parser", "coverage_table", "main", "missing_extra_message"]

COMMANDS = {m.COMMAND.name: m.COMMAND for m in [
    trace, flops, coverage, prune, quantize, nan_check, diff, graph, demo, models]}
"""Subcommands by name, in ``--help`` order."""


# -- entry point ---------------------------------------------------------------------------

def _quiet_backends():
    """Keep backend start-up chatter off the terminal (before any backend loads):
    TensorFlow's C++ logs (absl, oneDNN, CPU features; 3 = fatal only, its
    errors reach the CLI as Python exceptions), its Python logger, and
    transformers' warnings. A user's own setting wins."""
    import logging
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("tensorflow").setLevel(logging.ERROR)


def build_parser():
    """The argument parser with every registered subcommand."""
    examples = "\n".join(f"  {c.example}" for c in COMMANDS.values())
    parser = argparse.ArgumentParser(
        prog="amanda",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            amanda instruments deep neural networks at every op: write a tool once
            (analysis routines that pick ops, instrumentation routines that run there)
            and apply it to any model, forward and backward, with
            `with amanda.apply(tool): ...`. This command runs ready-made tools on
            built-in or your own models."""),
        epilog="examples:\n" + examples
               + "\n\nrun `amanda COMMAND --help` for the options of a command.")
    parser.add_argument("--version", action="version", version=f"amanda {amanda.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for c in COMMANDS.values():
        p = sub.add_parser(c.name, help=c.help, description=c.description,
                           epilog=f"example:\n  {c.example}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        c.add_arguments(p)
        p.set_defaults(run=c.run)
    return parser


def main(argv=None):
    """Run the ``amanda`` command line; returns the exit status.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
    """
    _quiet_backends()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    discard_outputs()   # nothing staged by an earlier call in this process
    try:
        status = _run(args)
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 2
    except UsageError as exc:
        print(f"amanda {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except amanda.AmandaError as exc:
        print(f"amanda {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        message = missing_extra_message(args.command, exc)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 2
    return status


def _run(args):
    """Run the command; its outputs move into place only if it returns (an
    exit status of 1 for a found NaN or divergence is a result, not a
    failure), and are deleted if it raises."""
    try:
        status = args.run(args)
    except BaseException:
        discard_outputs()
        raise
    commit_outputs()
    return status
