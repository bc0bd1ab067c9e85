"""Per-step cost of ``StableOptimizer`` in ``model.fit``, measured against A/A noise.

Usage::

    KERAS_BACKEND=jax python benchmarks/step_overhead.py [--rounds 25] [--steps N] [--warmup 3] [--threads 1]

Three copies of the same model (Dense MLP 784-1024-1024-512-10, about 2.4 M
parameters, batch 32, Adam) are trained with ``model.fit`` in one process:

* ``U``: plain ``keras.optimizers.Adam``  (A)
* ``W``: ``StableOptimizer(Adam)``        (B)
* ``U2``: plain Adam again, a second compiled model (the A/A control)

Each round fits every model for ``warmup + steps`` steps, in a rotating order
(``U W U2``, ``W U2 U``, ``U2 U W``...), and takes the median step time of the
last ``steps`` steps from a callback (``on_train_batch_end``; a callback that
overrides it makes Keras hand it concrete logs, so every step has finished when it
runs, on every backend). Per round it forms ``W/U`` (A/B) and ``U2/U`` (A/A), and
reports the median of the per-round ratios with their min and max, as the
project's PERF_NOTES.md asks. A wrapped/unwrapped ratio inside the A/A band is
"no measurable difference"; the target is a median ``W/U <= 1.02``.

Threads: by default every backend runs its step on one intra-op thread
(``torch.set_num_threads``, ``tf.config.threading``, ``XLA_FLAGS`` for JAX). On a
shared 2-core machine multi-threaded steps swing by 2-20x whenever another
process runs, which swamps the A/A band; ``--threads 0`` keeps the backends'
defaults.

Under JAX it also makes a structural check that is stronger than any timing:
the jaxpr (and the lowered StableHLO text) of ``model.train_step`` is identical
for ``U`` and ``W``, and ``StableOptimizer.stateless_apply`` traces to the same
jaxpr as the inner optimizer's. A control (``Adam(amsgrad=True)``) shows the
check does see a different optimizer.

Exit code: 0 when the JAX check (if run) passes and the median ``W/U`` is
``<= 1.02`` or inside the A/A band; 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time

BATCH = 32
INPUT_DIM = 784
HIDDEN = (1024, 1024, 512)
CLASSES = 10
TARGET = 1.02
# Default timed steps per fit: about 0.3-0.4 s per fit at PERF_NOTES' step times
# (jax 6.5-8.7 ms, tensorflow 11-12 ms, torch 26-28 ms).
DEFAULT_STEPS = {"jax": 40, "tensorflow": 30, "torch": 15}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Median per-step time ratio StableOptimizer(Adam) / Adam in model.fit, with A/A control."
    )
    parser.add_argument("--rounds", type=int, default=25, help="interleaved rounds (default 25)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per fit (default: jax 40, tensorflow 30, torch 15)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each fit")
    c.add_threads_arg(parser)
    parser.add_argument("--no-jaxpr", action="store_true", help="skip the JAX structural check")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as c  # noqa: E402

if __name__ == "__main__":
    c.configure_threads_env(parse_args().threads)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_stable_state as kss  # noqa: E402


def build_model(optimizer, seed=0):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((INPUT_DIM,))]
    layers += [keras.layers.Dense(units, activation="relu") for units in HIDDEN]
    layers.append(keras.layers.Dense(CLASSES))
    model = keras.Sequential(layers)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class StepTimer(keras.callbacks.Callback):
    """Times each step after ``warmup`` steps: intervals between consecutive batch ends."""

    def __init__(self, warmup):
        super().__init__()
        self.warmup = warmup
        self.times = []

    def on_train_begin(self, logs=None):
        self.times = []

    def on_train_batch_end(self, batch, logs=None):
        # Overriding this hook turns off Keras' async callback dispatch and makes it
        # convert the logs to Python floats first, so the step has finished here.
        if batch >= self.warmup - 1:
            self.times.append(time.perf_counter())

    def step_times(self):
        return np.diff(np.asarray(self.times))


def fit_round(model, x, y, timer):
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    return float(np.median(timer.step_times()))


def jax_structural_check(models, x, y):
    """Compare jaxprs / StableHLO of ``train_step`` and ``stateless_apply`` across models."""
    import jax

    data = (x[:BATCH], y[:BATCH])

    def state(m):
        return (
            [v.value for v in m.trainable_variables],
            [v.value for v in m.non_trainable_variables],
            [v.value for v in m.optimizer.variables],
            [v.value for v in m.metrics_variables],
        )

    def digest(text):
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    out = {}
    for name, m in models.items():
        jaxpr = str(jax.make_jaxpr(m.train_step)(state(m), data))
        hlo = jax.jit(m.train_step).lower(state(m), data).as_text()
        out[name] = (jaxpr, hlo)
    rows = [(name, len(j.splitlines()), digest(j), digest(h)) for name, (j, h) in out.items()]

    # stateless_apply of the wrapper vs its own inner optimizer, on the same values.
    w = models["W"]
    opt_vars = [v.value for v in w.optimizer.variables]
    grads = [keras.ops.ones_like(v.value) for v in w.trainable_variables]
    train_vars = [v.value for v in w.trainable_variables]
    wrapped = str(jax.make_jaxpr(w.optimizer.stateless_apply)(opt_vars, grads, train_vars))
    inner = str(jax.make_jaxpr(w.optimizer.inner_optimizer.stateless_apply)(opt_vars, grads, train_vars))
    return {
        "rows": rows,
        "train_step_jaxpr_same": out["U"][0] == out["W"][0],
        "train_step_hlo_same": out["U"][1] == out["W"][1],
        "aa_same": out["U"][0] == out["U2"][0],
        "control_differs": out["U"][0] != out["amsgrad"][0],
        "stateless_apply_same": wrapped == inner,
        "stateless_apply_eqns": len(wrapped.splitlines()),
    }


def summary(values):
    return statistics.median(values), min(values), max(values)


def main(argv=None):
    args = parse_args(argv)
    backend = keras.backend.backend()
    steps = args.steps or DEFAULT_STEPS.get(backend, 50)
    threads = c.configure_threads(args.threads)

    rng = np.random.default_rng(0)
    n = (args.warmup + steps) * BATCH
    x = rng.normal(size=(n, INPUT_DIM)).astype("float32")
    y = rng.integers(0, CLASSES, size=(n,)).astype("int32")

    models = {
        "U": build_model(keras.optimizers.Adam(1e-4)),
        "W": build_model(kss.StableOptimizer(keras.optimizers.Adam(1e-4))),
        "U2": build_model(keras.optimizers.Adam(1e-4)),
    }
    params = models["U"].count_params()
    print(
        f"step_overhead: backend={backend}, Keras {keras.__version__}, MLP {INPUT_DIM}-"
        f"{'-'.join(map(str, HIDDEN))}-{CLASSES} ({params:,} parameters), batch {BATCH}, Adam; "
        f"{args.rounds} rounds x {steps} timed steps (+{args.warmup} warm-up) per model; "
        f"threads {threads}; {os.cpu_count()} CPUs",
        flush=True,
    )

    t_start = time.perf_counter()
    timer = StepTimer(args.warmup)
    for m in models.values():  # compile / trace, first-touch memory
        m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    ok = True
    if backend == "jax" and not args.no_jaxpr:
        models["amsgrad"] = build_model(keras.optimizers.Adam(1e-4, amsgrad=True))
        models["amsgrad"].optimizer.build(models["amsgrad"].trainable_variables)
        check = jax_structural_check(models, x, y)
        del models["amsgrad"]
        print("\nJAX structural check (jax.make_jaxpr / jit(...).lower of model.train_step)")
        print(f"  {'model':<26} {'jaxpr lines':>11}  {'jaxpr sha256':>12}  {'StableHLO sha256':>16}")
        labels = {"U": "U  Adam", "W": "W  StableOptimizer(Adam)", "U2": "U2 Adam (A/A)"}
        for name, lines, jd, hd in check["rows"]:
            print(f"  {labels.get(name, 'control Adam(amsgrad)'):<26} {lines:>11}  {jd:>12}  {hd:>16}")
        print(f"  train_step jaxpr identical, wrapped vs unwrapped:     {check['train_step_jaxpr_same']}")
        print(f"  train_step StableHLO identical, wrapped vs unwrapped: {check['train_step_hlo_same']}")
        print(
            f"  stateless_apply jaxpr identical, wrapper vs inner:    {check['stateless_apply_same']} "
            f"({check['stateless_apply_eqns']} lines)"
        )
        print(f"  control: Adam(amsgrad=True) jaxpr differs:           {check['control_differs']}")
        ok = (
            check["train_step_jaxpr_same"]
            and check["train_step_hlo_same"]
            and check["stateless_apply_same"]
            and check["aa_same"]
            and check["control_differs"]
        )
        print(f"  structural check: {'PASS' if ok else 'FAIL'}", flush=True)

    orders = [("U", "W", "U2"), ("W", "U2", "U"), ("U2", "U", "W")]
    per_step = {name: [] for name in ("U", "W", "U2")}
    ratio_ab, ratio_aa = [], []
    print("\nRounds (median step time of the round, ms)")
    for r in range(args.rounds):
        got = {}
        for name in orders[r % len(orders)]:
            got[name] = fit_round(models[name], x, y, timer)
            per_step[name].append(got[name])
        ratio_ab.append(got["W"] / got["U"])
        ratio_aa.append(got["U2"] / got["U"])
        print(
            f"  round {r + 1:>2} ({' '.join(orders[r % len(orders)]):<7}): U {got['U'] * 1e3:7.2f}  "
            f"W {got['W'] * 1e3:7.2f}  U2 {got['U2'] * 1e3:7.2f}   W/U {ratio_ab[-1]:.3f}  "
            f"U2/U {ratio_aa[-1]:.3f}",
            flush=True,
        )
    elapsed = time.perf_counter() - t_start

    print(f"\nResults ({backend}, {args.rounds} interleaved rounds, median [min, max])")
    print(f"  {'':<36} {'median':>8} {'min':>8} {'max':>8}")
    for name, label in (
        ("U", "U  Adam, ms/step"),
        ("W", "W  StableOptimizer(Adam), ms/step"),
        ("U2", "U2 Adam, ms/step"),
    ):
        med, lo, hi = summary(per_step[name])
        print(f"  {label:<36} {med * 1e3:8.2f} {lo * 1e3:8.2f} {hi * 1e3:8.2f}")
    ab, aa = summary(ratio_ab), summary(ratio_aa)
    print(f"  {'A/B  W/U  (wrapped / unwrapped)':<36} {ab[0]:8.3f} {ab[1]:8.3f} {ab[2]:8.3f}")
    print(f"  {'A/A  U2/U (unwrapped / unwrapped)':<36} {aa[0]:8.3f} {aa[1]:8.3f} {aa[2]:8.3f}")

    within_noise = aa[1] <= ab[0] <= aa[2]
    meets_target = ab[0] <= TARGET
    if meets_target and within_noise:
        verdict = f"no measurable difference: median W/U {ab[0]:.3f} <= {TARGET} and inside the A/A band"
    elif meets_target:
        verdict = f"median W/U {ab[0]:.3f} <= {TARGET} (outside the A/A band [{aa[1]:.3f}, {aa[2]:.3f}])"
    elif within_noise:
        verdict = (
            f"median W/U {ab[0]:.3f} > {TARGET} but inside the A/A band [{aa[1]:.3f}, {aa[2]:.3f}]: noise"
        )
    else:
        verdict = f"median W/U {ab[0]:.3f} > {TARGET} and outside the A/A band [{aa[1]:.3f}, {aa[2]:.3f}]"
    ok = ok and (meets_target or within_noise)
    print(f"\nVERDICT: {'PASS' if ok else 'FAIL'} - {verdict} ({elapsed:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
