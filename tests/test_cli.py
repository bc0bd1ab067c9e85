"""The ``keras-stable-state`` command line: inspect, verify and diff, run in-process via ``main``."""

import io
import json
import os
import subprocess
import sys

import keras
import ml_dtypes
import numpy as np
import pytest
from conftest import BACKEND, to_np

import keras_stable_state as kss
from keras_stable_state import cli
from keras_stable_state import format as storage
from keras_stable_state._identity.registry import VariableRegistry
from keras_stable_state.cli import output


class _Position:
    """A state provider standing in for StableCheckpoint's position."""

    def __init__(self, epoch=3, step=5, global_step=17):
        self.value = {"epoch": epoch, "step": step, "global_step": global_step, "epoch_rng": None}

    def get_state(self):
        return dict(self.value)

    def set_state(self, value):
        self.value = dict(value)


def _model(opt=None, extra_layer=False):
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="hidden")]
    if extra_layer:
        layers.append(keras.layers.Dense(8, name="extra"))
    layers.append(keras.layers.Dense(1, name="out"))
    m = keras.Sequential(layers)
    m.compile(optimizer=opt or kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=m), loss="mse")
    return m


def _trained(data, opt=None, extra_layer=False, callbacks=()):
    x, y = data
    m = _model(opt, extra_layer)
    m.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False, callbacks=list(callbacks))
    return m


def _run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _keys(model):
    registry = VariableRegistry.from_model(model)
    return {str(registry.key_of(v)): v for v in model.variables}


@pytest.fixture
def saved(tmp_path, data):
    """A trained model and its training state as .h5 and .keras, with a callback and a position."""
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=3)
    m = _trained(data, callbacks=[es])
    for ext in ("h5", "keras"):
        kss.save_training_state(tmp_path / f"s.{ext}", m, callbacks=[es], state={"position": _Position()})
    return m, tmp_path


@pytest.mark.parametrize("ext", ["h5", "keras"])
def test_inspect_shows_writer_keys_slots_contract_and_state(capsys, saved, ext):
    m, folder = saved
    code, out, err = _run(capsys, "inspect", folder / f"s.{ext}")
    assert code == 0, err
    assert "\x1b[" not in out  # piped: plain text
    assert f"writer backend  {BACKEND}" in out
    assert f"Keras version   {keras.__version__}" in out
    assert "dtype policy    float32" in out
    for key in _keys(m):
        assert key in out
    row = next(line for line in out.splitlines() if line.strip().startswith("path:layers/hidden/kernel "))
    assert "(4, 8)" in row and "float32" in row and "momentums, velocities" in row
    assert "optimizer#iteration" in out
    assert "Contract (4 trainable variables, checked on restore)" in out
    assert "epoch 3, step 5 of the epoch, global step 17" in out
    assert "EarlyStopping/0" in out and "wait=" in out
    if ext == "keras":
        assert storage.KERAS_WEIGHTS_MEMBER in out and storage.MEMBER in out


@pytest.mark.parametrize("ext", ["h5", "keras"])
def test_inspect_json_matches_the_model(capsys, saved, ext):
    m, folder = saved
    code, out, _ = _run(capsys, "inspect", folder / f"s.{ext}", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["kind"] == "keras_stable_state"
    assert doc["metadata"]["backend"] == BACKEND
    assert doc["metadata"]["keras_version"] == keras.__version__
    assert doc["format_version"] == storage.FORMAT_VERSION
    assert doc["metadata"]["model_state"] == "all"
    keys = _keys(m)
    assert {v["key"]: v["shape"] for v in doc["variables"]} == {k: list(v.shape) for k, v in keys.items()}
    for v in doc["variables"]:
        assert v["stored"] and v["trainable"] is True
        assert set(v["slots"]) == {"momentums", "velocities"}
        assert all(s["shape"] == v["shape"] for s in v["slots"].values())
    assert doc["variables"][0]["bytes"] == 4 * 8 * 4
    assert [g["key"] for g in doc["optimizer_globals"]] == ["optimizer#iteration", "optimizer#learning_rate"]
    assert doc["contract"] == kss.TrainableContract.capture(m).to_json()
    assert doc["position"] == {"epoch": 3, "step": 5, "global_step": 17, "epoch_rng_saved": False}
    assert doc["callbacks"]["EarlyStopping/0"]["wait"] == 0
    assert doc["rng_saved"] is True
    assert doc["counts"] == {"model": 4, "optimizer": 10, "state": len(doc["arrays"])}


@pytest.mark.parametrize("kind", ["weights.h5", "keras"])
def test_inspect_stock_file_says_optimizer_state_is_positional(capsys, tmp_path, data, kind):
    m = _trained(data, opt=keras.optimizers.Adam(1e-2))
    path = tmp_path / f"stock.{kind}"
    m.save_weights(path) if kind == "weights.h5" else m.save(path)
    code, out, _ = _run(capsys, "inspect", path)
    assert code == 0
    assert "stock Keras" in out and "not written by keras_stable_state" in out
    assert "Optimizer state is POSITIONAL" in out
    assert "layers/dense/vars/0" in out and "(4, 8)" in out
    code, out, _ = _run(capsys, "inspect", path, "--json")
    doc = json.loads(out)
    assert doc["kind"] == "stock"
    assert sorted(tuple(e["shape"]) for e in doc["model"]) == sorted(tuple(v.shape) for v in m.weights)
    assert doc["optimizer"]["count"] == len(m.optimizer.variables)
    assert doc["optimizer"]["positional"] is True
    assert [v["shape"] for v in doc["optimizer"]["variables"]] == [
        list(v.shape) for v in m.optimizer.variables
    ]
    assert "POSITIONAL" in doc["note"]


def test_inspect_stock_archive_of_a_stable_optimizer_lists_its_keys(capsys, tmp_path, data):
    m = _trained(data)
    m.save(tmp_path / "stable.keras")
    code, out, _ = _run(capsys, "inspect", tmp_path / "stable.keras", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["optimizer"]["positional"] is False
    keys = [v["entry_key"] for v in doc["optimizer"]["variables"]]
    assert "optimizer#iteration" in keys and "path:layers/hidden/kernel#momentums" in keys
    code, out, _ = _run(capsys, "inspect", tmp_path / "stable.keras")
    assert "Optimizer state is KEYED" in out and "path:layers/out/bias#velocities" in out


@pytest.mark.parametrize("name", ["s.h5", "s.keras", "stock.weights.h5", "stock.keras"])
def test_verify_intact_files(capsys, saved, name):
    m, folder = saved
    if name == "stock.weights.h5":
        m.save_weights(folder / name)
    elif name == "stock.keras":
        m.save(folder / name)
    code, out, err = _run(capsys, "verify", folder / name)
    assert code == 0, out + err
    assert out.startswith(f"OK {folder / name}")
    if name.startswith("stock"):
        assert "no per-array checksums" in out
    else:
        assert "match their xxh3-64 checksums" in out
    code, out, _ = _run(capsys, "verify", folder / name, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True and doc["damaged"] == []


def _flip_kernel_byte(model, src, dst):
    raw = bytearray(src.read_bytes())
    target = to_np(model.get_layer("hidden").kernel).tobytes()
    # the last copy: in a .keras archive, the training-state member comes after Keras' own weights
    at = bytes(raw).rfind(target[:16])
    assert at > 0
    raw[at + 4] ^= 0xFF
    dst.write_bytes(bytes(raw))


@pytest.mark.parametrize("ext", ["h5", "keras"])
def test_verify_names_the_damaged_key(capsys, saved, ext):
    m, folder = saved
    bad = folder / f"bad.{ext}"
    _flip_kernel_byte(m, folder / f"s.{ext}", bad)
    code, out, _ = _run(capsys, "verify", bad)
    assert code == 1
    assert out.startswith(f"DAMAGED {bad}")
    assert "path:layers/hidden/kernel" in out and "xxh3-64 checksum" in out
    assert "path:layers/hidden/bias " not in out
    if ext == "keras":  # the kernel is stored once, in Keras' own weights member
        assert "model.weights.h5" in out and "not the one the training state was written with" in out
    else:
        assert "fails its xxh3-128 seal" in out
    code, out, _ = _run(capsys, "verify", bad, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False
    assert "path:layers/hidden/kernel" in [d["key"] for d in doc["damaged"]]
    # the library refuses the same file
    with pytest.raises(kss.CorruptCheckpointError):
        storage.read_file(bad)


@pytest.mark.parametrize("ext", ["h5", "keras"])
def test_verify_and_inspect_refuse_a_truncated_file(capsys, saved, ext):
    _, folder = saved
    raw = (folder / f"s.{ext}").read_bytes()
    cut = folder / f"cut.{ext}"
    cut.write_bytes(raw[: len(raw) // 2])
    code, out, err = _run(capsys, "verify", cut)
    assert code == 1
    assert str(cut) in err and "truncated" in err and "earlier checkpoint" in err
    code, _, err = _run(capsys, "inspect", cut)
    assert code == 2 and "truncated" in err


def test_missing_file_and_usage_errors(capsys, tmp_path):
    code, _, err = _run(capsys, "verify", tmp_path / "absent.h5")
    assert code == 2 and "no such file" in err
    code, _, err = _run(capsys, "inspect", tmp_path)
    assert code == 2 and "is a folder" in err
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    capsys.readouterr()


def test_diff_reports_the_largest_difference_after_one_step(capsys, tmp_path, data):
    x, y = data
    m = _trained(data)
    kss.save_training_state(tmp_path / "a.h5", m)
    before = {k: to_np(v) for k, v in _keys(m).items()}
    m.fit(x[:8], y[:8], epochs=1, batch_size=8, verbose=0, shuffle=False)
    kss.save_training_state(tmp_path / "b.keras", m)
    after = {k: to_np(v) for k, v in _keys(m).items()}
    code, out, _ = _run(capsys, "diff", tmp_path / "a.h5", tmp_path / "b.keras", "--json")
    assert code == 0
    doc = json.loads(out)
    model = doc["sections"]["model"]
    assert model["compared_by"] == "key" and not model["only_in_a"] and not model["only_in_b"]
    key = "path:layers/hidden/kernel"
    expected = float(np.max(np.abs(before[key].astype(np.float64) - after[key].astype(np.float64))))
    assert expected > 0
    assert model["max_abs_diff"][key] == expected
    assert doc["sections"]["optimizer"]["max_abs_diff"]["optimizer#iteration"] == 1.0
    assert doc["contract"]["only_in_a"] == doc["contract"]["only_in_b"] == []
    assert doc["metadata"] == []
    code, out, _ = _run(capsys, "diff", tmp_path / "a.h5", tmp_path / "b.keras")
    assert code == 0 and "\x1b[" not in out
    row = next(line for line in out.splitlines() if line.strip().startswith(key + " "))
    assert row.split()[-1] == f"{expected:.6g}"
    assert "Contract: identical (4 trainable variables)" in out


def test_diff_lists_keys_only_in_one_file(capsys, tmp_path, data):
    kss.save_training_state(tmp_path / "small.h5", _trained(data))
    keras.backend.clear_session()
    kss.save_training_state(tmp_path / "big.h5", _trained(data, extra_layer=True))
    code, out, _ = _run(capsys, "diff", tmp_path / "small.h5", tmp_path / "big.h5", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["sections"]["model"]["only_in_b"] == ["path:layers/extra/kernel", "path:layers/extra/bias"]
    assert doc["sections"]["model"]["only_in_a"] == []
    assert "path:layers/extra/kernel#momentums" in doc["sections"]["optimizer"]["only_in_b"]
    assert doc["contract"]["only_in_b"] == ["path:layers/extra/kernel", "path:layers/extra/bias"]
    # the output layer's kernel changed shape: (8, 1) in both, so values are compared
    code, out, _ = _run(capsys, "diff", tmp_path / "small.h5", tmp_path / "big.h5")
    assert "Model variables only in B" in out and "path:layers/extra/bias" in out
    assert "Contract differs" in out and "only in B" in out


def test_diff_between_a_stock_file_and_ours_pairs_what_is_comparable(capsys, tmp_path, data):
    m = _trained(data, opt=keras.optimizers.Adam(1e-2))
    m.save_weights(tmp_path / "stock.weights.h5")
    kss.save_training_state(tmp_path / "ours.h5", m)
    code, out, _ = _run(capsys, "diff", tmp_path / "stock.weights.h5", tmp_path / "ours.h5", "--json")
    assert code == 0
    doc = json.loads(out)
    assert any("Keys differ in kind" in n for n in doc["notes"])
    model = doc["sections"]["model"]
    assert model["compared_by"] == "layer structure"
    assert model["pairs"]["layers/dense/vars/0"] == "path:layers/hidden/kernel"
    assert model["pairs"]["layers/dense_1/vars/1"] == "path:layers/out/bias"
    assert set(model["max_abs_diff"].values()) == {0.0}
    opt = doc["sections"]["optimizer"]
    assert opt["compared_by"] == "position"
    assert len(opt["max_abs_diff"]) == len(m.optimizer.variables)
    assert set(opt["max_abs_diff"].values()) == {0.0}
    code, out, _ = _run(capsys, "diff", tmp_path / "ours.h5", tmp_path / "stock.weights.h5")
    assert code == 0 and "Keys differ in kind" in out


def test_diff_of_an_unreadable_file_exits_2(capsys, saved):
    _, folder = saved
    raw = (folder / "s.h5").read_bytes()
    (folder / "cut.h5").write_bytes(raw[:100])
    code, _, err = _run(capsys, "diff", folder / "s.h5", folder / "cut.h5")
    assert code == 2 and "cut.h5" in err


def test_max_abs_difference_casts_to_float64():
    a = np.array([1.0, 2.0, np.nan, np.inf], dtype=ml_dtypes.bfloat16)
    b = np.array([1.5, 2.0, np.nan, np.inf], dtype=ml_dtypes.bfloat16)
    assert cli.max_abs_difference(a, b) == 0.5
    assert cli.max_abs_difference(np.array([3], "int64"), np.array([-2], "int32")) == 5.0
    assert np.isnan(cli.max_abs_difference(np.array([np.nan]), np.array([1.0])))
    assert cli.max_abs_difference(np.zeros((0, 3)), np.zeros((0, 3))) == 0.0


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_terminal_output_uses_rich_tables_and_progress(monkeypatch, saved):
    _, folder = saved
    out, err = _Tty(), _Tty()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(output, "PROGRESS_MIN_BYTES", 0)
    assert cli.main(["inspect", str(folder / "s.h5")]) == 0
    assert cli.main(["verify", str(folder / "s.keras")]) == 0
    assert cli.main(["diff", str(folder / "s.h5"), str(folder / "s.keras")]) == 0
    text = out.getvalue()
    assert "momentums" in text and "Contract" in text and "OK" in text
    assert "─" in text  # a rich table rule


@pytest.mark.slow
def test_python_dash_m_entry_point(saved):
    _, folder = saved
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-m", "keras_stable_state", "inspect", str(folder / "s.h5")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "path:layers/hidden/kernel" in result.stdout and "\x1b[" not in result.stdout
    assert f"writer backend  {BACKEND}" in result.stdout


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kss.__file__)))
_FRAMEWORKS = ("keras", "tensorflow", "jax", "torch")


def _python(argv, backend=BACKEND, stubs=None):
    """Run ``python *argv`` in a fresh process with ``KERAS_BACKEND=backend``, ``stubs`` first on the path."""
    path = os.pathsep.join(str(p) for p in (stubs, _ROOT) if p)
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(
        [sys.executable, *map(str, argv)], env=env, capture_output=True, text=True, timeout=300
    )


def test_the_command_line_imports_no_keras_and_no_backend(saved):
    """Importing the CLI, and running each command, loads neither Keras nor a backend."""
    _, folder = saved
    code = (
        "import sys\n"
        "import keras_stable_state.cli as cli\n"
        f"frameworks = {_FRAMEWORKS!r}\n"
        "def loaded(): return sorted(m for m in sys.modules if m.split('.')[0] in frameworks)\n"
        "assert loaded() == [], loaded()\n"
        "assert 'numpy' not in sys.modules and 'h5py' not in sys.modules\n"
        "assert cli.main(['inspect', sys.argv[1]]) == 0\n"
        "assert cli.main(['verify', sys.argv[2], '--json']) == 0\n"
        "assert cli.main(['diff', sys.argv[1], sys.argv[2]]) == 0\n"
        "assert loaded() == [], loaded()\n"
    )
    result = _python(["-c", code, folder / "s.h5", folder / "s.keras"])
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_package_loads_its_names_on_first_use():
    code = (
        "import sys\n"
        "import keras_stable_state as kss\n"
        "assert 'keras' not in sys.modules\n"
        "assert 'StableCheckpoint' in dir(kss) and kss.__version__\n"
        "from keras_stable_state import StableCheckpoint\n"
        "import keras\n"
        "assert keras.saving.get_registered_object('keras_stable_state>StableOptimizer') is kss.StableOptimizer\n"
        "assert StableCheckpoint is kss.StableCheckpoint\n"
    )
    result = _python(["-c", code])
    assert result.returncode == 0, result.stderr[-2000:]
    # Keras imported first: the names load with the package, so load_model knows StableOptimizer
    code = "import keras, keras_stable_state as kss\nassert 'StableOptimizer' in vars(kss)\n"
    result = _python(["-c", code])
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.fixture
def broken_backends(tmp_path):
    """A folder of stub ``jax``, ``tensorflow`` and ``torch`` packages that fail to import."""
    for name in ("jax", "tensorflow", "torch"):
        (tmp_path / "stubs" / name).mkdir(parents=True)
        (tmp_path / "stubs" / name / "__init__.py").write_text(
            f"raise ImportError('stub: {name} is not installed')\n"
        )
    return tmp_path / "stubs"


def test_commands_run_where_no_backend_can_be_imported(saved, broken_backends):
    _, folder = saved
    result = _python(["-c", "import keras"], backend="jax", stubs=broken_backends)
    assert result.returncode != 0 and "stub: jax is not installed" in result.stderr  # the stubs do fail
    for argv in (["inspect", "s.h5"], ["verify", "s.keras"], ["diff", "s.h5", "s.keras", "--json"]):
        paths = [folder / a if "." in a else a for a in argv]
        result = _python(["-m", "keras_stable_state", *paths], backend="jax", stubs=broken_backends)
        assert result.returncode == 0, (argv, result.stderr[-2000:])


@pytest.mark.parametrize(
    "backend,fix",
    [
        ("jax", 'install it with pip install "keras-stable-state[jax]"'),
        ("nonexistent", 'set KERAS_BACKEND to jax, tensorflow or torch and install it with pip install "'),
    ],
)
def test_a_command_that_cannot_load_the_backend_exits_2_naming_keras_backend(
    saved, broken_backends, backend, fix
):
    """No command needs Keras today; one that did (here: inspect, patched) and met a backend that
    cannot import exits 2 (not 1, which means damaged) with one line naming KERAS_BACKEND."""
    _, folder = saved
    code = (
        "import sys\n"
        "import keras_stable_state.cli as cli\n"
        "from keras_stable_state.cli import data\n"
        "def needs_keras(path):\n"
        "    import keras  # noqa: F401\n"
        "data.inspect_file = needs_keras\n"
        "sys.exit(cli.main(['inspect', sys.argv[1]]))\n"
    )
    result = _python(["-c", code, folder / "s.h5"], backend=backend, stubs=broken_backends)
    assert result.returncode == cli.EXIT_ERROR, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("keras-stable-state inspect: error: Keras cannot load its backend")
    assert f"KERAS_BACKEND={backend}" in lines[0] and fix in lines[0]


def test_keys_with_control_characters_are_printed_escaped(capsys, tmp_path):
    evil = "path:layers/\x1b[2J\x1b[31mred\nOK fake line\r"
    record = storage.StateRecord(
        metadata={"backend": BACKEND, "keras_version": keras.__version__, "format_version": 2},
        contract=[[evil, [2], "float32"]],
        model={evil: np.ones(2, "float32")},
        optimizer={},
        extra={"callbacks": {}, "providers": {}, "rng": None},
    )
    path = tmp_path / "evil.h5"
    storage.write_record(path, record)
    for command in ("inspect", "verify"):
        code, out, err = _run(capsys, command, path)
        assert code != 0  # a key with control characters is malformed: refused, and named escaped
        assert "\x1b" not in out + err and "\r" not in out + err
        assert "\nOK fake line" not in out + err
        assert "\\x1b[2J\\x1b[31mred\\nOK fake line\\r" in out + err
