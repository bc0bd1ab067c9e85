"""``ResumableSampler``: a custom loop over a ``DataLoader`` resumes at the batch it stopped at.

Ranks of a ``DistributedDataParallel`` run are simulated in one process: one
``DistributedSampler(num_replicas=W, rank=r)`` (wrapped) and one ``DataLoader`` per rank,
iterated in lockstep; a global step is the union of the ranks' batches. For generated
dataset lengths, batch sizes, seeds, ``shuffle``/``drop_last`` and world sizes, the run is
killed at every point (before an epoch's first batch, after each batch), rank 0's state is
restored into fresh samplers, and the batches that follow are compared with the
uninterrupted run's: the same per-rank batches, index for index, on the same world size;
the same global batches on another world size with the same global batch; warned
otherwise. A Keras custom loop through ``CheckpointManager`` ends with the uninterrupted
run's weights, by position.
"""

import copy
import math

import keras
import numpy as np
import pytest
from conftest import BACKEND, hypothesis_examples, to_np
from hypothesis import given, settings
from hypothesis import strategies as st
from kit import assert_same_state, grads, mlp

import keras_stable_state as kss

pytestmark = pytest.mark.frameworks("torch")
torch = pytest.importorskip("torch", reason="ResumableSampler wraps torch samplers")
data = torch.utils.data


def _ranks(n, world, batch, *, shuffle=True, seed=0, drop_last=False, loader_drop_last=False, workers=0):
    """``[(sampler, loader)]`` of each rank over the dataset ``range(n)``."""
    ds = list(range(n))
    out = []
    for rank in range(world):
        inner = data.DistributedSampler(
            ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        sampler = kss.ResumableSampler(inner, batch_size=batch)
        loader = data.DataLoader(
            ds, batch_size=batch, sampler=sampler, drop_last=loader_drop_last, num_workers=workers
        )
        out.append((sampler, loader))
    return out


def _run(ranks, epochs, *, kill=None):
    """Train ``epochs`` in lockstep: ``[(epoch, (rank 0's batch, rank 1's, ...))]``, and rank 0's
    state at event ``kill`` (events: each epoch's ``set_epoch``, each global step), or ``None``."""
    seen, events = [], 0
    for epoch in range(ranks[0][0].epoch, epochs):
        for sampler, _ in ranks:
            sampler.set_epoch(epoch)
        if events == kill:
            return seen, copy.deepcopy(ranks[0][0].get_state())
        events += 1
        tracks = [s.track(loader) for s, loader in ranks]
        for batches in zip(*tracks, strict=True):
            seen.append((epoch, tuple(tuple(b.tolist()) for b in batches)))
            if events == kill:
                state = copy.deepcopy(ranks[0][0].get_state())
                for track in tracks:
                    track.close()  # the loaders' iterators (and workers) end here, not at exit
                return seen, state
            events += 1
    return seen, None


def _restored(state, *args, **kwargs):
    ranks = _ranks(*args, **kwargs)
    for sampler, _ in ranks:
        sampler.set_state(copy.deepcopy(state))  # every rank restores rank 0's saved state
    return ranks


def _global(seen):
    return [(epoch, sorted(i for b in batches for i in b)) for epoch, batches in seen]


def _events(n, world, batch, epochs, drop_last, loader_drop_last):
    per_rank = data.DistributedSampler(
        list(range(n)), num_replicas=world, rank=0, drop_last=drop_last
    ).num_samples
    steps = per_rank // batch if loader_drop_last else math.ceil(per_rank / batch)
    return epochs * (steps + 1)


_CASES = dict(
    n=st.integers(1, 23),
    world=st.integers(1, 4),
    batch=st.integers(1, 5),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**31),
    drop_last=st.booleans(),
    loader_drop_last=st.booleans(),
)


@settings(max_examples=hypothesis_examples(25), deadline=None)
@given(**_CASES)
def test_every_kill_point_resumes_the_same_batches_property(
    n, world, batch, shuffle, seed, drop_last, loader_drop_last
):
    """Same world size: after a restore at any point, each rank's batches are the uninterrupted run's."""
    kw = dict(shuffle=shuffle, seed=seed, drop_last=drop_last, loader_drop_last=loader_drop_last)
    epochs = 2
    full, _ = _run(_ranks(n, world, batch, **kw), epochs)
    for kill in range(_events(n, world, batch, epochs, drop_last, loader_drop_last)):
        before, state = _run(_ranks(n, world, batch, **kw), epochs, kill=kill)
        assert state is not None and state["num_replicas"] == world and state["batch_size"] == batch
        after, _ = _run(_restored(state, n, world, batch, **kw), epochs)
        assert before + after == full, (kill, state)


@settings(max_examples=hypothesis_examples(25), deadline=None)
@given(**_CASES, new_world=st.integers(1, 4))
def test_another_world_size_with_the_same_global_batch_property(
    n, world, batch, shuffle, seed, drop_last, loader_drop_last, new_world
):
    """World size ``W`` to ``W2`` with per-rank batch ``B*W/W2``: the same global batches when ``W2``
    divides the epoch's padded order; otherwise warned, naming both world sizes and batches."""
    if (batch * world) % new_world:
        new_world = world  # no integer per-rank batch keeps the global batch: same world
    new_batch = batch * world // new_world
    kw = dict(shuffle=shuffle, seed=seed, drop_last=drop_last, loader_drop_last=loader_drop_last)
    epochs = 2
    full = _global(_run(_ranks(n, world, batch, **kw), epochs)[0])
    total = data.DistributedSampler(
        list(range(n)), num_replicas=world, rank=0, drop_last=drop_last
    ).total_size
    for kill in range(_events(n, world, batch, epochs, drop_last, loader_drop_last)):
        before, state = _run(_ranks(n, world, batch, **kw), epochs, kill=kill)
        if total % new_world:
            with pytest.warns(kss.InexactResumeWarning, match=f"cannot be split evenly among {new_world}"):
                _restored(state, n, new_world, new_batch, **kw)
            continue
        after, _ = _run(_restored(state, n, new_world, new_batch, **kw), epochs)
        assert _global(before) + _global(after) == full, (kill, state)


def test_two_to_one_and_on_to_three_processes():
    """2 processes (batch 3) -> 1 (batch 6) -> 3 (batch 2): the order of the first run all along,
    its padding included (25 samples padded to 26), over three epochs."""
    n, epochs = 25, 3
    kw = dict(seed=7)
    full = _global(_run(_ranks(n, 2, 3, **kw), epochs)[0])
    first, state = _run(_ranks(n, 2, 3, **kw), epochs, kill=4)
    assert state["num_replicas"] == 2 and state["order_num_replicas"] == 2
    resumed = _restored(state, n, 1, 6, **kw)
    second, state2 = _run(resumed, epochs, kill=5)
    assert state2["num_replicas"] == 1 and state2["order_num_replicas"] == 2 and state2["batch_size"] == 6
    assert len(resumed[0][0]) == 26  # the first run's padded epoch, not this world's 25
    third, _ = _run(_restored(state2, n, 2, 3, **kw), epochs)
    assert _global(first) + _global(second) + _global(third) == full


def test_another_global_batch_is_warned_naming_both():
    """The issue's case: 2 processes -> 1 with the same per-rank batch (the global batch halves)."""
    _, state = _run(_ranks(20, 2, 4), 2, kill=3)
    with pytest.warns(kss.InexactResumeWarning) as caught:
        _restored(state, 20, 1, 4)
    text = str(caught[0].message)
    assert "saved by 2 processes with per-rank batch 4 (global batch 8)" in text
    assert "this run has 1 process with per-rank batch 4 (global batch 4)" in text
    assert "a per-rank batch of 8 on 1 process" in text


def test_a_warned_resume_continues_near_the_saved_place():
    """Another global batch: the resumed epoch starts at the first of this run's batches not wholly
    trained (samples 0..15 of the epoch's order trained; batches of 6: from batch 2, sample 12)."""
    n = 20
    first, state = _run(_ranks(n, 2, 4, seed=1), 1, kill=2)  # 2 global steps of 8 samples
    with pytest.warns(kss.InexactResumeWarning, match="continues at batch 2 of this run's epoch 0"):
        ranks = _restored(state, n, 1, 6, seed=1)
    after, _ = _run(ranks, 1)
    order = data.DistributedSampler(list(range(n)), num_replicas=1, rank=0, seed=1)
    assert [i for _, b in after for i in b[0]] == list(order)[12:]


def test_other_sampler_settings_are_warned():
    _, state = _run(_ranks(20, 2, 2, seed=1), 2, kill=2)
    with pytest.warns(kss.InexactResumeWarning, match=r"seed 1 saved, 2 now"):
        _restored(state, 20, 2, 2, seed=2)
    with pytest.warns(kss.InexactResumeWarning, match=r"dataset_length 20 saved, 21 now"):
        _restored(state, 21, 2, 2, seed=1)


def test_set_epoch_past_a_restored_epoch_is_warned():
    _, state = _run(_ranks(20, 1, 4), 2, kill=2)  # epoch 0 after 2 of its 5 batches
    ((sampler, _),) = _restored(state, 20, 1, 4)
    with pytest.warns(
        kss.InexactResumeWarning, match=r"after 2 of its 5 batches, but the loop called set_epoch\(1\)"
    ):
        sampler.set_epoch(1)


@pytest.mark.parametrize("loader_drop_last", [False, True])
def test_set_epoch_after_a_finished_epoch_is_quiet(loader_drop_last):
    """Saved after an epoch's last batch (7 samples a rank, batches of 3: 3 batches, 2 with the
    loader's drop_last): a loop that computes the next epoch itself goes on exactly, unwarned."""
    kw = dict(loader_drop_last=loader_drop_last)
    steps = 2 if loader_drop_last else 3
    full, _ = _run(_ranks(14, 2, 3, **kw), 2)
    before, state = _run(_ranks(14, 2, 3, **kw), 2, kill=steps)
    assert state["epoch"] == 0 and state["batches_consumed"] == steps
    ranks = _restored(state, 14, 2, 3, **kw)
    for sampler, _ in ranks:
        sampler.set_epoch(1)  # no warning: nothing of epoch 0 is left
    after, _ = _run(ranks, 2)
    assert before + after == full


@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")  # JAX's, for the workers
def test_counts_the_batches_the_loop_took_not_what_workers_read_ahead():
    if BACKEND == "tensorflow":
        pytest.skip("DataLoader workers die at random under TensorFlow (see test_fit_torch_inputs)")
    kw = dict(seed=3, workers=2)
    full, _ = _run(_ranks(40, 1, 2, **kw), 1)
    before, state = _run(_ranks(40, 1, 2, **kw), 1, kill=4)
    assert state["batches_consumed"] == 4  # the workers had read up to 4 batches more
    after, _ = _run(_restored(state, 40, 1, 2, **kw), 1)
    assert before + after == full


def test_the_skipped_samples_are_not_loaded():
    loaded = []

    class Logged(data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            loaded.append(i)
            return i

    _, state = _run(_ranks(10, 1, 2, seed=5), 1, kill=3)
    sampler = kss.ResumableSampler(
        data.DistributedSampler(Logged(), num_replicas=1, rank=0, seed=5), batch_size=2
    )
    sampler.set_state(state)
    rest = [
        i for b in sampler.track(data.DataLoader(Logged(), batch_size=2, sampler=sampler)) for i in b.tolist()
    ]
    assert sorted(loaded) == sorted(rest) and len(rest) == 4  # 3 batches of 2 skipped


@pytest.mark.parametrize("kind", ["random", "subset", "sequential"])
@pytest.mark.parametrize("loader_drop_last", [False, True])
def test_single_process_samplers_resume_at_every_point(kind, loader_drop_last):
    n, batch, epochs = 11, 3, 3

    def make():
        ds = list(range(n))
        gen = torch.Generator().manual_seed(4)
        inner = {
            "random": lambda: data.RandomSampler(ds, generator=gen),
            "subset": lambda: data.SubsetRandomSampler(list(range(1, n)), generator=gen),
            "sequential": lambda: data.SequentialSampler(ds),
        }[kind]()
        sampler = kss.ResumableSampler(inner, batch_size=batch)
        return [(sampler, data.DataLoader(ds, batch_size=batch, sampler=sampler, drop_last=loader_drop_last))]

    full, _ = _run(make(), epochs)
    assert len({b for _, b in full}) > 1
    for kill in range(len(full) + epochs):
        before, state = _run(make(), epochs, kill=kill)
        ranks = make()
        torch.Generator().manual_seed(99)  # the fresh sampler's generator is replaced by the saved one
        ranks[0][0].set_state(state)
        after, _ = _run(ranks, epochs)
        assert before + after == full, (kill, state)


def test_the_loop_must_iterate_through_track():
    ((sampler, loader),) = _ranks(10, 1, 2)
    next(iter(loader))
    with pytest.raises(kss.StateError, match=r"sampler\.track\(loader\)"):
        sampler.get_state()


def test_refused_arguments():
    ds = list(range(8))
    with pytest.raises(TypeError, match="wraps a torch.utils.data DistributedSampler"):
        kss.ResumableSampler(data.BatchSampler(data.SequentialSampler(ds), 2, False), batch_size=2)
    with pytest.raises(ValueError, match=r"RandomSampler\(\.\.\., generator=torch.Generator\(\)"):
        kss.ResumableSampler(data.RandomSampler(ds), batch_size=2)
    with pytest.raises(ValueError, match="positive integer"):
        kss.ResumableSampler(data.SequentialSampler(ds), batch_size=0)
    sampler = kss.ResumableSampler(data.SequentialSampler(ds), batch_size=2)
    with pytest.raises(ValueError, match="does not draw its indices from this sampler"):
        sampler.track(data.DataLoader(ds, batch_size=2))
    with pytest.raises(ValueError, match="the loader's batch size is 4"):
        sampler.track(data.DataLoader(ds, batch_size=4, sampler=sampler))


def test_a_malformed_saved_state_is_refused_before_anything_is_set(tmp_path):
    class Fake:
        def __init__(self, state):
            self.state = state

        def get_state(self):
            return self.state

        def set_state(self, state):
            self.state = state

    model = mlp()
    model.optimizer.build(model.trainable_variables)
    ((sampler, _),) = _ranks(10, 1, 2)
    bad = {**sampler.get_state(), "batches_consumed": -1}
    kss.save_training_state(tmp_path / "bad.h5", model, state={"data": Fake(bad)})
    with pytest.raises(kss.CorruptCheckpointError, match="batches_consumed"):
        kss.restore_training_state(tmp_path / "bad.h5", model, state={"data": sampler})
    assert sampler.get_state()["batches_consumed"] == 0


def test_a_random_sampler_generator_round_trips_through_the_file(tmp_path):
    n, batch = 9, 2

    def make(seed):
        ds = list(range(n))
        sampler = kss.ResumableSampler(
            data.RandomSampler(ds, generator=torch.Generator().manual_seed(seed)), batch
        )
        return [(sampler, data.DataLoader(ds, batch_size=batch, sampler=sampler))]

    model = mlp()
    model.optimizer.build(model.trainable_variables)
    full, _ = _run(make(0), 3)
    ranks = make(0)
    before, _ = _run(ranks, 3, kill=7)
    kss.save_training_state(tmp_path / "run.h5", model, state={"data": ranks[0][0]})
    resumed = make(1)
    kss.restore_training_state(tmp_path / "run.h5", model, state={"data": resumed[0][0]})
    after, _ = _run(resumed, 3)
    assert before + after == full


# -- a Keras custom loop, DDP simulated: the mean over ranks of each rank's mean loss ------------
N, FEATURES, EPOCHS = 24, 4, 2
_rng = np.random.default_rng(0)
X = _rng.normal(size=(N, FEATURES)).astype("float32")
Y = (X @ _rng.normal(size=(FEATURES, 1))).astype("float32")


def _train(directory, world, batch, *, stop=None, init_seed=1):
    """A custom loop over ``world`` simulated ranks, saving every 2 steps; ``stop``: leave after
    that many global steps. Returns the model."""
    ds = data.TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))
    ranks = []
    for rank in range(world):
        sampler = kss.ResumableSampler(
            data.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=11),
            batch_size=batch,
        )
        ranks.append((sampler, data.DataLoader(ds, batch_size=batch, sampler=sampler)))
    model = mlp(seed=init_seed, activation="relu")
    model.optimizer.build(model.trainable_variables)
    with kss.CheckpointManager(directory, max_to_keep=2) as mgr:
        step = 0
        if mgr.restore(model, state={"data": ranks[0][0]}) is not None:
            step = mgr.restored_step
            for sampler, _ in ranks[1:]:  # what every other rank reads from the same file
                sampler.set_state(ranks[0][0].get_state())
        for epoch in range(ranks[0][0].epoch, EPOCHS):
            for sampler, _ in ranks:
                sampler.set_epoch(epoch)
            for batches in zip(*[s.track(loader) for s, loader in ranks], strict=True):

                def loss_fn(batches=batches):
                    per_rank = [
                        keras.ops.mean(
                            keras.ops.square(model(x.numpy()) - keras.ops.convert_to_tensor(y.numpy()))
                        )
                        for x, y in batches
                    ]
                    return sum(per_rank) / len(per_rank)

                model.optimizer.apply(grads(loss_fn, model.trainable_variables), model.trainable_variables)
                step += 1
                if step % 2 == 0:
                    mgr.save(step, model, state={"data": ranks[0][0]})
                if step == stop:
                    return model
    return model


@pytest.mark.slow
def test_keras_custom_loop_resumes_on_the_same_and_on_half_the_processes(tmp_path):
    """Killed after steps 5, 7 and 9 (last saves: mid-epoch 0, its end, mid-epoch 1 of 6 steps each),
    resumed on 2 processes (bit for bit) and on 1 with twice the per-rank batch (the same samples
    in every step: only the float summation order differs)."""
    reference = _train(tmp_path / "ref", 2, 2)
    fresh = _train(tmp_path / "fresh", 1, 4, init_seed=2)
    assert not np.allclose(to_np(fresh.weights[0]), to_np(reference.weights[0]))  # the restores matter
    for stop in (5, 7, 9):
        run = tmp_path / f"run{stop}"
        _train(run, 2, 2, stop=stop)
        for name in ("same", "half"):
            (run / name).mkdir()
            for f in run.glob("ckpt-*.h5"):
                (run / name / f.name).write_bytes(f.read_bytes())
        assert_same_state(_train(run / "same", 2, 2, init_seed=2), reference)
        assert_same_state(_train(run / "half", 1, 4, init_seed=2), reference, rtol=1e-5, atol=1e-6)
