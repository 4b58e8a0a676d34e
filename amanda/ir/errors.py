"""Exceptions raised by the amanda IR."""

# The IR is the bottom layer, so it must import without the rest of amanda; once
# amanda.errors exists, IR errors become ordinary amanda errors for callers that
# catch the common base class.
try:
    from amanda.errors import AmandaError as _Base
except ImportError:
    _Base = Exception


class IRError(_Base):
    """An operation on the IR was refused or the IR is malformed."""


class VerificationError(IRError):
    """`Graph.verify` found a broken invariant.

    Attributes:
        op: The offending op, or None when the fault is not tied to one op
            (for example a bad graph output).
    """

    def __init__(self, message, op=None):
        super().__init__(message)
        self.op = op
