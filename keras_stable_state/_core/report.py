"""The [`RestoreReport`][keras_stable_state.RestoreReport] that ``restore_training_state`` returns, and the writer metadata it compares."""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from keras_stable_state import format

__all__ = ["RestoreReport", "writer_metadata"]


@dataclasses.dataclass
class RestoreReport:
    """What [`restore_training_state`][keras_stable_state.restore_training_state] did.

    Attributes:
        matched: ``{key: "name" | "order"}`` for every restored model variable
            and optimizer variable: how its saved array was matched.
        left_fresh: Keys of live variables the file had no value for (they
            keep their current values).
        dropped: Saved keys that were not restored; ``dropped_reasons`` says why.
        dropped_reasons: ``{saved key: reason}`` for every key in ``dropped``:
            ``"no longer trained"`` (frozen since, ``strict=False``),
            ``"not in the model (renamed or removed)"``, ``"no such variable in
            the live optimizer"``, ``"extra variable not passed in `variables=`"``,
            ``"no rename rule matches"``, ``"no optimizer to restore into
            (compile the model or pass optimizer=)"``, ``"kept the compiled
            learning rate (keep_learning_rate=True)"``; for ``"callback:<key>"`` (a
            ``StableCheckpoint`` resume) ``"no callback of this fit takes it"``.
        renamed: ``(saved key, key restored as)`` for every key a ``prefix`` or
            ``rename`` rule changed.
        learning_rates: ``(key, compiled value, saved value, "replaced" | "kept")``
            for every learning-rate variable whose saved value differs from the
            compiled one (``"kept"`` with ``keep_learning_rate=True``). ``str(report)``
            suggests ``keep_learning_rate=True`` for a replaced one only when
            ``transfer`` is set: on a resume the saved value is the run's own
            (e.g. lowered by ``ReduceLROnPlateau``) and is the one to continue with.
        transfer: ``True`` for a transfer or fine-tuning restore: one with
            ``prefix``, ``rename`` or ``strict=False``, where keeping the compiled
            learning rate (``keep_learning_rate=True``) is an option; ``False`` for
            a resume (``StableCheckpoint``'s restores among them).
        counters_near_limit: ``(key, value, dtype maximum, dtype)`` for every
            optimizer ``iterations`` counter restored within 1% of its integer
            dtype's maximum. Keras keeps
            it as ``int32`` on JAX and Torch (``int64`` on TensorFlow); past
            2**31 - 1 it wraps to negative, the learning rate of a schedule or
            Adam's bias correction becomes ``inf`` and the weights ``NaN``.
        casts: ``(key, saved dtype, variable dtype)`` for every array cast.
        mapped: ``{key: mapper}`` (the mapper's repr, e.g.
            ``"CastMapper(dtype='bfloat16')"``) for every array stored through
            a mapper (``save_training_state(..., mappers=...)``) and decoded.
        lossy: The keys not restored bit-exactly: those of ``mapped`` whose mapper
            is lossy (they hold the decoded stored values), and those of ``casts``
            whose cast can round or overflow (to a narrower float: ``float32`` to
            ``bfloat16`` or ``float16``, between ``float16`` and ``bfloat16``).
        restored_state: Other state put back (``"callback:EarlyStopping/0"``,
            ``"state:<provider>"``, ``"rng"``). With ``"rng"``, ``str(report)`` says
            that a ``model.fit(shuffle=True)`` started after the restore does not draw
            the same data order on JAX and Torch: only ``StableCheckpoint`` restores it.
        built_optimizer: ``True`` when the optimizer was built by the restore.
        order_keys: Saved keys that are registration-order keys
            (``order:<i>#<slot>``): the state was saved with
            ``allow_order_keys=True`` and these were matched by position.
        transfer_note: ``True`` when another backend wrote the file and the model
            has layers whose continuation differs across backends (Embedding,
            normalizations); ``str(report)`` then explains it.
        source: ``"keras_stable_state"`` or the kind of stock Keras file.
        writer: Metadata of the writer (backend, Keras version, format version);
            empty for stock files.

    Examples:
        >>> report = kss.restore_training_state("run.keras", model)
        >>> report.by_order           # [] when every array was matched by name
        >>> report.casts              # [("optimizer#iteration", "int64", "int32")] from TensorFlow to JAX
        >>> print(report)
    """

    matched: dict[str, str] = dataclasses.field(default_factory=dict)
    left_fresh: list[str] = dataclasses.field(default_factory=list)
    dropped: list[str] = dataclasses.field(default_factory=list)
    dropped_reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    renamed: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    learning_rates: list[tuple[str, float, float, str]] = dataclasses.field(default_factory=list)
    casts: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    mapped: dict[str, str] = dataclasses.field(default_factory=dict)
    lossy: list[str] = dataclasses.field(default_factory=list)
    restored_state: list[str] = dataclasses.field(default_factory=list)
    built_optimizer: bool = False
    order_keys: list[str] = dataclasses.field(default_factory=list)
    transfer_note: bool = False
    transfer: bool = False
    counters_near_limit: list[tuple[str, int, int, str]] = dataclasses.field(default_factory=list)
    source: str = format.FORMAT
    writer: dict[str, Any] = dataclasses.field(default_factory=dict)

    def drop(self, key: str, reason: str) -> None:
        """List ``key`` in ``dropped`` with its ``reason``."""
        self.dropped.append(key)
        self.dropped_reasons[key] = reason

    @property
    def by_name(self) -> list[str]:
        return [k for k, how in self.matched.items() if how == "name"]

    @property
    def by_order(self) -> list[str]:
        return [k for k, how in self.matched.items() if how == "order"]

    @property
    def writer_differs(self) -> list[tuple[str, Any, Any]]:
        """``(field, writer's value, reader's value)`` where the writing backend,
        Keras version or dtype policy differs from this process's."""
        reader = writer_metadata(None)
        return [
            (f, self.writer[f], reader[f])
            for f in ("backend", "keras_version", "dtype_policy")
            if f in self.writer and self.writer[f] != reader[f]
        ]

    def __str__(self) -> str:
        lines = [
            f"Restored {len(self.matched)} arrays from {self.source}"
            + (
                f" (written by {self.writer.get('backend')} / Keras {self.writer.get('keras_version')})"
                if self.writer
                else ""
            ),
            f"  matched by name: {len(self.by_name)}, by registration order: {len(self.by_order)}",
        ]
        for field, theirs, ours in self.writer_differs:
            lines.append(f"  written with {field} {theirs}, read with {ours}")
        if self.order_keys:
            lines.append(
                "  keyed by registration order (saved with allow_order_keys=True), matched by position: "
                f"{self.order_keys}"
            )
        if self.transfer_note:
            lines.append(
                "  note: the state above is restored exactly; continued training matches the writer's "
                "within float rounding for Dense, Conv and normalization layers, but backends update "
                "Embedding rows (and biases feeding straight into a normalization) differently, so "
                "those drift apart by about 1e-2 over tens of steps. That is the backends' arithmetic, "
                "not lost state (see docs: cross-backend transfer)."
            )
        if "rng" in self.restored_state:
            lines.append(
                "  random state restored; a later model.fit(shuffle=True) may draw another data order "
                "than an uninterrupted run: only StableCheckpoint restores it (docs/how-to/resume-fit.md)"
            )
        if self.built_optimizer:
            lines.append("  the optimizer was not built; the restore built it")
        if self.left_fresh:
            lines.append(f"  left fresh (no saved value): {self.left_fresh}")
        if self.renamed:
            old, new = self.renamed[0]
            lines.append(f"  renamed {len(self.renamed)} saved keys (e.g. {old} -> {new})")
        by_reason: dict[str, list[str]] = {}
        for key in self.dropped:
            by_reason.setdefault(self.dropped_reasons.get(key, "not restored"), []).append(key)
        for reason, keys in by_reason.items():
            lines.append(f"  dropped ({reason}): {keys}")
        for key, live, saved, action in self.learning_rates:
            if action == "kept":
                lines.append(f"  learning rate {key}: compiled {live:.6g} kept (saved {saved:.6g})")
            elif self.transfer:
                lines.append(
                    f"  learning rate {key}: compiled {live:.6g} replaced by saved {saved:.6g} "
                    "(pass keep_learning_rate=True to keep the compiled value)"
                )
            else:
                lines.append(f"  learning rate {key}: compiled {live:.6g} replaced by saved {saved:.6g}")
        for key, value, limit, dtype in self.counters_near_limit:
            lines.append(
                f"  warning: {key} = {value} is within {limit - value} steps of its {dtype} maximum "
                f"{limit}; past it the counter wraps to negative and training breaks (learning rate "
                "inf, weights NaN). Stop before it, or continue on TensorFlow (int64 counter)."
            )
        for key, src, dst in self.casts:
            lines.append(f"  cast {key}: {src} -> {dst}")
        by_mapper: dict[str, list[str]] = {}
        for key, mapper in self.mapped.items():
            by_mapper.setdefault(mapper, []).append(key)
        for mapper, keys in by_mapper.items():
            lines.append(f"  stored through {mapper}, decoded: {keys}")
        if self.lossy:
            lines.append(
                f"  not restored bit-exactly (lossy mappers or casts to a narrower dtype: the values "
                f"are the decoded or cast ones, not the values saved): {self.lossy}"
            )
        return "\n".join(lines)


def writer_metadata(model: Any) -> dict[str, Any]:
    return {
        "backend": keras.backend.backend(),
        "keras_version": keras.__version__,
        "format_version": format.FORMAT_VERSION,
        "dtype_policy": keras.config.dtype_policy().name,
        "model_class": None if model is None else type(model).__name__,
    }
