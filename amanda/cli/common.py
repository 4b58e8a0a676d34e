"""What every ``amanda`` subcommand shares: the :class:`Command` record,
usage errors, argparse types, model loading, the missing-extra message and
JSON output.

Nothing here imports torch, TensorFlow or ONNX at import time: ``amanda
--help`` and the one-line missing-extra message work on a bare install.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable

from amanda.cli.table import use_rich

DEFAULT_OUT = "amanda-out"


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand.

    Attributes:
        name: what the user types (``amanda <name>``).
        help: one line for ``amanda --help``.
        description: what it does, shown by ``amanda <name> --help``.
        example: an example command line, shown by both helps.
        add_arguments: ``add_arguments(parser)`` declares its arguments.
        run: ``run(args)`` does the work and returns the exit status.
    """

    name: str
    help: str
    description: str
    example: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """A bad command line the parser could not catch (e.g. an unknown model)."""


# -- shared helpers ---------------------------------------------------------------------

def _model_help():
    from amanda import models
    names = ", ".join(models.available())
    return (f"a built-in PyTorch model ({names}); keras:NAME[:SIZE], a Keras model in a "
            "TF graph (keras:cnn, keras:resnet50, keras:mobilenetv2:96); "
            "path/to/model.onnx, run in onnxruntime; or path/to/file.py:factory, where "
            "factory() returns (model, inputs) of a PyTorch model (the file imports like a "
            "script: its folder is on sys.path). `amanda models` lists them")


def _count(minimum, what="an integer"):
    """An argparse type: an int >= ``minimum``, else a clear usage error."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = "int"
    return parse


def _fraction(text):
    """An argparse type: a float in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _bits(text):
    """An argparse type: 0 (leave in float) or 2..16 bits."""
    value = _count(0)(text)
    if value == 1 or value > 16:
        raise argparse.ArgumentTypeError(f"must be 0 (float) or 2 to 16 bits, got {value}")
    return value


def _pytorch_only(specs, command, why):
    """Reject Keras and ONNX specs before anything runs."""
    for spec in specs:
        if spec.startswith("keras:") or spec.endswith(".onnx"):
            kind = "a TensorFlow" if spec.startswith("keras:") else "an ONNX"
            raise UsageError(f"{spec} is {kind} model; `amanda {command}` is PyTorch-only "
                             f"({why})")


class _Workloads:
    """Loads each model spec once per command; checks them all up front so a
    typo fails before any model runs."""

    def __init__(self, *spec_lists):
        from amanda import models
        self._loaded = {}
        for specs in spec_lists:
            for spec in specs:
                try:
                    models.check(spec)
                except models.ModelSpecError as exc:
                    raise UsageError(str(exc)) from None

    def __call__(self, spec):
        from amanda import models
        if spec not in self._loaded:
            try:
                self._loaded[spec] = models.load(spec)
            except models.ModelSpecError as exc:
                raise UsageError(str(exc)) from None
        return self._loaded[spec]


def _write_json(out_dir, filename, data):
    """Write ``data`` as OUT/filename (staged: in place once the command succeeds)."""
    path = os.path.join(out_dir, filename)
    with open(staged(path), "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
    return path


# -- outputs: written under temporary names, renamed when the command succeeds ---------

_STAGED = []   # (temporary path, final path) of the running command


def staged(path):
    """The temporary path to write the output ``path`` to.

    Every file a command writes goes through here: it lands next to its final
    place as ``.amanda-partial-PID-NAME`` (same extension, so savefig and
    exporters still see the format) and :func:`commit_outputs` renames it to
    ``path`` when the command succeeds; :func:`discard_outputs` deletes it
    when it fails, so a failed command leaves neither a partial file nor a
    mix of this run's and the previous run's outputs."""
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temporary = os.path.join(folder, f".amanda-partial-{os.getpid()}-{name}")
    _STAGED.append((temporary, path))
    return temporary


def commit_outputs():
    """Move every staged output into place (the command succeeded)."""
    while _STAGED:
        temporary, final = _STAGED.pop(0)
        if os.path.exists(temporary):
            os.replace(temporary, final)


def discard_outputs():
    """Delete every staged output (the command failed)."""
    while _STAGED:
        temporary, _ = _STAGED.pop()
        if os.path.exists(temporary):
            os.remove(temporary)


# -- shared helpers for the tool commands ---------------------------------------------------

class MissingPiece(UsageError):
    """A subcommand needs a module that is not in this installation."""


#: The distribution name on PyPI (``amanda`` there is an unrelated project);
#: the import name and the command stay ``amanda``.
DISTRIBUTION = "amanda-instrument"


def install_hint(extra):
    """The ``pip install`` that brings ``extra`` ("" = the core)."""
    return f"pip install '{DISTRIBUTION}[{extra}]'" if extra else f"pip install {DISTRIBUTION}"


class MissingExtra(MissingPiece):
    """A module of an optional extra is not installed: the message is the
    whole one-line hint (printed as is, exit status 2)."""


# The extra of pyproject.toml that installs each optional top-level module;
# "" for the core dependencies (a broken install: reinstall amanda).
EXTRA_OF_MODULE = {
    "torch": "torch", "transformers": "torch",
    "tensorflow": "tensorflow", "keras": "tensorflow",
    "onnx": "onnx", "onnxruntime": "onnx", "onnxruntime_extensions": "onnx",
    "onnxscript": "onnx", "tf2onnx": "onnx",
    "matplotlib": "viz", "networkx": "viz",
    "numpy": "", "rich": "",
}


def missing_extra_message(command, error):
    """One line naming the command, the missing module and the ``pip install``
    that brings it, or None when ``error`` is not about an optional module."""
    module = (getattr(error, "name", None) or "").partition(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    if extra is None:
        return None
    return f"amanda {command}: needs {module}, which is not installed; {install_hint(extra)}"


def _installed(module):
    from amanda.runtime.backends import installed
    return installed(module)


def spec_modules(spec):
    """The optional modules a model spec needs to load (before it loads)."""
    if spec.startswith("keras:"):
        return ["tensorflow"]
    if spec.endswith(".onnx"):
        return ["onnx", "onnxruntime"]
    return ["torch"]


def require(command, specs, *modules):
    """Check, before anything runs, the modules the model specs and the
    chosen options need (:func:`require_modules`)."""
    needed = [m for spec in specs for m in spec_modules(spec)] + list(modules)
    require_modules(command, list(dict.fromkeys(needed)))


def require_modules(command, modules):
    """Fail with the one-line install hint for the first of ``modules`` not
    installed: called before any model loads or any file is written."""
    for module in modules:
        if not _installed(module):
            raise MissingExtra(missing_extra_message(command, ModuleNotFoundError(name=module)))


def _require(module, command, what):
    """Import ``module`` or fail naming the missing piece."""
    from amanda.runtime.backends import load
    if not _installed(module):
        raise MissingPiece(f"`amanda {command}` needs {what} ({module}), which is not "
                           "installed in this tree")
    return load(module)


def _load(spec, command, frameworks=("pytorch", "tensorflow", "onnx")):
    """Load one model spec, checking the command supports its framework."""
    workload = _Workloads([spec])(spec)
    if workload.framework not in frameworks:
        raise UsageError(f"`amanda {command}` works on {' and '.join(frameworks)} models; "
                         f"{spec} is a {workload.framework} model")
    return workload


def _progress(iterable, total, label):
    """Iterate with a progress bar on a terminal (rich, on stderr); plain
    iteration otherwise."""
    if total <= 1 or not use_rich(sys.stderr):
        yield from iterable
        return
    from rich.console import Console
    from rich.progress import track
    yield from track(iterable, total=total, description=label, transient=True,
                     console=Console(stderr=True))


def _safe_name(spec):
    """A file-name-safe form of a model spec (``keras:resnet50`` -> ``keras-resnet50``)."""
    base = os.path.basename(spec) if os.sep in spec else spec
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in base).strip("-") or "model"


def _add_model_argument(parser):
    parser.add_argument("model", metavar="MODEL", help=_model_help())


def _add_out_argument(parser, files):
    parser.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                        help=f"where to write {files} (default: {DEFAULT_OUT}/)")


def _relative_error(reference, value):
    import numpy as np
    reference, value = np.asarray(reference, np.float64), np.asarray(value, np.float64)
    norm = float(np.linalg.norm(reference))
    return float(np.linalg.norm(value - reference)) / norm if norm else float(np.abs(value).max())


def _sqnr_db(reference, value):
    import numpy as np
    reference, value = np.asarray(reference, np.float64), np.asarray(value, np.float64)
    noise = float(((value - reference) ** 2).sum())
    return float("inf") if noise == 0 else 10 * float(np.log10((reference ** 2).sum() / noise))


def _jsonable(value):
    """Tuples, NumPy values and other objects as JSON-friendly values."""
    import numpy as np
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _stderr(message):
    sys.stdout.flush()  # keep progress lines in order with the output
    print(message, file=sys.stderr, flush=True)

