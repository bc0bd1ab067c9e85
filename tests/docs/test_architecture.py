"""The architecture page's dependency diagram (docs/contributing/architecture.md, "The layers
and their dependencies") is the package's import graph: an edge ``A -> B`` for every part
``A`` that imports a module of part ``B`` (at module level or inside a function, read by
``ast`` as the structure checks read it), and none other; ``B (m, n)`` names exactly the
modules of ``B`` that ``A`` imports; the parts marked ``(no Keras)`` are the Keras-free ones;
the layer order the page states is the structure checks' ``LAYERS``. A new import changes
the diagram, or this test fails naming the edge."""

import pathlib
import re

from kit import ROOT
from test_structure import KERAS_FREE, LAYERS, _graph, _part, once

PAGE = pathlib.Path(ROOT) / "docs" / "contributing" / "architecture.md"
SECTION = "## The layers and their dependencies"
NO_KERAS = re.compile(r"\s{2,}\(no Keras\)\s*$")


def _section() -> str:
    text = PAGE.read_text(encoding="utf-8")
    assert SECTION in text, f"{PAGE}: no section {SECTION!r}"
    return text.split(SECTION, 1)[1].split("\n## ", 1)[0]


def _split(deps: str) -> list:
    """``"a (x, y), b, c (z)"`` -> ``["a (x, y)", "b", "c (z)"]``: commas outside parentheses."""
    found, depth, current = [], 0, ""
    for char in deps:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            found.append(current.strip())
            current = ""
        else:
            current += char
    return [*found, current.strip()] if current.strip() else found


def _diagram():
    """``(parts in the diagram's order, {(a, b): modules named or None}, {parts marked no Keras})``."""
    block = re.search(r"```text\n(.*?)```", _section(), re.S)
    assert block, f"{PAGE}: no ```text diagram under {SECTION!r}"
    lines = []
    for raw in block.group(1).splitlines():
        if raw.strip() and raw[0].isspace():  # a continuation of the line above
            lines[-1] += " " + raw.strip()
        elif raw.strip():
            lines.append(raw.strip())
    order, edges, keras_free = [], {}, set()
    for line in lines:
        if NO_KERAS.search(line):
            line = NO_KERAS.sub("", line)
            keras_free.add(line.split()[0])
        part, _, deps = (piece.strip() for piece in line.partition("->"))
        order.append(part)
        for dep in _split(deps):
            match = re.fullmatch(r"(\S+)(?:\s+\(([^)]*)\))?", dep)
            assert match, f"{PAGE}: {part} -> {dep!r} is not 'part' or 'part (module, ...)'"
            named = match.group(2)
            edges[(part, match.group(1))] = (
                sorted(name.strip() for name in named.split(",")) if named is not None else None
            )
    return order, edges, keras_free


def _imported() -> dict:
    """``{(part, part it imports): [modules of that part imported, relative to it]}``."""
    found = {}
    for module, targets in _graph().items():
        for target in targets:
            a, b = _part(module), _part(target)
            if a != b:
                rest = target.split(".")[2:]  # keras_stable_state.<part>.<rest>
                found.setdefault((a, b), set()).add(".".join(rest) if rest else b)
    return {edge: sorted(modules) for edge, modules in found.items()}


@once
def test_the_diagram_has_every_part_once_high_to_low():
    order, _, _ = _diagram()
    assert sorted(order) == sorted(LAYERS)
    ranks = [LAYERS[part] for part in order]
    assert ranks == sorted(ranks, reverse=True), f"not high to low: {order}"


@once
def test_the_diagram_edges_are_the_import_graph():
    _, drawn, _ = _diagram()
    imported = _imported()
    missing = sorted(f"{a} -> {b}" for a, b in set(imported) - set(drawn))
    extra = sorted(f"{a} -> {b}" for a, b in set(drawn) - set(imported))
    assert (missing, extra) == ([], []), (
        f"{PAGE.name}: imports the diagram lacks {missing}; edges no import makes {extra}"
    )


@once
def test_the_modules_the_diagram_names_are_the_ones_imported():
    _, drawn, _ = _diagram()
    imported = _imported()
    differ = {
        f"{a} -> {b}": {"drawn": named, "imported": imported.get((a, b))}
        for (a, b), named in drawn.items()
        if named is not None and named != imported.get((a, b))
    }
    assert differ == {}


@once
def test_the_parts_marked_without_keras_and_the_layer_order_are_the_structure_checks():
    _, _, keras_free = _diagram()
    assert sorted(keras_free) == sorted(KERAS_FREE)
    stated = re.search(r"The layers, low to high[^:]*:\n(.*?)\n\n", _section(), re.S)
    assert stated, f"{PAGE}: no 'The layers, low to high' sentence under {SECTION!r}"
    groups = [re.findall(r"`([^`]+)`", group) for group in stated.group(1).split("<")]
    assert [sorted(group) for group in groups] == [
        sorted(part for part, rank in LAYERS.items() if rank == level)
        for level in sorted(set(LAYERS.values()))
    ]
