"""A checkpoint directory that knows its run (issue 31): each checkpoint's step is its sealed
record's, never its file name's (renamed, copied and swapped files, generated; local and S3);
a rollback starts a new timeline, the abandoned checkpoints moved into ``abandoned/`` (local,
S3, ``*.orbax``); a manager that did not restore is refused a save at or below the newest
step (a reused directory); a ``fit`` stopped by a callback counts as finished when run again.

Values are compared by position with values the test set itself before each save."""

import os
import secrets
import shutil
import signal

import keras
import numpy as np
import pytest
from conftest import hypothesis_examples, to_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import mlp

import keras_stable_state as kss
from keras_stable_state.cli.listing import list_directory


def _variables(model):
    return list(model.weights) + list(model.optimizer.variables)


def _fill(model, step):
    """Give every variable of ``model`` (weights, optimizer) a value of its own for ``step``."""
    values = []
    for i, v in enumerate(_variables(model)):
        value = np.full(tuple(v.shape), step * 100 + i, dtype=keras.backend.standardize_dtype(v.dtype))
        v.assign(value)
        values.append(value)
    return values


def _assert_values(model, expected, what):
    found = [to_np(v) for v in _variables(model)]
    assert len(found) == len(expected)
    for i, (got, want) in enumerate(zip(found, expected, strict=True)):
        np.testing.assert_array_equal(got, want, err_msg=f"{what}: variable {i}")


def _save(mgr, model, step, **kwargs):
    values = _fill(model, step)
    mgr.save(step, model, metrics={"loss": 1.0 / (step + 1)}, epoch=step, **kwargs)
    return values


def _name(step, suffix=".h5"):
    return f"ckpt-{step:010d}{suffix}"


# -- the step is the record's: renamed, copied, swapped files (generated) ----------------------
SAVED = (1, 2, 3, 4)
NAMES = (*SAVED, 7, 9)
_OP = st.tuples(st.sampled_from(["copy", "rename", "swap"]), st.sampled_from(NAMES), st.sampled_from(NAMES))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A directory of checkpoints of SAVED (each its own values), and those values."""
    folder = tmp_path_factory.mktemp("template") / "ck"
    model = mlp(seed=0, build=True)
    with kss.CheckpointManager(folder, max_to_keep=None, monitor="loss") as mgr:
        values = {step: _save(mgr, model, step) for step in SAVED}
    return folder, values


def _apply(ops, folder, content):
    """Apply the file operations ``ops`` to ``folder``; ``content``: {name step: the step
    whose checkpoint the file holds}, updated alike."""
    for op, a, b in ops:
        if a == b or a not in content:
            continue
        src, dst = os.path.join(folder, _name(a)), os.path.join(folder, _name(b))
        if op == "copy":
            shutil.copyfile(src, dst)
            content[b] = content[a]
        elif op == "rename" or b not in content:
            os.replace(src, dst)
            content[b] = content.pop(a)
        else:  # swap
            tmp = os.path.join(folder, "swap.tmp")
            os.replace(src, tmp)
            os.replace(dst, src)
            os.replace(tmp, dst)
            content[a], content[b] = content[b], content[a]


@given(ops=st.lists(_OP, min_size=1, max_size=4))
@settings(
    max_examples=hypothesis_examples(25),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_renamed_copied_swapped_checkpoints_restore_only_as_their_records_step(
    template, tmp_path_factory, ops
):
    source, values = template
    folder = tmp_path_factory.mktemp("ops") / "ck"
    shutil.copytree(source, folder)
    content = {step: step for step in SAVED}
    _apply(ops, folder, content)
    good = sorted(n for n, c in content.items() if n == c)
    bad = sorted(n for n, c in content.items() if n != c)

    listing = list_directory(folder)  # ls: steps from the records, misnamed files flagged
    rows = {row.file: row for row in listing.checkpoints}
    for n, c in content.items():
        row = rows[os.path.join(str(folder), _name(n))]
        if n == c:
            assert (row.step, row.status, row.epoch) == (n, "ok", n)
        else:
            assert row.status == "misnamed" and row.step == c and str(n) in row.reason
    assert listing.resume_step == (good[-1] if good else None)

    model = mlp(seed=5, build=True)
    before = [to_np(v) for v in _variables(model)]
    with kss.CheckpointManager(folder, max_to_keep=None, monitor="loss") as mgr:
        assert mgr.all_steps() == good
        assert mgr.latest_step() == (good[-1] if good else None)
        assert mgr.best_step() == (good[-1] if good else None)  # loss 1/(step+1): the newest is best
        for n, c in content.items():
            if n == c:
                info = mgr.metadata(n)
                assert (info.step, info.epoch, info.metrics["loss"]) == (n, n, 1.0 / (n + 1))
            else:
                with pytest.raises(
                    kss.CheckpointFormatError,
                    match=rf"named for step {n}, but its sealed record says step {c}",
                ):
                    mgr.metadata(n)
        above = [n for n in bad if not good or n > good[-1]]
        if above:
            with pytest.warns(kss.UnreadableCheckpointWarning, match="named for step"):
                report = mgr.restore(model)
        else:
            report = mgr.restore(model)
        if good:
            assert report is not None and mgr.restored_step == good[-1]
            _assert_values(model, values[good[-1]], f"restored step {good[-1]}")
        else:
            assert report is None and mgr.restored_step is None
            _assert_values(model, before, "untouched")
        assert sorted(os.path.basename(p) for p, _ in mgr.moved_checkpoints) == [_name(n) for n in above]
    aside = sorted(os.listdir(folder / "unreadable")) if above else []
    assert aside == [_name(n) for n in above]  # kept, not deleted


def test_a_copied_file_is_refused_as_an_int_step_and_moved_aside(template, tmp_path):
    source, values = template
    folder = tmp_path / "ck"
    shutil.copytree(source, folder)
    shutil.copyfile(folder / _name(1), folder / _name(9))  # the issue's `cp`
    model = mlp(seed=5, build=True)
    before = [to_np(v) for v in _variables(model)]
    with kss.CheckpointManager(folder) as mgr:
        with pytest.raises(kss.CheckpointFormatError) as err:
            mgr.restore(model, step=9)
        assert "named for step 9, but its sealed record says step 1" in str(err.value)
        assert (err.value.expected, err.value.received) == (9, 1)
        assert "unreadable" in str(err.value)
        _assert_values(model, before, "untouched")
        assert os.listdir(folder / "unreadable") == [_name(9)]
        mgr.restore(model)
        assert mgr.restored_step == 4
        _assert_values(model, values[4], "step 4")


# -- timelines: rollback, reused directory --------------------------------------------------------
def _rollback(folder, reopen, abandoned):
    """The issue's rollback: 10, 20, 30; restore(step=10); save 15, 16."""
    model = mlp(seed=0, build=True)
    saved = {}
    with reopen(folder) as mgr:
        for step in (10, 20, 30):
            saved[step] = _save(mgr, model, step)
    with reopen(folder) as mgr:
        mgr.restore(model, step=10)
        _assert_values(model, saved[10], "rolled back to 10")
        saved[15] = _save(mgr, model, 15)
        assert mgr.all_steps() == [10, 15]
        saved[16] = _save(mgr, model, 16)
        assert mgr.all_steps() == [10, 15, 16] and mgr.latest_step() == 16
        assert sorted(p.rsplit("/", 1)[-1] for p, _ in mgr.abandoned_checkpoints) == [
            _name(20, abandoned),
            _name(30, abandoned),
        ]
        with pytest.raises(kss.StateError, match=r"refuses to save step 12: .* holds steps \[10, 15, 16\]"):
            mgr.save(12, model)  # the new timeline's own past: never silent either
    fresh = mlp(seed=3, build=True)
    with reopen(folder) as mgr:
        mgr.restore(fresh)  # the next resume: the live timeline's newest
        assert mgr.restored_step == 16
        _assert_values(fresh, saved[16], "resumed at 16")
        assert mgr.abandoned_checkpoints == []  # a resume from the newest abandons nothing
    return saved


def test_rollback_then_save_starts_a_new_timeline_local(tmp_path):
    folder = tmp_path / "ck"
    saved = _rollback(folder, lambda f: kss.CheckpointManager(f, max_to_keep=3), ".h5")
    aside = folder / "abandoned"
    assert sorted(os.listdir(aside)) == [_name(20), _name(30)]
    for step in (20, 30):  # nothing deleted: each restores to its own values
        model = mlp(seed=4, build=True)
        kss.restore_training_state(aside / _name(step), model)
        _assert_values(model, saved[step], f"abandoned {step}")


def test_rollback_then_save_starts_a_new_timeline_orbax(tmp_path):
    pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint (the [orbax] extra) is not installed")
    folder = tmp_path / "run.orbax"
    _rollback(folder, lambda f: kss.CheckpointManager(f, max_to_keep=3), ".orbax")
    assert sorted(os.listdir(folder / "abandoned")) == [_name(20, ".orbax"), _name(30, ".orbax")]


def test_reused_directory_is_refused_then_a_new_timeline_on_request(tmp_path):
    folder = tmp_path / "ck"
    other = mlp(seed=2, build=True)
    with kss.CheckpointManager(folder, max_to_keep=2) as mgr:
        theirs = {step: _save(mgr, other, step) for step in (100, 200)}
    model = mlp(seed=0, build=True)
    with kss.CheckpointManager(folder, max_to_keep=2) as mgr:
        with pytest.raises(kss.StateError) as err:
            _save(mgr, model, 10)
        message = str(err.value)
        for part in (
            "steps [100, 200]",
            "restore first",
            "another directory",
            "new_timeline=True",
            "abandoned/",
        ):
            assert part in message, part
        assert sorted(n for n in os.listdir(folder) if n.startswith("ckpt-")) == [_name(100), _name(200)]
        ours = {10: _save(mgr, model, 10, new_timeline=True)}
        for step in (20, 30):
            ours[step] = _save(mgr, model, step)
        assert mgr.all_steps() == [20, 30]
    assert sorted(os.listdir(folder / "abandoned")) == [_name(100), _name(200)]
    fresh = mlp(seed=3, build=True)
    with kss.CheckpointManager(folder) as mgr:
        mgr.restore(fresh)
        assert mgr.restored_step == 30
        _assert_values(fresh, ours[30], "this run's 30")
    back = mlp(seed=3, build=True)
    kss.restore_training_state(folder / "abandoned" / _name(200), back)
    _assert_values(back, theirs[200], "the other run's 200, kept")


def test_a_manager_that_did_not_restore_may_save_after_the_newest_and_replace_its_own(tmp_path):
    folder = tmp_path / "ck"
    model = mlp(seed=0, build=True)
    with kss.CheckpointManager(folder) as mgr:
        _save(mgr, model, 5)
    with kss.CheckpointManager(folder) as mgr:
        _save(mgr, model, 6)  # after the newest: a plain save
        again = _save(mgr, model, 6)  # its own newest again: replaced
        assert mgr.all_steps() == [5, 6]
        with pytest.raises(kss.StateError, match="refuses to save step 5"):
            _save(mgr, model, 5)
    fresh = mlp(seed=1, build=True)
    with kss.CheckpointManager(folder) as mgr:
        mgr.restore(fresh)
    _assert_values(fresh, again, "the replaced 6")
    assert not os.path.exists(folder / "abandoned")


# -- fit: a stopped run is finished --------------------------------------------------------------
class _StopAfter(keras.callbacks.Callback):
    """Sets ``model.stop_training`` at the end of epoch ``epoch`` (as EarlyStopping does)."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def get_state(self):
        return {}  # stateless: the stop is where it was given

    def set_state(self, state):
        pass

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.model.stop_training = True


def _fit(folder, data, epochs, callbacks=(), seed=0, **options):
    x, y = data
    model = mlp(seed=seed)
    stateful = {
        f"c{i}": cb for i, cb in enumerate(callbacks) if isinstance(cb, keras.callbacks.EarlyStopping)
    }
    ckpt = kss.StableCheckpoint(folder, callbacks=stateful, **options)
    history = model.fit(
        x, y, epochs=epochs, batch_size=8, callbacks=[ckpt, *callbacks], verbose=0, shuffle=False
    )
    return model, ckpt, history


def _state(model):
    return [to_np(v) for v in _variables(model)]


@pytest.mark.parametrize("stopper", ["early_stopping", "stop_training"])
def test_a_fit_stopped_by_a_callback_trains_nothing_when_run_again(tmp_path, data, capsys, stopper):
    folder = tmp_path / "ck"

    def callbacks():
        if stopper == "early_stopping":  # loss never improves by 1e9: stops after epoch 1 (patience 1)
            return [keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=1e9)]
        return [_StopAfter(1)]

    first, _, history = _fit(folder, data, 5, callbacks())
    assert len(history.history["loss"]) == 2
    stopped = _state(first)
    iterations = int(to_np(first.optimizer.iterations))
    capsys.readouterr()
    again, ckpt, history = _fit(folder, data, 5, callbacks(), seed=7)
    out = capsys.readouterr().out
    assert ckpt.run_complete and ckpt.run_stopped
    assert out.count("was stopped by a callback") == 1 and "resume_stopped=True" in out
    assert len(history.history["loss"]) == 2  # the restored History, nothing more
    assert int(to_np(again.optimizer.iterations)) == iterations
    for i, (got, want) in enumerate(zip(_state(again), stopped, strict=True)):
        np.testing.assert_array_equal(got, want, err_msg=f"variable {i}")
    # extending is explicit: more epochs than the stopped fit's, or resume_stopped=True
    more, ckpt, history = _fit(folder, data, 3, seed=7, resume_stopped=True)
    assert not ckpt.run_complete and len(history.history["loss"]) == 3
    if stopper == "early_stopping":  # removed to train on: not warned about, listed as dropped
        assert ckpt.restore_report.dropped_reasons["callback:c0"] == "no callback of this fit takes it"
    assert int(to_np(more.optimizer.iterations)) == iterations + iterations // 2


def test_a_fit_stopped_then_given_more_epochs_trains_on_like_an_uninterrupted_one(tmp_path, data):
    straight, _, full = _fit(tmp_path / "a", data, 4)
    _fit(tmp_path / "b", data, 4, [_StopAfter(1)])
    same, ckpt, history = _fit(tmp_path / "b", data, 4, seed=7)  # same epochs: finished
    assert ckpt.run_stopped and len(history.history["loss"]) == 2
    resumed, ckpt, history = _fit(tmp_path / "b", data, 4, seed=7, resume_stopped=True)
    assert not ckpt.run_stopped
    assert history.history["loss"] == full.history["loss"]
    for i, (got, want) in enumerate(zip(_state(resumed), _state(straight), strict=True)):
        np.testing.assert_array_equal(got, want, err_msg=f"variable {i}")


class _SignalAt(keras.callbacks.Callback):
    """Sends this process SIGTERM (a preemption) at the end of global step ``at``."""

    def __init__(self, at):
        super().__init__()
        self.at, self.step = at, 0

    def get_state(self):
        return {}

    def set_state(self, state):
        pass

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_preempted_fit_is_not_a_stopped_one_and_resumes_to_the_end(tmp_path, data):
    straight, _, full = _fit(tmp_path / "a", data, 3)
    _, ckpt, history = _fit(tmp_path / "b", data, 3, [_SignalAt(6)])  # mid-epoch 1
    assert ckpt.reached_preemption and len(history.history["loss"]) == 2
    resumed, ckpt, history = _fit(tmp_path / "b", data, 3, seed=7)
    assert not ckpt.run_complete and not ckpt.run_stopped
    assert history.history["loss"] == full.history["loss"]
    for i, (got, want) in enumerate(zip(_state(resumed), _state(straight), strict=True)):
        np.testing.assert_array_equal(got, want, err_msg=f"variable {i}")


def test_a_fit_whose_newest_checkpoint_is_a_copy_resumes_from_its_own_newest(tmp_path, data):
    straight, _, _ = _fit(tmp_path / "a", data, 3)
    folder = tmp_path / "b"
    _fit(folder, data, 2)  # 4 steps per epoch: ckpt-4, ckpt-8
    shutil.copyfile(folder / _name(4), folder / _name(12))  # a copy named as epoch 3's end
    with pytest.warns(
        kss.UnreadableCheckpointWarning, match="named for step 12, but its sealed record says step 4"
    ):
        resumed, ckpt, _ = _fit(folder, data, 3, seed=7)
    assert not ckpt.run_complete
    assert os.listdir(folder / "unreadable") == [_name(12)]
    for i, (got, want) in enumerate(zip(_state(resumed), _state(straight), strict=True)):
        np.testing.assert_array_equal(got, want, err_msg=f"variable {i}")


# -- an object store (a real S3 server: test_object_store's) ---------------------------------------
try:
    from test_object_store import bucket, server  # noqa: F401 - the fixtures
except pytest.skip.Exception as skipped:  # no s3fs or moto (the dev extra)
    _NO_S3 = str(skipped)

    @pytest.fixture
    def bucket():
        pytest.skip(_NO_S3)


@pytest.fixture
def s3_url(bucket):
    return f"s3://{bucket}/run-{secrets.token_hex(3)}"


def _fs():
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return fs


def test_s3_copied_swapped_and_edited_markers_never_change_a_step(s3_url):
    model = mlp(seed=0, build=True)
    with kss.CheckpointManager(s3_url, max_to_keep=None, monitor="loss") as mgr:
        values = {step: _save(mgr, model, step) for step in (1, 2, 3)}
    fs, path = _fs(), s3_url.removeprefix("s3://")
    for suffix in ("", ".commit"):  # a copy of step 1, object and marker, named step 9
        fs.copy(f"{path}/{_name(1)}{suffix}", f"{path}/{_name(9)}{suffix}")
    marker = f"{path}/{_name(1)}.commit"  # an edited marker: step 1 the best by far
    import json

    payload = json.loads(fs.cat_file(marker))
    payload["payload"]["record"]["metrics"]["loss"] = -1.0
    fs.pipe_file(marker, json.dumps(payload).encode())
    fs.invalidate_cache()
    fresh = mlp(seed=4, build=True)
    with kss.CheckpointManager(s3_url, max_to_keep=None, monitor="loss") as mgr:
        assert mgr.all_steps() == [1, 2, 3]
        assert mgr.best_step() == 3  # from the sealed records, not the edited marker
        assert mgr.metadata(1).metrics["loss"] == 0.5
        with pytest.raises(
            kss.CheckpointFormatError, match="named for step 9, but its sealed record says step 1"
        ):
            mgr.metadata(9)
        with pytest.warns(kss.UnreadableCheckpointWarning, match="named for step 9"):
            mgr.restore(fresh)
        assert mgr.restored_step == 3
        _assert_values(fresh, values[3], "step 3")
    found = _fs().ls(f"{path}/unreadable")
    assert [p.rsplit("/", 1)[-1] for p in found] == [_name(9)]


def test_s3_swapped_objects_fall_back_to_the_newest_in_place(s3_url):
    model = mlp(seed=0, build=True)
    with kss.CheckpointManager(s3_url, max_to_keep=None) as mgr:
        values = {step: _save(mgr, model, step) for step in (1, 2, 3)}
    fs, path = _fs(), s3_url.removeprefix("s3://")
    for suffix in ("", ".commit"):
        a, b = f"{path}/{_name(2)}{suffix}", f"{path}/{_name(3)}{suffix}"
        fs.copy(a, f"{path}/swap")
        fs.copy(b, a)
        fs.copy(f"{path}/swap", b)
        fs.rm(f"{path}/swap")
    fresh = mlp(seed=4, build=True)
    with kss.CheckpointManager(s3_url) as mgr:
        assert mgr.all_steps() == [1]
        with pytest.warns(kss.UnreadableCheckpointWarning):
            mgr.restore(fresh)
        assert mgr.restored_step == 1
        _assert_values(fresh, values[1], "step 1")


def test_s3_rollback_then_save_starts_a_new_timeline(s3_url):
    _rollback(s3_url, lambda f: kss.CheckpointManager(f, max_to_keep=3), ".h5")
    found = sorted(p.rsplit("/", 1)[-1] for p in _fs().ls(f"{s3_url.removeprefix('s3://')}/abandoned"))
    assert found == [_name(20), _name(30)]


def test_s3_reused_directory_is_refused(s3_url):
    other = mlp(seed=2, build=True)
    with kss.CheckpointManager(s3_url) as mgr:
        for step in (100, 200):
            _save(mgr, other, step)
    with kss.CheckpointManager(s3_url) as mgr, pytest.raises(kss.StateError, match=r"steps \[100, 200\]"):
        _save(mgr, mlp(seed=0, build=True), 10)


def _apply_s3(fs, ops, path, content):
    """`_apply` in the store: each checkpoint object moves with its commit marker."""

    def copy(a, b):
        for suffix in ("", ".commit"):
            fs.copy(f"{path}/{a}{suffix}", f"{path}/{b}{suffix}")

    def remove(a):
        fs.rm([f"{path}/{a}", f"{path}/{a}.commit"])

    for op, a, b in ops:
        if a == b or a not in content:
            continue
        if op == "copy":
            copy(_name(a), _name(b))
            content[b] = content[a]
        elif op == "rename" or b not in content:
            copy(_name(a), _name(b))
            remove(_name(a))
            content[b] = content.pop(a)
        else:
            copy(_name(a), "swap")
            copy(_name(b), _name(a))
            copy("swap", _name(b))
            remove("swap")
            content[a], content[b] = content[b], content[a]
    fs.invalidate_cache()


@given(ops=st.lists(_OP, min_size=1, max_size=3))
@settings(
    max_examples=hypothesis_examples(6),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_s3_renamed_copied_swapped_checkpoints_restore_only_as_their_records_step(bucket, ops):
    fs = _fs()
    template = f"{bucket}/template"
    if not fs.exists(f"{template}/{_name(SAVED[-1])}.commit"):
        model = mlp(seed=0, build=True)
        with kss.CheckpointManager(f"s3://{template}", max_to_keep=None) as mgr:
            values = {step: _save(mgr, model, step) for step in SAVED}
        _S3_VALUES.update(values)
    path = f"{bucket}/run-{secrets.token_hex(4)}"
    for step in SAVED:
        for suffix in ("", ".commit"):
            fs.copy(f"{template}/{_name(step)}{suffix}", f"{path}/{_name(step)}{suffix}")
    content = {step: step for step in SAVED}
    _apply_s3(fs, ops, path, content)
    good = sorted(n for n, c in content.items() if n == c)
    bad = sorted(n for n, c in content.items() if n != c)
    above = [n for n in bad if not good or n > good[-1]]
    model = mlp(seed=5, build=True)
    with kss.CheckpointManager(f"s3://{path}", max_to_keep=None) as mgr:
        assert mgr.all_steps() == good
        if above:
            with pytest.warns(kss.UnreadableCheckpointWarning, match="named for step"):
                mgr.restore(model)
        else:
            mgr.restore(model)
        assert mgr.restored_step == (good[-1] if good else None)
        if good:
            _assert_values(model, _S3_VALUES[good[-1]], f"restored step {good[-1]}")
    aside = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{path}/unreadable")) if above else []
    assert aside == [_name(n) for n in above]


_S3_VALUES = {}


# -- ls: the lean summary is the sealed record ---------------------------------------------------
def test_ls_reads_each_sealed_record_and_a_changed_record_byte_is_damage(template, tmp_path):
    import h5py

    from keras_stable_state.format import open_file
    from keras_stable_state.format.summary import read_summary

    source, _ = template
    folder = tmp_path / "ck"
    shutil.copytree(source, folder)
    path = str(folder / _name(2))
    with open_file(path) as f:
        full = f.extra["providers"]["checkpoint"], f.metadata["backend"], f.version
    metadata, extra, version = read_summary(path, "checkpoint")
    assert (extra["providers"]["checkpoint"], metadata["backend"], version) == full
    assert full[0]["step"] == 2 and full[0]["epoch"] == 2
    with h5py.File(path, "r") as f:  # where the manager's record lies in the file
        offset = f["extra"].id.get_offset()
    with open(path, "r+b") as fh:
        text = fh.read()
        at = text.index(b'"step": 2', offset) + len(b'"step": ')
        fh.seek(at)
        fh.write(b"7")  # the record now says step 7: the seal no longer holds
    with pytest.raises(kss.CorruptCheckpointError):
        read_summary(path, "checkpoint")
    rows = {row.file: row for row in list_directory(folder).checkpoints}
    assert rows[path].status == "damaged"
    assert [(r.step, r.status) for r in rows.values() if r.file != path] == [(4, "ok"), (3, "ok"), (1, "ok")]
