"""One of two Torch ranks (``torch.distributed``, gloo on CPU) training a Keras model inside
``DistributedDataParallel`` with a custom loop, as Keras' guide "Multi-GPU distributed
training with PyTorch" does (a ``DistributedSampler(shuffle=True)`` with ``set_epoch``, a
Keras Adam applied to the gradients DDP averaged), checkpointed by a ``CheckpointManager``
that every rank calls; run by tests/test_multiprocess_torch.py.

    python multiprocess_torch.py RANK PORT PHASE FOLDER [KILL_AT]

PHASE ``full``: the uninterrupted run into FOLDER/full; then a run into FOLDER/preempt
where rank 1 receives SIGTERM after step PREEMPT_AT: both ranks save the same step and
stop. PHASE ``killed``: the same run into FOLDER/run, both ranks SIGKILLed after step
KILL_AT. PHASE ``resume``: every rank restores FOLDER/run and trains to the end; then a
fresh manager on FOLDER/run where rank 1 skips the restore: both ranks' next save is
refused. Each rank writes its model and optimizer variables (by position) to
FOLDER/<phase>_<rank>.npz and prints what the test checks.
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


def build():
    # seeded initializers (keras.utils.set_random_seed would import TensorFlow: seconds per rank)
    dense = [
        keras.layers.Dense(
            units, activation=act, kernel_initializer=keras.initializers.GlorotUniform(seed=seed)
        )
        for units, act, seed in ((8, "tanh", 1), (1, None, 2))
    ]
    model = keras.Sequential([keras.Input((5,)), *dense])
    optimizer = kss.StableOptimizer(keras.optimizers.Adam(0.05))
    optimizer.build(model.trainable_variables)
    return model, optimizer


def train(model, optimizer, mgr, first, last, *, guard=None, term_at=None, kill_at=None):
    """Train global steps ``first + 1 .. last`` (the epoch and the offset in it recomputed from
    ``first``), saving every SAVE_EVERY steps; the step of a preemption save, else None."""
    ddp = DistributedDataParallel(model)
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
            loss = torch.mean((ddp(x) - y) ** 2)
            loss.backward()
            optimizer.apply([v.value.grad for v in model.trainable_variables], model.trainable_variables)
            model.zero_grad()
            step += 1
            if step == kill_at:
                print(f"rank {RANK} killed", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if RANK == 1 and step == term_at:
                os.kill(os.getpid(), signal.SIGTERM)  # handled by the guard: only noted
            if guard is not None and mgr.reached_preemption(step):
                path = mgr.save(step, model, optimizer=optimizer)
                print(f"rank {RANK} preempted at {step} saved {path}", flush=True)
                return step
            if step % SAVE_EVERY == 0:
                path = mgr.save(step, model, optimizer=optimizer)
                print(f"rank {RANK} saved {path}", flush=True)
    return None


def write(name, model, optimizer):
    arrays = {f"model_{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(model.weights)}
    arrays.update(
        {f"optimizer_{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(optimizer.variables)}
    )
    np.savez(os.path.join(FOLDER, f"{name}_{RANK}.npz"), **arrays)


def run(directory, *, restore, **options):
    model, optimizer = build()
    mgr = kss.CheckpointManager(os.path.join(FOLDER, directory), max_to_keep=2)
    if restore:
        mgr.restore(model, optimizer=optimizer)
        print(f"rank {RANK} restored {mgr.restored_step}", flush=True)
    first = mgr.restored_step or 0
    if "guard" in options:
        with mgr.preemption_guard() as guard:
            options["guard"] = guard
            stopped = train(model, optimizer, mgr, first, STEPS, **options)
    else:
        stopped = train(model, optimizer, mgr, first, STEPS, **options)
    mgr.close()
    return model, optimizer, mgr, stopped


if PHASE == "full":
    model, optimizer, mgr, _ = run("full", restore=True)
    write("full", model, optimizer)
    info = mgr.metadata(STEPS)
    print(f"rank {RANK} steps {mgr.all_steps()} world_size {info.world_size}", flush=True)
    _, _, _, stopped = run("preempt", restore=True, guard=None, term_at=PREEMPT_AT)
    print(f"rank {RANK} stopped at {stopped}", flush=True)
elif PHASE == "killed":
    run("run", restore=True, kill_at=KILL_AT)
elif PHASE == "resume":
    model, optimizer, mgr, _ = run("run", restore=True)
    write("resumed", model, optimizer)
    # Rank 1 skips the restore: its loop starts at step 0, rank 0's at STEPS; at the next
    # save both ranks are refused (no rank hangs).
    model, optimizer = build()
    mgr = kss.CheckpointManager(os.path.join(FOLDER, "run"), max_to_keep=2)
    if RANK == 0:
        mgr.restore(model, optimizer=optimizer)
    first = mgr.restored_step or 0
    try:
        train(model, optimizer, mgr, first, first + SAVE_EVERY + 1)
    except kss.StateError as err:
        print(f"rank {RANK} refused: {err}", flush=True)
    mgr.close()
print(f"rank {RANK} {PHASE} done", flush=True)
dist.destroy_process_group()
