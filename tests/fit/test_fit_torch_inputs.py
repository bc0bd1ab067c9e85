"""A ``torch.utils.data.DataLoader`` input of ``fit`` (accepted on every backend) resumes
exactly with ``StableCheckpoint``: its order and worker seeds are drawn from generators
(the loader's ``generator=``, its samplers', Torch's global one) whose states the
checkpoint holds. Each case: an uninterrupted fit, then fits preempted once or twice
(mid-epoch and at an epoch boundary), each resumed with a fresh model, another seed and a
loader whose generator is seeded otherwise; weights, optimizer variables and History
equal the uninterrupted run's bit for bit. What cannot be replayed is warned about."""

import shutil

import numpy as np
import pytest
from conftest import BACKEND
from kit import assert_resumes_exactly, assert_same_state, fit_input, inexact_warnings, run_on_backend

import keras_stable_state as kss

pytestmark = pytest.mark.frameworks("torch")
torch = pytest.importorskip("torch", reason="DataLoader inputs need torch installed")
data = torch.utils.data

N, BATCH, EPOCHS = 48, 8, 3  # 6 batches per epoch, 18 in all
rng = np.random.default_rng(3)
X = rng.normal(size=(N, 4)).astype("float32")
Y = (X @ rng.normal(size=(4, 1))).astype("float32")


class _Noisy(data.Dataset):
    """Samples with noise drawn from Torch's global generator in ``__getitem__`` (in the
    worker processes, seeded from the loader's base seed, with ``num_workers > 0``)."""

    def __init__(self, n=N):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.from_numpy(X[i % N]) + 0.01 * torch.rand(4), torch.from_numpy(Y[i % N])


class _Rotating(data.Sampler):
    """A sampler of the user's whose order depends on a counter of its passes."""

    def __init__(self, n, step=5):
        self.n, self.step, self.passes = n, step, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        start, self.passes = self.passes * self.step, self.passes + 1
        return iter([(start + i) % self.n for i in range(self.n)])

    def state_dict(self):
        return {"passes": self.passes}

    def load_state_dict(self, state):
        self.passes = int(state["passes"])


class _RotatingNoState(_Rotating):
    state_dict = None
    load_state_dict = None


def _tensors():
    return data.TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))


def _gen(seed):
    return torch.Generator().manual_seed(1000 + seed)


# name -> loader(seed): each resumed run makes its loader with another seed (a decoy).
LOADERS = {
    "global-generator": lambda s: data.DataLoader(_tensors(), batch_size=BATCH, shuffle=True),
    "generator": lambda s: data.DataLoader(_tensors(), batch_size=BATCH, shuffle=True, generator=_gen(s)),
    "drop-last": lambda s: data.DataLoader(
        data.TensorDataset(
            torch.from_numpy(np.concatenate([X, X[:3]])), torch.from_numpy(np.concatenate([Y, Y[:3]]))
        ),
        batch_size=BATCH,
        shuffle=True,
        drop_last=True,
        generator=_gen(s),
    ),
    "noisy-dataset": lambda s: data.DataLoader(_Noisy(), batch_size=BATCH, shuffle=True, generator=_gen(s)),
    "workers": lambda s: data.DataLoader(
        _Noisy(), batch_size=BATCH, shuffle=True, num_workers=2, generator=_gen(s)
    ),
    "workers-global": lambda s: data.DataLoader(_Noisy(), batch_size=BATCH, shuffle=True, num_workers=2),
    "sampler-replacement": lambda s: data.DataLoader(
        _tensors(),
        batch_size=BATCH,
        sampler=data.RandomSampler(range(N), replacement=True, generator=_gen(s)),
    ),
    "weighted-sampler": lambda s: data.DataLoader(
        _tensors(), batch_size=BATCH, sampler=data.WeightedRandomSampler(np.linspace(1, 2, N), N)
    ),
    "batch-sampler": lambda s: data.DataLoader(
        _tensors(),
        batch_sampler=data.BatchSampler(data.RandomSampler(range(N), generator=_gen(s)), BATCH, False),
    ),
    "user-sampler-with-state": lambda s: data.DataLoader(_tensors(), batch_size=BATCH, sampler=_Rotating(N)),
}

# (preempted at (epoch, batch), the global step of the newest checkpoint then); save_freq=2.
STOPS = {
    "mid-epoch": [((1, 3), 8)],
    "boundary-then-mid-epoch": [((1, 0), 6), ((2, 5), 16)],
}


def _fit(directory, make_loader, seed, stop=None):
    return fit_input(directory, make_loader, seed, stop, epochs=EPOCHS, shuffle=False)


_REFERENCES = {}


def _reference(tmp_path_factory, name):
    if name not in _REFERENCES:
        model, _ = _fit(tmp_path_factory.mktemp("ref"), LOADERS[name], seed=0)
        assert int(model.optimizer.iterations) == EPOCHS * N // BATCH
        _REFERENCES[name] = model
    return _REFERENCES[name]


def _assert_resumes_exactly(tmp_path, reference, make_loader, stops):
    return assert_resumes_exactly(tmp_path, reference, make_loader, stops, epochs=EPOCHS, shuffle=False)


# Worker processes per epoch: slow. On TensorFlow, Keras iterates a DataLoader inside tf.data's
# from_generator thread, and with num_workers > 0 its workers die at random ("DataLoader worker
# exited unexpectedly with exit code 1") without keras_stable_state too: 2 of 8 plain 3-epoch fits
# on this machine. No exact comparison can be made there; JAX and Torch run them.
_WORKER_MARKS = [
    pytest.mark.slow,
    pytest.mark.skipif(
        BACKEND == "tensorflow",
        reason="Keras on TensorFlow: DataLoader workers in tf.data's generator thread die at random, "
        "with or without keras_stable_state",
    ),
]


@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")  # JAX's, for the workers
@pytest.mark.parametrize("stops", sorted(STOPS))
@pytest.mark.parametrize(
    "name",
    [
        # each loader killed once mid-epoch on some backends and twice on the others, in turn
        # (pairwise); the worker loaders, which TensorFlow skips, both ways on JAX and Torch
        pytest.param(
            name, marks=_WORKER_MARKS if name.startswith("workers") else [pytest.mark.pairwise("stops")]
        )
        for name in sorted(LOADERS)
    ],
)
def test_dataloader_resumes_exactly(tmp_path, tmp_path_factory, name, stops):
    reference = _reference(tmp_path_factory, name)
    _assert_resumes_exactly(tmp_path, reference, LOADERS[name], STOPS[stops])


def test_the_uninterrupted_run_repeats_itself_and_differs_with_another_generator_seed(tmp_path):
    """The references are deterministic, and the decoy loaders of the resumed runs draw
    another order: a resume that did not put the generators back would not match."""
    a, _ = _fit(tmp_path / "a", LOADERS["generator"], seed=0)
    b, _ = _fit(tmp_path / "b", LOADERS["generator"], seed=0)
    assert_same_state(a, b)
    c, _ = _fit(tmp_path / "c", lambda s: LOADERS["generator"](s + 1), seed=0)
    assert not all(np.array_equal(u, v) for u, v in zip(a.get_weights(), c.get_weights(), strict=True))


def test_the_generator_states_are_in_the_checkpoint(tmp_path, tmp_path_factory):
    ckpt = _assert_resumes_exactly(
        tmp_path, _reference(tmp_path_factory, "generator"), LOADERS["generator"], STOPS["mid-epoch"]
    )
    assert "state:loader" in ckpt.restore_report.restored_state


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11 on torch 2.13
def test_torchdata_stateful_dataloader_resumes_exactly(tmp_path, tmp_path_factory):
    sdl = pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata installed")

    def make(seed):
        return sdl.StatefulDataLoader(_tensors(), batch_size=BATCH, shuffle=True, generator=_gen(seed))

    reference, _ = _fit(tmp_path_factory.mktemp("ref"), make, seed=0)
    _assert_resumes_exactly(tmp_path, reference, make, STOPS["boundary-then-mid-epoch"])


def test_a_sampler_without_state_dict_is_warned_about_naming_it(tmp_path):
    loader = lambda s: data.DataLoader(_tensors(), batch_size=BATCH, sampler=_RotatingNoState(N))  # noqa: E731
    with pytest.warns(
        kss.InexactResumeWarning, match=r"sampler \(_RotatingNoState\).*state_dict\(\)/load_state_dict\(\)"
    ):
        _fit(tmp_path, loader, seed=0, stop=(0, 0))


@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_persistent_workers_are_warned_about(tmp_path):
    def loader(s):
        return data.DataLoader(_Noisy(), batch_size=BATCH, num_workers=1, persistent_workers=True)

    with pytest.warns(
        kss.InexactResumeWarning, match=r"DataLoader keeps its 1 worker processes.*persistent_workers=False"
    ):
        _fit(tmp_path, loader, seed=0, stop=(0, 0))


def test_a_checkpoint_of_another_loader_is_refused(tmp_path):
    _fit(tmp_path, LOADERS["generator"], seed=0, stop=(1, 3))
    with pytest.raises(kss.StateError, match=r"DataLoader.*(has none|holds the generators)"):
        _fit(tmp_path, LOADERS["global-generator"], seed=0)


# Keras' fit on the Torch backend makes two iterators of a DataLoader per epoch, TensorFlow's and
# JAX's one, each drawing from the generators: a resume across the Torch backend is warned about
# (the writer runs in a child process).
WRITER = "jax" if BACKEND == "torch" else "torch"


ACROSS = ["generator", "global-generator"]


@pytest.fixture(scope="module")
def written_on_writer(tmp_path_factory):
    """A folder per name of `ACROSS`: its loader's fit preempted at (1, 3) on WRITER (one child
    process writes both)."""
    root = tmp_path_factory.mktemp("writer")
    code = "\n".join(f"t._fit({str(root / n)!r}, t.LOADERS[{n!r}], 0, (1, 3))" for n in ACROSS)
    run_on_backend(WRITER, "test_fit_torch_inputs", code)
    return root


@pytest.mark.frameworks(WRITER)
@pytest.mark.parametrize("name", ACROSS)
def test_a_dataloader_resumed_across_the_torch_backend_warns_that_later_epochs_draw_otherwise(
    tmp_path, written_on_writer, name
):
    shutil.copytree(written_on_writer / name, tmp_path, dirs_exist_ok=True)
    (_, ckpt), found = inexact_warnings(lambda: _fit(tmp_path, LOADERS[name], 5))
    assert ckpt.restore_report is not None
    assert any(
        f"written on {WRITER} " in m and "RandomSampler" in m and "two iterators of the loader" in m
        for m in found
    ), found


def test_a_sequential_dataloader_draws_nothing_and_is_not_warned_about(tmp_path):
    """The warning above names loaders whose order draws from generators only (same backend here:
    a sequential loader without workers resumes exactly and quietly)."""
    seq = lambda s: data.DataLoader(_tensors(), batch_size=BATCH)  # noqa: E731
    reference, _ = _fit(tmp_path / "ref", seq, 0)
    assert_resumes_exactly(tmp_path / "run", reference, seq, STOPS["mid-epoch"], epochs=EPOCHS, shuffle=False)
