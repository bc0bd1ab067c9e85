"""The random state of a ``torch.utils.data.DataLoader`` input of ``fit``, as a state provider.

A ``DataLoader`` (on any backend: Keras' ``TorchDataLoaderAdapter``) draws each epoch's
order and its workers' seeds when Keras makes the epoch's iterator: its base seed from
``loader.generator``, the ``RandomSampler``'s permutation from the sampler's
``generator`` (the loader's, given ``shuffle=True, generator=g``), Torch's global
generator where either is ``None`` (saved with the global random state, ``_state.rng``).
Worker processes are seeded from the base seed, so a fresh iterator made from the same
generator states reads the same batches, workers included. `LoaderState` snapshots the
generators the loader and its samplers hold at each epoch begin (where the position's
``epoch_rng`` is taken) and at each save; a resume puts the epoch-begin states back
before Keras makes the epoch's iterator, the skipped batches replay the interrupted
epoch, and the states at the save are set once they are drawn.

A sampler of the user's (its class outside ``torch``/``torchdata``) may keep state of its
own (an epoch counter): with ``state_dict()``/``load_state_dict()`` its state is saved at
each epoch begin, before the epoch's pass, and loaded on resume at the same place.
torchdata's ``StatefulDataLoader`` and samplers are read through their generators: their
own ``state_dict()`` is a position inside the current pass, which Keras' iteration
cannot start from (``fit`` counts each epoch's batches from 0), and calling it between
passes makes an iterator (a draw that would change the run).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_stable_state import _state
from keras_stable_state._state.tree import malformed, show
from keras_stable_state.errors import StateError

RECORD = "providers/loader"
"""Record of the ``DataLoader``'s generator and sampler states in a checkpoint."""

_KNOWN_MODULES = ("torch.", "torchdata.")


def _is_user_class(obj: Any) -> bool:
    return not type(obj).__module__.startswith(_KNOWN_MODULES)


def _samplers(loader: Any) -> dict[str, Any]:
    """``{path: sampler}`` of the samplers a ``DataLoader`` reads (``sampler``,
    ``batch_sampler`` and the ``sampler`` each wraps), each object once."""
    found: dict[str, Any] = {}
    seen = set()
    todo = [
        ("sampler", getattr(loader, "sampler", None)),
        ("batch_sampler", getattr(loader, "batch_sampler", None)),
    ]
    while todo:
        path, obj = todo.pop(0)
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        found[path] = obj
        todo.append((f"{path}.sampler", getattr(obj, "sampler", None)))
    return found


def _generators(loader: Any, samplers: dict[str, Any]) -> dict[str, Any]:
    """``{path: torch.Generator}`` of the generators the loader and its samplers hold
    (attributes of theirs), each generator once (``shuffle=True, generator=g`` hands the
    loader's ``g`` to its ``RandomSampler``)."""
    import torch

    found: dict[str, Any] = {}
    seen = set()
    for owner, obj in [("loader", loader), *samplers.items()]:
        for name, value in sorted(vars(obj).items()):
            if isinstance(value, torch.Generator) and id(value) not in seen:
                seen.add(id(value))
                found[f"{owner}.{name}"] = value
    return found


def stateful_samplers(samplers: dict[str, Any]) -> dict[str, Any]:
    """The user samplers of ``samplers`` with ``state_dict()``/``load_state_dict()``."""
    return {
        path: s
        for path, s in samplers.items()
        if _is_user_class(s)
        and callable(getattr(s, "state_dict", None))
        and callable(getattr(s, "load_state_dict", None))
    }


def hidden_samplers(loader: Any) -> list[str]:
    """``"path (Class)"`` of the loader's samplers whose state nothing here can read: the
    user's own classes without ``state_dict()``/``load_state_dict()``."""
    samplers = _samplers(loader)
    keep = stateful_samplers(samplers)
    return [
        f"{path} ({type(s).__name__})"
        for path, s in samplers.items()
        if _is_user_class(s) and path not in keep
    ]


class LoaderState:
    """The generator states (and user samplers' ``state_dict()``) of one ``DataLoader``.

    Args:
        loader: The ``fit``'s ``torch.utils.data.DataLoader`` (``torch`` is loaded).

    Attributes:
        generators: ``{path: torch.Generator}`` held by the loader and its samplers
            (``"loader.generator"``, ``"sampler.generator"``, ...).
        samplers: ``{path: sampler}`` of the user samplers with ``state_dict()``.
        epoch: The snapshot taken at the current epoch's begin (`snapshot`).
        draws: ``{batch: uint8 array}``, on the Torch backend: Torch's global generator
            state before the batch's data was drawn, for each batch of the current epoch
            whose drawing took numbers from it (a dataset's random augmentation without
            workers, a sampler without a generator). The model's unseeded random layers
            draw from the same generator there (Torch's ``dropout``), and a skipped batch
            is not trained, so the replay of an interrupted epoch sets each of these states
            before drawing that batch (`replay_draw`). ``{}`` elsewhere (nothing but the
            data pipeline draws from it) and for a pipeline that draws nothing from it.
    """

    def __init__(self, loader: Any) -> None:
        import keras

        self.loader = loader
        found = _samplers(loader)
        self.generators = _generators(loader, found)
        self.samplers = stateful_samplers(found)
        self.epoch = self.snapshot()
        self.track = keras.backend.backend() == "torch"
        self.draws: dict[int, np.ndarray] = {}
        self._after_step: tuple[int, Any] | None = None

    def __bool__(self) -> bool:
        """Whether there is anything to save: generators or samplers of the loader's, or
        (Torch backend) draws of the global generator to replay."""
        return bool(self.generators or self.samplers or self.track)

    def snapshot(self) -> dict:
        """``{"generators": {path: uint8 array}, "samplers": {path: state_dict()}}`` now."""
        gens = {path: g.get_state().numpy().copy() for path, g in self.generators.items()}
        return {"generators": gens, "samplers": {path: s.state_dict() for path, s in self.samplers.items()}}

    def begin_epoch(self) -> None:
        """Note the states the epoch's iterator will draw from (before Keras makes it)."""
        self.epoch = self.snapshot()
        self.draws, self._after_step = {}, None

    def note_step(self, batch: int) -> None:
        """At a trained batch's end: Torch's global state before the next batch is drawn."""
        if self.track:
            import torch

            self._after_step = (batch, torch.get_rng_state())

    def note_draw(self, batch: int) -> None:
        """At a trained batch's begin (its data drawn): keep the state before the draw if
        the draw took numbers from Torch's global generator."""
        after, self._after_step = self._after_step, None
        if after is None or after[0] != batch - 1:
            return
        import torch

        if not torch.equal(after[1], torch.get_rng_state()):
            self.draws[batch] = after[1].numpy().copy()

    def replay_draw(self, batch: int) -> None:
        """Before ``batch`` is drawn in the replay of an interrupted epoch (at the end of the
        skipped batch before it): Torch's global state it was drawn from, if kept."""
        if batch in self.draws:
            import torch

            torch.set_rng_state(torch.from_numpy(self.draws[batch].copy()))

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "draws": {str(b): a for b, a in sorted(self.draws.items())}}

    def set_state(self, value: dict) -> None:
        """Put the epoch-begin states back (an epoch-boundary save's are the save's)."""
        self.apply(value["epoch"])

    def check(self, value: Any, where: str | None = None) -> dict:
        """A saved state (arrays joined back), checked against this loader.

        Raises:
            CorruptCheckpointError: if it is malformed (a generator state Torch refuses).
            StateError: if it holds other generators or samplers than this loader's (the
                ``DataLoader`` was made otherwise: ``generator=``, ``sampler=``).
        """
        import torch

        value = _state.check_provider_state(self, value, RECORD, where)
        for part in ("epoch",):
            gens = value[part].get("generators") if isinstance(value[part], dict) else None
            if not isinstance(gens, dict):
                raise malformed(f"{RECORD}/{part}", "expected an object with 'generators'", where)
            if sorted(gens) != sorted(self.generators):
                raise StateError(
                    f"The checkpoint's DataLoader random state holds the generators {sorted(gens)}, this "
                    f"fit's DataLoader {sorted(self.generators)}: the loader was made otherwise (its "
                    "generator=, sampler= or batch_sampler=), so its order cannot be put back. Resume with "
                    "the DataLoader the checkpoint was saved with, or start a new run in another directory.",
                    key=f"{RECORD}/{part}/generators",
                    expected=sorted(self.generators),
                    received=sorted(gens),
                )
            for path, array in gens.items():
                record = f"{RECORD}/{part}/generators/{path}"
                if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
                    raise malformed(record, f"expected a 1-D uint8 array, found {show(array)}", where)
                try:
                    torch.Generator(device=self.generators[path].device).set_state(
                        torch.from_numpy(array.copy())
                    )
                except (RuntimeError, ValueError, TypeError) as err:
                    raise malformed(record, f"Torch refuses it ({err})", where) from err
        draws = value.get("draws")
        if not isinstance(draws, dict):
            raise malformed(f"{RECORD}/draws", f"expected an object, found {show(draws)}", where)
        for key, array in draws.items():
            record = f"{RECORD}/draws/{key}"
            if not (isinstance(key, str) and key.isdigit()):
                raise malformed(record, "expected a batch index as the key", where)
            if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
                raise malformed(record, f"expected a 1-D uint8 array, found {show(array)}", where)
            try:
                torch.Generator().set_state(torch.from_numpy(array.copy()))
            except (RuntimeError, ValueError, TypeError) as err:
                raise malformed(record, f"Torch refuses it ({err})", where) from err
        saved = value["epoch"].get("samplers")
        if not isinstance(saved, dict) or sorted(saved) != sorted(self.samplers):
            raise StateError(
                f"The checkpoint holds the state_dict() of the samplers {sorted(saved or {})}, this fit's "
                f"DataLoader has {sorted(self.samplers)}: resume with the samplers the checkpoint was saved "
                "with, or start a new run in another directory.",
                key=f"{RECORD}/epoch/samplers",
                expected=sorted(self.samplers),
                received=sorted(saved or {}),
            )
        return value

    def apply(self, snap: dict) -> None:
        """Set the generators (and samplers' ``load_state_dict``) from a checked snapshot."""
        import torch

        for path, array in snap["generators"].items():
            self.generators[path].set_state(torch.from_numpy(np.array(array, dtype=np.uint8)))
        for path, value in snap.get("samplers", {}).items():
            self.samplers[path].load_state_dict(value)

    def resume(self, value: dict) -> None:
        """Put a checked saved state back at the resumed epoch's begin: the epoch-begin
        states. Mid-epoch, the skipped batches then draw from them as the interrupted run
        did (only the loader draws from its generators), so they stand where they stood at
        the save once those batches are drawn."""
        self.apply(value["epoch"])
        self.epoch = value["epoch"]  # this epoch's begin, for the resumed run's next saves
        self.draws = {int(b): np.asarray(a) for b, a in value["draws"].items()} if self.track else {}
        self._after_step = None
