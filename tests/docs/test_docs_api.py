"""The API reference page (docs/reference.md, rendered by mkdocstrings) reads cleanly.

No Sphinx role is printed literally (the docstrings use mkdocstrings links and code
spans), every parameter table row has a type (from the annotations), and no public
docstring is over 70 lines (long explanations live on the how-to pages).

The site is the one ``make docs`` built when ``KSS_DOCS_SITE`` names it (``make test``
passes ``build/site``); otherwise it is built once, into a temporary folder. The page is
the same on every backend: the checks run once, in the jax pass.
"""

import inspect
import os
import pathlib
import re
import subprocess
import sys

import keras
import kit
import pytest

import keras_stable_state as kss

ROOT = pathlib.Path(kit.ROOT)
ROLE = re.compile(r":(class|func|meth|attr|data|mod|exc|obj):")
MAX_DOC_LINES = 70

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="the API page does not depend on the backend: checked once, in the jax pass",
)


@pytest.fixture(scope="module")
def reference_html(tmp_path_factory) -> str:
    site = os.environ.get("KSS_DOCS_SITE")
    if site:
        page = pathlib.Path(site) / "reference" / "index.html"
        if page.exists():
            return page.read_text()
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the [docs] extra)")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (the [docs] extra)")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return (out / "reference" / "index.html").read_text()


def test_no_sphinx_role_is_printed(reference_html: str) -> None:
    text = re.sub(r"<[^>]+>", "", reference_html)
    found = sorted({m.group(0) for m in ROLE.finditer(text)})
    assert found == [], f"Sphinx roles printed literally on the API page: {found}"


def _rows(html: str, keep) -> list[tuple[str, str]]:
    """``(name, type text)`` of each row of every table whose header cells ``keep`` accepts."""
    rows = []
    for table in re.findall(r"<table>.*?</table>", html, re.S):
        if not keep(re.findall(r"<th>(.*?)</th>", table)):
            continue
        for row in re.findall(r'<tr class="doc-section-item">(.*?)</tr>', table, re.S):
            cells = re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
            name, kind = (re.sub(r"<[^>]+>|\s+", " ", cell).strip() for cell in cells[:2])
            rows.append((name, kind))
    return rows


def _parameter_rows(html: str) -> list[tuple[str, str]]:
    """Rows of every parameter table (the tables with a Default column)."""
    return _rows(html, lambda heads: "Default" in heads)


def test_every_parameter_has_a_type(reference_html: str) -> None:
    rows = _parameter_rows(reference_html)
    assert len(rows) > 50, "no parameter tables found: has the page's layout changed?"
    untyped = [name for name, kind in rows if not kind]
    assert untyped == [], f"parameters without a type on the API page: {untyped}"


def _attribute_rows(html: str) -> list[tuple[str, str]]:
    """Rows of every Attributes table (Name, Type, Description; Returns and Raises have no Name)."""
    return _rows(html, lambda heads: heads == ["Name", "Type", "Description"])


def test_every_attribute_has_a_type(reference_html: str) -> None:
    rows = _attribute_rows(reference_html)
    names = {name for name, _ in rows}
    assert {"run_stopped", "restored_step", "on_saved"} <= names, (
        "no Attributes tables found: layout changed?"
    )
    untyped = sorted({name for name, kind in rows if not kind})
    assert untyped == [], f"attributes without a type on the API page (write `name (type): ...`): {untyped}"


def test_public_docstrings_are_short() -> None:
    long = {}
    for name in kss.__all__:
        obj = getattr(kss, name)
        members = [(name, obj)]
        if inspect.isclass(obj):
            members += [(f"{name}.{m}", v) for m, v in vars(obj).items() if not m.startswith("_")]
        for qualname, member in members:
            doc = inspect.getdoc(member) if not isinstance(member, str | int | float) else None
            if doc and len(doc.splitlines()) > MAX_DOC_LINES:
                long[qualname] = len(doc.splitlines())
    assert long == {}, (
        f"public docstrings over {MAX_DOC_LINES} lines (move the detail to docs/how-to): {long}"
    )


def test_every_example_renders_as_code(reference_html: str) -> None:
    """``>>>`` lines render inside code blocks (an ``Example:`` section, unlike ``Examples:``,
    turned them into nested Markdown quotes)."""
    quoted = [
        q for q in re.findall(r"<blockquote>(.*?)</blockquote>", reference_html, re.S) if "&gt;&gt;&gt;" in q
    ]
    assert quoted == [], f"examples rendered as quotes, not code: {quoted[:2]}"
    code = [p for p in re.findall(r"<pre>(.*?)</pre>", reference_html, re.S) if "&gt;&gt;&gt;" in p]
    assert len(code) >= 20, f"only {len(code)} examples render as code"
