"""`OpOrder`: the program order of a graph's ops, with O(1) insertion and removal.

A plain list makes "insert just before/after this op" cost a search for the op
plus a shift of everything behind it, so instrumenting every op of a graph was
quadratic. `OpOrder` is a doubly linked list (as torch.fx keeps its nodes) whose
links live in two dicts keyed by op, so the `Op` class carries no list fields
and membership is a dict lookup. ``None`` is the sentinel that closes the ring:
``next[None]`` is the first op and ``prev[None]`` the last.
"""


class OpOrder:
    """Ops in order; insertion next to a known op and removal are O(1)."""

    __slots__ = ("_next", "_prev", "_snapshot")

    def __init__(self):
        self._next = {None: None}
        self._prev = {None: None}
        self._snapshot = ()  # tuple of the ops, or None once the order changed

    def __len__(self):
        return len(self._next) - 1

    def __contains__(self, op):
        return op is not None and op in self._next

    def __iter__(self):
        """Walks the live list: do not insert or remove while iterating."""
        following = self._next
        op = following[None]
        while op is not None:
            yield op
            op = following[op]

    def snapshot(self):
        """A tuple of the ops in order, cached until the order next changes (so
        reading a graph many times between edits walks the links once)."""
        if self._snapshot is None:
            self._snapshot = tuple(self)
        return self._snapshot

    def first(self):
        """The first op, or None if empty."""
        return self._next[None]

    def last(self):
        """The last op, or None if empty."""
        return self._prev[None]

    def next_of(self, op):
        """The op after ``op``, or None if ``op`` is the last."""
        return self._next[op]

    def prev_of(self, op):
        """The op before ``op``, or None if ``op`` is the first."""
        return self._prev[op]

    def append(self, op):
        """Puts ``op`` (not already present) at the end."""
        self.insert_after(self._prev[None], op)

    def insert_before(self, anchor, op):
        """Puts ``op`` (not already present) just before ``anchor`` (present)."""
        self.insert_after(self._prev[anchor], op)

    def insert_after(self, anchor, op):
        """Puts ``op`` (not already present) just after ``anchor`` (present, or
        None for the front)."""
        following = self._next[anchor]
        self._snapshot = None
        self._next[anchor] = op
        self._next[op] = following
        self._prev[op] = anchor
        self._prev[following] = op

    def remove(self, op):
        """Takes ``op`` (present) out of the order."""
        before = self._prev.pop(op)
        after = self._next.pop(op)
        self._snapshot = None
        self._next[before] = after
        self._prev[after] = before
