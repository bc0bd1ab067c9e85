"""Worker process of the fuzz suite (tests/integrity/test_integrity.py); a script, not a test module.

    python tests/_fuzz_worker.py serve WORKDIR

imports Keras once (backend from ``KERAS_BACKEND``), writes the pristine files
into ``WORKDIR`` if they are not there yet (a short ``fit`` with
``StableCheckpoint``, then ``save_training_state`` to ``.h5`` and ``.keras``),
builds the model once, restores every pristine file to learn the reference
state, prints one ``KSSFUZZ-READY {...}`` line and then reads cases, one JSON
object a line, from stdin. For each case it damages a copy of a pristine file
(a byte flip, a truncation or an HDF5 edit), sets the live state to other
values, calls ``restore_training_state`` and ``keras-stable-state verify`` /
``inspect``, and prints one ``KSSFUZZ-RESULT {...}`` line, flushed.

The verdict of a case is one of

* ``exact``: restore returned and every model variable, optimizer variable,
  random state, callback state and provider state equals the reference, bit
  for bit;
* ``refused``: a ``StateError`` subclass naming a key or the file, with every
  one of those states equal to its value before the call;
* ``failure``: anything else (listed in ``problems``).

``verify`` must exit 0 exactly when restore returned, and neither command may
raise or print a traceback. A crash or a hang of this process is detected by
the parent, which restarts it from the next case.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import traceback
import zipfile
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
faulthandler.enable()

import _records  # noqa: E402
import h5py  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_stable_state as kss  # noqa: E402
from keras_stable_state import cli, format  # noqa: E402
from keras_stable_state.errors import (  # noqa: E402
    BindingError,
    CheckpointInUseError,
    ContractError,
    NewerFormatError,
    StateError,
)
from keras_stable_state.format import writer  # noqa: E402
from keras_stable_state.format.record import MEMBER  # noqa: E402

BACKEND = keras.backend.backend()
TARGETS = {"h5": "state.h5", "keras": "state.keras", "ckpt": "ckpt.h5"}
CKPT_STEP = 9  # the StableCheckpoint file fuzzed: mid-epoch (epoch 2, step 1)
EDITS = (
    "json_digit",
    "json_field",
    "attr_crc",
    "attr_dtype",
    "attr_key",
    "root_attr",
    "byteorder_bits",
    "byteorder_values",
    "retype_uint",
    "retype_float64",
    "reshape",
    "delete_dataset",
    "add_dataset",
    "index_row",
    "blob_size",
    "blob_retype",
)
SECTIONS = ("model", "optimizer", "state")
RECORDS = ("metadata", "contract", "extra")


# -- the model and its state ----------------------------------------------------------------
def build_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    h = keras.layers.BatchNormalization(name="norm")(h)
    h = keras.layers.Dropout(0.25, name="drop")(h)
    outputs = keras.layers.Dense(1, name="out")(h)
    model = keras.Model(inputs, outputs, name="fuzz")
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def early_stopping():
    cb = keras.callbacks.EarlyStopping(monitor="loss", patience=5, restore_best_weights=True)
    cb.on_train_begin()
    return cb


class Probe:
    """A state provider whose saved state mixes JSON values and arrays."""

    def get_state(self):
        return {
            "count": 7,
            "scale": 0.25,
            "name": "probe",
            "vec": np.arange(5, dtype="float32") * 0.5,
            "nested": {"ids": [1, 2, 3], "flag": True},
        }

    def set_state(self, value):  # pragma: no cover - only the recorder below is restored into
        raise AssertionError("not restored into")


class Recorder:
    """A provider that keeps what ``set_state`` gives it (``None`` until then: a live
    state of ``None`` lets the restore's form check accept any saved form)."""

    SENTINEL = None

    def __init__(self):
        self.state = self.SENTINEL

    def get_state(self):
        return self.state

    def set_state(self, value):
        self.state = value


def flatten(obj, prefix, out):
    """``{name: np.ndarray}`` for every leaf of a nested structure (exact comparison)."""
    if isinstance(obj, dict):
        out[prefix + "{}"] = np.array(sorted(map(str, obj)))
        for k, v in obj.items():
            flatten(v, f"{prefix}/{k}", out)
    elif isinstance(obj, (list, tuple)):
        out[prefix + "[]"] = np.array(len(obj))
        for i, v in enumerate(obj):
            flatten(v, f"{prefix}/{i}", out)
    elif obj is None:
        out[prefix] = np.array("<None>")
    elif isinstance(obj, bool):
        out[prefix] = np.array(obj)
    elif isinstance(obj, int):
        out[prefix] = np.array(str(obj)) if abs(obj) >= 2**63 else np.array(obj, dtype=np.int64)
    elif isinstance(obj, float):
        out[prefix] = np.array(obj, dtype=np.float64)
    elif isinstance(obj, str):
        out[prefix] = np.array(obj)
    else:
        out[prefix] = np.array(keras.ops.convert_to_numpy(obj) if not isinstance(obj, np.ndarray) else obj)
    return out


def _global_seed_generator(create=False):
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    if create:
        return seed_generator.global_seed_generator()
    return global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)


class Live:
    """The live objects a restore writes into: model, optimizer, callbacks, providers."""

    def __init__(self, model, target):
        self.model = model
        self.target = target
        self.es = early_stopping()
        self.providers = (
            {"position": Recorder(), "metrics": Recorder()} if target == "ckpt" else {"probe": Recorder()}
        )

    def restore(self, path, allow_cast=False):
        return kss.restore_training_state(
            path,
            self.model,
            allow_cast=allow_cast,
            callbacks=[self.es],
            state=self.providers,
        )

    def snapshot(self):
        out = {}
        for i, v in enumerate(self.model.variables):
            out[f"model[{i}] {v.path}"] = keras.ops.convert_to_numpy(v.value)
        for i, v in enumerate(self.model.optimizer.variables):
            out[f"optimizer[{i}] {v.path}"] = keras.ops.convert_to_numpy(v.value)
        flatten(np.random.get_state(legacy=False), "rng/numpy", out)
        version, internal, gauss = random.getstate()
        flatten(
            {"version": version, "internal": np.array(internal, dtype=np.uint64), "gauss": gauss},
            "rng/python",
            out,
        )
        gen = _global_seed_generator()
        out["rng/keras_global_seed"] = (
            np.array("<None>") if gen is None else keras.ops.convert_to_numpy(gen.state.value)
        )
        if BACKEND == "torch":
            import torch

            out["rng/torch"] = torch.get_rng_state().numpy()
        es = self.es
        flatten(
            {
                "wait": es.wait,
                "stopped_epoch": es.stopped_epoch,
                "best": None if es.best is None else float(es.best),
                "best_epoch": es.best_epoch,
                "best_weights": es.best_weights,
            },
            "callback/EarlyStopping",
            out,
        )
        for name, rec in self.providers.items():
            flatten(rec.state, f"provider/{name}", out)
        return out

    def perturb(self, seed):
        """Set every state to a value other than the reference (a no-op restore must show)."""
        variables = list(self.model.variables) + list(self.model.optimizer.variables)
        for v in variables:
            value = keras.ops.convert_to_numpy(v.value)
            if value.dtype == bool:
                v.assign(~value)
            else:
                v.assign((value + np.ones((), value.dtype)).astype(value.dtype))
        np.random.seed(10_000 + seed)
        random.seed(20_000 + seed)
        _global_seed_generator(create=True).state.assign(np.array([seed + 1, 3], dtype="uint32"))
        if BACKEND == "torch":
            import torch

            torch.manual_seed(30_000 + seed)
        self.es = early_stopping()
        for rec in self.providers.values():
            rec.state = Recorder.SENTINEL


def differences(a, b, limit=12):
    """Names whose values differ (dtype, shape or bytes), missing on either side included."""
    out = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            out.append(f"{name}: only in {'after' if name in b else 'before'}")
            continue
        x, y = np.asarray(a[name]), np.asarray(b[name])
        if x.dtype == object or y.dtype == object:
            same = x.dtype == y.dtype and x.shape == y.shape and x.tolist() == y.tolist()
        else:
            same = x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        if not same:
            out.append(f"{name}: {_short(x)} != {_short(y)}")
    return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])


def _short(x):
    text = np.array2string(np.asarray(x).ravel()[:4], threshold=4, precision=9)
    return f"{x.dtype}{list(x.shape)} {text}"


# -- pristine files -----------------------------------------------------------------------
def setup(workdir):
    """Write the pristine files and the state saved in them (``saved-*.npz``)."""
    model = build_model()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    keras.random.normal((1,))  # the global seed generator exists and is saved in every file
    ckdir = os.path.join(workdir, "ckpts")
    es = early_stopping()
    model.fit(
        x,
        y,
        epochs=3,
        batch_size=4,
        verbose=0,
        callbacks=[kss.StableCheckpoint(ckdir, save_freq=3, max_to_keep=10), es],
    )
    shutil.copyfile(os.path.join(ckdir, f"ckpt-{CKPT_STEP:010d}.h5"), os.path.join(workdir, TARGETS["ckpt"]))
    live = Live(model, "h5")
    live.es = es
    live.providers["probe"].state = Probe().get_state()
    for target in ("h5", "keras"):
        # The state as save_training_state reads it (model.save may draw Python random numbers).
        saved = live.snapshot()
        kss.save_training_state(
            os.path.join(workdir, TARGETS[target]), model, callbacks=[es], state={"probe": Probe()}
        )
        np.savez(
            os.path.join(workdir, f"saved-{target}.npz"), **{f"k{i}": v for i, v in enumerate(saved.values())}
        )
        with open(os.path.join(workdir, f"saved-{target}.json"), "w") as fh:
            json.dump(list(saved), fh)


def load_saved(workdir, target):
    with open(os.path.join(workdir, f"saved-{target}.json")) as fh:
        names = json.load(fh)
    with np.load(os.path.join(workdir, f"saved-{target}.npz"), allow_pickle=False) as z:
        return {name: z[f"k{i}"] for i, name in enumerate(names)}


def file_names(path):
    """Keys, dataset paths and record names in a pristine file (what a message may name)."""
    names = set()
    with format.open_file(path) as f:
        for e in f.entries:
            names.update({e.key, e.dataset, e.dataset.lstrip("/")})
    return names


# -- damage ---------------------------------------------------------------------------------
def _signer():
    """The storage function that re-signs an edited file, if storage has one."""
    for name in ("reseal", "resign", "sign_file", "seal_file"):
        fn = getattr(writer, name, None)
        if callable(fn):
            return fn
    return None


def _datasets(f, kind=None):
    out = []
    for section in SECTIONS:
        group = f.get(section)
        if not isinstance(group, h5py.Group):
            continue
        for name in sorted(group, key=lambda n: (len(n), n)):
            obj = group.get(name)
            if isinstance(obj, h5py.Dataset) and (kind is None or obj.dtype == np.dtype(kind)):
                out.append(obj)
    return out


def _recreate(ds, data):
    """Replace dataset ``ds`` by ``data`` (its own stored type), keeping its attributes."""
    parent, name = ds.parent, ds.name.rsplit("/", 1)[1]
    attrs = {k: ds.attrs[k] for k in ds.attrs}
    del parent[name]
    new = parent.create_dataset(name, data=data)
    for k, v in attrs.items():
        new.attrs[k] = v
    return new


def _json_records(f):
    return [n for n in RECORDS if isinstance(f.get(n), h5py.Dataset)]


def _read_text(ds):
    """A JSON record's text: UTF-8 bytes stored as uint8 (format 2) or a string (format 1)."""
    value = ds[()]
    if isinstance(value, np.ndarray) and value.dtype == np.uint8:
        return value.tobytes().decode("utf-8", errors="surrogateescape")
    return value.decode() if isinstance(value, bytes) else str(value)


def _write_text(ds, text):
    if ds.dtype == np.uint8:
        data = np.frombuffer(text.encode("utf-8", errors="surrogateescape"), dtype=np.uint8)
    elif ds.dtype.kind == "S":
        data = np.array(text.encode(), dtype=ds.dtype)
    else:
        data = np.array(text, dtype=h5py.string_dtype())
    return _recreate(ds, data)


def _forged_crc(key, dtype, value):
    """The CRC-32 storage would write for ``value`` (a forged but self-consistent entry)."""
    try:
        from keras_stable_state.format import sandbox

        return sandbox.crc_v2(key, dtype, value.shape, value.tobytes())
    except (ImportError, AttributeError):
        return zlib.crc32(value.tobytes()) & 0xFFFFFFFF


def edit_h5(path, edit, pick, pick2):
    """Apply one edit to the HDF5 file at ``path`` in place; returns its description or ``None``."""
    with h5py.File(path, "r+") as f:
        if edit in ("json_digit", "json_field"):
            recs = _json_records(f)
            if not recs:
                return None
            if edit == "json_digit":
                name = recs[pick % len(recs)]
                text = _read_text(f[name])
                where = [m.start() for m in re.finditer(r"\d", text)]
                if not where:
                    return None
                pos = where[pick2 % len(where)]
                new = str((int(text[pos]) + 1 + pick2 % 9) % 10)
                _write_text(f[name], text[:pos] + new + text[pos + 1 :])
                return f"{name}[{pos}]: {text[max(0, pos - 24) : pos + 8]!r} digit -> {new}"
            found = []
            for name in recs:
                text = _read_text(f[name])
                pattern = r'"(epoch|step|global_step|wait|best_epoch|count|pos|stopped_epoch)": (-?\d+)'
                found += [(name, m) for m in re.finditer(pattern, text)]
            if not found:
                return None
            name, m = found[pick % len(found)]
            text = _read_text(f[name])
            value = int(m.group(2)) + 1 + pick2 % 3
            _write_text(f[name], text[: m.start(2)] + str(value) + text[m.end(2) :])
            return f"{name}: {m.group(1)} {m.group(2)} -> {value}"
        if edit == "root_attr":
            attrs = sorted(f.attrs)
            if not attrs:
                return None
            k = attrs[pick % len(attrs)]
            old = f.attrs[k]
            mode = pick2 % 3
            if mode == 0:
                del f.attrs[k]
                return f"root attr {k!r} deleted"
            if mode == 1:
                f.attrs[k] = "2" if isinstance(old, (str, bytes)) else np.asarray(old) + 1
            else:
                f.attrs[k] = str(old) + "x"
            return f"root attr {k!r}: {old!r} -> {f.attrs[k]!r}"
        if edit == "index_row":  # format 3: one index row (or the rows' order) changed
            if "index" not in f:
                return None
            idx = _records.index(f)
            section = SECTIONS[pick % len(SECTIONS)] if idx[SECTIONS[pick % len(SECTIONS)]] else "model"
            field = _records.FIELDS[pick2 % len(_records.FIELDS)]
            _records.mutate_index(idx, section, pick, field, 1 + pick2 % 64)
            _records.write_json(f, "index", idx)
            return f"index {section} row {pick}: {field} changed"
        if edit in ("blob_size", "blob_retype"):  # format 3: a blob longer, shorter or retyped
            blobs = [ds for ds in _datasets(f, "uint8") if ds.parent.name != "/"]
            if "index" not in f or not blobs:
                return None
            ds = blobs[pick % len(blobs)]
            data = ds[()]
            if edit == "blob_size":
                new = np.concatenate([data, np.zeros(1 + pick2 % 32, np.uint8)]) if pick2 % 2 else data[:-1]
                _recreate(ds, new)
                return f"{ds.name}: {data.size} -> {new.size} bytes"
            new = data.view("<u4") if data.size % 4 == 0 else data.astype("<u2")
            _recreate(ds, new)
            return f"{ds.name}: stored type uint8 -> {new.dtype}"
        if edit == "add_dataset":
            group = f[SECTIONS[pick % 2]]
            value = np.zeros((3,), "float32")
            ds = group.create_dataset(str(len(group)), data=value)
            ds.attrs["key"] = "path:layers/evil/kernel"
            ds.attrs["dtype"] = "float32"
            ds.attrs["crc32"] = _forged_crc("path:layers/evil/kernel", "float32", value)
            return f"added {ds.name} 'path:layers/evil/kernel'"
        kind = "float32" if edit.startswith(("byteorder", "retype")) or edit == "reshape" else None
        datasets = _datasets(f, kind)
        if not datasets:
            return None
        ds = datasets[pick % len(datasets)]
        what = f"{ds.name} (key {ds.attrs.get('key')!r})"
        if edit.startswith("attr_"):
            attr = {"attr_crc": "crc32", "attr_dtype": "dtype", "attr_key": "key"}[edit]
            if attr not in ds.attrs:
                return None
            old = ds.attrs[attr]
            if attr == "crc32":
                ds.attrs[attr] = (np.asarray(old) + 1 + pick2 % 1000).astype(np.asarray(old).dtype)
            elif attr == "dtype":
                names = [n for n in ("float16", "float64", "int32", "bfloat16", "uint8", "x") if n != old]
                ds.attrs[attr] = names[pick2 % len(names)]
            else:
                mode = pick2 % 3
                if mode == 0:
                    same = [
                        d for d in _datasets(f) if d.parent == ds.parent and d != ds and d.shape == ds.shape
                    ] or [d for d in _datasets(f) if d != ds]
                    other = same[pick2 % len(same)]
                    ds.attrs["key"], other.attrs["key"] = other.attrs["key"], old
                    return f"{what}: key swapped with {other.name}"
                if mode == 1:
                    text = str(old)
                    pos = pick2 % max(1, len(text))
                    ds.attrs["key"] = (
                        text[:pos] + ("x" if text[pos : pos + 1] != "x" else "y") + text[pos + 1 :]
                    )
                else:
                    del ds.attrs["key"]
                    return f"{what}: key attribute deleted"
            return f"{what}: attr {attr} {old!r} -> {ds.attrs.get(attr)!r}"
        data = ds[()]
        if edit == "byteorder_bits":
            _recreate(ds, np.asarray(data).view(">f4"))
            return f"{what}: stored type <f4 -> >f4, same bytes"
        if edit == "byteorder_values":
            _recreate(ds, np.asarray(data).astype(">f4"))
            return f"{what}: stored type <f4 -> >f4, same values"
        if edit == "retype_uint":
            _recreate(ds, np.asarray(data).view("<u4"))
            return f"{what}: stored type float32 -> uint32, same bytes"
        if edit == "retype_float64":
            _recreate(ds, np.asarray(data).astype("<f8"))
            return f"{what}: stored type float32 -> float64, same values"
        if edit == "reshape":
            arr = np.asarray(data)
            new = arr.reshape(-1) if arr.ndim != 1 else arr.reshape(1, -1)
            _recreate(ds, new)
            return f"{what}: shape {arr.shape} -> {new.shape}"
        if edit == "delete_dataset":
            del ds.parent[ds.name.rsplit("/", 1)[1]]
            return f"{what}: deleted"
    raise ValueError(f"unknown edit {edit!r}")


def apply_edit(src, dst, case, workdir):
    """Copy ``src`` to ``dst`` with one HDF5 edit (inside the archive member for ``.keras``)."""
    resign = _signer() if case.get("resign") else None
    if case.get("resign") and resign is None:
        return None
    if not src.endswith(".keras"):
        shutil.copyfile(src, dst)
        detail = edit_h5(dst, case["edit"], case["pick"], case["pick2"])
        if detail and resign:
            resign(dst)
        return detail
    member_path = os.path.join(workdir, "member.h5")
    with zipfile.ZipFile(src) as zin:
        with open(member_path, "wb") as fh:
            fh.write(zin.read(MEMBER))
        detail = edit_h5(member_path, case["edit"], case["pick"], case["pick2"])
        if detail is None:
            return None
        if resign:
            resign(member_path)
        with zipfile.ZipFile(dst, "w") as zout:
            for info in zin.infolist():
                if info.filename == MEMBER:
                    with open(member_path, "rb") as fh:
                        zout.writestr(info, fh.read())
                else:
                    zout.writestr(info, zin.read(info.filename))
    return f"{MEMBER}: {detail}"


def make_case_file(case, workdir):
    """Write the damaged file for ``case``; returns ``(path, description)`` or ``(None, why)``."""
    src = os.path.join(workdir, TARGETS[case["target"]])
    ext = ".keras" if src.endswith(".keras") else ".h5"
    dst = os.path.join(workdir, f"case-{case['target']}{ext}")
    if os.path.exists(dst):
        os.remove(dst)
    kind = case["kind"]
    if kind == "pristine":
        shutil.copyfile(src, dst)
        return dst, "unchanged copy"
    if kind in ("flip", "truncate"):
        with open(src, "rb") as fh:
            data = bytearray(fh.read())
        if kind == "flip":
            off = case["offset"] % len(data)
            old = data[off]
            data[off] ^= case["mask"]
            detail = f"byte {off} of {len(data)}: {old:#04x} -> {data[off]:#04x}"
        else:
            detail = f"truncated to {case['length']} of {len(data)} bytes"
            data = data[: case["length"]]
        with open(dst, "wb") as fh:
            fh.write(data)
        return dst, detail
    if kind == "edit":
        detail = apply_edit(src, dst, case, workdir)
        return (dst, detail) if detail else (None, "edit not applicable to this file")
    raise ValueError(f"unknown kind {kind!r}")


# -- one case -------------------------------------------------------------------------------
def run_cli(args):
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(args)
    except BaseException as exc:  # noqa: BLE001 - everything the CLI lets escape is a finding
        return None, out.getvalue() + err.getvalue() + "".join(traceback.format_exception(exc))
    return rc, out.getvalue() + err.getvalue()


def run_case(ctx, case):
    result = {"id": case["id"], "case": case}
    path, detail = make_case_file(case, ctx["workdir"])
    result["detail"] = detail
    if path is None:
        result["verdict"] = "skipped"
        return result
    live = ctx["live"][case["target"]]
    reference = ctx["reference"][case["target"]]
    live.perturb(case["id"])
    before = live.snapshot()
    problems = []
    error = None
    t0 = time.perf_counter()
    try:
        live.restore(path, allow_cast=bool(case.get("allow_cast")))
    except StateError as exc:
        error = exc
    except BaseException as exc:  # noqa: BLE001 - a raw exception is a finding, reported in full
        error = exc
        problems.append(f"raw exception {type(exc).__module__}.{type(exc).__name__} from restore")
    result["t_restore"] = round(time.perf_counter() - t0, 4)
    after = live.snapshot()
    if error is None:
        diff = differences(reference, after)
        if diff:
            problems.append("restore returned but the state differs from the saved one: " + "; ".join(diff))
        result["outcome"] = "restored"
    else:
        result["outcome"] = "refused"
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = "".join(traceback.format_exception(error))[-4000:]
        diff = differences(before, after)
        if diff:
            problems.append("refused, but the live state was changed: " + "; ".join(diff))
        if isinstance(error, StateError):
            message = str(error)
            named = (
                path in message
                or os.path.basename(path) in message
                or (error.key is not None and str(error.key) in message)
                or any(n in message for n in ctx["names"][case["target"]])
            )
            if not named:
                problems.append("the refusal names neither a key nor the file")
            if isinstance(error, CheckpointInUseError):
                problems.append("a damaged file is reported as in use by another process")
    t0 = time.perf_counter()
    rc, text = run_cli(["verify", path])
    result["t_verify"] = round(time.perf_counter() - t0, 4)
    result["verify_rc"] = rc
    if rc is None:
        problems.append("verify raised: " + text[-1500:])
    else:
        if "Traceback" in text:
            problems.append("verify printed a traceback: " + text[-1500:])
        # A resealed file with an entry added, or its last one deleted, is self-consistent (the
        # seal detects damage, not forgery): verify finds it intact, only the model can differ.
        forged = case.get("edit") in ("add_dataset", "delete_dataset") and case.get("resign")
        if forged and rc == 0 and isinstance(error, (BindingError, ContractError)):
            pass  # a self-consistent forged file: intact, but it does not fit the model
        elif (rc == 0) != (error is None):
            problems.append(
                f"verify exit code {rc} disagrees with restore ({'returned' if error is None else 'refused'})"
                f": {text.strip()[-600:]}"
            )
    if case.get("inspect", True):
        t0 = time.perf_counter()
        rc, text = run_cli(["inspect", path])
        result["t_inspect"] = round(time.perf_counter() - t0, 4)
        result["inspect_rc"] = rc
        if rc is None:
            problems.append("inspect raised: " + text[-1500:])
        elif "Traceback" in text or rc not in (
            0,
            1,
            2,
            *((3,) if isinstance(error, NewerFormatError) else ()),
        ):
            # 3: a file from a newer keras_stable_state (a resealed format_version edit), only
            # where the restore refused it as such
            problems.append(f"inspect exit code {rc} or traceback: {text[-1500:]}")
    result["problems"] = problems
    if problems:
        result["verdict"] = "failure"
    else:
        result["verdict"] = "exact" if error is None else "refused"
    return result


# -- serving --------------------------------------------------------------------------------
def emit(tag, doc):
    sys.stdout.write(f"{tag} {json.dumps(doc, default=str)}\n")
    sys.stdout.flush()


def start(workdir):
    if not os.path.exists(os.path.join(workdir, "saved-keras.json")):
        setup(workdir)
        keras.backend.clear_session(free_memory=False)
    model = build_model()
    model(np.zeros((1, 4), "float32"))
    ctx = {"workdir": workdir, "live": {}, "reference": {}, "names": {}}
    problems = []
    # A resumed run restores in a fresh process: nothing (e.g. Keras' global seed generator)
    # exists yet. The first restore must give the saved state too.
    if _global_seed_generator() is None:
        live = Live(model, "h5")
        try:
            live.restore(os.path.join(workdir, TARGETS["h5"]))
            diff = differences(load_saved(workdir, "h5"), live.snapshot())
            if diff:
                problems.append(
                    f"the first restore in a fresh process ({TARGETS['h5']}) gives other values than were "
                    f"saved: {'; '.join(diff)}"
                )
        except BaseException as exc:  # noqa: BLE001
            problems.append(
                f"pristine {TARGETS['h5']} does not restore: {''.join(traceback.format_exception(exc))}"
            )
    for target, name in TARGETS.items():
        path = os.path.join(workdir, name)
        live = Live(model, target)
        live.perturb(0)
        try:
            live.restore(path)
        except BaseException as exc:  # noqa: BLE001
            problems.append(f"pristine {name} does not restore: {''.join(traceback.format_exception(exc))}")
            continue
        ctx["live"][target] = live
        ctx["reference"][target] = live.snapshot()
        ctx["names"][target] = file_names(path)
        if target in ("h5", "keras"):
            diff = differences(load_saved(workdir, target), ctx["reference"][target])
            if diff:
                problems.append(f"pristine {name} restores other values than were saved: {'; '.join(diff)}")
    sizes = {t: os.path.getsize(os.path.join(workdir, n)) for t, n in TARGETS.items()}
    return ctx, {"backend": BACKEND, "sizes": sizes, "problems": problems, "signer": bool(_signer())}


def serve(workdir):
    ctx, ready = start(workdir)
    emit("KSSFUZZ-READY", ready)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        case = json.loads(line)
        try:
            result = run_case(ctx, case)
        except BaseException as exc:  # noqa: BLE001 - a bug of the harness itself, reported as such
            result = {
                "id": case["id"],
                "case": case,
                "verdict": "failure",
                "problems": ["fuzz worker error: " + "".join(traceback.format_exception(exc))[-3000:]],
            }
        emit("KSSFUZZ-RESULT", result)


def main(argv):
    if len(argv) != 2 or argv[0] != "serve":
        print(__doc__, file=sys.stderr)
        return 2
    workdir = argv[1]
    os.makedirs(workdir, exist_ok=True)
    tempfile.tempdir = workdir
    serve(workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
