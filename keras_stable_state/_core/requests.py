"""The requests of the two verbs: the arguments of one save or restore, checked, and the
`ModelIndex` of its model (one walk, its registries and layer paths, the keys parsed),
carried whole to everything that plans the call; and the options of the two verbs as passed
(`SaveOptions`, `RestoreOptions`), grouped before they are checked.

`SaveRequest` is what `training_state_record` collects a record for; `RestoreRequest`
is what `restore_record` and its planners (`plan_optimizers`,
`plan_torch_optimizers`) restore. Both are made once per call and dropped when it
returns, and with them the index: nothing of one call is kept for the next.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Self

from keras_stable_state._identity.keys import MAIN, file_label
from keras_stable_state._identity.registry import ModelIndex

if TYPE_CHECKING:
    import keras

__all__ = ["KeywordOptions", "RestoreOptions", "RestoreRequest", "SaveOptions", "SaveRequest"]


class KeywordOptions:
    """A frozen dataclass of a public verb's options, made from its keyword arguments."""

    @classmethod
    def from_keywords(cls, verb: str, /, **kwargs: object) -> Self:
        """The options from keyword arguments named as the verb's.

        Raises:
            TypeError: for a name that is not an option, as Python says it for ``verb``.
        """
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        for name in kwargs:
            if name not in names:
                raise TypeError(f"{verb}() got an unexpected keyword argument {name!r}")
        return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class SaveOptions(KeywordOptions):
    """The options of [`save_training_state`][keras_stable_state.save_training_state] that
    decide what is saved, as passed (unchecked: `training_state_record` checks them); each
    field is documented there."""

    optimizer: object = None
    model_state: object = "all"
    callbacks: object = ()
    state: object = None
    include_rng: object = True
    allow_order_keys: object = False
    variables: object = None
    mappers: object = None


@dataclasses.dataclass(frozen=True)
class RestoreOptions(KeywordOptions):
    """The options of [`restore_training_state`][keras_stable_state.restore_training_state] but ``defer``, as passed (unchecked:
    `restore_with` checks them); each field is documented there."""

    optimizer: object = None
    strict: object = True
    allow_cast: object = False
    callbacks: object = ()
    state: object = None
    include_rng: object = True
    include_metrics: object = True
    check_schedule: object = True
    variables: object = None
    prefix: object = None
    rename: object = None
    keep_learning_rate: object = False
    storage_options: object = None
    all_or_nothing: object = True


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """The arguments of one save, checked (by `training_state_record`).

    Attributes:
        verb: The public verb saving, as messages name it (``"save_training_state"``).
        index: The `ModelIndex` of ``model``: every registry of the save comes from its walk.
        optimizers: ``{name: Keras optimizer}`` (``"optimizer"`` for ``model.optimizer`` or
            the one passed).
        torch_optimizers: ``{name: torch.optim.Optimizer}`` passed as ``optimizer=``.
        callbacks: ``{key: callback}``.
        providers: ``{name: provider}`` (the model's metrics among them when it has some).
        extras: ``{name: keras.Variable}``: the variables outside the model.
        model_state: ``"all"``, ``"trainable"`` or ``"none"``.
        include_rng, allow_order_keys: The flags of
            [`save_training_state`][keras_stable_state.save_training_state].
        mapper_rules: The checked ``mappers`` (`check_mappers`), ``[]`` for none.
    """

    verb: str
    index: ModelIndex
    optimizers: dict
    torch_optimizers: dict
    callbacks: dict
    providers: dict
    extras: dict
    model_state: str
    include_rng: bool
    allow_order_keys: bool
    mapper_rules: list

    @property
    def model(self) -> keras.Model:
        """The model saved."""
        return self.index.model

    @property
    def optimizer(self):
        """The main optimizer, or ``None``."""
        return self.optimizers.get(MAIN)


@dataclasses.dataclass(frozen=True)
class RestoreRequest:
    """The arguments of one restore, checked (by `restore_with`).

    Attributes:
        filepath: The file (``str``; ``"<bytes>"`` for bytes), for messages and rollback reports.
        index: The `ModelIndex` of the built ``keras.Model`` restored into: every registry,
            layer path and parsed key of the restore comes from it.
        optimizers: ``{name: optimizer}`` (``"optimizer"`` for ``model.optimizer`` or the one passed).
        torch_optimizers: ``{name: torch.optim.Optimizer}`` passed as ``optimizer=``.
        callbacks: ``{key: callback}``.
        providers: ``{name: provider}``.
        extras: ``{name: keras.Variable}``: the variables outside the model.
        rules: The rename rules, or ``None``.
        strict, allow_cast, include_rng, check_schedule, keep_learning_rate, include_metrics:
            The flags of [`restore_training_state`][keras_stable_state.restore_training_state].
        owned: The record's arrays are this restore's alone (it read them, and nothing
            else reads them afterwards): a variable may keep an array's memory as its
            own instead of a copy (`variable_step`).
        in_place: Arrays left in the file (`FileArray`, proven whole) are read straight
            into their variables after every check, with no copy of the values they
            replace (`assign_in_place`); ``False``: read into new memory first, all or
            nothing.
        rollback_on_host: With ``in_place``, all or nothing still: each variable read in
            place is copied into host memory first and put back if the restore fails (a
            model on an accelerator: `keras_stable_state._core.host_rollback`).
    """

    filepath: str
    index: ModelIndex
    optimizers: dict
    callbacks: dict
    providers: dict
    extras: dict
    rules: list | None
    strict: bool
    allow_cast: bool
    include_rng: bool
    check_schedule: bool
    keep_learning_rate: bool
    owned: bool = False
    include_metrics: bool = True
    in_place: bool = False
    rollback_on_host: bool = False
    torch_optimizers: dict = dataclasses.field(default_factory=dict)

    @property
    def model(self) -> keras.Model:
        """The model restored into."""
        return self.index.model

    @property
    def where(self) -> str:
        """The file as messages name it."""
        return file_label(self.filepath)

    @property
    def optimizer(self):
        """The main optimizer, or ``None``."""
        return self.optimizers.get(MAIN)
