"""The driver lifecycle: a backend is patched while any thread is inside
``amanda.apply``, and restored exactly when the last one leaves.

``apply`` calls ``enter(session)`` on each backend's driver when a scope
opens and ``exit(session, restored)`` when it closes (also on errors;
:mod:`amanda.tool`). Every driver does the same bookkeeping around its own
hooks; `Driver` is that bookkeeping, once (imports no framework):

* per thread: the depth of the thread's scopes, kept on `amanda.controls.state`
  beside the thread's stack of sessions. `begin` runs when the thread's
  outermost scope opens, `end` when it closes; the scopes nested in it see
  `nested_enter` / `nested_exit`;
* per process: the threads inside a scope are counted under a lock;
  `install` runs when the first thread enters, `uninstall` when the last
  one leaves (also when `end` raised).

A failing `begin` or `install` leaves nothing behind: the thread's depth
and the count are restored (and `end` undoes a `begin` whose `install`
failed); ``apply`` does not call `exit` for a driver whose `enter` raised.
"""

from __future__ import annotations

import threading

from amanda import controls


class Driver:
    """Base of the backends' drivers; override the hooks (all do nothing)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0     # threads inside a scope

    # -- hooks -----------------------------------------------------------------------

    def install(self):
        """Patch the backend (process-wide; the first thread's scope opens)."""

    def uninstall(self):
        """Restore the backend (the last thread's last scope closed)."""

    def begin(self, session):
        """The thread's outermost scope opens (before `install`)."""

    def end(self, session):
        """The thread's outermost scope closes (before `uninstall`)."""

    def nested_enter(self, session):
        """A scope opens inside another one of this thread."""

    def nested_exit(self, session, restored):
        """A nested scope closes; ``restored`` is the session in force again."""

    # -- the lifecycle -----------------------------------------------------------------

    def depth(self):
        """How many scopes of this thread this driver is inside."""
        return controls.state.drivers.get(self, 0)

    def enter(self, session):
        depths = controls.state.drivers
        depth = depths.get(self, 0)
        if depth:
            self.nested_enter(session)
            depths[self] = depth + 1
            return
        depths[self] = 1
        try:
            self.begin(session)
        except BaseException:
            del depths[self]
            raise
        try:
            self._acquire()
        except BaseException:
            del depths[self]
            self.end(session)
            raise

    def exit(self, session, restored):
        depths = controls.state.drivers
        depth = depths[self] - 1
        if depth:
            depths[self] = depth
            self.nested_exit(session, restored)
            return
        del depths[self]
        try:
            self.end(session)
        finally:
            self._release()

    def _acquire(self):
        with self._lock:
            self._users += 1
            if self._users == 1:
                try:
                    self.install()
                except BaseException:
                    self._users -= 1
                    raise

    def _release(self):
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self.uninstall()
