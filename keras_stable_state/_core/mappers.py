"""Per-key mappers: how an array is stored in a training state, and how it is read back.

``save_training_state(..., mappers={pattern: mapper})`` passes every model
variable and optimizer variable whose key ``re.search(pattern, key)`` finds
through ``mapper.encode``; the file holds the *encoded* array (that is what
its CRC-32 covers) and, under ``extra["mappers"][key]``, the mapper's
registered name and config, the array's original dtype and shape, and the
mapper's parameters (arrays stored beside the others, checksummed the same
way). ``restore_training_state`` rebuilds each mapper from the file, decodes,
and then checks shape and dtype against the live variable as for any array:
the caller does not pass the mappers again.

Built-in mappers:

* [`CastMapper`][keras_stable_state.CastMapper] (``CastMapper("bfloat16")``): store a floating-point
  array in another floating-point dtype; cast back on load.
* [`QuantizeMapper`][keras_stable_state.QuantizeMapper]: symmetric per-array int8 quantization
  (``scale = max|x| / 127``, ``q = round(x / scale)``, ``x' = q * scale``).

A mapper is a [`StateMapper`][keras_stable_state.StateMapper] subclass registered with
``keras.saving.register_keras_serializable`` (its registered name is part of
the file: restore looks it up in Keras' registry and never imports a module
named by the file).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, cast

import keras
import ml_dtypes
import numpy as np

from keras_stable_state import _state, format
from keras_stable_state.errors import CorruptCheckpointError, DtypeMismatchError, StateError, listed
from keras_stable_state.format.record import BY_KEY

__all__ = ["SECTION", "CastMapper", "QuantizeMapper", "StateMapper", "check_mappers", "decode_record"]

SECTION = "mappers"
_PACKAGE = "keras_stable_state"
_FLOATS = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")


def _is_float(name: str) -> bool:
    return name in _FLOATS


@keras.saving.register_keras_serializable(package=_PACKAGE)
class StateMapper:
    """Base class of per-key mappers: how one array is stored and read back.

    Subclasses implement [`encode`][keras_stable_state.StateMapper.encode] and [`decode`][keras_stable_state.StateMapper.decode], set `lossy`,
    and round-trip through [`get_config`][keras_stable_state.StateMapper.get_config] / `from_config`; register
    them with ``@keras.saving.register_keras_serializable()`` so that a file
    naming them can be restored (the class must be registered, i.e. its module
    imported, in the restoring process too).

    Attributes:
        lossy (bool): ``True`` when ``decode(encode(x))`` may differ from ``x``; the
            restore report then lists the keys as not restored bit-exactly.

    Examples:
        >>> @keras.saving.register_keras_serializable(package="my_project")
        ... class Float16(kss.StateMapper):
        ...     lossy = True
        ...     def encode(self, key, array):
        ...         return array.astype("float16"), {}
        ...     def decode(self, key, array, dtype, params):
        ...         return array.astype(dtype)
    """

    lossy = False

    def encode(self, key: str, array: np.ndarray) -> np.ndarray | tuple[np.ndarray, dict[str, Any]]:
        """Encode one array for storage.

        Args:
            key: The array's key (``path:layers/dense/kernel``,
                ``path:layers/dense/kernel#momentums``).
            array: The value, a floating-point NumPy array of any shape.

        Returns:
            ``(stored, params)``: the NumPy array to store (any dtype the file
            format stores: bool, (u)int8-64, float16/32/64, bfloat16, float8)
            and a dict of parameters decode needs (NumPy arrays, numbers,
            strings), stored beside it; or just ``stored`` when there are none.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement encode(key, array).")

    def decode(self, key: str, array: np.ndarray, dtype: str, params: dict[str, Any]) -> np.ndarray:
        """Decode a stored array back to ``dtype``.

        Args:
            key: The array's key, as saved.
            array: The stored array (what [`encode`][keras_stable_state.StateMapper.encode] returned).
            dtype: The original dtype name (``"float32"``).
            params: The parameters [`encode`][keras_stable_state.StateMapper.encode] returned (arrays as NumPy arrays).

        Returns:
            A NumPy array of dtype ``dtype`` and the original shape.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement decode(key, array, dtype, params).")

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, as JSON-ready values."""
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> StateMapper:
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CastMapper(StateMapper):
    """Store floating-point arrays in another floating-point dtype; cast back on load.

    ``CastMapper("bfloat16")`` halves a float32 state: the restored value is
    exactly ``x.astype(bfloat16).astype(float32)`` (round to nearest even, as
    NumPy / ml_dtypes cast). Lossy unless ``dtype`` is ``"float64"`` (every
    float dtype a variable holds fits float64 exactly).

    Args:
        dtype: ``"bfloat16"`` (default), ``"float16"``, ``"float32"``,
            ``"float64"``, ``"float8_e4m3fn"`` or ``"float8_e5m2"``.

    Raises:
        ValueError: for another dtype.
        StateError: at save, naming the key, when a finite value overflows
            ``dtype`` (e.g. 1e5 to float16): it would be stored as infinity.

    Examples:
        >>> kss.save_training_state("run.h5", model, mappers={r"^path:": kss.CastMapper("bfloat16")})
        >>> kss.restore_training_state("run.h5", model).lossy   # every model variable's key
    """

    def __init__(self, dtype: str = "bfloat16") -> None:
        if dtype not in _FLOATS:
            raise ValueError(f"`dtype` of CastMapper must be one of {_FLOATS}. Received: dtype={dtype!r}")
        self.dtype = dtype

    @property
    def lossy(self) -> bool:  # type: ignore[override]  # per instance (its dtype); StateMapper's is a class attribute
        return self.dtype != "float64"

    def encode(self, key: str, array: np.ndarray) -> np.ndarray | tuple[np.ndarray, dict[str, Any]]:
        with np.errstate(over="ignore"):  # an overflow is refused below, naming the key
            stored = np.asarray(array).astype(format.numpy_dtype(self.dtype))
        overflow = np.isfinite(array) & ~np.isfinite(stored)
        if overflow.any():
            worst = float(np.max(np.abs(np.asarray(array, dtype=np.float64)[overflow])))
            raise StateError(
                f"CastMapper({self.dtype!r}) cannot store {key}: values up to {worst:.6g} overflow "
                f"{self.dtype} (largest {float(ml_dtypes.finfo(format.numpy_dtype(self.dtype)).max):.6g}) "
                "and would be stored as infinity. Use a wider dtype (bfloat16 has float32's range) or "
                "leave this key out of the pattern.",
                key=key,
                expected=f"values within {self.dtype}'s range",
                received=worst,
            )
        return stored, {}

    def decode(self, key: str, array: np.ndarray, dtype: str, params: dict[str, Any]) -> np.ndarray:
        return np.asarray(array).astype(format.numpy_dtype(dtype))

    def get_config(self) -> dict[str, Any]:
        return {"dtype": self.dtype}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class QuantizeMapper(StateMapper):
    """Symmetric per-array int8 quantization: a quarter of float32's bytes.

    With ``m = max|x|`` over the whole array (computed in float64)::

        scale = m / 127                            (0 when m == 0)
        q     = clip(round(x / scale), -127, 127)  stored as int8
        x'    = (q * scale).astype(dtype)          on load

    ``scale`` is stored beside ``q`` as a float64 scalar. Bound: every restored
    element satisfies ``|x' - x| <= scale / 2 + m * eps(dtype) / 2`` (half a
    quantization step, plus the rounding of the final cast to ``dtype``,
    ``eps = ml_dtypes.finfo(dtype).eps``). Zeros are restored exactly. The
    scheme is the symmetric "absmax" int8 quantization of LLM.int8()
    (Dettmers et al., 2022, section 3), per tensor.

    Raises:
        StateError: at save, naming the key, for an array holding NaN or infinity.

    Examples:
        >>> kss.save_training_state("run.h5", model, mappers={r"^path:.*#": kss.QuantizeMapper()})
        >>> err_bound = kss.QuantizeMapper.bound(momentum_array)   # |restored - saved| <= err_bound
    """

    lossy = True

    def encode(self, key: str, array: np.ndarray) -> np.ndarray | tuple[np.ndarray, dict[str, Any]]:
        x = np.asarray(array, dtype=np.float64)
        if not np.isfinite(x).all():
            raise StateError(
                f"QuantizeMapper cannot store {key}: it holds NaN or infinity, which int8 cannot "
                "represent. Leave this key out of the pattern (or find why the value is not finite).",
                key=key,
                expected="finite values",
                received="NaN or infinity",
            )
        m = float(np.max(np.abs(x))) if x.size else 0.0
        scale = m / 127.0
        q = (
            np.zeros(x.shape, np.int8)
            if scale == 0
            else np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
        )
        return q, {"scale": np.asarray(scale, dtype=np.float64)}

    def decode(self, key: str, array: np.ndarray, dtype: str, params: dict[str, Any]) -> np.ndarray:
        scale = np.asarray(params["scale"], dtype=np.float64)
        return (np.asarray(array, dtype=np.float64) * scale).astype(format.numpy_dtype(dtype))

    @staticmethod
    def bound(array: np.ndarray, dtype: str = "float32") -> float:
        """The documented bound on ``|x' - x|`` for ``array`` restored as ``dtype``."""
        m = float(np.max(np.abs(np.asarray(array, dtype=np.float64)))) if np.size(array) else 0.0
        return m / 127.0 / 2.0 + m * float(ml_dtypes.finfo(format.numpy_dtype(dtype)).eps) / 2.0


# -- save --------------------------------------------------------------------------------
@dataclasses.dataclass
class _Rule:
    pattern: str
    regex: re.Pattern[str]
    mapper: StateMapper
    name: str  # the registered name


def _registered_name(mapper: StateMapper, pattern: str, verb: str) -> str:
    cls = type(mapper)
    name: str = keras.saving.get_registered_name(cls)
    if keras.saving.get_registered_object(name) is not cls:
        raise TypeError(
            f"`mappers[{pattern!r}]` of {verb} is a {cls.__name__}, which is not registered with "
            "Keras: decorate the class with @keras.saving.register_keras_serializable(package=...) so "
            "that restore_training_state can rebuild it from the file."
        )
    return name


def check_mappers(mappers: object, verb: str) -> list[_Rule]:
    """The ``mappers`` argument as ``[_Rule]``; ``[]`` for ``None``.

    Raises:
        TypeError: for a non-dict, a non-string pattern, a value that is not a
            registered [`StateMapper`][keras_stable_state.StateMapper], or a config that is not JSON.
        ValueError: for a pattern that is not a regular expression.
    """
    if mappers is None:
        return []
    if not isinstance(mappers, dict):
        raise TypeError(
            f"`mappers` of {verb} must be a dict {{pattern: StateMapper}}, e.g. "
            "mappers={r'^path:.*kernel': kss.CastMapper('bfloat16')}. Received: "
            f"{type(mappers).__name__} {mappers!r:.100}"
        )
    rules = []
    for pattern, mapper in mappers.items():
        if not isinstance(pattern, str):
            raise TypeError(
                f"`mappers` keys of {verb} must be regular expressions (str). Received: {pattern!r}"
            )
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise ValueError(
                f"`mappers` pattern {pattern!r} of {verb} is not a valid regular expression ({err})."
            ) from err
        if not isinstance(mapper, StateMapper):
            raise TypeError(
                f"`mappers[{pattern!r}]` of {verb} must be a keras_stable_state.StateMapper (e.g. "
                f"kss.CastMapper('bfloat16')). Received: {type(mapper).__name__} {mapper!r:.100}"
            )
        name = _registered_name(mapper, pattern, verb)
        try:
            json.dumps(mapper.get_config())
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"`mappers[{pattern!r}]` of {verb}: get_config() of {type(mapper).__name__} must return "
                f"JSON-ready values; it is stored in the file ({err})."
            ) from err
        rules.append(_Rule(pattern, regex, mapper, name))
    return rules


def _encode_one(rule: _Rule, key: str, array: Any) -> tuple[np.ndarray, dict[str, Any]]:
    name = format.dtype_name(array)
    if not _is_float(name):
        raise DtypeMismatchError(
            f"Mapper pattern {rule.pattern!r} ({rule.mapper!r}) matches {key}, which is {name}: mappers "
            "only store floating-point state; an integer counter (iterations) or a boolean would be "
            "corrupted. Narrow the pattern so that it leaves this key out (e.g. r'^path:' for model "
            "variables, r'#' for slots).",
            key=key,
            expected="a floating-point array",
            received=name,
        )
    result = rule.mapper.encode(key, np.array(array, copy=True))
    stored, params = result if isinstance(result, tuple) else (result, {})
    stored = np.asarray(stored) if isinstance(stored, np.generic) else stored  # a 0-d result
    if not isinstance(stored, np.ndarray) or format.dtype_name(stored) not in format.DTYPES:
        raise TypeError(
            f"{rule.mapper!r}.encode({key!r}, ...) must return a NumPy array of a storable dtype (bool, "
            f"int, uint, float, bfloat16, float8) and a dict. Received: {type(stored).__name__} "
            f"{getattr(stored, 'dtype', '')}"
        )
    if not isinstance(params, dict):
        raise TypeError(
            f"{rule.mapper!r}.encode({key!r}, ...) must return (array, dict); params is {params!r:.80}"
        )
    return stored, params


def encode_arrays(
    rules: list[_Rule], model_arrays: dict[str, Any], opt_arrays: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Encode every array a rule matches.

    Returns:
        ``(model_arrays, opt_arrays, section, arrays)``: the arrays with the
        matched ones encoded, the JSON ``extra["mappers"]`` record, and the
        parameter arrays it refers to (for the ``state`` section).

    Raises:
        ValueError: naming the pattern, for a pattern that matches no saved
            key, and naming the key, for a key two patterns match.
        DtypeMismatchError: naming the key, for a matched array that is not floating-point.
        StateError: naming the key, when the mapper refuses the values.
    """
    section: dict[str, Any] = {}
    found: dict[str, Any] = {}
    used: set[str] = set()
    out: list[dict[str, Any]] = []
    for arrays in (model_arrays, opt_arrays):
        mapped: dict[str, Any] = {}
        for key, array in arrays.items():
            hits = [r for r in rules if r.regex.search(key)]
            if len(hits) > 1:
                raise ValueError(
                    f"`mappers` patterns {[r.pattern for r in hits]} all match {key}; give each key one "
                    "mapper (anchor the patterns, e.g. with '^' and '$')."
                )
            if not hits:
                mapped[key] = array
                continue
            rule = hits[0]
            used.add(rule.pattern)
            if callable(array):  # converted lazily by save_training_state (storage.StateRecord)
                array = array()
            stored, params = _encode_one(rule, key, array)
            json_params, refs = _state.split_arrays(params, f"{SECTION}/{key}")
            found.update(refs)
            section[key] = {
                "mapper": {"class_name": rule.name, "config": rule.mapper.get_config()},
                "dtype": format.dtype_name(array),
                "shape": list(np.shape(array)),
                "params": json_params,
            }
            mapped[key] = stored
        out.append(mapped)
    unused = [r.pattern for r in rules if r.pattern not in used]
    if unused:
        keys = [*model_arrays, *opt_arrays]
        raise ValueError(
            f"`mappers` patterns {listed(unused)} match no saved key (re.search); the keys saved are e.g. "
            f"{listed(keys)}. Fix the pattern or leave it out."
        )
    return out[0], out[1], section, found


# -- restore -----------------------------------------------------------------------------
def _mapper_of(key: str, spec: dict[str, Any], where: str) -> StateMapper:
    name = spec["class_name"]
    cls = keras.saving.get_registered_object(name)
    if not (isinstance(cls, type) and issubclass(cls, StateMapper)):
        raise StateError(
            f"{where}: {key} was stored through mapper {name!r}, which is not a registered "
            "keras_stable_state.StateMapper in this process. Import the module that defines it "
            "(registered with @keras.saving.register_keras_serializable) before restoring.",
            key=key,
            expected="a registered StateMapper",
            received=name,
        )
    try:
        return cls.from_config(spec["config"])
    except (TypeError, ValueError, KeyError) as err:
        raise StateError(
            f"{where}: the config of mapper {name!r} stored for {key} is not one it accepts "
            f"({type(err).__name__}: {err}); config={spec['config']!r:.200}. The file was written by "
            "another version of that mapper, or is damaged.",
            key=key,
            received=spec["config"],
        ) from err


def decode_record(
    record: format.StateRecord | format.StockWeights, where: str
) -> tuple[format.StateRecord | format.StockWeights, dict[str, StateMapper]]:
    """``record`` with every mapped array decoded, and ``{key: mapper}`` of those.

    A record without mappers (or a stock Keras file) is returned as it is.

    Raises:
        StateError: naming the key, for a mapper not registered in this
            process, a config it refuses, or a decode that fails or returns
            another shape or dtype than saved.
        CorruptCheckpointError: naming the key, for a mapper record about no saved array.
    """
    specs = record.extra.get(SECTION)  # (a stock Keras file's extra is empty)
    if not specs or record.matched_by != BY_KEY:
        return record, {}
    keyed = cast(format.StateRecord, record)  # matched by key: our record
    sections = {"model": dict(keyed.model), "optimizer": dict(keyed.optimizer)}
    mapped: dict[str, StateMapper] = {}
    for key, spec in specs.items():
        arrays = next((a for a in sections.values() if key in a), None)
        if arrays is None:
            raise CorruptCheckpointError(
                f"{where}: a mapper is recorded for {key}, which the file holds no array for. The file is "
                "damaged; restore from an earlier checkpoint.",
                key=key,
            )
        mapper = _mapper_of(key, spec["mapper"], where)
        params = _state.join_arrays(spec["params"], keyed.arrays, where)
        try:
            value = mapper.decode(key, arrays[key], spec["dtype"], params)
        except Exception as err:  # noqa: BLE001 - any failure of a user's decode is named by key
            raise StateError(
                f"{where}: decoding {key} with {mapper!r} failed ({type(err).__name__}: {err}).",
                key=key,
            ) from err
        value = np.asarray(value) if isinstance(value, np.generic) else value  # a 0-d result
        shape, dtype = tuple(spec["shape"]), spec["dtype"]
        if not isinstance(value, np.ndarray) or value.shape != shape or format.dtype_name(value) != dtype:
            raise StateError(
                f"{where}: {mapper!r} decoded {key} as {getattr(value, 'dtype', type(value).__name__)} "
                f"{getattr(value, 'shape', '')}, but it was saved as {dtype} {shape}; the mapper's decode "
                "does not invert its encode.",
                key=key,
                expected=(dtype, shape),
                received=(str(getattr(value, "dtype", None)), getattr(value, "shape", None)),
            )
        arrays[key] = value
        mapped[key] = mapper
    return dataclasses.replace(keyed, model=sections["model"], optimizer=sections["optimizer"]), mapped
