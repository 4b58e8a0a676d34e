"""Backend runtimes: lower instrumented programs back to each backend and run them.

Eager drivers are activated by :func:`amanda.apply` for every backend whose
framework the user has already imported, so importing amanda never imports a
framework.
"""

from __future__ import annotations

import importlib
import sys

# framework module name -> module of its driver (exposes ``DRIVER`` with
# enter(session) / exit(session, restored)); graph-mode drivers included.
EAGER_DRIVERS = {
    "torch": "amanda.runtime.pytorch",
    "tensorflow": "amanda.runtime.tensorflow",
}


def eager_drivers():
    """The drivers of the frameworks imported so far, loaded on first use."""
    drivers = []
    for framework, module in EAGER_DRIVERS.items():
        if framework in sys.modules:
            drivers.append(importlib.import_module(module).DRIVER)
    return drivers
