"""``inspect`` of a ``.keras`` checkpoint reads only what it prints of Keras' ``config.json``:
a 300 MB config (a model with a huge embedded vocabulary, say) prints its class name with the
memory of a small one, and a config that fails its zip CRC-32 is still reported damaged."""

import json
import os
import subprocess
import sys
import zipfile

import keras
import pytest

import keras_stable_state as kss

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="inspect runs without Keras, the same on every backend: checked once, in the jax pass",
)

# Peak resident memory (MiB) of inspecting argv[1] in this process (VmHWM: this program's
# own, not the forking parent's as ru_maxrss would be), printed after the result.
CHILD = """
import sys
from keras_stable_state.cli import main
status = main(["inspect", sys.argv[1]])
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")][0].split()[1]
print("PEAK", int(hwm) // 1024, "STATUS", status)
"""


def _with_config(src, dst, config: bytes):
    """``src`` rewritten with ``config`` as its ``config.json`` (every other member as it is)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = config if info.filename == "config.json" else zin.read(info.filename)
            zout.writestr(info, data, compress_type=info.compress_type)


def _inspect(path):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(kss.__file__)))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, env=env, timeout=300
    )
    line = [x for x in done.stdout.splitlines() if x.startswith("PEAK")][-1].split()
    return int(line[1]), int(line[3]), done.stdout


@pytest.mark.slow
def test_a_300_mb_config_is_inspected_in_the_memory_of_a_small_one(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="head")], name="tiny")
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam(), model=model), loss="mse")
    kss.save_training_state(tmp_path / "run.keras", model)
    with zipfile.ZipFile(tmp_path / "run.keras") as z:
        config = json.loads(z.read("config.json"))
    small = dict(config, class_name="BigVocabModel")
    # 360 MB of JSON: a 40-million-token vocabulary (written as bytes: json.dumps of the list
    # takes seconds and a list of 40 million references)
    one = json.dumps(dict(small, config=dict(config["config"], vocabulary=["token"]))).encode()
    assert one.count(b'["token"]') == 1
    big_bytes = one.replace(b'["token"]', b"[" + b'"token", ' * (40_000_000 - 1) + b'"token"]')
    assert len(big_bytes) > 300 * 2**20
    _with_config(tmp_path / "run.keras", tmp_path / "small.keras", json.dumps(small).encode())
    _with_config(tmp_path / "run.keras", tmp_path / "big.keras", big_bytes)
    del big_bytes
    small_peak, small_status, small_out = _inspect(tmp_path / "small.keras")
    big_peak, big_status, big_out = _inspect(tmp_path / "big.keras")
    assert small_status == big_status == 0, (small_out, big_out)
    # the class inspect prints of a training state is its record's; the config is read past
    assert "model class     Sequential" in small_out and "model class     Sequential" in big_out
    assert big_peak - small_peak < 64, f"peak {big_peak} MiB for a 360 MB config against {small_peak} MiB"
