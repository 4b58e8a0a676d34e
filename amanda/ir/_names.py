"""Per-graph name tables that keep op and tensor names unique."""

from .errors import IRError


class NameTable:
    """Hands out unique names and tracks which object owns each one.

    A requested name that is already taken gets the first free ``_<k>`` suffix
    (``conv``, ``conv_1``, ...), the way torch.fx names nodes; a request without a
    name gets the next free number, which prints as ``%0``, ``%1``, ...
    """

    __slots__ = ("_owners", "_next_suffix", "_next_number")

    def __init__(self):
        self._owners = {}
        self._next_suffix = {}
        self._next_number = 0

    def claim(self, owner, requested=None):
        """Returns a fresh name for ``owner``, based on ``requested`` if given."""
        name = self._fresh_number() if requested is None else self._fresh_from(requested)
        self._owners[name] = owner
        return name

    def rename(self, owner, old, new):
        """Moves ``owner`` from ``old`` to ``new``.

        Raises:
            IRError: ``new`` is not a str or belongs to another object.
        """
        if not isinstance(new, str):
            raise IRError(f"names must be str, got {type(new).__name__}")
        holder = self._owners.get(new)
        if holder is not None and holder is not owner:
            raise IRError(f"name {new!r} is already used in this graph")
        if self._owners.get(old) is owner:
            del self._owners[old]
        self._owners[new] = owner

    def release(self, name, owner):
        """Frees ``name`` if ``owner`` still holds it."""
        if self._owners.get(name) is owner:
            del self._owners[name]

    def _fresh_number(self):
        number, owners = self._next_number, self._owners
        name = str(number)
        while name in owners:
            number += 1
            name = str(number)
        self._next_number = number + 1
        return name

    def _fresh_from(self, base):
        if not isinstance(base, str):
            raise IRError(f"names must be str, got {type(base).__name__}")
        if base not in self._owners:
            return base
        # Remembering the last suffix per base keeps repeated requests linear.
        k = self._next_suffix.get(base, 1)
        while f"{base}_{k}" in self._owners:
            k += 1
        self._next_suffix[base] = k + 1
        return f"{base}_{k}"
