"""The process's scratch folder for the files onnxruntime writes or reads
while amanda creates a session.

Two kinds of files: the model onnxruntime optimised ahead of the side
branches (``optimized_model_filepath``, its weights beside it; see
:mod:`amanda.runtime.onnx.session`), removed once read; and the empty sparse
file the external data of a lean model names (`stub`), which onnxruntime
opens but never reads.

One folder per process, made on first use and removed when the process
exits, rather than a temporary folder per creation: on ext4 (mounted with
``discard``, as here) removing a folder made the next creation's writes
slow. Measured on the small BERT: onnxruntime's optimisation with the model
written into a fresh folder removed after each creation took 32 ms, into
one kept folder whose files are removed 19.5 ms (the optimisation alone
takes about 19 ms). Each creation's files have names of their own
(`Files`), so creations on several threads never share one; a forked child
makes a folder of its own and never removes its parent's.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile
import threading

_lock = threading.Lock()
_folder = None   # (pid, path)
_stub_size = 0
_counter = itertools.count()

#: the file a lean model's shared initializers name (`stub`)
STUB = "amanda-shared.bin"


def folder():
    """The scratch folder's path (made now if this process has none)."""
    global _folder, _stub_size
    with _lock:
        if _folder is None or _folder[0] != os.getpid():
            path = tempfile.mkdtemp(prefix="amanda-onnx-")
            _folder = (os.getpid(), path)
            _stub_size = 0
            atexit.register(_remove, _folder)
        return _folder[1]


def _remove(made):
    if made[0] == os.getpid():
        shutil.rmtree(made[1], ignore_errors=True)


class Files:
    """The files of one creation in the scratch folder: ``<stem>.<suffix>``.

    Attributes:
        name: the folder's path (where `path` puts them).
        stem: the names' common start, unique in the process.
    """

    def __init__(self):
        self.name = folder()
        self.stem = f"amanda-{os.getpid()}-{next(_counter)}"
        self._made = []

    def path(self, suffix):
        """The path of this creation's file ``<stem><suffix>`` (removed by `cleanup`)."""
        path = os.path.join(self.name, self.stem + suffix)
        self._made.append(path)
        return path

    def owns(self, name):
        """Whether the file ``name`` (in the folder) is one of this creation's."""
        return name.startswith(self.stem + ".")

    def cleanup(self):
        """Remove this creation's files (twice is harmless)."""
        for path in self._made:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def stub(size):
    """The scratch folder's path, where `STUB` is an empty sparse file of at
    least ``size`` bytes (grown when a larger one is asked for; onnxruntime
    checks the external data's extent against it but reads none of it)."""
    global _stub_size
    path = folder()
    with _lock:
        if size > _stub_size:
            with open(os.path.join(path, STUB), "ab") as file:
                if file.tell() < size:
                    file.truncate(size)
            _stub_size = size
    return path
