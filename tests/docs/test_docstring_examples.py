"""The ``>>>`` examples of the public docstrings run, on the current backend.

Every docstring of a name in ``keras_stable_state.__all__`` (and of its methods) is
collected with :mod:`doctest` and run in a fresh folder holding ``run.h5`` and
``run.keras`` saved from ``model``, with these names: the public API (bare and as
``kss``), ``keras``, ``np``, ``model`` (a compiled, trained ``Sequential`` whose one
``Dense`` layer is ``dense``, wrapped in ``StableOptimizer``), ``x`` and ``y``.

The examples are sketches as much as tests, so:

- an example that shows no output may print anything (a path, a ``History``);
- one that shows ``SomeError: message`` expects that exception (``...`` in the message
  matches anything); one commented ``# raises`` (``# raises: why``, ``# raises XError``) expects an exception (of the class named
  after it, or of the documented exception class);
- one that shows output must print it (``...`` matches anything, whitespace is free).

Examples that need a file or an object the sketch leaves to the reader are skipped with
the reason below; a failing one is a docstring to fix, not a test to loosen.
"""

import doctest
import re

import keras
import numpy as np
import pytest

import keras_stable_state as kss

# Docstrings whose example cannot run as written, and why.
NEEDS = {
    "kss.BindingError": "needs a stock Keras file and a model with another optimizer",
    "kss.CheckpointInUseError": "needs another process holding the file",
    "kss.ContractError": "needs a model with a layer 'hidden'; `err` is the exception the sketch raised",
    "kss.CorruptCheckpointError": "needs a damaged file",
    "kss.DtypeMismatchError": "needs a file saved with float16 arrays",
    "kss.GradientAccumulator": "needs `grads`, `x_batch` and `optimizer` of a custom training loop",
    "kss.MalformedKeyError": "needs a damaged file",
    "kss.NewerFormatError": "needs a file written by a newer keras_stable_state",
    "kss.StorageBackendError": "needs gcsfs not installed (with it, the sketch would reach the real gs:// store)",
    "kss.StorageError": "needs an object store that stops answering (`mgr`)",
    "kss.StoragePermissionError": "needs an object store that refuses the credentials",
    "kss.PendingRestore": "needs the reader's `build_model()`",
    "kss.QuantizeMapper": "needs the reader's `momentum_array`",
    "kss.ResumableSampler": "needs torch (`ds`, a DataLoader) and a training loop (`mgr`, `train_step`)",
    "kss.ScheduleMismatchError": "needs a model whose schedule differs from the saved one",
    "kss.restore_training_state_from_bytes": "needs an object store (`bucket`)",
    "kss.training_state_to_bytes": "needs an object store (`bucket`)",
}
# Examples that should run but do not: to fix in the docstring (then drop the entry).
OUT_OF_DATE = {}

_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.IGNORE_EXCEPTION_DETAIL
_SHOWN_ERROR = re.compile(r"^(\w+(?:Error|Exception|Warning)):")
# ``# raises``, ``# raises: why`` or ``# raises XError`` (not ``# raises XError if ...``).
_RAISES = re.compile(r"#\s*raises(?::|\s+(\w+(?:Error|Exception))\s*$|\s*$)")


def _docstrings() -> dict:
    finder, found = doctest.DocTestFinder(exclude_empty=True), {}
    for name in kss.__all__:
        for test in finder.find(getattr(kss, name), f"kss.{name}", globs={}):
            if test.examples:
                found.setdefault(test.name, test)
    return found


DOCSTRINGS = _docstrings()


class _Checker(doctest.OutputChecker):
    """No output shown: any output passes (a sketch's statement returns a value)."""

    def check_output(self, want, got, optionflags):
        return not want or super().check_output(want, got, optionflags)


def _expect_exceptions(test):
    """Shown ``XError: message`` and ``# raises`` comments as doctest exception examples."""
    owner = getattr(kss, test.name.split(".")[1], None)
    own_error = owner.__name__ if isinstance(owner, type) and issubclass(owner, Exception) else None
    for example in test.examples:
        shown = _SHOWN_ERROR.match(example.want)
        raises = _RAISES.search(example.source)
        if shown:
            example.exc_msg = example.want
        elif raises and (raises.group(1) or own_error):
            example.exc_msg = f"{raises.group(1) or own_error}: ...\n"
        elif raises:
            example.exc_msg = "...\n"
        else:
            continue
        example.want = "Traceback (most recent call last):\n" + example.exc_msg


def _namespace():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(1e-3), model=model), loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    model.fit(x, y, verbose=0)
    kss.save_training_state("run.h5", model)
    kss.save_training_state("run.keras", model)
    names = {name: getattr(kss, name) for name in kss.__all__}
    return {**names, "kss": kss, "keras": keras, "np": np, "model": model, "x": x, "y": y}


def _marks(name):
    if name in NEEDS:
        return [pytest.mark.skip(reason=NEEDS[name])]
    if name in OUT_OF_DATE:
        return [pytest.mark.xfail(strict=True, reason=f"issue 15: docstring example: {OUT_OF_DATE[name]}")]
    return []


def test_the_skip_lists_name_docstrings_with_examples():
    assert sorted((set(NEEDS) | set(OUT_OF_DATE)) - set(DOCSTRINGS)) == []


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in sorted(DOCSTRINGS)])
def test_docstring_example_runs(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    test = DOCSTRINGS[name]
    test = doctest.DocTest(
        [doctest.Example(e.source, e.want, e.exc_msg, e.lineno, e.indent, e.options) for e in test.examples],
        _namespace(),
        test.name,
        test.filename,
        test.lineno,
        test.docstring,
    )
    _expect_exceptions(test)
    report = []
    runner = doctest.DocTestRunner(checker=_Checker(), optionflags=_FLAGS)
    result = runner.run(test, out=report.append, clear_globs=True)
    assert result.failed == 0, "".join(report)
