"""Protobuf values the ONNX frontend keeps in IR attrs.

`ProtoAttr` wraps a message (a weight, a tensor attribute, a type) so that
IR hashing and printing see a digest of its bytes, not the bytes.
"""

from __future__ import annotations

import hashlib

__all__ = ["ProtoAttr"]


class ProtoAttr:
    """A protobuf message kept in IR attrs (a weight, a tensor attribute, a type).

    Its ``repr`` is the message type and a digest of its bytes, so structural
    hashes cover the content without printing it; JSON keeps only that repr.
    Treat the message as read-only: IR copies share it.

    Attributes:
        message: the protobuf message.
    """

    __slots__ = ("_digest", "message")

    def __init__(self, message):
        self.message = message
        self._digest = None

    @property
    def digest(self):
        """SHA-256 of the serialized message (computed once)."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.message.SerializeToString()).hexdigest()
        return self._digest

    def to_numpy(self):
        """The value of a ``TensorProto`` as a NumPy array."""
        from onnx import numpy_helper

        return numpy_helper.to_array(self.message)

    def __eq__(self, other):
        return isinstance(other, ProtoAttr) and other.digest == self.digest

    def __hash__(self):
        return hash(self.digest)

    def __repr__(self):
        return f"onnx.{type(self.message).__name__}(sha256:{self.digest[:24]})"


def _text(data):
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return bytes(data)
