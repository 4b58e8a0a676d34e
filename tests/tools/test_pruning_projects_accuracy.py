"""The accuracy runs behind docs/tools/pruning-projects.md (slow: about 20 s
on two cores). Each project is trained dense, then fine-tuned once
with its baseline (written the way the original works) and once with the
amanda tool, at the same sparsity: the two must reach the same accuracy, and
the figures the docs show must be what a run gives (within a few test
samples: another CPU may round differently)."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("tensorflow")

from benchmarks import pruning_projects  # noqa: E402

RECORDED = json.loads(pruning_projects.RESULTS.read_text())


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("project", sorted(pruning_projects.RUNS))
def test_amanda_tool_trains_to_the_accuracy_of_its_baseline(project, one_thread):
    result = pruning_projects.RUNS[project]()
    assert result["amanda"] == pytest.approx(result["baseline"], abs=1e-6), result
    recorded = RECORDED[project]
    for key in ("dense", "baseline", "amanda"):
        assert result[key] == pytest.approx(recorded[key], abs=TOLERANCE.get(project, 0.03)), \
            (key, result, recorded)


#: Projects whose fine-tuned accuracy moves between processes by more than
#: a few test samples: the tile-wise run's baseline (and amanda, equal to it
#: in every run) gave 0.932, 0.940, 0.960 and 0.972 in four processes on
#: 2026-11-29, with TF sessions of one thread each and equal dense
#: accuracies (what makes the fine-tuning differ between processes is not
#: found yet)
TOLERANCE = {"tile_wise": 0.05}
