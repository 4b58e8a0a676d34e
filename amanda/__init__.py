"""amanda: unified instrumentation for deep neural networks.

Write a tool once — analysis routines that choose where to instrument and
instrumentation routines that run there — and apply it to PyTorch eager,
TensorFlow graph mode or ONNX models with ``with amanda.apply(tool): ...``.

Importing amanda never imports a framework; a backend loads when first used.
"""

from amanda import tool
from amanda.context import Action, OpContext
from amanda.controls import (ad_disabled, ad_enabled, cache_disabled, cache_enabled,
                             disabled, enabled)
from amanda.errors import (AmandaError, BackendError, DependencyError, EagerFallbackWarning,
                           NotBitExactWarning, NotInstrumentedWarning, ToolError)
from amanda.export import export
from amanda.instrumentation import instrument
from amanda.runtime import evaluate
from amanda.tool import Tool, apply

__version__ = "0.1.0"

__all__ = [
    "Action", "AmandaError", "BackendError", "DependencyError", "EagerFallbackWarning",
    "NotBitExactWarning",
    "NotInstrumentedWarning",
    "OpContext", "Tool",
    "ToolError", "ad_disabled", "ad_enabled", "apply", "cache_disabled", "cache_enabled",
    "disabled", "enabled", "evaluate", "export", "instrument", "tool", "tools", "ir", "portable",
]


def __getattr__(name):
    # Subpackages load on first access so `import amanda` stays light.
    if name in ("tools", "ir", "frontends", "passes", "runtime", "portable"):
        from amanda.runtime.backends import load
        return load(f"amanda.{name}")
    raise AttributeError(f"module 'amanda' has no attribute {name!r}")
