"""The ``keras-stable-state`` command line: inspect, verify, diff and ls, run in-process via ``main``.

The files are written once per module (``files``); the CLI reads the files each backend
wrote in that backend's pass. Tests of pure rendering or of the process (no file written
by a backend) run in the jax pass only: the CLI imports no Keras, so they cannot differ.
"""

import io
import json
import os
import subprocess
import sys
import types

import keras
import ml_dtypes
import numpy as np
import pytest
from conftest import BACKEND, to_np
from kit import mlp

import keras_stable_state as kss
from keras_stable_state import cli, format
from keras_stable_state._identity.registry import VariableRegistry
from keras_stable_state.cli import output
from keras_stable_state.format.record import KERAS_WEIGHTS_MEMBER, MEMBER
from keras_stable_state.format.writer import reseal, write_record


class _Position:
    """A state provider standing in for StableCheckpoint's position."""

    def __init__(self, epoch=3, step=5, global_step=17):
        self.value = {"epoch": epoch, "step": step, "global_step": global_step, "epoch_rng": None}

    def get_state(self):
        return dict(self.value)

    def set_state(self, value):
        self.value = dict(value)


def _trained(data, opt=None, extra_layer=False, callbacks=()):
    x, y = data
    if extra_layer:  # a linear Dense(8) "extra" between "hidden" and "out"
        names = ("hidden", "extra", "out")
        m = mlp(4, (8, 8), activation=("relu", None), layer_names=names, optimizer=opt or "stable")
    else:
        m = mlp(4, 8, activation="relu", named=True, optimizer=opt or "stable")
    m.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False, callbacks=list(callbacks))
    return m


ONCE = pytest.mark.skipif(
    BACKEND != "jax", reason="Keras-free CLI rendering / process behaviour: run once, in the jax pass"
)


def _run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _keys(model):
    registry = VariableRegistry.from_model(model)
    return {str(registry.key_of(v)): v for v in model.variables}


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every file the tests read, written once by this backend: a trained model's training
    state as .h5 and .keras (with a callback and a position), stock Keras files, a state one
    step later, one of a model with an extra layer, and a CheckpointManager directory."""
    folder = tmp_path_factory.mktemp("cli")
    data = _data()
    x, y = data
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=3)
    m = _trained(data, callbacks=[es])
    for ext in ("h5", "keras"):
        kss.save_training_state(folder / f"s.{ext}", m, callbacks=[es], state={"position": _Position()})
    m.save(folder / "stable.keras")
    stock = _trained(data, opt=keras.optimizers.Adam(1e-2))
    stock.save_weights(folder / "stock.weights.h5")
    stock.save(folder / "stock.keras")
    kss.save_training_state(folder / "stock-ours.h5", stock)
    before = {k: to_np(v) for k, v in _keys(m).items()}
    with kss.CheckpointManager(folder / "ckpts", max_to_keep=None, monitor="loss") as mgr:
        for step, loss in [(1, 0.5), (2, 0.2), (3, 0.3)]:
            mgr.save(step, m, metrics={"loss": loss}, epoch=step - 1)
    m.fit(x[:8], y[:8], epochs=1, batch_size=8, verbose=0, shuffle=False)
    kss.save_training_state(folder / "b.keras", m)
    after = {k: to_np(v) for k, v in _keys(m).items()}
    big = _trained(data, extra_layer=True)
    kss.save_training_state(folder / "big.h5", big)
    keras.backend.clear_session(free_memory=False)
    return types.SimpleNamespace(
        folder=folder, model=m, stock=stock, before=before, after=after, keys=set(_keys(m))
    )


@pytest.fixture
def saved(files):
    return files.model, files.folder


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
        assert KERAS_WEIGHTS_MEMBER in out and MEMBER in out


@pytest.mark.parametrize("ext", ["h5", "keras"])
def test_inspect_json_matches_the_model(capsys, saved, ext):
    m, folder = saved
    code, out, _ = _run(capsys, "inspect", folder / f"s.{ext}", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["kind"] == "keras_stable_state"
    assert doc["metadata"]["backend"] == BACKEND
    assert doc["metadata"]["keras_version"] == keras.__version__
    assert doc["format_version"] == format.FORMAT_VERSION
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
def test_inspect_stock_file_says_optimizer_state_is_positional(capsys, files, kind):
    m, path = files.stock, files.folder / f"stock.{kind}"
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


def test_inspect_stock_archive_of_a_stable_optimizer_lists_its_keys(capsys, files):
    code, out, _ = _run(capsys, "inspect", files.folder / "stable.keras", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["optimizer"]["positional"] is False
    keys = [v["entry_key"] for v in doc["optimizer"]["variables"]]
    assert "optimizer#iteration" in keys and "path:layers/hidden/kernel#momentums" in keys
    code, out, _ = _run(capsys, "inspect", files.folder / "stable.keras")
    assert "Optimizer state is KEYED" in out and "path:layers/out/bias#velocities" in out


@pytest.mark.parametrize("name", ["s.h5", "s.keras", "stock.weights.h5", "stock.keras"])
def test_verify_intact_files(capsys, saved, name):
    m, folder = saved
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


def _flip_kernel_byte(kernel, src, dst):
    raw = bytearray(src.read_bytes())
    target = kernel.tobytes()
    # the last copy: in a .keras archive, the training-state member comes after Keras' own weights
    at = bytes(raw).rfind(target[:16])
    assert at > 0
    raw[at + 4] ^= 0xFF
    dst.write_bytes(bytes(raw))


@pytest.mark.parametrize("ext", ["h5", "keras"])
def test_verify_names_the_damaged_key(capsys, files, tmp_path, ext):
    folder = files.folder
    bad = tmp_path / f"bad.{ext}"
    _flip_kernel_byte(files.before["path:layers/hidden/kernel"], folder / f"s.{ext}", bad)
    code, out, err = _run(capsys, "verify", bad)
    # the seal fails on opening: the file is refused as a whole, in one line on stderr
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith(f"keras-stable-state verify: DAMAGED: {bad}")
    out = err
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
        format.read_file(bad)


@pytest.mark.parametrize("ext", ["h5", "keras"])
def test_verify_and_inspect_refuse_a_truncated_file(capsys, saved, tmp_path, ext):
    _, folder = saved
    raw = (folder / f"s.{ext}").read_bytes()
    cut = tmp_path / f"cut.{ext}"
    cut.write_bytes(raw[: len(raw) // 2])
    code, out, err = _run(capsys, "verify", cut)
    assert code == cli.EXIT_DAMAGED and out == ""  # printed once: one line on stderr
    assert err.startswith("keras-stable-state verify: DAMAGED: ") and err.count("\n") == 1
    assert str(cut) in err and "truncated" in err and "earlier checkpoint" in err
    code, out, _ = _run(capsys, "verify", cut, "--json")
    doc = json.loads(out)
    assert code == cli.EXIT_DAMAGED and doc["ok"] is False and "truncated" in doc["error"]
    code, out, err = _run(capsys, "inspect", cut)
    assert code == 2 and "truncated" in err and out == ""
    code, out, err = _run(capsys, "inspect", cut, "--json")
    assert code == 2 and err == ""
    assert json.loads(out)["error"]["kind"] == "damaged" and json.loads(out)["error"]["file"] == str(cut)


@pytest.mark.backend_free
@ONCE
def test_missing_file_and_usage_errors(capsys, tmp_path):
    code, _, err = _run(capsys, "verify", tmp_path / "absent.h5")
    assert code == 2 and "no such file" in err
    code, out, err = _run(capsys, "verify", tmp_path)
    assert code == 2 and "is a folder" in err and "ls" in err and out == ""
    code, out, err = _run(capsys, "verify", tmp_path / "absent.h5", "--json")
    assert code == 2 and err == ""
    assert json.loads(out) == {
        "error": {
            "kind": "not_found",
            "file": str(tmp_path / "absent.h5"),
            "message": f"{tmp_path / 'absent.h5'}: no such file. Check the path.",
            "exit_code": 2,
        }
    }
    assert cli.main(["diff", "a.h5", "b.h5", "--atol", "-1"]) == 2
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    capsys.readouterr()


def test_diff_reports_the_largest_difference_after_one_step_and_exits_1(capsys, files):
    a, b = files.folder / "s.h5", files.folder / "b.keras"
    code, out, _ = _run(capsys, "diff", a, b, "--json")
    assert code == cli.EXIT_DIFFERENT == 1
    doc = json.loads(out)
    model = doc["sections"]["model"]
    assert model["compared_by"] == "key" and not model["only_in_a"] and not model["only_in_b"]
    key = "path:layers/hidden/kernel"
    deltas = [
        float(np.max(np.abs(files.before[k].astype(np.float64) - files.after[k].astype(np.float64))))
        for k in files.keys
    ]
    expected = float(
        np.max(np.abs(files.before[key].astype(np.float64) - files.after[key].astype(np.float64)))
    )
    assert expected > 0
    assert model["max_abs_diff"][key] == expected
    assert doc["sections"]["optimizer"]["max_abs_diff"]["optimizer#iteration"] == 1.0
    assert doc["contract"]["only_in_a"] == doc["contract"]["only_in_b"] == []
    assert doc["metadata"] == []
    code, out, _ = _run(capsys, "diff", a, b)
    assert code == 1 and "\x1b[" not in out
    row = next(line for line in out.splitlines() if line.strip().startswith(key + " "))
    assert row.split()[-1] == f"{expected:.6g}"
    assert "Contract: identical (4 trainable variables)" in out
    assert out.rstrip().endswith("DIFFERENT: the states differ.")
    # --atol: the model's arrays within it, but the iteration count (1) and position still differ
    assert _run(capsys, "diff", a, b, "--atol", str(max(deltas)))[0] == 1
    code, out, _ = _run(capsys, "diff", a, files.folder / "s.keras", "--atol", "0")
    assert code == 0 and out.rstrip().endswith("EQUAL: the states are the same.")


def test_diff_lists_keys_only_in_one_file(capsys, files):
    small, big = files.folder / "s.h5", files.folder / "big.h5"
    code, out, _ = _run(capsys, "diff", small, big, "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["sections"]["model"]["only_in_b"] == ["path:layers/extra/kernel", "path:layers/extra/bias"]
    assert doc["sections"]["model"]["only_in_a"] == []
    assert "path:layers/extra/kernel#momentums" in doc["sections"]["optimizer"]["only_in_b"]
    assert doc["contract"]["only_in_b"] == ["path:layers/extra/kernel", "path:layers/extra/bias"]
    code, out, _ = _run(capsys, "diff", small, big)
    assert "Model variables only in B" in out and "path:layers/extra/bias" in out
    assert "Contract differs" in out and "only in B" in out


def test_diff_between_a_stock_file_and_ours_pairs_what_is_comparable(capsys, files):
    m = files.stock
    stock, ours = files.folder / "stock.weights.h5", files.folder / "stock-ours.h5"
    code, out, _ = _run(capsys, "diff", stock, ours, "--json")
    assert code == 0  # the same values, paired by layer structure and position
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
    code, out, _ = _run(capsys, "diff", ours, stock)
    assert code == 0 and "Keys differ in kind" in out


def test_diff_of_an_unreadable_file_exits_2(capsys, saved, tmp_path):
    _, folder = saved
    raw = (folder / "s.h5").read_bytes()
    (tmp_path / "cut.h5").write_bytes(raw[:100])
    code, out, err = _run(capsys, "diff", folder / "s.h5", tmp_path / "cut.h5")
    assert code == 2 and "cut.h5" in err and out == ""
    code, out, err = _run(capsys, "diff", folder / "s.h5", tmp_path / "cut.h5", "--json")
    assert code == 2 and err == ""
    assert json.loads(out)["error"]["file"] == str(tmp_path / "cut.h5")


@pytest.mark.backend_free
@ONCE
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


@ONCE
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


@ONCE
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
    # exit codes through the real entry point: states that differ (1), a FIFO (2, not damaged)
    argv = [sys.executable, "-m", "keras_stable_state", "diff", str(folder / "s.h5"), str(folder / "b.keras")]
    assert subprocess.run(argv, env=env, capture_output=True, timeout=300).returncode == 1
    os.mkfifo(folder / "fifo.h5")
    try:
        argv = [sys.executable, "-m", "keras_stable_state", "verify", str(folder / "fifo.h5")]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    finally:
        os.unlink(folder / "fifo.h5")
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith("keras-stable-state verify: error: ") and "FIFO" in done.stderr


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kss.__file__)))
_FRAMEWORKS = ("keras", "tensorflow", "jax", "torch")


def _python(argv, backend=BACKEND, stubs=None):
    """Run ``python *argv`` in a fresh process with ``KERAS_BACKEND=backend``, ``stubs`` first on the path."""
    path = os.pathsep.join(str(p) for p in (stubs, _ROOT) if p)
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(
        [sys.executable, *map(str, argv)], env=env, capture_output=True, text=True, timeout=300
    )


@ONCE
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
        "assert cli.main(['ls', sys.argv[3]]) == 0\n"
        "assert loaded() == [], loaded()\n"
    )
    result = _python(["-c", code, folder / "s.h5", folder / "s.keras", folder / "ckpts"])
    assert result.returncode == 0, result.stderr[-2000:]


@ONCE
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


@ONCE
def test_commands_run_where_no_backend_can_be_imported(saved, broken_backends):
    _, folder = saved
    result = _python(["-c", "import keras"], backend="jax", stubs=broken_backends)
    assert result.returncode != 0 and "stub: jax is not installed" in result.stderr  # the stubs do fail
    for argv in (["inspect", "s.h5"], ["verify", "s.keras"], ["diff", "s.h5", "s.keras", "--json"]):
        paths = [folder / a if "." in a else a for a in argv]
        result = _python(["-m", "keras_stable_state", *paths], backend="jax", stubs=broken_backends)
        assert result.returncode == 0, (argv, result.stderr[-2000:])


@ONCE
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


@ONCE
def test_keys_with_control_characters_are_printed_escaped(capsys, tmp_path):
    evil = "path:layers/\x1b[2J\x1b[31mred\nOK fake line\r"
    record = format.StateRecord(
        metadata={"backend": BACKEND, "keras_version": keras.__version__, "format_version": 2},
        contract=[[evil, [2], "float32"]],
        model={evil: np.ones(2, "float32")},
        optimizer={},
        extra={"callbacks": {}, "providers": {}, "rng": None},
    )
    path = tmp_path / "evil.h5"
    write_record(path, record)
    for command in ("inspect", "verify"):
        code, out, err = _run(capsys, command, path)
        assert code != 0  # a key with control characters is malformed: refused, and named escaped
        assert "\x1b" not in out + err and "\r" not in out + err
        assert "\nOK fake line" not in out + err
        assert "\\x1b[2J\\x1b[31mred\\nOK fake line\\r" in out + err


def test_ls_lists_steps_metrics_status_the_resume_and_the_best(capsys, files, tmp_path):
    """A CheckpointManager directory of this backend: every checkpoint with its step, epoch,
    metrics and size; a damaged newest one and a FIFO are skipped as the manager skips them,
    so fit resumes from the one before; the best by the recorded monitor."""
    import shutil

    folder = tmp_path / "ckpts"
    shutil.copytree(files.folder / "ckpts", folder)
    code, out, err = _run(capsys, "ls", folder, "--json")
    assert code == 0, err
    doc = json.loads(out)
    rows = doc["checkpoints"]
    assert [r["step"] for r in rows] == [3, 2, 1]
    assert [r["status"] for r in rows] == ["ok"] * 3
    assert [r["epoch"] for r in rows] == [2, 1, 0]
    assert [r["metrics"] for r in rows] == [{"loss": 0.3}, {"loss": 0.2}, {"loss": 0.5}]
    assert [r["size_bytes"] for r in rows] == [os.path.getsize(r["file"]) for r in rows]
    assert {r["backend"] for r in rows} == {BACKEND}
    assert [r["world_size"] for r in rows] == [1, 1, 1]  # saved by one process
    assert doc["resume_step"] == 3 and [r["resume"] for r in rows] == [True, False, False]
    assert doc["monitor"] == "loss" and doc["mode"] == "min" and doc["best_step"] == 2
    # damage the newest, add a FIFO step and an unfinished save
    newest = folder / "ckpt-0000000003.h5"
    raw = bytearray(newest.read_bytes())
    raw[-200] ^= 0xFF
    newest.write_bytes(bytes(raw))
    os.mkfifo(folder / "ckpt-0000000004.h5")
    import socket

    sock, cwd = socket.socket(socket.AF_UNIX), os.getcwd()
    os.chdir(folder)  # a relative name: a socket's path is at most ~100 characters
    try:
        sock.bind("ckpt-0000000005.h5")
    finally:
        os.chdir(cwd)
    (folder / ".kss-0123abcd.h5").write_bytes(b"partial")
    code, out, err = _run(capsys, "ls", folder, "--json")
    doc = json.loads(out)
    assert code == 0 and err == ""
    assert [(r["step"], r["status"]) for r in doc["checkpoints"]] == [
        (5, "unreadable"),
        (4, "unreadable"),
        (3, "damaged"),
        (2, "ok"),
        (1, "ok"),
        (None, "incomplete"),
    ]
    assert (
        "is a socket" in doc["checkpoints"][0]["reason"] and "damaged" not in doc["checkpoints"][0]["reason"]
    )
    assert "FIFO" in doc["checkpoints"][1]["reason"] and "seal" in doc["checkpoints"][2]["reason"]
    assert doc["resume_step"] == 2 and doc["best_step"] == 2
    assert doc["resume"].startswith("fit resumes from step 2")
    code, out, _ = _run(capsys, "ls", folder)  # text; `inspect DIR` is the same listing
    assert code == 0 and "fit resumes from step 2" in out and "best by loss (min): step 2" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("3 "))
    assert "damaged" in row
    assert _run(capsys, "inspect", folder)[1] == out
    # the manager agrees: it restores step 2, moving the FIFO and the damaged file aside
    os.unlink(folder / ".kss-0123abcd.h5")
    model = mlp(4, 8, activation="relu", named=True)
    with pytest.warns(kss.UnreadableCheckpointWarning):
        with kss.CheckpointManager(folder, max_to_keep=None, monitor="loss") as mgr:
            mgr.restore(model)
            assert mgr.restored_step == 2
    sock.close()
    # a file, and a missing path, are refused once
    code, out, err = _run(capsys, "ls", newest.with_name("ckpt-0000000002.h5"), "--json")
    assert code == 2 and err == "" and json.loads(out)["error"]["kind"] == "unreadable"
    code, out, err = _run(capsys, "ls", tmp_path / "absent")
    assert code == 2 and out == "" and err.count("\n") == 1 and "no such directory" in err


def test_ls_of_a_newer_format_checkpoint_says_fit_stops_there(capsys, files, tmp_path):
    import shutil

    folder = tmp_path / "ckpts"
    shutil.copytree(files.folder / "ckpts", folder)
    record = format.read_file(folder / "ckpt-0000000003.h5")
    record.metadata["format_version"] = format.FORMAT_VERSION
    path = folder / "ckpt-0000000003.h5"
    import h5py

    write_record(path, record)
    with h5py.File(path, "r+") as h5:  # a format this version does not read, under an intact seal
        h5.attrs["format_version"] = format.FORMAT_VERSION + 1
    reseal(path)
    code, out, _ = _run(capsys, "ls", folder, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["checkpoints"][0]["status"] == "newer_format"
    assert doc["resume_step"] is None and doc["resume"].startswith("fit stops at step 3")
    assert _run(capsys, "verify", path)[0] == cli.EXIT_NEWER


def test_orbax_states_are_inspected_verified_and_compared(capsys, files, tmp_path):
    """A '.orbax' state of this backend: inspect lists its arrays from the sealed index,
    verify reads each with TensorStore (no Orbax, no JAX) and checks its hash, and a
    changed byte in arrays/ is named as damage (exit 1)."""
    pytest.importorskip("orbax.checkpoint", reason="the '.orbax' engine needs the [orbax] extra")
    pytest.importorskip("tensorstore", reason="reading '.orbax' arrays needs the [orbax] extra")
    path = tmp_path / "run.orbax"
    kss.save_training_state(path, files.model)
    code, out, err = _run(capsys, "inspect", path, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["container"] == ".orbax directory" and doc["metadata"]["backend"] == BACKEND
    assert {v["key"]: v["shape"] for v in doc["variables"]} == {
        k: list(v.shape) for k, v in _keys(files.model).items()
    }
    assert "orbax" not in doc["metadata"]  # the array index is shown as the arrays, not as metadata
    code, out, err = _run(capsys, "verify", path)
    assert code == 0, out + err
    assert out.startswith(f"OK {path}: all ") and "Orbax index hashes" in out
    assert _run(capsys, "diff", path, files.folder / "s.h5")[0] == 1  # saved one step earlier
    code, out, _ = _run(capsys, "diff", path, files.folder / "b.keras", "--json")
    doc = json.loads(out)
    assert set(doc["sections"]["model"]["max_abs_diff"].values()) == {0.0}
    # change the values of the hidden kernel in arrays/ behind the index's back (Orbax compresses
    # its chunks, so the bytes are rewritten through TensorStore)
    import tensorstore

    index = format.read_file(path / "state.h5").metadata["orbax"]["arrays"]
    leaf = next(f"{sec}.{name}" for sec, key, name, *_ in index if key == "path:layers/hidden/kernel")
    kvstore = {"driver": "ocdbt", "base": f"file://{path / 'arrays'}", "path": f"{leaf}/"}
    array = tensorstore.open({"driver": "zarr", "kvstore": kvstore}, open=True).result()
    array.write(array.read().result() + 1).result()
    code, out, _ = _run(capsys, "verify", path, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False
    assert [d["key"] for d in doc["damaged"]] == ["path:layers/hidden/kernel"]
    assert "fails its hash" in doc["damaged"][0]["reason"]
    # a '.orbax' folder that is not one
    (tmp_path / "empty.orbax").mkdir()
    code, out, err = _run(capsys, "verify", tmp_path / "empty.orbax")
    assert code == 2 and "has no 'state.h5'" in err and out == ""
