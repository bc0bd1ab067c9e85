"""An atomic write drops the page cache of the file it replaces before writing its temporary
file (``format.atomic.release_cached_pages``): the file itself is left whole, and nothing
but a regular file is opened (a FIFO is not waited on, a link not followed)."""

import os
import threading

import numpy as np
import pytest

from keras_stable_state.format import atomic


def test_release_cached_pages_leaves_the_file_whole(tmp_path):
    path = tmp_path / "old.h5"
    data = np.random.default_rng(0).integers(0, 256, size=3 << 20, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    with open(path, "rb") as fh:
        assert fh.read() == data  # in the page cache
    atomic.release_cached_pages(str(path))
    assert path.read_bytes() == data


def test_an_atomic_write_replaces_the_file_after_the_drop(tmp_path):
    path = tmp_path / "run.h5"
    path.write_bytes(b"old contents")
    with atomic.atomic_path(str(path), suffix=".h5") as tmp:
        assert path.read_bytes() == b"old contents"  # dropped from the cache, still whole
        with open(tmp, "wb") as fh:
            fh.write(b"new contents")
    assert path.read_bytes() == b"new contents"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo (POSIX)")
def test_release_cached_pages_returns_at_once_for_a_fifo_a_link_or_no_file(tmp_path):
    fifo = tmp_path / "fifo.h5"
    os.mkfifo(fifo)
    target = tmp_path / "target.h5"
    target.write_bytes(b"target")
    link = tmp_path / "link.h5"
    link.symlink_to(target)
    done = threading.Event()

    def call():
        atomic.release_cached_pages(str(fifo))  # an open() for reading would wait for a writer
        atomic.release_cached_pages(str(link))
        atomic.release_cached_pages(str(tmp_path / "missing.h5"))
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(10), "release_cached_pages blocked on a FIFO"
    assert target.read_bytes() == b"target"
