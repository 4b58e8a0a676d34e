"""amanda.distributed: reports of 2 DDP ranks (gloo, 127.0.0.1) merged."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda import distributed  # noqa: E402
from amanda.models import load  # noqa: E402
from amanda.tools.flops import FlopsProfiler  # noqa: E402
from tests.tools.test_trace_viewer import check_perfetto_json  # noqa: E402


def test_counts_are_summed_and_a_disagreeing_rank_is_loud():
    same = {"forward": {"conv2d": 10, "linear": 2}}
    report = distributed.merge_counts([same, same])
    assert report["total"]["forward"] == {"conv2d": 20, "linear": 4} and report["consistent"]
    odd = {"forward": {"conv2d": 10, "linear": 3}}
    with pytest.warns(distributed.RankMismatchWarning, match="rank 1 .*linear: 2 vs 3"):
        report = distributed.merge_counts([same, odd], "FLOPs")
    assert not report["consistent"] and report["total"]["forward"]["linear"] == 5
    with pytest.raises(amanda.AmandaError, match="rank 1"):
        distributed.merge_counts([same, odd], strict=True)


def test_two_processes_one_trace_and_summed_flops(tmp_path, capsys):
    from amanda.cli import main
    single = FlopsProfiler()
    with amanda.apply(single):
        load("cnn").run()
    assert main(["flops", "cnn", "--nproc", "2", "--out", str(tmp_path)]) == 0
    (report,) = json.loads((tmp_path / "flops.json").read_text())
    assert report["ranks"] == 2 and report["consistent"]
    for phase in ("forward", "backward"):
        assert report["total"][phase] == {t: 2 * n for t, n in single.by_type(phase).items()}
    assert "every rank counted the same" in capsys.readouterr().out

    assert main(["trace", "cnn", "--nproc", "2", "--steps", "2", "--out", str(tmp_path)]) == 0
    loaded = check_perfetto_json(json.loads((tmp_path / "trace.json").read_text()))
    assert {pid for pid, _ in loaded["slices"]} == {0, 1}            # a track group per rank
    for rank in (0, 1):
        spans = [e for (pid, _), events in loaded["slices"].items() if pid == rank
                 for e in events]
        assert [e["name"] for e in spans if e["cat"] == "step"] == ["step 1"]
        assert sum(e["name"] == "conv2d" for e in spans) == 4
    assert len(loaded["flows"]) == 2 * 13                              # ids unique across ranks
