"""The resume matrix's input kinds added for issue 33 (tests/resume_matrix.py draws them):
``torch.utils.data.DataLoader`` (shuffled by the global generator or a user ``generator=``,
worker processes, ``drop_last``, a user ``Sampler`` with or without ``state_dict()``, a
``BatchSampler``), torchdata's ``StatefulDataLoader``, grain (``MapDataset``,
``IterDataset``, ``grain.DataLoader``) and ``tf.data`` pipelines with their own random
state (a random ``map``, an unseeded reshuffle, a ``py_function``).

Drawing (:func:`draw_options`) needs NumPy alone; the builders import their framework in
the child process that runs the case.
"""

from __future__ import annotations

import math

import numpy as np

#: The new input kinds and their weights, on the scale of ``resume_matrix.INPUT_WEIGHTS``
#: (the kinds drawn before issue 33 keep theirs: a case draws one of these instead with
#: probability ``sum(NEW_INPUTS) / (sum(INPUT_WEIGHTS) + sum(NEW_INPUTS))``).
NEW_INPUTS = {
    "tfdata_random_map": 1.0,
    "tfdata_reshuffle_unseeded": 0.75,
    "tfdata_py_function": 0.5,
    "torch_loader": 1.5,
    "torch_loader_shuffle": 2.0,
    "torch_loader_shuffle_generator": 1.5,
    "torch_loader_sampler_nostate": 0.5,
    "torch_loader_sampler_state": 0.75,
    "torch_loader_batch_sampler": 0.75,
    "torchdata_stateful": 1.0,
    "grain_map": 1.0,
    "grain_map_shuffle": 1.0,
    "grain_iter": 1.0,
    "grain_iter_random_map": 0.75,
    "grain_loader": 1.0,
}

#: The six input kinds Keras 3.15's fit accepts, by the prefix of the matrix's input names.
FAMILIES = (
    ("numpy", "NumPy arrays"),
    ("tfdata", "tf.data"),
    ("pydataset", "PyDataset"),
    ("generator", "Python generator"),
    ("torch", "torch DataLoader"),
    ("grain", "grain"),
)


def family(kind):
    """The input kind (one of :data:`FAMILIES`' labels) of the matrix input ``kind``."""
    for prefix, label in FAMILIES:
        if kind.startswith(prefix):
            return label
    raise ValueError(f"unknown matrix input {kind!r}")


def is_loader(kind):
    return kind.startswith("torch")


def is_grain(kind):
    return kind.startswith("grain")


def frameworks(kind):
    """The packages the input ``kind`` needs beside Keras and NumPy."""
    if kind.startswith("tfdata"):
        return ("tensorflow",)
    if kind == "torchdata_stateful":
        return ("torch", "torchdata")
    if is_loader(kind):
        return ("torch",)
    if is_grain(kind):
        return ("grain",)
    return ()


def draw_options(rng, c):
    """Draw the options of a new input kind into case ``c`` (after its other fields, from
    the generator's second stream ``rng``)."""
    kind = c["input"]
    if is_loader(kind):
        c["loader_workers"] = int(_choice(rng, (0, 1, 2), (3, 1, 1)))
        c["drop_last"] = bool(rng.random() < 0.3)
        # Random augmentation in __getitem__: drawn from Torch's global generator in the
        # main process, from the worker's seed (the loader's base seed + id) in a worker.
        c["loader_augment"] = bool(rng.random() < 0.4)
        c["loader_seed"] = int(rng.integers(0, 2**16))
    elif is_grain(kind):
        c["drop_last"] = bool(rng.random() < 0.3)
        c["loader_seed"] = int(rng.integers(0, 2**16))


def _choice(rng, options, p):
    p = np.asarray(p, dtype=float)
    return options[int(rng.choice(len(options), p=p / p.sum()))]


def batches(c, n, b):
    """Batches per epoch of ``n`` samples in batches of ``b`` for case ``c``'s input."""
    return n // b if c.get("drop_last") else math.ceil(n / b)


# -- builders (run in the child) -------------------------------------------------------------


def _element(x, ys, i):
    return x[i], (ys[0][i] if len(ys) == 1 else tuple(y[i] for y in ys))


def tfdata_extra(c, ds):
    """``ds`` (unbatched ``(x, y)`` samples) with the random state of the kinds above."""
    import tensorflow as tf

    kind = c["input"]
    if kind == "tfdata_random_map":
        return ds.map(lambda x, y: (x + tf.random.uniform(tf.shape(x), -0.05, 0.05, seed=3), y))
    if kind == "tfdata_reshuffle_unseeded":  # seeded by tf.random.set_seed alone
        return ds.shuffle(1024, reshuffle_each_iteration=True)
    if kind == "tfdata_py_function":  # noise from NumPy's global generator, outside tf.data

        def noise(x):
            return (x + np.random.uniform(-0.05, 0.05, size=x.shape)).astype("float32")

        def apply(x, y):
            out = tf.py_function(lambda t: noise(t.numpy()), [x], tf.float32)
            out.set_shape(x.shape)
            return out, y

        return ds.map(apply)
    return ds


def torch_loader(c, x, ys, b):
    """The case's ``torch.utils.data.DataLoader`` (or torchdata ``StatefulDataLoader``)."""
    import torch
    from torch.utils import data as tud

    kind, augment = c["input"], c.get("loader_augment", False)

    class Samples(tud.Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            xi, yi = _element(x, ys, i)
            if augment:
                xi = xi + 0.05 * (torch.rand(xi.shape).numpy() - 0.5)
            return xi.astype("float32"), yi

    class UserSampler(tud.Sampler):
        """A user's sampler: a new permutation per epoch from its own NumPy generator."""

        def __init__(self, n, seed):
            self.n, self.rng = n, np.random.default_rng(seed)

        def __len__(self):
            return self.n

        def __iter__(self):
            return iter(self.rng.permutation(self.n).tolist())

    class UserSamplerWithState(UserSampler):
        def state_dict(self):
            return {"rng": self.rng.bit_generator.state}

        def load_state_dict(self, state):
            self.rng.bit_generator.state = state["rng"]

    def collate(samples):
        # default_collate turns the targets' tuple of a two-output model into a list, whose
        # spec TensorFlow's from_generator refuses (Keras' adapter on TensorFlow): kept a tuple.
        xb, yb = tud.default_collate(samples)
        return xb, (tuple(yb) if isinstance(yb, list) else yb)

    ds, seed = Samples(), c["loader_seed"]
    kw = {"num_workers": c["loader_workers"], "collate_fn": collate}
    if kind == "torch_loader_batch_sampler":
        sampler = tud.BatchSampler(tud.RandomSampler(ds), batch_size=b, drop_last=c["drop_last"])
        return tud.DataLoader(ds, batch_sampler=sampler, **kw)
    kw.update(batch_size=b, drop_last=c["drop_last"])
    if kind == "torch_loader_shuffle":
        kw["shuffle"] = True
    elif kind == "torch_loader_shuffle_generator":
        kw.update(shuffle=True, generator=torch.Generator().manual_seed(seed))
    elif kind == "torch_loader_sampler_nostate":
        kw["sampler"] = UserSampler(len(x), seed)
    elif kind == "torch_loader_sampler_state":
        kw["sampler"] = UserSamplerWithState(len(x), seed)
    elif kind == "torchdata_stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(ds, shuffle=True, **kw)
    return tud.DataLoader(ds, **kw)


def grain_input(c, x, ys, b):
    """The case's grain ``MapDataset``, ``IterDataset`` or ``grain.DataLoader``."""
    import grain

    kind, seed, drop = c["input"], c["loader_seed"], c["drop_last"]
    source = [_element(x, ys, i) for i in range(len(x))]

    def noise(element, rng):
        return (element[0] + rng.uniform(-0.05, 0.05, size=element[0].shape).astype("float32"), element[1])

    if kind == "grain_loader":
        sampler = grain.samplers.IndexSampler(num_records=len(x), shuffle=True, seed=seed, num_epochs=1)
        return grain.DataLoader(
            data_source=source,
            sampler=sampler,
            operations=[grain.transforms.Batch(b, drop_remainder=drop)],
            worker_count=0,
        )
    ds = grain.MapDataset.source(source)
    if kind in ("grain_map_shuffle", "grain_iter", "grain_iter_random_map"):
        ds = ds.shuffle(seed=seed)
    if kind == "grain_iter":
        return ds.to_iter_dataset().batch(b, drop_remainder=drop)
    if kind == "grain_iter_random_map":  # its random state advances per element: the iterator's
        return ds.to_iter_dataset().random_map(noise, seed=seed + 1).batch(b, drop_remainder=drop)
    return ds.batch(b, drop_remainder=drop)
