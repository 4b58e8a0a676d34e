"""The CLI tests run the built-in PyTorch models: skipped where torch is not installed."""

import pytest

pytest.importorskip("torch")
