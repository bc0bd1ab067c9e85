"""Several processes: who writes, how the processes agree, gathering and placing arrays.

Two runtimes count as several processes:

- JAX with ``jax.distributed`` (``jax.process_count() > 1``), everywhere: every
  function that gathers or agrees is a collective (every process must call it, in the
  same order, as ``jax.experimental.multihost_utils`` requires).
- Torch with an initialized ``torch.distributed`` process group of several ranks,
  only inside `torch_ranks` (entered by ``CheckpointManager``: its saves and
  preemption checks are collectives over the ranks, its restores none). The small
  exchanges go through a ``gloo`` group of the library's own, made once per process at
  the first collective (``dist.new_group(backend="gloo")``: it works beside an NCCL
  default group, and DDP's collectives on the default group never interleave with
  ours). Outside `torch_ranks` (``save_training_state`` called alone), each Torch
  process is one process, as before.

On TensorFlow, and with one process, every function here is the one-process case
(no collective is run). Torch is imported only on the Torch backend.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np

from keras_stable_state.errors import StateError

_SCOPE = threading.local()  # .mode: None, "collective" or "alone" (see torch_ranks)
_GROUP: dict[str, Any] = {}  # "world": the default process group ours was made under; "group": ours


def _jax():
    if keras.backend.backend() != "jax":
        return None
    import jax

    return jax


def _torch():
    """``torch.distributed`` where it counts: the Torch backend, inside `torch_ranks`, with an
    initialized process group; else ``None`` (torch is not imported on other backends)."""
    if getattr(_SCOPE, "mode", None) is None or keras.backend.backend() != "torch":
        return None
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


@contextlib.contextmanager
def torch_ranks(collective: bool) -> Iterator[None]:
    """Within (in this thread): the ranks of an initialized ``torch.distributed`` process group
    count as processes (Torch backend only; nothing changes on JAX and TensorFlow).

    With ``collective=True`` the functions that gather or agree are collectives over the
    ranks (every rank must call them, in the same order). With ``collective=False`` none
    is: in `on_primary` rank 0 does the work and every rank may compute its own answer (a restore,
    where a rank that skips the call must not leave the others waiting). A scope entered
    inside another keeps the outer one's mode.
    """
    outer = getattr(_SCOPE, "mode", None)
    if outer is None:
        _SCOPE.mode = "collective" if collective else "alone"
    try:
        yield
    finally:
        if outer is None:
            _SCOPE.mode = None


def process_count() -> int:
    """The number of processes: ``jax.process_count()`` on JAX; the world size of the
    ``torch.distributed`` process group inside `torch_ranks` on Torch; else 1."""
    jax = _jax()
    if jax is not None:
        return jax.process_count()
    dist = _torch()
    return 1 if dist is None else dist.get_world_size()


def process_index() -> int:
    """This process' index: ``jax.process_index()`` on JAX; the ``torch.distributed`` rank
    inside `torch_ranks` on Torch; else 0."""
    jax = _jax()
    if jax is not None:
        return jax.process_index()
    dist = _torch()
    return 0 if dist is None else dist.get_rank()


def independent() -> bool:
    """Whether this process decides alone among several (Torch ranks inside
    ``torch_ranks(collective=False)``): no collective may run."""
    return getattr(_SCOPE, "mode", None) == "alone" and _jax() is None and process_count() > 1


def runtime() -> str | None:
    """``"jax"`` or ``"torch"``: the runtime of several processes in force here; ``None``
    with one process."""
    if process_count() == 1:
        return None
    return "jax" if _jax() is not None else "torch"


def _torch_group(dist):
    """The library's ``gloo`` group over every rank, made at the first collective (every rank
    makes it there: ``new_group`` is itself collective) and again after a new default group."""
    world = dist.group.WORLD
    if _GROUP.get("world") is not world:
        _GROUP.update(world=world, group=dist.new_group(backend="gloo"))
    return _GROUP["group"]


@contextlib.contextmanager
def _torch_collective(dist, what: str) -> Iterator[Any]:
    """Within: the library's group, for a collective; a failure of the collective (a rank
    gone, or the group's timeout) raised as a [`StateError`][keras_stable_state.StateError]
    naming the fix."""
    try:
        yield _torch_group(dist)
    except RuntimeError as err:
        raise StateError(
            f"{what}: the exchange between the torch.distributed ranks failed on rank {dist.get_rank()} "
            f"({err}). Every rank must call CheckpointManager.save and reached_preemption at the same "
            "step, in the same order (a rank that does not call it leaves the others waiting until the "
            "process group's timeout), and none may stop before the others.",
            key=None,
            expected="every rank in the same call",
            received=str(err),
        ) from err


def _broadcast(array: np.ndarray, what: str) -> np.ndarray:
    """Process 0's ``array`` (same shape and dtype on every process) on every process."""
    dist = _torch()
    if dist is None:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(array))
    import torch

    tensor = torch.from_numpy(np.array(array, copy=True).reshape(-1))
    with _torch_collective(dist, what) as group:
        dist.broadcast(tensor, src=0, group=group)
    return tensor.numpy().reshape(np.shape(array))


def gather_rows(values: Sequence[int], what: str = "a check") -> np.ndarray:
    """Every process' ``values`` (ints from -1 to 2**62 - 1, as many on every process),
    ``int64`` of shape ``(processes, len(values))``, row ``i``: process ``i`` (a collective;
    one row with one process)."""
    mine = np.asarray([int(v) for v in values], dtype=np.int64)
    if process_count() == 1:
        return mine.reshape(1, -1)
    dist = _torch()
    if dist is None:  # JAX: int32 halves (jax without x64 has no int64)
        from jax.experimental import multihost_utils

        shifted = mine + 1
        halves = np.stack([shifted >> 31, shifted & (2**31 - 1)], axis=-1).astype(np.int32)
        every = np.asarray(multihost_utils.process_allgather(halves)).astype(np.int64)
        return ((every[..., 0] << 31) | every[..., 1]) - 1
    import torch

    tensor = torch.from_numpy(mine)
    out = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    with _torch_collective(dist, what) as group:
        dist.all_gather(out, tensor, group=group)
    return torch.stack(out).numpy()


def is_sharded(value) -> bool:
    """Whether ``value`` is a ``jax.Array`` with shards on more than one device."""
    jax = _jax()
    return jax is not None and isinstance(value, jax.Array) and len(value.sharding.device_set) > 1


def gather(value) -> np.ndarray:
    """The whole of a JAX array as NumPy, on every process.

    An array that this process holds whole (one process, or replicated on its
    devices) is copied to the host; otherwise every process takes part in
    ``multihost_utils.process_allgather`` (a collective).
    """
    if value.is_fully_addressable or value.is_fully_replicated:
        return np.asarray(value)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def place(variable, array):
    """``array`` put on ``variable``'s current sharding, each process building only its own shards.

    On backends other than JAX, for an unsharded variable, or for a value that
    is already a ``jax.Array`` (placed by the Orbax engine), ``array`` is
    returned as it is and ``variable.assign`` places it.
    """
    jax = _jax()
    if jax is None or isinstance(array, jax.Array):
        return array
    current = getattr(variable, "value", None)
    if not is_sharded(current):
        return array
    host = np.asarray(array)
    return jax.make_array_from_callback(host.shape, current.sharding, lambda index: host[index])


class Turn:
    """This process' part in `on_primary`: whether it runs the block's work (``runs``:
    process 0), or, where it decides alone (`independent`), computes its own answer
    (``alone``); ``result``: what the block computed, set by it (JSON values to share).
    After a sharing block, ``result`` is process 0's on every process."""

    __slots__ = ("alone", "result", "runs")

    def __init__(self, runs: bool, alone: bool = False) -> None:
        self.runs = runs
        self.alone = alone
        self.result: Any = None


@contextlib.contextmanager
def on_primary(what: str, *, share: bool = False) -> Iterator[Turn]:
    """Within: process 0 does the work (the block runs it when ``turn.runs``); every process
    leaves the block once it is done there.

    With several processes the others wait for process 0's outcome (a broadcast, so also
    a barrier): if the block raised there, process 0 re-raises its error and the others
    raise a [`StateError`][keras_stable_state.StateError] saying so. With ``share=True``
    the ``result`` process 0's block set (JSON values) is then broadcast: every process
    leaves with it in ``turn.result``. Where the process decides alone (`independent`:
    Torch ranks in a restore) nothing is exchanged: ``runs`` on process 0, ``alone`` on
    every process (a block may compute its own answer on the others).

    The caller runs its own work inside the block: nothing here calls it.

    Args:
        what: The file or directory concerned, for the message.
        share: Broadcast process 0's ``turn.result`` to every process.

    Raises:
        StateError: on processes other than 0, when the work failed on process 0.
        Exception: on process 0, whatever the block raised.
    """
    if independent():
        yield Turn(runs=process_index() == 0, alone=True)
        return
    if process_count() == 1:
        yield Turn(runs=True)
        return
    turn = Turn(runs=process_index() == 0)
    failure = None
    try:
        yield turn
    except Exception as err:  # noqa: BLE001 - re-raised below, after the others heard of it
        failure = err
    ok = int(_broadcast(np.array([failure is None], dtype=np.int32), f"the write of {what!r}")[0])
    if failure is not None:
        raise failure
    if not ok:
        raise StateError(
            f"Process 0 failed to write {what!r} (its error is raised there); nothing was written by this "
            f"process ({process_index()}), which only gathers arrays for process 0. Fix the error that "
            "process 0 reports and save again.",
            key=None,
            expected="a write on process 0",
            received="a failure on process 0",
        )
    if share:
        turn.result = _share(turn.result, f"the answer of process 0 about {what!r}")


def _share(result: Any, told: str) -> Any:
    """Process 0's ``result`` (JSON values) on every process (a collective)."""
    import json

    data = np.frombuffer(json.dumps(result).encode("utf-8"), dtype=np.uint8) if process_index() == 0 else None
    size = int(_broadcast(np.array([0 if data is None else data.size], dtype=np.int32), told)[0])
    buffer = np.zeros(size, dtype=np.uint8) if data is None else data
    return json.loads(_broadcast(buffer, told).tobytes().decode("utf-8"))


def any_process(flag: bool, step: int, what: str) -> bool:
    """Whether ``flag`` is true on any process, every process asking at the same ``step``.

    With one process this is ``bool(flag)`` (no collective). With several processes every
    process gathers every process' ``(flag, step)`` (`gather_rows`, a collective: every
    process calls it at each step, in the same order) and decides with `agree`.

    Raises:
        StateError: if the processes asked at different steps (see `agree`).
    """
    if process_count() == 1:
        return bool(flag)
    return agree(gather_rows([int(bool(flag)), int(step) % (2**31 - 1)], what), what)


def agree(table, what: str) -> bool:
    """The decision of `any_process` from its gathered table, one row ``(flag, step)``
    per process (row ``i``: process ``i``): whether any flag is set.

    Raises:
        StateError: if the rows hold different steps: the processes do not run in step (one
            skipped a call), so they could not save at one step. ``what`` names the caller.
    """
    rows = np.asarray(table).reshape(-1, 2)
    steps = {int(i): int(s) for i, s in enumerate(rows[:, 1])}
    if len(set(steps.values())) > 1:
        raise StateError(
            f"{what}: the processes asked at different steps ({steps}, process: step), so they "
            "cannot agree on one step to save and stop at. Call it on every process at every "
            "step, with the same step number.",
            key=None,
            expected="one step on every process",
            received=steps,
        )
    return bool(rows[:, 0].any())


def gather_ints(value: int) -> list:
    """``value`` of every process, by process index (a collective; ``[value]`` with one)."""
    return [int(v) for v in gather_rows([value])[:, 0]]
