"""Effective path (Qiu et al., CVPR 2019): the tool against a straightforward
implementation written here with plain loops over neurons, class paths on a
toy task, unknown ops, and the docs example."""

import pathlib
import re

import numpy as np
import pytest
import torch
from torch import nn

import amanda
from amanda.errors import ToolError
from amanda.tools import effective_path as ep
from amanda.tools.effective_path import EffectivePathTool

THETAS = (0.3, 0.5, 0.8, 1.0)


def run(model, x):
    # One call site: every step gets the same op ids (a Sequential's ops are
    # located at the line calling it).
    return model(x)


def extract(model, x, theta, **options):
    tool = EffectivePathTool(theta=theta, **options)
    with torch.no_grad(), amanda.apply(tool):
        run(model, x)
    return tool


# -- the reference: loops over neurons, no amanda -------------------------------------

def ref_select(contributions, theta):
    """Indices of the shortest prefix of the contributions (descending, ties
    by index) reaching theta of the sum of the positive ones."""
    ranked = sorted(range(len(contributions)), key=lambda i: (-contributions[i], i))
    total = 0.0
    for i in ranked:
        if contributions[i] > 0:
            total += contributions[i]
    if total <= 0:
        return []
    chosen, running = [], 0.0
    for i in ranked:
        chosen.append(i)
        running += contributions[i]
        if running >= theta * total:
            break
    return chosen


def ref_linear(layer, x, out_mask, theta):
    w = layer.weight.detach().numpy()
    in_mask = np.zeros(x.shape, bool)
    synapses = np.zeros((x.shape[0],) + w.shape, bool)
    for n in range(x.shape[0]):
        for j in range(w.shape[0]):
            if not out_mask[n, j]:
                continue
            contributions = [float(x[n, i]) * float(w[j, i]) for i in range(w.shape[1])]
            for i in ref_select(contributions, theta):
                in_mask[n, i] = True
                synapses[n, j, i] = True
    return in_mask, synapses


def ref_conv(layer, x, out_mask, theta):
    w = layer.weight.detach().numpy()
    (s, _), (p, _) = layer.stride, layer.padding
    _, cin, height, width = x.shape
    _, _, kh, kw = w.shape
    in_mask = np.zeros(x.shape, bool)
    synapses = np.zeros((x.shape[0],) + w.shape, bool)
    for n, co, oh, ow in zip(*np.nonzero(out_mask)):
        taps, contributions = [], []
        for ci in range(cin):
            for a in range(kh):
                for b in range(kw):
                    ih, iw = oh * s + a - p, ow * s + b - p
                    inside = 0 <= ih < height and 0 <= iw < width
                    value = float(x[n, ci, ih, iw]) * float(w[co, ci, a, b]) if inside else 0.0
                    taps.append((ci, a, b, ih, iw))
                    contributions.append(value)
        for k in ref_select(contributions, theta):
            ci, a, b, ih, iw = taps[k]
            in_mask[n, ci, ih, iw] = True
            synapses[n, co, ci, a, b] = True
    return in_mask, synapses


def ref_max_pool(layer, x, out_mask):
    k, s = layer.kernel_size, layer.stride
    in_mask = np.zeros(x.shape, bool)
    for n, c, oh, ow in zip(*np.nonzero(out_mask)):
        best = None
        for a in range(k):
            for b in range(k):
                value = x[n, c, oh * s + a, ow * s + b]
                if best is None or value > best[0]:
                    best = (value, oh * s + a, ow * s + b)
        in_mask[n, c, best[1], best[2]] = True
    return in_mask


def reference_paths(model, x, theta):
    """Per layer of a Sequential: critical output neurons and synapses."""
    activations = [x.numpy()]
    with torch.no_grad():
        for layer in model:
            activations.append(layer(torch.as_tensor(activations[-1])).numpy())
    logits = activations[-1]
    mask = np.zeros(logits.shape, bool)
    mask[np.arange(len(logits)), logits.argmax(1)] = True
    neurons, synapses = {}, {}
    for index in reversed(range(len(model))):
        layer, x_in = model[index], activations[index]
        neurons[str(index)] = mask
        if isinstance(layer, nn.Linear):
            mask, synapses[str(index)] = ref_linear(layer, x_in, mask, theta)
        elif isinstance(layer, nn.Conv2d):
            mask, synapses[str(index)] = ref_conv(layer, x_in, mask, theta)
        elif isinstance(layer, nn.MaxPool2d):
            mask = ref_max_pool(layer, x_in, mask)
        else:   # ReLU, Flatten
            mask = mask.reshape(x_in.shape)
    return neurons, synapses, mask


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 16), nn.ReLU(),
                         nn.Linear(16, 5))


def small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 6, 3, stride=2), nn.ReLU(), nn.Flatten(),
                         nn.Linear(6 * 2 * 2, 10), nn.ReLU(), nn.Linear(10, 4))


def assert_same_as_reference(model, x, theta):
    tool = extract(model, x, theta)
    neurons, synapses, input_mask = reference_paths(model, x, theta)
    assert len(tool.paths) == len(x)
    logits = model(x).detach().numpy()
    for n, path in enumerate(tool.paths):
        assert path.label == logits[n].argmax()
        assert path.unknown == []
        by_module = {path.modules[name]: name for name in path.neurons}
        assert set(by_module) == set(neurons)
        for module, mask in neurons.items():
            np.testing.assert_array_equal(path.neurons[by_module[module]], mask[n],
                                          err_msg=f"neurons of layer {module}, theta {theta}")
        assert {path.modules[name] for name in path.synapses} == set(synapses)
        for module, mask in synapses.items():
            np.testing.assert_array_equal(path.synapses[by_module[module]], mask[n],
                                          err_msg=f"synapses of layer {module}, theta {theta}")
        (pixels,) = path.inputs.values()
        np.testing.assert_array_equal(pixels, input_mask[n])
    return tool


@pytest.mark.parametrize("theta", THETAS)
def test_mlp_matches_the_loop_reference(theta):
    torch.manual_seed(1)
    tool = assert_same_as_reference(mlp(), torch.randn(4, 12), theta)
    # the path is a real subset: sparse at small theta, never empty
    densities = tool.paths[0].synapse_density()
    assert all(0 < d <= 1 for d in densities.values())


@pytest.mark.parametrize("theta", THETAS)
def test_cnn_matches_the_loop_reference(theta):
    torch.manual_seed(2)
    assert_same_as_reference(small_cnn(), torch.randn(3, 2, 10, 10), theta)


def test_larger_theta_gives_a_larger_path():
    torch.manual_seed(3)
    model, x = small_cnn(), torch.randn(2, 2, 10, 10)
    sizes = [sum(int(m.sum()) for m in extract(model, x, t).paths[0].synapses.values())
             for t in THETAS]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_selection_rule_edge_cases():
    select = ep.select_contributions
    # ties go to the lower index; the prefix stops as soon as theta is reached
    np.testing.assert_array_equal(select([[1.0, 3.0, 3.0, -5.0]], 0.4), [[False, True, False, False]])
    np.testing.assert_array_equal(select([[1.0, 3.0, 3.0, -5.0]], 0.5), [[False, True, True, False]])
    # negative contributions never count; no positive one: nothing is selected
    np.testing.assert_array_equal(select([[-1.0, 0.0]], 1.0), [[False, False]])
    np.testing.assert_array_equal(select([[2.0, -1.0, 1.0]], 1.0), [[True, False, True]])


def test_residual_add_keeps_both_branches_and_avg_pool_is_linear():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            y = torch.relu(self.conv(x)) + x
            return self.fc(self.pool(y).flatten(1))

    torch.manual_seed(0)
    tool = extract(Block(), torch.rand(2, 3, 5, 5), 0.5)
    path = tool.paths[0]
    assert path.unknown == []
    types = list(path.types.values())
    assert types[:4] == ["conv2d", "relu", "add", "adaptive_avg_pool2d"]
    # the input reaches the add twice: directly and through the convolution
    (pixels,) = path.inputs.values()
    add = next(name for name, t in path.types.items() if t == "add")
    direct = path.neurons[add]
    assert (pixels | direct).sum() >= direct.sum() and pixels.any()
    assert path.synapses[next(n for n, t in path.types.items() if t == "conv2d")].any()


def test_unknown_ops_are_reported_or_raise():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)

        def forward(self, x):
            return self.fc2(torch.cumsum(self.fc1(x), dim=1))

    torch.manual_seed(0)
    model, x = Odd(), torch.rand(2, 4)
    tool = extract(model, x, 0.5)
    with pytest.warns(UserWarning, match="cumsum"):
        path = tool.paths[0]     # steps are walked when the paths are read
    assert [t for _, t in path.unknown] == ["cumsum"]
    assert tool.unknown["cumsum"] == 1
    # the walk stops there: fc1 is not on the path
    assert set(path.types.values()) == {"linear", "cumsum"}
    strict = extract(model, x, 0.5, strict=True)
    with pytest.raises(ToolError, match="no extraction rule for op type 'cumsum'") as error:
        _ = strict.paths
    assert "cumsum" in str(error.value)


def test_bad_theta_and_output():
    with pytest.raises(ToolError, match="theta"):
        EffectivePathTool(theta=0)
    with pytest.raises(ToolError, match="no forward op matches"):
        _ = extract(mlp(), torch.rand(1, 12), 0.5, output="nowhere").paths


def test_output_by_module_path_and_labels_from_graph_walk():
    model = mlp()
    x = torch.rand(3, 12)
    tool = extract(model, x, 0.5, output="4")
    assert [p.label for p in tool.paths] == model(x).argmax(1).tolist()


# -- class paths on a toy task ---------------------------------------------------------

def toy_data(n, generator, means):
    labels = torch.randint(0, len(means), (n,), generator=generator)
    return means[labels] + 0.35 * torch.randn(n, means.shape[1], generator=generator), labels


@pytest.fixture(scope="module")
def toy():
    """A tiny MLP trained for a few hundred steps on three separable blobs."""
    generator = torch.Generator().manual_seed(0)
    means = 1.5 * torch.randn(3, 16, generator=generator)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(200):
        x, y = toy_data(64, generator, means)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, means, generator


def path_similarities(model, inputs, profile):
    tool = extract(model, inputs, 0.5)
    return np.array([p.similarity(profile[p.label]) if p.label in profile else 0.0
                     for p in tool.paths])


def test_class_path_similarity_separates_own_samples_from_noise(toy):
    model, means, generator = toy
    train, labels = toy_data(150, generator, means)
    accuracy = (model(train).argmax(1) == labels).float().mean().item()
    assert accuracy > 0.95
    profile = extract(model, train, 0.5).class_paths()
    assert set(profile) == {0, 1, 2} and sum(p.count for p in profile.values()) == 150
    held_out, _ = toy_data(60, generator, means)
    noise = 1.5 * torch.randn(60, 16, generator=generator)
    own = path_similarities(model, held_out, profile)
    other = path_similarities(model, noise, profile)
    # a threshold between the two groups classifies most samples right (AUC)
    auc = (own[:, None] > other[None, :]).mean() + 0.5 * (own[:, None] == other[None, :]).mean()
    print(f"\nsimilarity to class path: own {own.mean():.3f} (min {own.min():.3f}), "
          f"noise {other.mean():.3f} (max {other.max():.3f}), AUC {auc:.3f}")
    assert own.mean() > other.mean() + 0.1
    assert auc > 0.9


# -- docs -----------------------------------------------------------------------------

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "tools" / "effective-path.md"


def test_docs_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert blocks
    namespace = {"__name__": "__docs__"}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)  # noqa: S102 (the docs example)
    assert namespace["tool"].paths


# -- the same tool on the ONNX export --------------------------------------------------

def test_same_masks_on_torch_and_onnx_versions_of_the_cnn():
    try:
        import onnxruntime

        import amanda.runtime.onnx
    except ImportError as error:
        pytest.skip(f"the ONNX frontend/runtime is not available: {error}")
    import io
    import warnings
    model = small_cnn().eval()
    torch.manual_seed(4)
    x = torch.randn(3, 2, 10, 10)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the TorchScript exporter's deprecation notice
        torch.onnx.export(model, (x,), buffer, dynamo=False, opset_version=13,
                          input_names=["x"], output_names=["y"])
    for theta in (0.5, 0.9):
        on_torch = extract(model, x, theta)
        on_onnx = EffectivePathTool(theta=theta)
        with amanda.apply(on_onnx):   # the same tool, through the ONNX graph pass
            onnxruntime.InferenceSession(buffer.getvalue()).run(None, {"x": x.numpy()})
        assert len(on_onnx.paths) == len(on_torch.paths) == 3
        for mine, theirs in zip(on_torch.paths, on_onnx.paths):
            assert theirs.unknown == [] and mine.label == theirs.label
            assert list(mine.types.values()) == list(theirs.types.values())
            for a, b in zip(mine.neurons.values(), theirs.neurons.values()):
                np.testing.assert_array_equal(a, b)
            assert len(mine.synapses) == len(theirs.synapses) == 4
            for a, b in zip(mine.synapses.values(), theirs.synapses.values()):
                np.testing.assert_array_equal(a, b)
            (pixels,) = mine.inputs.values()
            np.testing.assert_array_equal(pixels, theirs.inputs["x"])
