"""Time of ``keras-stable-state ls`` over a directory of many checkpoints (issue 31).

Usage::

    KERAS_BACKEND=jax python benchmarks/ls_many.py [--count 10000] [--dir FOLDER] [--json]

The directory is made once (``--dir`` keeps it between runs): ``--count`` distinct
checkpoints of a small model, each saved by a ``CheckpointManager`` (its own step,
epoch and metrics in its sealed record). Then ``ls`` runs in a fresh process (the command
line imports no Keras), with its wall time measured around the whole process, and in this
process (``list_directory``, twice: files cold in the page cache only the first time
if the directory was just written, so the second is the warm figure).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def make(directory: str, count: int) -> None:
    import keras
    import numpy as np

    import keras_stable_state as kss

    have = len([n for n in os.listdir(directory) if n.startswith("ckpt-")]) if os.path.isdir(directory) else 0
    if have >= count:
        return
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=kss.StableOptimizer(keras.optimizers.Adam()), loss="mse")
    model.train_on_batch(np.ones((2, 2), "float32"), np.ones((2, 1), "float32"))
    started = time.perf_counter()
    with kss.CheckpointManager(directory, max_to_keep=None, monitor="loss") as mgr:
        for step in range(have + 1, count + 1):
            mgr.save(step, model, metrics={"loss": 1.0 / step}, epoch=step // 10)
    print(f"wrote {count - have} checkpoints in {time.perf_counter() - started:.1f} s", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    directory = args.dir or os.path.join(tempfile.mkdtemp(), "ck")
    make(directory, args.count)
    command = [sys.executable, "-m", "keras_stable_state", "ls", directory]
    if args.json:
        command.append("--json")
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    secs = time.perf_counter() - started
    lines = done.stdout.count("\n")
    print(
        f"ls of {args.count} checkpoints: {secs:.2f} s (a fresh process, rc {done.returncode}, {lines} lines)"
    )
    from keras_stable_state.cli.listing import list_directory

    for attempt in (1, 2):
        started = time.perf_counter()
        listing = list_directory(directory)
        secs = time.perf_counter() - started
        print(
            f"list_directory #{attempt}: {secs:.2f} s, {len(listing.checkpoints)} rows, "
            f"{secs / max(1, len(listing.checkpoints)) * 1e3:.3f} ms per checkpoint"
        )


if __name__ == "__main__":
    main()
