"""A Keras model trained inside torch DistributedDataParallel (DDP) that resumes exactly.

The loop of Keras' guide "Multi-GPU distributed training with PyTorch" (one process per
device, a DistributedSampler, torch.optim.Adam), with a StepLR scheduler and a
kss.CheckpointManager that every rank calls. Run it with torchrun, 2 processes:

    torchrun --standalone --nproc_per_node 2 examples/ddp_resume.py --dir runs/ddp

Stop it at any moment (Ctrl-C, a scheduler's SIGTERM, SIGKILL, a lost machine) and run
the same command again: every rank restores the newest checkpoint (the weights, Adam's
moments, the scheduler's learning rate, the sampler's place in the epoch) and the run
ends with the weights of a run never stopped, bit for bit. On CPU the ranks talk through
gloo, with one GPU per rank through NCCL. See docs/how-to/torch-ddp.md.
"""

import argparse
import os
import signal

os.environ.setdefault("KERAS_BACKEND", "torch")  # before Keras is imported

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import keras_stable_state as kss  # noqa: E402

FEATURES = 8


def parse_args():
    parser = argparse.ArgumentParser(description="Resumable DDP training of a Keras model (torchrun).")
    parser.add_argument("--dir", required=True, help="checkpoint directory, one that every rank sees")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2048, help="samples in the dataset")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank (x ranks: the global batch)")
    parser.add_argument("--save-every", type=int, default=20, help="save every this many steps")
    # Used by tests/docs/test_torch_ddp_howto.py only:
    parser.add_argument("--kill-at", type=int, help="(tests) SIGKILL every rank after this step")
    parser.add_argument("--dump", help="(tests) each rank writes its final state to DUMP-rank<r>.npz")
    return parser.parse_args()


def build_model():
    # Seeded: the same initial weights in every launch (DDP also copies rank 0's to the others).
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(
                32, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(seed=1)
            ),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2)),
        ]
    )


def dataset(samples):
    """The same data on every rank; the sampler gives each rank its share."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    y = np.sin(x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)  # before the model: Keras builds on the current device
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    data = dataset(args.samples)
    # num_replicas and rank come from the process group; the wrapper counts the batches trained.
    sampler = kss.ResumableSampler(DistributedSampler(data, shuffle=True, seed=0), batch_size=args.batch_size)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    model = build_model()
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.5)
    state = {"scheduler": scheduler, "data": sampler}

    # Every rank: the same directory, the same calls in the same order. Rank 0 writes.
    mgr = kss.CheckpointManager(args.dir, max_to_keep=3)
    mgr.restore(model, optimizer=optimizer, state=state)  # a fresh directory: nothing to restore
    step = saved = mgr.restored_step or 0
    print(f"rank {rank}/{world}: from step {step} (epoch {sampler.epoch})", flush=True)
    preempted, loss = False, None
    with mgr.preemption_guard():  # SIGTERM to any rank: every rank saves the same step and stops
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)
            for x, y in sampler.track(loader):  # the rest of the epoch after a restore
                x, y = x.to(device), y.to(device)
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                loss.backward()  # DDP averages the gradients over the ranks
                optimizer.step()
                scheduler.step()
                step += 1
                preempted = mgr.reached_preemption(step)  # every rank, every step
                if preempted or step % args.save_every == 0:
                    mgr.save(step, model, optimizer=optimizer, state=state)
                    saved = step
                if step == args.kill_at:
                    print(f"rank {rank}: killed at step {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                if preempted:
                    break
            if preempted:
                print(f"rank {rank}: preempted, saved step {step}", flush=True)
                break
            if rank == 0 and loss is not None:
                print(f"epoch {epoch}: step {step}, loss {loss.item():.5f}", flush=True)
    if step != saved:
        mgr.save(step, model, optimizer=optimizer, state=state)  # the end: a rerun trains nothing
    mgr.close()
    if args.dump:
        dump(f"{args.dump}-rank{rank}.npz", model, optimizer, scheduler)
    print(f"rank {rank}: done at step {step}", flush=True)
    dist.destroy_process_group()


def dump(path, model, optimizer, scheduler):
    """(tests) The model's weights, the optimizer's state and the learning rate, by position."""
    arrays = {f"weight_{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(model.weights)}
    for i, param_state in sorted(optimizer.state_dict()["state"].items()):
        for name, value in sorted(param_state.items()):
            arrays[f"adam_{i}_{name}"] = torch.as_tensor(value).cpu().numpy()
    arrays["lr"] = np.array(scheduler.get_last_lr())
    np.savez(path, **arrays)


if __name__ == "__main__":
    main()
