"""Where a restored ``ResumableSampler`` continues: the pure part (no torch).

A ``DistributedSampler`` epoch is one global order ``G`` (the dataset's permutation
for ``seed + epoch``, padded or cut to ``total_size``, a multiple of the world size);
rank ``r`` of ``W`` reads ``G[r::W]``, so global step ``j`` of an epoch (per-rank
batch ``B``) trains the samples ``G[j*B*W:(j+1)*B*W]``. A resume on another world size
``W2`` with per-rank batch ``B2`` trains the same global batches when ``B2*W2 == B*W``
and ``W2`` divides ``total_size``: rank ``r`` then reads ``G[r::W2]`` of the saved
run's ``G`` (its padding), in the resumed epoch and every later one.

`plan_resume` compares a saved state with the live sampler and says where to
continue (batches of this run's epoch to leave out), which global order to follow,
and, where the resume cannot be exact, why and what would make it exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["FIELDS", "Resume", "check_saved", "plan_resume", "total_size", "world"]

# The saved fields (``None`` where the sampler kind has none: seed/shuffle/drop_last of a
# RandomSampler, generator of a DistributedSampler). ``loader_drop_last``: the DataLoader's
# ``drop_last`` (whether the epoch's last, short batch is dropped).
FIELDS = (
    "kind",
    "epoch",
    "batches_consumed",
    "batch_size",
    "num_replicas",
    "rank",
    "order_num_replicas",
    "dataset_length",
    "num_samples",
    "seed",
    "shuffle",
    "drop_last",
    "loader_drop_last",
    "generator",
)
_COUNTS = ("epoch", "batches_consumed", "rank", "dataset_length", "num_samples")
_POSITIVE = ("batch_size", "num_replicas", "order_num_replicas")


def total_size(dataset_length: int, num_replicas: int, drop_last: bool) -> int:
    """``DistributedSampler.total_size``: the epoch's global order length (samples)."""
    if drop_last and dataset_length % num_replicas:
        return math.ceil((dataset_length - num_replicas) / num_replicas) * num_replicas
    return math.ceil(dataset_length / num_replicas) * num_replicas


def processes(num_replicas: int) -> str:
    """``"1 process"``, ``"2 processes"``."""
    return "1 process" if num_replicas == 1 else f"{num_replicas} processes"


def world(num_replicas: int, batch_size: int) -> str:
    """``"2 processes with per-rank batch 8 (global batch 16)"``."""
    return f"{processes(num_replicas)} with per-rank batch {batch_size} (global batch {num_replicas * batch_size})"


def check_saved(state: dict[str, Any]) -> None:
    """Refuse a malformed saved state (``ValueError`` naming the field)."""
    if not isinstance(state, dict):
        raise ValueError(f"expected an object of the fields {list(FIELDS)}, found {type(state).__name__}")
    missing = [f for f in FIELDS if f not in state]
    if missing:
        raise ValueError(f"fields {missing} are missing")
    for name in _COUNTS + _POSITIVE:
        value = state[name]
        low = 1 if name in _POSITIVE else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"field {name!r} must be an integer >= {low}, found {value!r}")
    if not isinstance(state["kind"], str) or not state["kind"]:
        raise ValueError(f"field 'kind' must be a sampler class name, found {state['kind']!r}")
    if state["seed"] is not None and (isinstance(state["seed"], bool) or not isinstance(state["seed"], int)):
        raise ValueError(f"field 'seed' must be an integer or null, found {state['seed']!r}")
    if not isinstance(state["loader_drop_last"], bool):
        raise ValueError(
            f"field 'loader_drop_last' must be true or false, found {state['loader_drop_last']!r}"
        )
    for name in ("shuffle", "drop_last"):
        if state[name] is not None and not isinstance(state[name], bool):
            raise ValueError(f"field {name!r} must be true, false or null, found {state[name]!r}")
    gen = state["generator"]
    if gen is not None and (getattr(gen, "dtype", None) != "uint8" or getattr(gen, "ndim", None) != 1):
        raise ValueError("field 'generator' must be null or a 1-D uint8 array (a torch.Generator state)")
    if state["rank"] >= state["num_replicas"]:
        raise ValueError(f"rank {state['rank']} is not below num_replicas {state['num_replicas']}")


@dataclass(frozen=True)
class Resume:
    """Where a restored sampler continues.

    Attributes:
        batches: Batches of this run's epoch to leave out (per rank).
        order_num_replicas: The world size whose padding the global order follows
            (``None``: the live sampler's own order).
        restore_generator: Whether the saved generator state applies to the live sampler.
        problem: ``None`` when exact, else the warning's text.
    """

    batches: int
    order_num_replicas: int | None
    restore_generator: bool
    problem: str | None


def _differs(saved: dict[str, Any], live: dict[str, Any]) -> list[str]:
    """The sampler settings that differ, as ``"seed 3 saved, 4 now"``."""
    out = []
    for name in ("dataset_length", "num_samples", "seed", "shuffle", "drop_last"):
        if name == "num_samples" and saved["shuffle"] is not None:
            continue  # a DistributedSampler's is per rank: it follows the world size
        if saved[name] != live[name]:
            out.append(f"{name} {saved[name]!r} saved, {live[name]!r} now")
    return out


def plan_resume(saved: dict[str, Any], live: dict[str, Any], *, replayable: bool) -> Resume:
    """Where to continue after restoring ``saved`` into a sampler whose state now is ``live``.

    Args:
        saved: A checked saved state (`check_saved`).
        live: The live sampler's state (same fields).
        replayable: Whether the live sampler's order can be replayed for another world
            size (a plain ``DistributedSampler`` whose order this torch computes as
            expected).

    Returns:
        A `Resume`; its ``problem`` names saved and live world size and batch, what
        differs, where the run continues and how to resume exactly.
    """
    w_s, b_s, w, b = saved["num_replicas"], saved["batch_size"], live["num_replicas"], live["batch_size"]
    order_w = saved["order_num_replicas"]
    k, epoch = saved["batches_consumed"], saved["epoch"]
    same_kind = saved["kind"] == live["kind"]
    differs = _differs(saved, live) if same_kind else []
    exact_batch = b_s * w_s == b * w
    reason, fix = None, None
    if not same_kind:
        reason = f"The saved order comes from a {saved['kind']}, this run's from a {live['kind']}."
        fix = f"resume with a {saved['kind']} as the saved run had"
    elif differs:
        reason = "The sampler differs: " + "; ".join(differs) + "."
        fix = "make the sampler (and dataset) as the saved run did"
    elif not exact_batch:
        reason = f"The global batch differs ({b_s * w_s} saved, {b * w} now)."
        if (b_s * w_s) % w == 0:
            fix = f"keep the global batch: a per-rank batch of {b_s * w_s // w} on {processes(w)}"
        else:
            fix = f"resume on {processes(w_s)} with per-rank batch {b_s}"
    elif order_w != w:
        total = total_size(saved["dataset_length"], order_w, bool(saved["drop_last"]))
        if not replayable:
            reason = (
                f"This {live['kind']} cannot replay the saved run's order for another number of "
                "processes (a subclass with its own order, or a torch whose DistributedSampler "
                "orders an epoch otherwise)."
            )
            fix = f"resume on {processes(order_w)}"
        elif total % w:
            cut = "cut" if saved["drop_last"] else "padded"
            reason = (
                f"The saved run's epoch order ({saved['dataset_length']} samples, {cut} to {total} for "
                f"{order_w} replicas) cannot be split evenly among {w} processes."
            )
            fix = f"resume on a number of processes that divides {total}, such as {order_w}"
    if reason is None:
        return Resume(k, None if order_w == w else order_w, same_kind, None)
    consumed = k * b_s * w_s  # samples of the epoch's global order the saved run trained
    batches = consumed // (b * w)
    problem = (
        f"ResumableSampler: the checkpoint was saved by {world(w_s, b_s)} at epoch {epoch} after "
        f"{k} batches; this run has {world(w, b)}. {reason} The resumed run trains other samples "
        f"than an uninterrupted one would: it continues at batch {batches} of this run's epoch "
        f"{epoch} (sample {batches * b * w} of its order; the saved run had trained {consumed}). "
        f"To resume exactly, {fix}."
    )
    return Resume(batches, None, same_kind, problem)
