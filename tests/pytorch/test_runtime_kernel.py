"""The shared runtime kernel: the driver lifecycle (amanda.runtime.driver) and
the analysis-time probe (amanda.runtime.probe), on their own (no framework).

The backends' drivers and probes are these classes with hooks; what the
backends do with them is tested per backend (tests/onnx, tests/tensorflow).
"""

import threading

import pytest

from amanda import controls
from amanda.errors import BackendError
from amanda.runtime import probe
from amanda.runtime.driver import Driver


class Recording(Driver):
    def __init__(self, fail_install=0):
        super().__init__()
        self.log = []
        self.installed = False
        self.fail_install = fail_install

    def install(self):
        if self.fail_install:
            self.fail_install -= 1
            raise RuntimeError("install failed")
        assert not self.installed
        self.installed = True
        self.log.append("install")

    def uninstall(self):
        assert self.installed
        self.installed = False
        self.log.append("uninstall")

    def begin(self, session):
        self.log.append(("begin", session))

    def end(self, session):
        self.log.append(("end", session))

    def nested_enter(self, session):
        self.log.append(("nested_enter", session))

    def nested_exit(self, session, restored):
        self.log.append(("nested_exit", session, restored))


def test_nested_scopes_install_once_and_hooks_see_the_outermost_scope():
    driver = Recording()
    driver.enter("outer")
    driver.enter("inner")
    assert driver.depth() == 2 and driver.installed
    driver.exit("inner", "outer")
    assert driver.installed
    driver.exit("outer", None)
    assert not driver.installed and driver.depth() == 0
    assert driver.log == [("begin", "outer"), "install", ("nested_enter", "inner"),
                          ("nested_exit", "inner", "outer"), ("end", "outer"), "uninstall"]
    assert driver not in controls.state.drivers


def test_the_last_thread_out_uninstalls():
    driver = Recording()
    entered, release = threading.Event(), threading.Event()

    def other():
        driver.enter("theirs")
        entered.set()
        release.wait(10)
        driver.exit("theirs", None)

    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10)
    driver.enter("mine")          # a thread of its own: begin again, no second install
    assert driver.depth() == 1
    driver.exit("mine", None)
    assert driver.installed       # the other thread is still inside its scope
    release.set()
    thread.join(10)
    assert not driver.installed
    assert driver.log.count("install") == 1 and driver.log.count("uninstall") == 1
    assert driver.log.count(("begin", "mine")) == 1 and driver.log.count(("end", "mine")) == 1


def test_a_failing_install_leaves_nothing_behind():
    driver = Recording(fail_install=1)
    with pytest.raises(RuntimeError, match="install failed"):
        driver.enter("s")
    assert driver.depth() == 0 and driver._users == 0 and not driver.installed
    assert driver.log == [("begin", "s"), ("end", "s")]   # the begin is undone
    driver.enter("s")             # the next scope installs
    assert driver.installed
    driver.exit("s", None)
    assert not driver.installed


def test_end_raising_still_uninstalls():
    class Failing(Recording):
        def end(self, session):
            raise KeyError("end")

    driver = Failing()
    driver.enter("s")
    with pytest.raises(KeyError):
        driver.exit("s", None)
    assert not driver.installed and driver.depth() == 0


class Doubling:
    def evaluate(self, items):
        return [2 * item for item in items]


def test_evaluate_asks_the_probe_of_its_backend_only():
    with pytest.raises(BackendError, match="outside"):
        probe.evaluate("b1", 1, "outside")
    with probe.probing("b1", Doubling()):
        assert probe.evaluate("b1", 3, "outside") == 6
        assert probe.evaluate("b1", (1, 2), "outside") == [2, 4]
        assert probe.evaluate("b1", ["ab"], "outside", item=len) == [4]
        with pytest.raises(BackendError, match="no b2"):
            probe.evaluate("b2", 3, "no b2")
        inner = Doubling()
        with probe.probing("b1", inner):
            assert probe.current("b1") is inner
        assert probe.current("b1") is not inner and probe.current("b1") is not None
    assert probe.current("b1") is None


def test_a_probe_is_per_thread():
    seen = []
    with probe.probing("b1", Doubling()):
        thread = threading.Thread(target=lambda: seen.append(probe.current("b1")))
        thread.start()
        thread.join(10)
    assert seen == [None]
