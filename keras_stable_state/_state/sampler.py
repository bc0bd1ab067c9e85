"""``ResumableSampler``: a torch sampler whose place in the epoch is part of the training state.

It wraps the sampler a ``DataLoader`` would read (``DistributedSampler``,
``RandomSampler``, ``SequentialSampler``, ...), counts the batches the training loop
takes (`ResumableSampler.track`), and on restore yields the epoch's indices from
there on, so the skipped samples are never loaded. Torch is imported only when a
sampler is given (the user's torch, already loaded).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

from keras_stable_state._state.sampler_plan import check_saved, plan_resume, total_size
from keras_stable_state.errors import InexactResumeWarning, StateError

__all__ = ["ResumableSampler"]

_GENERATOR_KINDS = ("RandomSampler", "SubsetRandomSampler", "WeightedRandomSampler")


def _torch_data() -> Any:
    """``torch.utils.data`` where torch is loaded, else ``None`` (never imports torch)."""
    if "torch" not in sys.modules:
        return None
    import torch.utils.data

    return torch.utils.data


def _kind(sampler: Any) -> str:
    """The sampler's kind, refusing one whose order cannot be replayed."""
    data = _torch_data()
    if data is not None and isinstance(sampler, data.DistributedSampler):
        return type(sampler).__name__
    if data is not None and isinstance(sampler, data.SequentialSampler):
        return "SequentialSampler"
    for name in _GENERATOR_KINDS:
        if data is not None and isinstance(sampler, getattr(data, name)):
            if getattr(sampler, "generator", None) is None:
                raise ValueError(
                    f"ResumableSampler needs the {name}'s own generator to replay its order: one without "
                    "`generator=` draws a fresh seed from torch's global random state at every epoch. "
                    f"Make it as {name}(..., generator=torch.Generator().manual_seed(seed))."
                )
            return name
    raise TypeError(
        "ResumableSampler wraps a torch.utils.data DistributedSampler, SequentialSampler, or a "
        "RandomSampler, SubsetRandomSampler or WeightedRandomSampler with a generator. "
        f"Received: sampler={sampler!r} (of type {type(sampler).__name__})"
    )


class ResumableSampler:
    """A torch sampler that saves its place in the epoch and resumes from it.

    Wraps the sampler of a ``DataLoader`` (a ``DistributedSampler`` of a
    ``DistributedDataParallel`` loop, a ``RandomSampler`` with a generator, a
    ``SequentialSampler``) and is itself the ``sampler=`` of the ``DataLoader``. Its
    state (a provider for ``state={"data": sampler}`` of
    [`save_training_state`][keras_stable_state.save_training_state] and
    [`CheckpointManager`][keras_stable_state.CheckpointManager]) records the epoch, the
    batches the loop consumed in it (counted by [`track`][keras_stable_state.ResumableSampler.track],
    not the indices the ``DataLoader`` read ahead), the per-rank batch size, the world
    size (``num_replicas``), ``rank``, ``seed``, ``shuffle``, ``drop_last`` and the
    generator state of a ``RandomSampler``. After a restore the next batches are the
    ones an uninterrupted run would have trained; skipped samples are not loaded.

    A restore on another world size is exact (same samples in every global step) when
    the global batch (per-rank batch x world size) is unchanged and the saved epoch
    order splits evenly among the new processes; otherwise it warns with
    [`InexactResumeWarning`][keras_stable_state.InexactResumeWarning], naming both
    world sizes and batches, and continues near the saved place.

    Args:
        sampler: The torch sampler whose order to follow.
        batch_size: The per-rank batch size (int, samples): the ``DataLoader``'s.

    Raises:
        TypeError: for another kind of sampler.
        ValueError: for a ``RandomSampler`` (or subset, weighted) without
            ``generator=``, or a ``batch_size`` that is not a positive integer.

    Examples:
        >>> sampler = kss.ResumableSampler(DistributedSampler(ds, seed=0), batch_size=32)
        >>> loader = DataLoader(ds, batch_size=32, sampler=sampler)
        >>> mgr.restore(model, state={"data": sampler})
        >>> for epoch in range(sampler.epoch, epochs):
        ...     sampler.set_epoch(epoch)
        ...     for x, y in sampler.track(loader):
        ...         step = train_step(x, y)
        ...         mgr.save(step, model, state={"data": sampler})
    """

    replays_other_world_sizes = True  # CheckpointManager.restore leaves the world-size warning to it

    def __init__(self, sampler: Any, batch_size: int) -> None:
        self._kind = _kind(sampler)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                "`batch_size` of ResumableSampler must be the DataLoader's per-rank batch size, a "
                f"positive integer. Received: batch_size={batch_size!r}"
            )
        self.sampler = sampler
        self.batch_size = batch_size
        self._distributed = hasattr(sampler, "num_replicas")
        self._epoch = int(getattr(sampler, "epoch", 0))
        self._consumed = 0  # batches of the epoch the loop took (or, pending, to leave out)
        self._pending = False  # a restored place the next pass starts from
        self._order: int | None = None  # replay another world size's order (its padding)
        self._pass_generator: np.ndarray | None = None  # generator state at the pass's start
        self._started = False  # a pass over this epoch began
        self._pass_tracked = False  # ... and `track` counts it
        self._tracking = False
        self._drop_last_batch = False  # the DataLoader's drop_last (from `track`)

    # -- the sampler ---------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch (int) the next pass draws: the last ``set_epoch``, or the restored one."""
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        """Batches (int) of this epoch the loop took through ``track`` (or, after a restore, will skip)."""
        return self._consumed

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next pass (as ``DistributedSampler.set_epoch``).

        The same epoch as a restored one keeps the restored place; another leaves it, and
        warns with [`InexactResumeWarning`][keras_stable_state.InexactResumeWarning] when
        that drops batches of the restored epoch an uninterrupted run would train.
        """
        epoch = int(epoch)
        if self._pending and epoch != self._epoch:
            total = self._batches_per_epoch()
            if self._consumed < total:
                warnings.warn(
                    f"ResumableSampler was restored at epoch {self._epoch} after {self._consumed} of its "
                    f"{total} batches, but the loop called set_epoch({epoch}): the other "
                    f"{total - self._consumed} batches of epoch {self._epoch} are left out, unlike an "
                    "uninterrupted run. Start the loop at the restored epoch: "
                    "`for epoch in range(sampler.epoch, epochs): sampler.set_epoch(epoch)`.",
                    InexactResumeWarning,
                    stacklevel=2,
                )
            if self._kind in _GENERATOR_KINDS:
                for _ in self.sampler:  # the restored epoch's draw, as the uninterrupted run made it
                    pass
            self._pending = False
        if epoch != self._epoch:
            self._consumed, self._started, self._pass_generator = 0, False, None
        self._epoch = epoch
        if self._distributed:
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Indices per pass (per rank), as the wrapped sampler's ``len``."""
        if self._order is not None:
            return self._total(self._order) // self._world()
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        start = self._consumed if self._pending else 0
        self._pending = False
        self._consumed, self._started, self._pass_tracked = start, True, self._tracking
        if self._kind in _GENERATOR_KINDS:
            self._pass_generator = self.sampler.generator.get_state().numpy().copy()
        if self._order is not None:
            w = self._world()
            order = self._global_order(self._epoch, self._order)
            return iter(order[start * self.batch_size * w + self.sampler.rank :: w])
        return self._skipping(iter(self.sampler), start * self.batch_size)

    @staticmethod
    def _skipping(indices: Iterator[int], skip: int) -> Iterator[int]:
        for _ in range(skip):  # indices only: the skipped samples are not loaded
            if next(indices, None) is None:
                return
        yield from indices

    def track(self, loader: Any) -> Generator[Any, None, None]:
        """Iterate ``loader``'s batches, counting each one the loop takes.

        Args:
            loader: The ``DataLoader`` built on this sampler (``sampler=`` or a
                ``BatchSampler`` over it) with ``batch_size`` equal to this sampler's.

        Returns:
            A generator of the loader's batches (``close()`` ends the loader's iterator).

        Raises:
            ValueError: if ``loader`` does not read this sampler or has another batch size.
        """
        batch_sampler = getattr(loader, "batch_sampler", None)
        drawn = (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None))
        if not any(s is self for s in drawn):
            raise ValueError(
                "ResumableSampler.track(loader): the loader does not draw its indices from this "
                f"sampler (loader.sampler is a {type(getattr(loader, 'sampler', None)).__name__}). Build "
                f"it as DataLoader(dataset, batch_size={self.batch_size}, sampler=sampler)."
            )
        size = getattr(batch_sampler, "batch_size", None)
        if size != self.batch_size:
            raise ValueError(
                f"ResumableSampler.track(loader): the loader's batch size is {size}, the sampler's "
                f"batch_size={self.batch_size}; pass the DataLoader's per-rank batch size to both."
            )
        self._drop_last_batch = bool(getattr(batch_sampler, "drop_last", False))
        return self._counting(loader)

    def _counting(self, loader: Any) -> Generator[Any, None, None]:
        self._tracking = True
        try:
            batches = iter(loader)
        finally:
            self._tracking = False
        for batch in batches:
            self._consumed += 1
            self._pass_tracked = True
            yield batch

    # -- orders ----------------------------------------------------------------------------
    def _world(self) -> int:
        return int(self.sampler.num_replicas) if self._distributed else 1

    def _dataset_length(self) -> int:
        for name in ("dataset", "data_source", "indices", "weights"):
            if hasattr(self.sampler, name):
                return len(getattr(self.sampler, name))
        return len(self.sampler)  # pragma: no cover - every kind above has one

    def _total(self, num_replicas: int) -> int:
        return total_size(self._dataset_length(), num_replicas, bool(self.sampler.drop_last))

    def _global_order(self, epoch: int, num_replicas: int) -> list[int]:
        """``DistributedSampler``'s global order of ``epoch`` for ``num_replicas`` processes:
        the permutation for ``seed + epoch``, padded (cyclically) or cut to ``total_size``."""
        import torch

        n, total = self._dataset_length(), self._total(num_replicas)
        if self.sampler.shuffle:
            g = torch.Generator()
            g.manual_seed(self.sampler.seed + epoch)
            order: list[int] = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if total <= n:
            return order[:total]
        return (order * -(-total // n))[:total]

    def _replayable(self) -> bool:
        """Whether another world size's order of this sampler can be replayed: a
        ``DistributedSampler`` whose own order this module computes (checked on its epoch)."""
        data = _torch_data()
        if not self._distributed or type(self.sampler).__iter__ is not data.DistributedSampler.__iter__:
            return False
        w = self._world()
        epoch = int(self.sampler.epoch)
        return self._global_order(epoch, w)[self.sampler.rank :: w] == list(iter(self.sampler))

    def _batches_per_epoch(self) -> int:
        n = len(self)
        return n // self.batch_size if self._drop_last_batch else -(-n // self.batch_size)

    # -- the state provider -----------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """The sampler's place: ``{"kind", "epoch", "batches_consumed", "batch_size",
        "num_replicas", "rank", "order_num_replicas", "dataset_length", "num_samples",
        "seed", "shuffle", "drop_last", "loader_drop_last", "generator"}`` (ints, bools,
        ``None`` where the kind has none; ``order_num_replicas``: the world size whose
        padding the order follows; ``generator``: the uint8 state of a ``RandomSampler``'s
        generator at the epoch's start).

        Raises:
            StateError: if the loop iterated the ``DataLoader`` of this epoch directly,
                not through [`track`][keras_stable_state.ResumableSampler.track]: the
                batches it trained are unknown (the loader reads the sampler ahead).
        """
        if self._started and not self._pass_tracked:
            raise StateError(
                f"ResumableSampler cannot tell how many batches of epoch {self._epoch} the loop "
                "trained: the DataLoader was iterated directly, and it reads the sampler ahead of the "
                "loop (its workers prefetch). Iterate it through the sampler: "
                "`for batch in sampler.track(loader): ...`.",
                key="batches_consumed",
            )
        generator = None
        if self._kind in _GENERATOR_KINDS:
            started = self._started and not self._pending
            generator = self._pass_generator if started else None
            if generator is None:
                generator = self.sampler.generator.get_state().numpy().copy()
        s = self.sampler
        return {
            "kind": self._kind,
            "epoch": self._epoch,
            "batches_consumed": self._consumed,
            "batch_size": self.batch_size,
            "num_replicas": self._world(),
            "rank": int(s.rank) if self._distributed else 0,
            "order_num_replicas": self._order or self._world(),
            "dataset_length": self._dataset_length(),
            "num_samples": len(s),
            "seed": int(s.seed) if self._distributed else None,
            "shuffle": bool(s.shuffle) if self._distributed else None,
            "drop_last": bool(s.drop_last) if self._distributed else None,
            "loader_drop_last": self._drop_last_batch,
            "generator": generator,
        }

    def validate_state(self, state: dict[str, Any]) -> None:
        """Check a saved state's fields (called before anything is restored).

        Raises:
            ValueError: naming the malformed field.
        """
        check_saved(state)

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a saved place: the next pass yields the rest of the saved epoch.

        Warns with [`InexactResumeWarning`][keras_stable_state.InexactResumeWarning]
        where the resume cannot train the samples an uninterrupted run would (another
        global batch, sampler or dataset, or an order that another number of processes
        cannot split evenly), naming saved and live world size and batch.
        """
        check_saved(state)
        live = self._live()
        same_world = state["order_num_replicas"] == self._world()
        plan = plan_resume(state, live, replayable=not same_world and self._replayable())
        if plan.problem is not None:
            warnings.warn(plan.problem, InexactResumeWarning, stacklevel=2)
        self._order = plan.order_num_replicas
        if plan.restore_generator and state["generator"] is not None:
            import torch

            self.sampler.generator.set_state(torch.from_numpy(np.array(state["generator"], np.uint8)))
        self._epoch = int(state["epoch"])
        if self._distributed:
            self.sampler.set_epoch(self._epoch)
        self._consumed, self._pending = plan.batches, True
        self._drop_last_batch = bool(state["loader_drop_last"])  # until `track` sees the loader
        self._started, self._pass_tracked, self._pass_generator = False, False, None

    def _live(self) -> dict[str, Any]:
        """`get_state`'s fields of the live sampler, without the pass check."""
        started, self._started = self._started, False
        try:
            return {**self.get_state(), "generator": None}
        finally:
            self._started = started
