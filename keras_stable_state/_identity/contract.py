"""The trainable-variable contract: what a model must train for a state to apply."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from keras_stable_state._identity.dtypes import float_cast
from keras_stable_state._identity.keys import ParsedKeys
from keras_stable_state._identity.registry import ModelIndex
from keras_stable_state.errors import NAMES_SHOWN, ContractError, listed, shown

if TYPE_CHECKING:
    import keras


__all__ = ["TrainableContract", "check_contract", "contract_diff", "contract_of", "read_contract"]

# ``(missing, unexpected, reshaped, retyped)``: see `TrainableContract.diff`.
_Diff = tuple[list[str], list[str], list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]


@dataclasses.dataclass(frozen=True)
class TrainableContract:
    """``(key, shape, dtype)`` for every unique trainable variable of a model.

    A tied variable (a layer called twice, a shared embedding) appears once;
    frozen variables are not in it. Captured when a training state is saved,
    validated after the caller restored the model, whatever way they chose.

    Attributes:
        entries: Tuple of ``(key: str, shape: tuple[int, ...], dtype: str)``,
            in the model's ``trainable_variables`` order.

    Examples:
        >>> contract = TrainableContract.capture(model)
        >>> contract.validate(model)   # raises ContractError on any difference
    """

    entries: tuple[tuple[str, tuple[int, ...], str], ...]

    @classmethod
    def capture(cls, model: keras.Model) -> TrainableContract:
        """The contract of ``model``'s current trainable variables."""
        return contract_of(ModelIndex(model))

    def to_json(self) -> list[list[Any]]:
        """A JSON-serialisable list of ``[key, shape, dtype]``."""
        return [[k, list(s), d] for k, s, d in self.entries]

    @classmethod
    def from_json(cls, data: Iterable[Sequence[Any]]) -> TrainableContract:
        """Inverse of [`to_json`][keras_stable_state.TrainableContract.to_json].

        Raises:
            KeyFormatError: if a key is malformed.
        """
        return read_contract(data, ParsedKeys())

    def diff(
        self, model: keras.Model
    ) -> tuple[list[str], list[str], list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
        """``(missing, unexpected, reshaped, retyped)`` between this contract and ``model``.

        ``missing``: keys the contract lists but the model does not train
        (removed or frozen); ``unexpected``: keys the model trains that the
        contract does not list (added or unfrozen); ``reshaped`` /
        ``retyped``: ``(key, saved, current)`` triples.
        """
        return self._diff(TrainableContract.capture(model))

    def _diff(self, now: TrainableContract) -> _Diff:
        """`diff` against the contract ``now`` of the model."""
        saved = {k: (s, d) for k, s, d in self.entries}
        current = {k: (s, d) for k, s, d in now.entries}
        missing = [k for k in saved if k not in current]
        unexpected = [k for k in current if k not in saved]
        reshaped = [
            (k, saved[k][0], current[k][0]) for k in saved if k in current and saved[k][0] != current[k][0]
        ]
        retyped = [
            (k, saved[k][1], current[k][1]) for k in saved if k in current and saved[k][1] != current[k][1]
        ]
        return missing, unexpected, reshaped, retyped

    def validate(self, model: keras.Model, *, allow_cast: bool = False) -> None:
        """Check that ``model`` trains exactly the variables of this contract.

        Args:
            model: The model to check.
            allow_cast: Accept a variable re-typed between floating-point dtypes
                (``bfloat16``, ``float16``, ``float32``, ``float64``, either way): its
                saved values are cast when restored (``restore_training_state(...,
                allow_cast=True)``).

        Raises:
            ContractError: listing every missing, unexpected, reshaped and
                re-typed key (not only the first); a re-typed float variable
                names ``allow_cast=True`` as its fix.
        """
        self._validate(TrainableContract.capture(model), allow_cast)

    def _validate(self, now: TrainableContract, allow_cast: bool) -> None:
        """`validate` against the contract ``now`` of the model."""
        missing, unexpected, reshaped, retyped = self._diff(now)
        if allow_cast:
            retyped = [t for t in retyped if not float_cast(t[1], t[2])]
        if not (missing or unexpected or reshaped or retyped):
            return
        lines = ["The model's trainable variables do not match the saved contract:"]
        if missing:
            lines.append(
                f"  missing (saved as trainable, not trained now: frozen or removed): {listed(missing)}"
            )
        if unexpected:
            lines.append(
                f"  unexpected (trained now, not in the saved state: unfrozen or added): {listed(unexpected)}"
            )
        for what, changed in (("reshaped", reshaped), ("re-typed", retyped)):
            for k, s, c in changed[:NAMES_SHOWN]:
                lines.append(f"  {what}: {shown(k, quote=False)} saved {s}, now {c}")
            if len(changed) > NAMES_SHOWN:
                lines.append(f"  {what}: ... and {len(changed) - NAMES_SHOWN:,} more")
        if missing or unexpected:
            lines.append(
                "Restore into a model with the same trainable layers (freeze/unfreeze as when saved), "
                "or pass strict=False to drop the slots of variables that are no longer trained."
            )
        if reshaped:
            lines.append("A reshaped variable cannot be restored: build the layers with the saved shapes.")
        floats = [k for k, s, c in retyped if float_cast(s, c)]
        if floats:
            lines.append(
                f"The re-typed variables {listed(floats)} changed between floating-point dtypes: pass "
                "allow_cast=True to cast their saved values (each cast is listed in report.casts, "
                "those that lose precision in report.lossy), or build them with the saved dtype."
            )
        if len(floats) < len(retyped):
            lines.append(
                "A variable re-typed between kinds (integer, boolean, float) is never cast: build it "
                "with the saved dtype."
            )
        raise ContractError(
            "\n".join(lines),
            missing=missing,
            unexpected=unexpected,
            reshaped=reshaped,
            retyped=retyped,
        )


def contract_of(index: ModelIndex) -> TrainableContract:
    """[`TrainableContract.capture`][keras_stable_state.TrainableContract.capture] of the
    indexed model, from the index's walk."""
    registry = index.registry(index.model.trainable_variables)
    return TrainableContract(
        tuple((str(k), tuple(map(int, v.shape)), str(v.dtype)) for k, v in registry.entries)
    )


def read_contract(data: Iterable[Sequence[Any]], keys: ParsedKeys) -> TrainableContract:
    """[`TrainableContract.from_json`][keras_stable_state.TrainableContract.from_json], each
    key parsed through ``keys`` (once per call).

    Raises:
        KeyFormatError: if a key is malformed.
    """
    entries = []
    for key, shape, dtype in data:
        keys.parse(key)
        entries.append((str(key), tuple(int(d) for d in shape), str(dtype)))
    return TrainableContract(tuple(entries))


def contract_diff(saved: TrainableContract, index: ModelIndex) -> _Diff:
    """[`saved.diff`][keras_stable_state.TrainableContract.diff] of the indexed model."""
    return saved._diff(contract_of(index))


def check_contract(saved: TrainableContract, index: ModelIndex, *, allow_cast: bool = False) -> None:
    """[`saved.validate`][keras_stable_state.TrainableContract.validate] of the indexed model."""
    saved._validate(contract_of(index), allow_cast)
