"""One of two Torch ranks (``torch.distributed``, gloo on CPU) training a Keras model inside
``DistributedDataParallel`` with a custom loop, as Keras' guide "Multi-GPU distributed
training with PyTorch" does (a ``DistributedSampler(shuffle=True)`` with ``set_epoch``, a
Keras Adam applied to the gradients DDP averaged), checkpointed by a ``CheckpointManager``
that every rank calls; run by tests/transfer/test_multiprocess_torch.py.

    python multiprocess_torch.py RANK PORT PHASE FOLDER [KILL_AT]

Two tracks train in lockstep on the same batches, each with its own manager: a Keras
optimizer (FOLDER/<run>_keras) and a torch.optim.Adam with a StepLR scheduler
(FOLDER/<run>_torch). PHASE ``full``: the uninterrupted run into FOLDER/full_*; then a run
(Keras track) into FOLDER/preempt_keras where rank 1 receives SIGTERM after step
PREEMPT_AT: both ranks save the same step and stop. PHASE ``killed``: the same run into
FOLDER/run_*, both ranks SIGKILLed after step KILL_AT. PHASE ``resume``: every rank
restores FOLDER/run_* and trains to the end; then, for each track, a fresh manager on its
directory where rank 1 skips the restore: both ranks' next save is refused; then a
torch track whose saves leave its optimizer out (FOLDER/unpassed_torch): refused on both
ranks. Each rank
writes its model and optimizer arrays (by position) to FOLDER/<phase>_<kind>_<rank>.npz
and prints what the test checks.
"""

import os
import signal
import sys

RANK, PORT, PHASE, FOLDER = sys.argv[1:5]
RANK = int(RANK)
KILL_AT = int(sys.argv[5]) if len(sys.argv) > 5 else None
os.environ["KERAS_BACKEND"] = "torch"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK, world_size=2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import keras_stable_state as kss  # noqa: E402

SAMPLES, BATCH, EPOCHS, SAVE_EVERY, PREEMPT_AT = 48, 4, 4, 4, 5
STEPS_PER_EPOCH = SAMPLES // 2 // BATCH  # per rank: 6
STEPS = EPOCHS * STEPS_PER_EPOCH  # 24
rng = np.random.default_rng(0)
DATA = TensorDataset(
    torch.from_numpy(rng.normal(size=(SAMPLES, 5)).astype("float32")),
    torch.from_numpy(rng.normal(size=(SAMPLES, 1)).astype("float32")),
)


def build(kind):
    """A track: the model, its optimizer (``kind`` "keras": StableOptimizer(Adam), applied to
    the gradients DDP averaged; "torch": torch.optim.Adam with a StepLR scheduler, stepped on
    them) and the keywords of its saves and restores."""
    # seeded initializers (keras.utils.set_random_seed would import TensorFlow: seconds per rank)
    dense = [
        keras.layers.Dense(
            units, activation=act, kernel_initializer=keras.initializers.GlorotUniform(seed=seed)
        )
        for units, act, seed in ((8, "tanh", 1), (1, None, 2))
    ]
    model = keras.Sequential([keras.Input((5,)), *dense])
    if kind == "keras":
        optimizer = kss.StableOptimizer(keras.optimizers.Adam(0.05))
        optimizer.build(model.trainable_variables)
        return {"kind": kind, "model": model, "optimizer": optimizer, "keywords": {"optimizer": optimizer}}
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    keywords = {"optimizer": optimizer, "state": {"scheduler": scheduler}}
    return {
        "kind": kind,
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "keywords": keywords,
    }


def train_step(track, x, y):
    model, optimizer = track["model"], track["optimizer"]
    loss = torch.mean((track["ddp"](x) - y) ** 2)
    loss.backward()
    if track["kind"] == "keras":
        optimizer.apply([v.value.grad for v in model.trainable_variables], model.trainable_variables)
    else:
        optimizer.step()
        track["scheduler"].step()
    model.zero_grad()


def train(tracks, first, last, *, guard=None, term_at=None, kill_at=None):
    """Train global steps ``first + 1 .. last`` of every track in lockstep (the epoch and the
    offset in it recomputed from ``first``), each saving into its manager every SAVE_EVERY
    steps; the step of a preemption save, else None."""
    for track in tracks:
        track["ddp"] = DistributedDataParallel(track["model"])
    sampler = DistributedSampler(DATA, num_replicas=2, rank=RANK, shuffle=True, seed=3)
    loader = DataLoader(DATA, batch_size=BATCH, sampler=sampler)
    step = first
    for epoch in range(first // STEPS_PER_EPOCH, -(-last // STEPS_PER_EPOCH)):
        sampler.set_epoch(epoch)
        for index, (x, y) in enumerate(loader):
            if epoch * STEPS_PER_EPOCH + index < step:
                continue  # consumed before the checkpoint
            if step == last:
                return None
            for track in tracks:
                train_step(track, x, y)
            step += 1
            if step == kill_at:
                print(f"rank {RANK} killed", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if RANK == 1 and step == term_at:
                os.kill(os.getpid(), signal.SIGTERM)  # handled by the guard: only noted
            (track,) = tracks if guard is not None else (None,)
            if guard is not None and track["mgr"].reached_preemption(step):
                path = track["mgr"].save(step, track["model"], **track["keywords"])
                print(f"rank {RANK} preempted at {step} saved {path}", flush=True)
                return step
            if step % SAVE_EVERY == 0:
                for track in tracks:
                    path = track["mgr"].save(step, track["model"], **track["keywords"])
                    print(f"rank {RANK} saved {path}", flush=True)
    return None


def write(name, track):
    """The track's model and optimizer arrays by position (torch.optim: its state_dict's
    tensors, and the scheduler's learning rates) into FOLDER/<name>_<kind>_<rank>.npz."""
    model, optimizer = track["model"], track["optimizer"]
    arrays = {f"model_{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(model.weights)}
    if track["kind"] == "keras":
        arrays.update(
            {f"optimizer_{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(optimizer.variables)}
        )
    else:
        for i, state in sorted(optimizer.state_dict()["state"].items()):
            arrays.update(
                {f"optimizer_{i}_{k}": torch.as_tensor(v).numpy() for k, v in sorted(state.items())}
            )
        arrays["lr"] = np.array(track["scheduler"].get_last_lr())
    np.savez(os.path.join(FOLDER, f"{name}_{track['kind']}_{RANK}.npz"), **arrays)


def start(directory, kinds, *, restore=True):
    """Fresh tracks of ``kinds``, each with a manager on FOLDER/<directory>_<kind>, restored
    where ``restore``; the step to start from."""
    tracks = [build(kind) for kind in kinds]
    for track in tracks:
        track["mgr"] = kss.CheckpointManager(
            os.path.join(FOLDER, f"{directory}_{track['kind']}"), max_to_keep=2
        )
        if restore:
            track["mgr"].restore(track["model"], **track["keywords"])
            print(f"rank {RANK} restored {track['kind']} {track['mgr'].restored_step}", flush=True)
    return tracks, tracks[0]["mgr"].restored_step or 0


KINDS = ("keras", "torch")
if PHASE == "full":
    tracks, first = start("full", KINDS)
    train(tracks, first, STEPS)
    for track in tracks:
        track["mgr"].close()
        write("full", track)
        steps, world = track["mgr"].all_steps(), track["mgr"].metadata(STEPS).world_size
        print(f"rank {RANK} {track['kind']} steps {steps} world_size {world}", flush=True)
    tracks, first = start("preempt", ("keras",))
    with tracks[0]["mgr"].preemption_guard() as guard:
        stopped = train(tracks, first, STEPS, guard=guard, term_at=PREEMPT_AT)
    tracks[0]["mgr"].close()
    print(f"rank {RANK} stopped at {stopped}", flush=True)
elif PHASE == "killed":
    train(*start("run", KINDS), STEPS, kill_at=KILL_AT)
elif PHASE == "resume":
    tracks, first = start("run", KINDS)
    train(tracks, first, STEPS)
    for track in tracks:
        track["mgr"].close()
        write("resumed", track)
    # Rank 1 skips the restore: its loop starts at step 0, rank 0's at STEPS; at the next
    # save both ranks are refused (no rank hangs).
    for kind in KINDS:
        tracks, first = start("run", (kind,), restore=RANK == 0)
        try:
            train(tracks, first, first + SAVE_EVERY + 1)
        except kss.StateError as err:
            print(f"rank {RANK} refused {kind}: {err}", flush=True)
        tracks[0]["mgr"].close()
    # The torch.optim optimizer trains the model but is left out of the saves (its scheduler
    # passed): the first save is refused on every rank, before rank 0 writes (no rank hangs).
    tracks, first = start("unpassed", ("torch",), restore=False)
    tracks[0]["keywords"] = {"state": {"scheduler": tracks[0]["scheduler"]}}
    try:
        train(tracks, first, SAVE_EVERY + 1)
    except kss.StateError as err:
        print(f"rank {RANK} refused unpassed: {err}", flush=True)
    tracks[0]["mgr"].close()
    print(f"rank {RANK} unpassed steps {tracks[0]['mgr'].all_steps()}", flush=True)
print(f"rank {RANK} {PHASE} done", flush=True)
# Both ranks reach the end before either destroys the group: a rank that tore down its gloo
# pair while the other still used it ended with SIGABRT ("terminate called without an active
# exception", once in a loaded run, 2026-12-06).
dist.barrier()
dist.destroy_process_group()
