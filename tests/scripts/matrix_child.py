"""Run the phases of resume-matrix cases (tests/resume_matrix.py) from a JSON plan.

usage: matrix_child.py PLAN_JSON

Each phase starts with ``keras.backend.clear_session(free_memory=False)`` and (unless the phase is
unseeded) ``keras.utils.set_random_seed``, builds model, optimizer, callbacks and input
anew and runs ``model.fit`` with a ``StableCheckpoint`` (``plain`` phases without one and
with the bare optimizer: the run without the library, for the invariance check).
A phase with ``kill_at`` SIGKILLs this process when the global step reaches it. Each
phase writes ``<workdir>/<name>.json`` (status, warnings, error, History, per-epoch
learning rate, variable names) and, when it completes, ``<name>.npz`` (``w:<i>`` for
``model.weights[i]``, ``o:<i>`` for ``model.optimizer.variables[i]``).
"""

import json
import os
import signal
import sys
import traceback
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import resume_matrix as rm  # noqa: E402

import keras_stable_state as kss  # noqa: E402

WATCHED = (kss.InexactResumeWarning, kss.UnreadableCheckpointWarning)


class Probe(keras.callbacks.Callback):
    """Stateless for training: notes the end of train begin (the first real batch), the
    learning rate of each epoch, and kills the process at ``kill_at`` global steps."""

    repeatable_epoch_begin = True  # its on_epoch_begin only notes the epoch

    def get_state(self):  # no state that changes training
        return {}

    def set_state(self, state):
        pass

    def __init__(self, phase, spe, caught, record):
        super().__init__()
        self.phase, self.spe, self.caught, self.record = phase, spe, caught, record
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        # At the epoch's end, not its begin: a mid-epoch resume has restored the optimizer's
        # step count by then, so a schedule's rate at epoch begin differs from the reference's.
        self.record["lr"][str(epoch)] = learning_rate(self.model.optimizer)

    def on_train_batch_end(self, batch, logs=None):
        if self.record["begin_warnings"] is None and logs:
            self.record["begin_warnings"] = len(self.caught)
        kill_at = self.phase.get("kill_at")
        # Keras on JAX reports an epoch's last, partial execution (steps_per_execution not
        # dividing the epoch's steps) by its unclipped end, one batch past the epoch's last
        # (seed 27, jax case 5: batch 3 of 3): the batches applied are the epoch's.
        if kill_at is not None and self.epoch * self.spe + min(batch, self.spe - 1) + 1 == kill_at:
            self.record["status"] = "killed"
            write(self.phase, self.record, self.caught)
            os.kill(os.getpid(), signal.SIGKILL)


def learning_rate(opt):
    """The optimizer's current learning rate, or None for a MultiOptimizer (its groups'
    rates are optimizer variables, compared by position)."""
    inner = getattr(opt, "inner_optimizer", opt)
    if isinstance(inner, keras.optimizers.MultiOptimizer):
        return None
    return float(keras.ops.convert_to_numpy(inner.learning_rate))


def write(phase, record, caught):
    begin = record["begin_warnings"]
    record["warnings"] = [
        {
            "category": w.category.__name__,
            "message": str(w.message),
            "at_begin": begin is None or i < begin,
        }
        for i, w in enumerate(caught)
        if issubclass(w.category, WATCHED)
    ]
    record["other_warnings"] = sorted(
        {f"{w.category.__name__}: {w.message}"[:300] for w in caught}
        - {f"{w['category']}: {w['message']}"[:300] for w in record["warnings"]}
    )
    path = os.path.join(phase["workdir"], phase["name"] + ".json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def decoy():
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5), keras.layers.Dense(2)])
    m(np.zeros((1, 3), "float32"))


def run_phase(c, phase):
    keras.backend.clear_session(free_memory=False)
    if phase.get("seed") is not None:
        keras.utils.set_random_seed(phase["seed"])
        if "torch" in rm.mi.frameworks(c["input"]):  # a DataLoader's script seeds Torch too
            import torch

            torch.manual_seed(phase["seed"])
    if phase.get("decoy"):
        decoy()
    record = {
        "status": "running",
        "lr": {},
        "begin_warnings": None,
        "error": None,
        "backend": keras.backend.backend(),
    }
    workdir = phase["workdir"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plain = phase["kind"] == "plain"  # the same fit without the library
            model = rm.build_model(c)
            rm.compile_model(model, c, stable=not plain)
            folder = phase.get("ckpt") or (os.path.join(workdir, "plain") if plain else workdir)
            os.makedirs(folder, exist_ok=True)
            user = rm.build_callbacks(c, folder)
            callbacks = list(user.values())
            ckpt = None
            if not plain:
                # The reference has a StableCheckpoint too (its own folder): the uninterrupted
                # run of the same callbacks, compared with the plain run for invariance.
                passed = {k: v for k, v in user.items() if k in rm.STATEFUL and c["callbacks_passed"]}
                folder = phase.get("ckpt") or os.path.join(workdir, "ckpt-ref")
                ckpt = kss.StableCheckpoint(folder, save_freq=c["save_freq"], max_to_keep=2, callbacks=passed)
                callbacks.insert(0, ckpt)
                # Whether the killed run left anything to resume (a kill before the first save
                # leaves nothing: the "resume" is a fresh start, under the resume's seed).
                record["checkpoints_before"] = sorted(
                    n for n in (os.listdir(folder) if os.path.isdir(folder) else []) if n.startswith("ckpt-")
                )
            batch = phase.get("batch_size", c["batch_size"])
            kw = rm.build_fit_inputs(c, batch)
            spe = rm.steps_per_epoch(dict(c, batch_size=batch))
            callbacks.append(Probe(phase, spe, caught, record))
            history = model.fit(epochs=c["epochs"], verbose=0, callbacks=callbacks, **kw)
        except Exception as err:  # recorded: a refusal, a crash of the library or of the harness
            record["status"] = "error"
            record["error"] = {
                "type": type(err).__name__,
                "message": str(err),
                "state_error": isinstance(err, kss.StateError),
                "refused_at_begin": isinstance(err, kss.StateError) and record["begin_warnings"] is None,
                "traceback": traceback.format_exc(),
            }
            write(phase, record, caught)
            return
        record["status"] = "completed"
        record["restored"] = ckpt is not None and ckpt.restore_report is not None
        record["output_names"] = list(getattr(model, "output_names", None) or [])
        record["history"] = {k: [float(v) for v in vs] for k, vs in history.history.items()}
        record["epoch"] = [int(e) for e in history.epoch]
        opt_vars = list(model.optimizer.variables)
        record["names"] = {"w": [v.path for v in model.weights], "o": [v.path for v in opt_vars]}
        arrays = {f"w:{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(model.weights)}
        arrays.update({f"o:{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(opt_vars)})
        np.savez(os.path.join(workdir, phase["name"] + ".npz"), **arrays)
        write(phase, record, caught)


def main(plan_path):
    with open(plan_path) as f:
        plan = json.load(f)
    for phase in plan["phases"]:
        run_phase(plan["cases"][phase["case"]], phase)


if __name__ == "__main__":
    main(sys.argv[1])
