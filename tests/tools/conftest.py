"""The tests of this folder run PyTorch models: skipped where torch is not installed."""

import pytest

pytest.importorskip("torch")
