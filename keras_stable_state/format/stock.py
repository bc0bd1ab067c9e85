"""Stock Keras files: ``.keras`` archives without a training state, and ``.weights.h5``.

Their arrays are listed by HDF5 path (numbers in numeric order) and carry no
checksum of their own; a ``.keras`` archive's members are still checked
against their zip CRC-32. Inside Keras' weights, a ``StableOptimizer`` writes
its variables beside a ``keys`` dataset (UTF-8 JSON as ``uint8``) naming each
positional dataset's entry key. Legacy Keras 2 / tf.keras HDF5 files are
refused. See ``docs/concepts/file-format.md``.

This module imports no Keras.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError, listed
from keras_stable_state.format import sandbox
from keras_stable_state.format.probe import damaged
from keras_stable_state.format.record import BY_STRUCTURE, Entry, MatchedBy
from keras_stable_state.format.records import Listing

if TYPE_CHECKING:
    from keras_stable_state.format.source import Source

_OPTIMIZER = "optimizer/vars/"


@dataclasses.dataclass
class StockWeights:
    """Arrays of a stock Keras weights file, by their HDF5 path.

    Attributes:
        arrays: ``{"layers/dense/vars/0": array, ...}`` for model variables.
        optimizer: Optimizer arrays in their positional order (``"0"``, ``"1"``...),
            or ``{key: array}`` when a ``StableOptimizer`` wrote them.
        source: What the file is (``".keras archive"`` / ``".weights.h5"``).
        metadata, contract, extra: What a `StateRecord` holds of
            its writer, ``{}``, ``None`` and ``{}``: a stock file carries no record of ours.

    ``matched_by`` (a class attribute) is ``"structure"`` (`BY_STRUCTURE`): its arrays are matched to the
    live variables by the model's layer structure (their HDF5 paths), as ``load_weights`` does.
    """

    matched_by: ClassVar[MatchedBy] = BY_STRUCTURE
    arrays: dict[str, Any]
    optimizer: list[Any] | dict[str, Any]
    source: str

    @property
    def metadata(self) -> dict[str, Any]:
        return {}

    @property
    def contract(self) -> None:
        return None

    @property
    def extra(self) -> dict[str, Any]:
        return {}


def _natural(path: str) -> tuple[tuple[int, int, str], ...]:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("/"))


class StockListing(Listing):
    """The arrays of a stock Keras weights image (`list`).

    Attributes:
        metadata: Keras' ``metadata.json`` of an archive, or ``{}``.
        optimizer_keys: ``{dataset path: entry key}`` where a ``StableOptimizer`` wrote keys.
        key_groups: The groups (``"optimizer/vars/"``) holding such a ``keys`` dataset.
    """

    def __init__(self, src: Source) -> None:
        super().__init__(src)
        self.metadata: dict[str, Any] = {}
        self.optimizer_keys: dict[str, str] = {}
        self.key_groups: set[str] = set()

    def list(self) -> None:
        """List every array, by HDF5 path.

        Raises:
            CheckpointFormatError: for a legacy Keras HDF5 file, or one holding no arrays.
            CorruptCheckpointError: for a refused HDF5 object or unreadable optimizer keys.
        """
        f = self.src.h5
        if "model_weights" in f or "layer_names" in f.attrs or "model_config" in f.attrs:
            raise CheckpointFormatError(
                f"{self.where}: this is a legacy Keras HDF5 file (`model.save('x.h5')` or "
                "`save_weights('x.h5')` of Keras 2 / tf.keras), which keeps weights by layer order and no "
                "optimizer state by key. Load it with `keras.models.load_model` or `model.load_weights`, "
                "then save a training state with save_training_state.",
                received=self.where,
            )
        self.metadata = dict(self.src.keras_metadata)
        datasets = self.walk()
        if not datasets:
            raise CheckpointFormatError(
                f"{self.where}: this HDF5 file holds no arrays; it is neither a training state nor a Keras "
                "weights file.",
                received=self.where,
            )
        for name, ds in sorted(datasets, key=lambda item: _natural(item[0])):
            if name.startswith("optimizer/") and name.endswith("/keys"):
                self._read_keys(name, ds)
                continue
            dtype = "bfloat16" if ds.attrs.get("dtype") == "bfloat16" else ds.dtype.name
            self.entries.append(
                Entry(
                    section="optimizer" if name.startswith("optimizer/") else "model",
                    key=name,
                    dataset=name,
                    shape=tuple(int(n) for n in ds.shape),
                    dtype=dtype,
                    nbytes=int(ds.size) * ds.dtype.itemsize,
                )
            )

    def _read_keys(self, name: str, ds: Any) -> None:
        # StableOptimizer.save_own_variables: the entry keys of datasets "0", "1", ...
        group = name[: -len("keys")]
        self.key_groups.add(group)
        try:
            keys = json.loads(sandbox.read_dataset(ds).astype(np.uint8).tobytes().decode())
        except (ValueError, TypeError, OSError, RecursionError, UnicodeError) as err:
            raise damaged(self.where, f"optimizer keys {name!r} are unreadable ({err})", key=name) from err
        if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
            raise damaged(self.where, f"optimizer keys {name!r} are not a list of keys", key=name)
        self.optimizer_keys.update({f"{group}{i}": k for i, k in enumerate(keys)})


def stock_weights(
    in_archive: bool, arrays: dict[str, dict[str, Any]], optimizer_keys: dict[str, str], key_groups: set[str]
) -> StockWeights:
    """The `StockWeights` of a stock file's arrays, read whole.

    Args:
        in_archive: Whether the file is a ``.keras`` archive (else a ``.weights.h5`` file).
        arrays: ``{"model": {path: array}, "optimizer": {path: array}}``.
        optimizer_keys, key_groups: As `StockListing` found them.

    Raises:
        CorruptCheckpointError: if positional optimizer variables, or their
            ``StableOptimizer`` keys, are missing.
    """
    source = "stock Keras .keras archive" if in_archive else "stock Keras .weights.h5 file"
    opt = {k[len(_OPTIMIZER) :]: v for k, v in arrays["optimizer"].items() if k.startswith(_OPTIMIZER)}
    missing = [str(i) for i in range(len(opt)) if str(i) not in opt]
    if missing:
        raise CorruptCheckpointError(
            f"{source}: optimizer variables {listed(missing)} ({len(missing):,}) are missing from 'optimizer/vars' ({len(opt)} datasets). "
            "The file is damaged.",
            key=f"{_OPTIMIZER}{missing[0]}",
        )
    optimizer: list[Any] | dict[str, Any] = [opt[str(i)] for i in range(len(opt))]
    if _OPTIMIZER in key_groups:
        # written by a StableOptimizer inside Keras' own weights file: keyed, not positional
        names = {p: k for p, k in optimizer_keys.items() if p[len(_OPTIMIZER) :].isdigit()}
        paths = [f"{_OPTIMIZER}{i}" for i in range(len(optimizer))]
        if len(names) != len(optimizer) or any(p not in names for p in paths):
            raise CorruptCheckpointError(
                f"{source}: 'optimizer/vars/keys' names {len(names)} optimizer variables, the file holds "
                f"{len(optimizer)}. The file is damaged.",
                key="optimizer/vars/keys",
                expected=len(optimizer),
                received=len(names),
            )
        optimizer = dict(zip((names[p] for p in paths), optimizer, strict=True))
        source += " (optimizer saved by key by StableOptimizer)"
    return StockWeights(arrays=arrays["model"], optimizer=optimizer, source=source)
