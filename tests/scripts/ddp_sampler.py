"""One process of a DistributedDataParallel custom loop (Keras' "Multi-GPU distributed training
with PyTorch", on CPU with gloo) over a ``ResumableSampler(DistributedSampler(...))``.

    python ddp_sampler.py RANK WORLD PORT FOLDER PHASE BATCH [STOP]

PHASE ``save``: train every epoch, rank 0 saving ``FOLDER/ckpt.h5`` after global step STOP (a
save does not change the run: this is the uninterrupted run); ``resume``: every rank restores
``FOLDER/ckpt.h5`` (as a relaunch after a kill would) and trains on. Rank 0 writes the final
weights to ``FOLDER/<PHASE>-<WORLD>x<BATCH>.npz``.
"""

import os
import sys
import warnings

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import keras_stable_state as kss  # noqa: E402

N, FEATURES, EPOCHS = 20, 4, 2


def main(rank, world, port, folder, phase, batch, stop):
    warnings.simplefilter("error", kss.InexactResumeWarning)  # every case here resumes exactly
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    # num_replicas and rank come from the process group
    sampler = kss.ResumableSampler(DistributedSampler(dataset, shuffle=True, seed=5), batch_size=batch)
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler)

    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    optimizer = kss.StableOptimizer(keras.optimizers.Adam(1e-2), model=model)
    optimizer.build(model.trainable_variables)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    path = os.path.join(folder, "ckpt.h5")
    if phase == "resume":
        kss.restore_training_state(path, model, optimizer, state={"data": sampler})
    step = 0
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb in sampler.track(loader):
            loss = torch.mean((ddp(xb) - yb) ** 2)
            loss.backward()  # DDP averages the gradients over the ranks
            variables = model.trainable_variables
            optimizer.apply([v.value.grad for v in variables], variables)
            for v in variables:
                v.value.grad = None
            step += 1
            if phase == "save" and step == stop and rank == 0:
                kss.save_training_state(path, model, optimizer, state={"data": sampler})
    if rank == 0:
        np.savez(
            os.path.join(folder, f"{phase}-{world}x{batch}.npz"),
            *[keras.ops.convert_to_numpy(v) for v in model.weights],
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, port, folder, phase, batch = sys.argv[1:7]
    stop = int(sys.argv[7]) if len(sys.argv) > 7 else None
    main(int(rank), int(world), port, folder, phase, int(batch), stop)
