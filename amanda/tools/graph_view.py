"""Readable drawings of a traced IR graph: Graphviz DOT/SVG, or self-contained HTML.

:func:`build_view` turns an :class:`amanda.ir.Graph` into a small drawing
model (:class:`View`) a person can read:

* an op node shows its type, its module path (PyTorch) or name scope (graph
  backends) and the parameters it reads by name (``weight 32x3x3x3``), not
  ``%parameter_3``; edges carry the tensor's shape;
* forward ops are blue boxes, backward ops orange; graph inputs are ellipses;
* forward ops sit in nested clusters of their module path; repeated sibling
  modules with the same ops (``layer.1`` ... ``layer.11`` after ``layer.0``)
  collapse into one node, and so do the many backward ops of one forward op
  (an LSTM's hundreds of autograd nodes);
* TensorFlow's variable initialisers (``.../Initializer/...``, ``Assign``,
  ``IsInitialized``), constants and variable handles are hidden unless
  ``show_init=True``; a variable read is drawn as a parameter of its reader.

:func:`to_dot` writes the view as DOT (:func:`to_svg` runs Graphviz's ``dot``
on it), :func:`to_html` as one HTML file with an inline SVG drawn by a layered
layout, with pan and zoom, that needs nothing installed.

Example::

    from amanda.tools.graph_view import build_view, to_html
    view = build_view(tracer.graph)
    open("graph.html", "w").write(to_html(view, title="cnn"))
"""

from __future__ import annotations

import collections
import html
import re
import shutil
import subprocess

from amanda.runtime import vocabulary

__all__ = ["View", "build_view", "name_parameters", "to_dot", "to_html", "to_svg"]

FORWARD_FILL, BACKWARD_FILL, COLLAPSED_FILL = "#dbe9f7", "#fde3cc", "#e8e8e8"
# a forward op owning more backward ops than this gets one summary node
BACKWARD_GROUP = 6


def _words(op):
    """The vocabulary of an op's backend: which ops are initialisers, constants
    and variables (TF's), or None."""
    return vocabulary.of(op.namespace)


class Node:
    """One box (or ellipse) of the drawing.

    Attributes:
        id: unique DOT identifier.
        label: the lines shown.
        kind: ``"forward"``, ``"backward"``, ``"input"`` or ``"collapsed"``.
        module: the module path the node is drawn in ("" at the top).
        ops: the IR ops it stands for.
    """

    __slots__ = ("id", "label", "kind", "module", "ops")

    def __init__(self, id, label, kind, module="", ops=()):
        self.id, self.label, self.kind, self.module, self.ops = id, label, kind, module, list(ops)


class View:
    """Nodes and labelled edges ``(source id, target id, label)`` to draw."""

    __slots__ = ("nodes", "edges", "hidden")

    def __init__(self):
        self.nodes = {}
        self.edges = []
        self.hidden = 0   # ops left out (initialisers, constants)


# -- naming ----------------------------------------------------------------------------

def name_parameters(graph, model):
    """Give the parameter inputs of an eager trace their names in ``model``.

    The trace knows a parameter's shape and the module of the op reading it;
    the module's own parameters of that shape, in order, give the name
    (``conv_layer1.weight``), stored in the tensor's ``attrs["param"]``.

    Args:
        graph: a PyTorch eager trace (:class:`amanda.ir.Graph`).
        model: the ``torch.nn.Module`` that ran.
    """
    modules = dict(model.named_modules())
    taken = set()
    for op in graph.ops:
        module = modules.get(op.attrs.get("module"))
        if module is None:
            continue
        prefix = op.attrs["module"] + "." if op.attrs["module"] else ""
        for tensor in op.inputs:
            if tensor.producer is not None or tensor.attrs.get("kind") != "parameter" \
                    or "param" in tensor.attrs:
                continue
            for name, parameter in module.named_parameters(recurse=False):
                key = prefix + name
                if key not in taken and list(parameter.shape) == tensor.attrs.get("shape"):
                    tensor.attrs["param"] = key
                    taken.add(key)
                    break


def _shape(tensor):
    shape = tensor.attrs.get("shape")
    if shape is None:
        return ""
    return "x".join("?" if d is None or d == -1 else str(d) for d in shape) or "scalar"


def _module(op):
    if "module" in op.attrs:
        return op.attrs["module"] or ""
    return op.name.rpartition("/")[0]


def _parameter_name(tensor, reader_module):
    """The short name of a weight an op reads, or None for an activation."""
    producer = tensor.producer
    if producer is None:
        if tensor.attrs.get("kind") not in ("parameter", "buffer"):
            return None
        name = tensor.attrs.get("param")
        if name is None:
            return tensor.attrs.get("kind")
    else:
        words = _words(producer)
        handle = None if words is None else words.variable_of(producer)
        if handle is None:
            return None
        name = handle.name
    if reader_module and name.startswith(reader_module):
        name = name[len(reader_module):].lstrip("./")
    return name


# -- what to hide ----------------------------------------------------------------------

def _is_initialiser(op):
    words = _words(op)
    if words is None:
        return False
    return op.type in words.INITIALISER_TYPES or bool(
        set(op.name.split("/")) & words.INITIALISER_SCOPES)


def hidden_ops(graph, show_init=False):
    """The ops a drawing leaves out: TF initialisers (and every op only they
    read), constants, variable handles and variable reads (drawn as
    parameters of their readers)."""
    hidden = set()
    if not show_init:
        hidden = {op for op in graph.ops if _is_initialiser(op)}
        changed = True
        while changed:   # ops whose every consumer is hidden
            changed = False
            for op in graph.ops:
                if op in hidden:
                    continue
                users = [u for t in op.outputs for u in _consumers(t)]
                if users and all(u in hidden for u in users):
                    hidden.add(op)
                    changed = True
    for op in graph.ops:
        words = _words(op)
        if words is not None and (op.type in words.FOLDED_TYPES
                                  or words.variable_of(op) is not None):
            hidden.add(op)
    return hidden


def _consumers(tensor):
    return [op for op, _ in tensor.uses]


# -- collapsing repeated blocks --------------------------------------------------------

_INDEXED = re.compile(r"^(.*?)(\d+)$")


def _signature(ops, module):
    """The op types and relative module paths of a module's ops."""
    start = len(module)
    return tuple((op.type, _module(op)[start:]) for op in ops)


def _repeated_modules(forward_ops):
    """``{module path: first sibling}`` for modules that repeat an earlier
    sibling exactly (same ops under the same relative paths); siblings are
    paths equal up to a trailing number (``layer.3``, ``block_2``)."""
    by_module = collections.defaultdict(list)
    for op in forward_ops:
        path = _module(op)
        parts = re.split(r"([./])", path)
        for end in range(1, len(parts) + 1, 2):
            by_module["".join(parts[:end])].append(op)
    families = collections.defaultdict(list)
    for path in by_module:
        match = _INDEXED.match(path)
        if match and match.group(1)[-1:] in ("", ".", "/", "_"):
            families[match.group(1)].append((int(match.group(2)), path))
    repeats = {}
    for members in families.values():
        members.sort()
        first = None
        for _, path in members:
            if first is not None and _signature(by_module[path], path) == _signature(
                    by_module[first], first):
                repeats[path] = first
            else:
                first = path
    # a module inside a collapsed one is collapsed with it
    return {path: first for path, first in repeats.items()
            if not any(path.startswith(other + sep) for other in repeats for sep in "./")}


def _collapsed_owner(path, repeats):
    for candidate in repeats:
        if path == candidate or path.startswith(candidate + ".") or \
                path.startswith(candidate + "/"):
            return candidate
    return None


# -- the view --------------------------------------------------------------------------

def build_view(graph, show_init=False, collapse=True, forward_only=False):
    """The drawing model of ``graph``.

    Args:
        graph: an :class:`amanda.ir.Graph` (eager trace or lifted graph).
        show_init: keep TF initialiser ops.
        collapse: merge repeated sibling modules and large backward groups.
        forward_only: leave backward ops out.

    Returns:
        A :class:`View`.
    """
    view = View()
    hidden = hidden_ops(graph, show_init)
    view.hidden = len(hidden)
    ops = [op for op in graph.ops if op not in hidden
           and not (forward_only and op.attrs.get("backward"))]
    forward = [op for op in ops if not op.attrs.get("backward")]
    repeats = _repeated_modules(forward) if collapse else {}
    node_of = {}

    for op in forward:
        owner = _collapsed_owner(_module(op), repeats)
        if owner is not None:
            node_of[op] = _collapsed_node(view, owner, repeats, op)
            continue
        node = Node(f"op{len(view.nodes)}", _op_label(op), "forward", _module(op), [op])
        view.nodes[node.id] = node
        node_of[op] = node
    _add_backward(view, [op for op in ops if op.attrs.get("backward")], node_of, collapse)
    _add_edges(view, graph, ops, node_of)
    return view


def _collapsed_node(view, owner, repeats, op):
    first = repeats[owner]
    family = [p for p, f in repeats.items() if f == first]
    node_id = "collapsed:" + first
    node = view.nodes.get(node_id)
    if node is None:
        span = f"{family[0]} … {family[-1]}" if len(family) > 1 else family[0]
        parent = re.split(r"[./][^./]*$", first)[0] if re.search(r"[./]", first) else ""
        node = view.nodes[node_id] = Node(node_id, [], "collapsed", parent)
        node.label = [span, f"×{len(family)}, each like {first}"]
    node.ops.append(op)
    node.label[2:] = [f"{len(node.ops) // len(family)} ops each"]
    return node


def _add_backward(view, backward, node_of, collapse):
    groups = collections.defaultdict(list)
    owner_of = {}
    for op in backward:
        forward = _forward_op(op)
        key = node_of.get(forward).id if forward in node_of else None
        groups[key].append(op)
        owner_of[op] = forward
    for key, members in groups.items():
        forward_node = view.nodes.get(key)
        big = collapse and key is not None and (
            len(members) > BACKWARD_GROUP or forward_node.kind == "collapsed")
        if big:
            types = collections.Counter(op.type for op in members)
            top = ", ".join(f"{t} ×{n}" for t, n in types.most_common(3))
            node = Node(f"bw{len(view.nodes)}", [f"backward of {forward_node.label[0]}",
                                                 f"{len(members)} ops: {top}"],
                        "backward", "", members)
            view.nodes[node.id] = node
            for op in members:
                node_of[op] = node
            continue
        for op in members:
            forward = owner_of[op]
            where = _module(forward) if forward is not None else ""
            label = [op.type] + ([f"← {where}"] if where else [])
            node = Node(f"op{len(view.nodes)}", label, "backward", "", [op])
            view.nodes[node.id] = node
            node_of[op] = node


def _forward_op(op):
    from amanda.tools.graph import forward_op_of
    return forward_op_of(op)


def _op_label(op):
    module = _module(op)
    label = [op.type]
    if module:
        label.append(module)
    for tensor in op.inputs:
        name = _parameter_name(tensor, module)
        if name is not None:
            label.append(f"{name} {_shape(tensor)}".strip())
    return label


def _add_edges(view, graph, ops, node_of):
    seen = set()
    inputs = {}
    for op in ops:
        target = node_of[op]
        for tensor in op.inputs:
            producer = tensor.producer
            if producer is None or producer not in node_of:
                if producer is not None or _parameter_name(tensor, "") is not None \
                        or tensor.attrs.get("kind") == "gradient":
                    continue   # hidden producer, a weight (in the label) or a seed
                source = inputs.get(tensor.name)
                if source is None:
                    source = Node(f"in{len(view.nodes)}", [tensor.name, _shape(tensor)],
                                  "input")
                    view.nodes[source.id] = inputs[tensor.name] = source
            else:
                source = node_of[producer]
            if source is target:
                continue
            key = (source.id, target.id)
            if key not in seen:
                seen.add(key)
                view.edges.append((source.id, target.id, _shape(tensor)))


# -- DOT / SVG -------------------------------------------------------------------------

def _quote(text):
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _dot_node(node, cluster=None):
    lines = node.label
    if cluster is not None and node.kind == "forward" and len(lines) > 1 \
            and lines[1] == cluster:
        lines = lines[:1] + lines[2:]    # the cluster's title says where it is
    label = "\\n".join(str(line).replace("\\", "\\\\").replace('"', '\\"')
                       for line in lines)
    style = {
        "forward": f'shape=box, style="rounded,filled", fillcolor="{FORWARD_FILL}"',
        "backward": f'shape=box, style="rounded,filled,dashed", fillcolor="{BACKWARD_FILL}"',
        "collapsed": f'shape=box3d, style=filled, fillcolor="{COLLAPSED_FILL}"',
        "input": 'shape=ellipse, style=filled, fillcolor="#ffffff"',
    }[node.kind]
    return f'{_quote(node.id)} [label="{label}", {style}];'


def to_dot(view, title=None):
    """DOT text of a :class:`View`: forward ops in nested module clusters,
    backward ops in a cluster of their own below."""
    lines = ["digraph amanda {", "  rankdir=TB; newrank=true; nodesep=0.25; ranksep=0.35;",
             '  node [fontname="Helvetica", fontsize=10, margin="0.12,0.04"];',
             '  edge [fontname="Helvetica", fontsize=8, color="#555555"];']
    if title:
        lines.append(f"  label={_quote(title)}; labelloc=t; fontname=Helvetica; fontsize=14;")
    tree = collections.defaultdict(list)
    for node in view.nodes.values():
        if node.kind != "backward":
            tree[node.module].append(node)
    lines += _dot_cluster(tree, "", 1)
    backward = [n for n in view.nodes.values() if n.kind == "backward"]
    if backward:
        lines.append('  subgraph "cluster_backward" {')
        lines.append('    label="backward"; style="rounded,dashed"; color="#d08040";')
        lines += ["    " + _dot_node(n) for n in backward]
        lines.append("  }")
    for source, target, label in view.edges:
        backward_edge = view.nodes[source].kind == "backward" or \
            view.nodes[target].kind == "backward"
        extra = ', color="#d08040"' if backward_edge else ""
        lines.append(f"  {_quote(source)} -> {_quote(target)} [label={_quote(label)}{extra}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_cluster(tree, path, depth, drawn=False):
    indent = "  " * depth
    lines = [indent + _dot_node(n, path if drawn else None) for n in tree.get(path, ())]
    children = sorted({_child(p, path) for p in tree if _inside(p, path)})
    for child in children:
        count = sum(len(nodes) for p, nodes in tree.items() if p == child or _inside(p, child))
        if count < 2:     # a box of one: its label already names the module
            lines += _dot_cluster(tree, child, depth)
            continue
        lines.append(f"{indent}subgraph {_quote('cluster_' + child)} {{")
        short = child[len(path):].lstrip("./") or child
        lines.append(f'{indent}  label={_quote(short)}; style="rounded"; color="#99aabb";'
                     ' fontsize=9; labeljust=l;')
        lines += _dot_cluster(tree, child, depth + 1, drawn=True)
        lines.append(indent + "}")
    return lines


def _inside(candidate, path):
    if candidate == path:
        return False
    return path == "" or candidate.startswith(path + ".") or candidate.startswith(path + "/")


def _child(candidate, path):
    rest = candidate[len(path):].lstrip("./") if path else candidate
    head = re.split(r"[./]", rest)[0]
    if not path:
        return head
    return path + candidate[len(path)] + head


def to_svg(view, path, title=None):
    """Render the view with Graphviz's ``dot`` to an SVG file.

    Returns:
        ``path``, or None when ``dot`` is not installed.

    Raises:
        RuntimeError: ``dot`` failed.
    """
    return render(view, path, "svg", title)


def render(view, path, fmt, title=None):
    """Render the view's DOT (:func:`to_dot`) with Graphviz's ``dot`` to
    ``path`` in ``fmt`` (``svg``, ``png``): one drawing, the same in every
    format.

    Returns:
        ``path``, or None when ``dot`` is not installed.

    Raises:
        RuntimeError: ``dot`` failed.
    """
    dot = shutil.which("dot")
    if dot is None:
        return None
    options = ["-Gdpi=96"] if fmt == "png" else []
    done = subprocess.run([dot, f"-T{fmt}", *options, "-o", str(path)],
                          input=to_dot(view, title).encode(), capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"dot failed: {done.stderr.decode(errors='replace').strip()}")
    return path


# -- self-contained HTML ---------------------------------------------------------------

_CHAR_W, _LINE_H, _PAD, _GAP_X, _GAP_Y = 6.2, 13, 8, 24, 46


def _layout(view):
    """Positions ``node id -> (x, y, w, h)``: forward ops (and inputs) on the
    left, the main chain in one column, the backward ops beside them; on each
    side a node's row is its longest path from a source on that side, and
    nodes of a row are ordered by the mean column of their sources."""
    size = {n: (max(len(str(line)) for line in node.label) * _CHAR_W + 2 * _PAD,
                len(node.label) * _LINE_H + 2 * _PAD) for n, node in view.nodes.items()}
    positions, left = {}, 20.0
    for side in ("forward", "backward"):
        members = {n for n, node in view.nodes.items()
                   if (node.kind == "backward") == (side == "backward")}
        if not members:
            continue
        edges = [(a, b, label) for a, b, label in view.edges if a in members and b in members]
        placed = _layered(view, members, edges, size, left)
        positions.update(placed)
        left = max(x + w for x, _, w, _ in placed.values()) + 4 * _GAP_X
    return positions


def _layered(view, members, edges, size, left):
    incoming = collections.defaultdict(list)
    for source, target, _ in edges:
        incoming[target].append(source)
    order = [n for n in _topological(view, incoming, edges) if n in members]
    row = {}
    for node_id in order:
        row[node_id] = 1 + max((row.get(s, -1) for s in incoming[node_id]), default=-1)
    rows = collections.defaultdict(list)
    for node_id in order:
        rows[row[node_id]].append(node_id)
    # the first column is as wide as its widest box, boxes centred on it
    column = max(size[rows[r][0]][0] for r in rows)
    x_of, positions, y = {}, {}, 20.0
    for r in sorted(rows):
        ranked = sorted(rows[r], key=lambda n: _mean([x_of[s] for s in incoming[n]
                                                      if s in x_of], 0.0))
        x = left
        for i, n in enumerate(ranked):
            w, h = size[n]
            positions[n] = (x + (column - w) / 2, y, w, h) if i == 0 else (x, y, w, h)
            x_of[n] = positions[n][0] + w / 2
            x = (left + column if i == 0 else x + w) + _GAP_X * 2
        y += max(size[n][1] for n in ranked) + _GAP_Y
    return positions


def _topological(view, incoming, edges=None):
    """Node ids, every source before its targets (ties: insertion order)."""
    pending = {n: len(set(incoming[n])) for n in view.nodes}
    outgoing = collections.defaultdict(set)
    for source, target, _ in (view.edges if edges is None else edges):
        outgoing[source].add(target)
    ready = [n for n in view.nodes if pending[n] == 0]
    rank = {n: i for i, n in enumerate(view.nodes)}
    order = []
    while ready:
        ready.sort(key=rank.get)
        node = ready.pop(0)
        order.append(node)
        for target in outgoing[node]:
            pending[target] -= 1
            if pending[target] == 0:
                ready.append(target)
    return order + [n for n in view.nodes if n not in set(order)]   # cycles: appended


def _mean(values, default):
    return sum(values) / len(values) if values else default


def to_html(view, title="graph"):
    """One HTML file drawing the view as an inline SVG (layered layout, pan
    with the mouse, zoom with the wheel); needs no Graphviz."""
    positions = _layout(view)
    width = max((x + w for x, _, w, _ in positions.values()), default=100) + 20
    height = max((y + h for _, y, _, h in positions.values()), default=100) + 20
    fills = {"forward": FORWARD_FILL, "backward": BACKWARD_FILL, "collapsed": COLLAPSED_FILL,
             "input": "#ffffff"}
    parts = []
    for source, target, label in view.edges:
        sx, sy, sw, sh = positions[source]
        tx, ty, tw, _ = positions[target]
        x1, y1, x2, y2 = sx + sw / 2, sy + sh, tx + tw / 2, ty
        colour = "#d08040" if "backward" in (view.nodes[source].kind,
                                             view.nodes[target].kind) else "#667"
        parts.append(f'<path d="M{x1:.0f},{y1:.0f} C{x1:.0f},{y1 + 30:.0f} {x2:.0f},'
                     f'{y2 - 30:.0f} {x2:.0f},{y2:.0f}" stroke="{colour}" fill="none" '
                     'marker-end="url(#arrow)"/>')
        if label:   # beside the edge where it leaves its source, not across it
            parts.append(f'<text x="{x1 + 5:.0f}" y="{y1 + 12:.0f}" '
                         f'class="edge">{html.escape(label)}</text>')
    for node_id, node in view.nodes.items():
        x, y, w, h = positions[node_id]
        radius = h / 2 if node.kind == "input" else 4
        dash = ' stroke-dasharray="4 2"' if node.kind == "backward" else ""
        tip = html.escape(", ".join(op.name for op in node.ops[:20]))
        parts.append(f'<g><title>{tip}</title><rect x="{x:.0f}" y="{y:.0f}" width="{w:.0f}" '
                     f'height="{h:.0f}" rx="{radius:.0f}" fill="{fills[node.kind]}" '
                     f'stroke="#445"{dash}/>')
        for i, line in enumerate(node.label):
            weight = ' font-weight="bold"' if i == 0 else ""
            parts.append(f'<text x="{x + w / 2:.0f}" y="{y + _PAD + (i + 0.8) * _LINE_H:.0f}" '
                         f'text-anchor="middle"{weight}>{html.escape(str(line))}</text>')
        parts.append("</g>")
    return _HTML.format(title=html.escape(title), width=f"{width:.0f}",
                        height=f"{height:.0f}", body="\n".join(parts),
                        legend=html.escape(f"{len(view.nodes)} nodes, {len(view.edges)} edges"
                                           f"; {view.hidden} initialiser/constant ops hidden"))


_HTML = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ margin: 0; font-family: Helvetica, Arial, sans-serif; }}
header {{ padding: 6px 10px; background: #f4f4f4; border-bottom: 1px solid #ccc; font-size: 13px; }}
.key {{ display: inline-block; width: 12px; height: 12px; border: 1px solid #445; margin: 0 3px 0 12px; vertical-align: middle; }}
svg {{ display: block; width: 100vw; height: calc(100vh - 32px); cursor: grab; }}
text {{ font-size: 10px; fill: #222; }}
text.edge {{ font-size: 9px; fill: #555; paint-order: stroke; stroke: #fff; stroke-width: 3px; }}
</style></head><body>
<header><b>{title}</b> &nbsp; {legend}
<span class="key" style="background:#dbe9f7"></span>forward
<span class="key" style="background:#fde3cc"></span>backward
<span class="key" style="background:#e8e8e8"></span>repeated blocks
&nbsp; (drag to pan, wheel to zoom, hover a box for its ops)</header>
<svg id="g" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">
<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#667"/></marker></defs>
{body}
</svg>
<script>
const svg = document.getElementById("g");
let box = svg.viewBox.baseVal, drag = null;
svg.addEventListener("wheel", e => {{
  e.preventDefault();
  const k = e.deltaY > 0 ? 1.15 : 1 / 1.15, r = svg.getBoundingClientRect();
  const px = box.x + (e.clientX - r.left) / r.width * box.width;
  const py = box.y + (e.clientY - r.top) / r.height * box.height;
  box.x = px - (px - box.x) * k; box.y = py - (py - box.y) * k;
  box.width *= k; box.height *= k;
}}, {{passive: false}});
svg.addEventListener("mousedown", e => drag = [e.clientX, e.clientY]);
window.addEventListener("mouseup", () => drag = null);
window.addEventListener("mousemove", e => {{
  if (!drag) return;
  const r = svg.getBoundingClientRect();
  box.x -= (e.clientX - drag[0]) * box.width / r.width;
  box.y -= (e.clientY - drag[1]) * box.height / r.height;
  drag = [e.clientX, e.clientY];
}});
</script></body></html>
"""
