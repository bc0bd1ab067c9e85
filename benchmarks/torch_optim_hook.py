"""Per-step cost of the ``torch.optim`` step post-hook that keras_stable_state registers on the
Torch backend (it records each optimizer that steps, so that a save leaving one out is refused).

Usage::

    KERAS_BACKEND=torch python benchmarks/torch_optim_hook.py [--rounds 15] [--steps 30]

A custom loop (Dense MLP 784-1024-1024-512-10, about 2.4 M parameters, batch 32,
``torch.optim.Adam`` over ``model.parameters()``, loss.backward(), opt.step()) runs in one
process on one intra-op thread. Each round times ``steps`` steps without the hook (``A``),
with it (``B``) and without it again (``A2``, the A/A control), in a rotating order, and forms
the ratios of the median step times ``B/A`` and ``A2/A``; the medians of the per-round ratios
are printed with their min and max, and the cost of one call of the hook alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import timeit

os.environ.setdefault("KERAS_BACKEND", "torch")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    import keras
    import torch

    from keras_stable_state._optimizer import torch_optim

    torch.set_num_threads(1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((784,)), *(keras.layers.Dense(n, activation="relu") for n in (1024, 1024, 512))]
        + [keras.layers.Dense(10)]
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))

    def steps(n: int) -> float:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def hooked(on: bool) -> None:
        if on:
            torch_optim.watch_steps()
        elif torch_optim._HOOK:
            torch_optim._HOOK.pop().remove()

    steps(10)
    ab, aa = [], []
    order = ["A", "B", "A2"]
    for r in range(args.rounds):
        timed = {}
        for name in order[r % 3 :] + order[: r % 3]:
            hooked(name == "B")
            timed[name] = steps(args.steps)
        ab.append(timed["B"] / timed["A"])
        aa.append(timed["A2"] / timed["A"])
        if r == 0:
            print(f"step: {timed['A'] * 1e3:.2f} ms without the hook")

    def show(ratios: list[float]) -> str:
        return f"median {statistics.median(ratios):.4f} (min {min(ratios):.4f}, max {max(ratios):.4f})"

    print(f"B/A  (hook / no hook): {show(ab)}")
    print(f"A2/A (A/A control):    {show(aa)}")
    call = min(timeit.repeat(lambda: torch_optim._stepped(opt, (), {}), number=100_000, repeat=5)) / 100_000
    print(f"one call of the hook: {call * 1e6:.2f} us")


if __name__ == "__main__":
    main()
