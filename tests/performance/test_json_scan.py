"""`format.json_scan.top_level_class_name` (what ``inspect`` prints of a ``.keras`` archive's
``config.json``) agrees with ``json.loads`` on every document, whatever its layout and
wherever the chunks split it, and passes over nested content without a step per character."""

import io
import json
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keras_stable_state.format import json_scan

_TEXT = st.text(alphabet=string.printable + 'é"\\\u2028€😀', max_size=12)
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=20,
)


@pytest.mark.backend_free
@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["class_name", "config", "x", 'k"\\']) | _TEXT, _VALUES, max_size=5),
    st.booleans(),
    st.sampled_from([None, 0, 2]),
    st.integers(1, 64),
)
def test_the_class_name_is_json_loads_own_whatever_the_layout_and_chunks(document, ascii, indent, chunk):
    expected = document.get("class_name")
    expected = expected if isinstance(expected, str) else None
    data = json.dumps(document, ensure_ascii=ascii, indent=indent).encode()
    original = json_scan.CHUNK
    json_scan.CHUNK = chunk  # read in pieces that split strings, escapes and UTF-8 sequences
    try:
        assert json_scan.top_level_class_name(io.BytesIO(data), max_depth=64) == expected
    finally:
        json_scan.CHUNK = original


@pytest.mark.backend_free
def test_nesting_deeper_than_the_limit_is_refused_also_inside_skipped_content():
    deep = '{"a": [' + '{"b": [' * 40 + "1" + "]}" * 40 + '], "class_name": "M"}'
    assert json_scan.top_level_class_name(io.BytesIO(deep.encode()), max_depth=100) == "M"
    with pytest.raises(ValueError, match="nested deeper than 64 levels"):
        json_scan.top_level_class_name(io.BytesIO(deep.encode()), max_depth=64)


@pytest.mark.backend_free
def test_a_long_nested_list_of_strings_is_passed_in_few_steps(monkeypatch):
    """The vocabulary case of tests/performance/test_inspect_memory.py: a million strings below the
    top level cost a handful of Python steps per chunk, not one per character (counted, not
    timed: the decoder's chunks are the only loop iterations the nested list adds)."""
    body = b'{"config": {"vocabulary": [' + b'"tok\\"en", ' * 1_000_000 + b'"x"]}, "class_name": "Big"}'
    steps = []
    real = json_scan._NESTED

    class Counting:
        def match(self, text, pos):
            steps.append(pos)
            return real.match(text, pos)

    monkeypatch.setattr(json_scan, "_NESTED", Counting())
    assert json_scan.top_level_class_name(io.BytesIO(body), max_depth=64) == "Big"
    chunks = -(-len(body) // json_scan.CHUNK)
    assert len(steps) <= 4 * chunks, (len(steps), chunks)
