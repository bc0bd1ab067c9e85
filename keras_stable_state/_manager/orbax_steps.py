"""Checkpoints that are ``.orbax`` step directories.

A [`CheckpointManager`][keras_stable_state.CheckpointManager] (and so a
[`StableCheckpoint`][keras_stable_state.StableCheckpoint]) whose directory is named ``*.orbax``
keeps each checkpoint as a directory ``ckpt-<step:010d>.orbax`` written by the
``.orbax`` engine (`keras_stable_state._engines.orbax`: every JAX process its own
shards, process 0 the sealed ``state.h5``). The engine builds a step in
``.ckpt-<step>.orbax.kss-partial`` and commits it by renaming that folder onto its name,
so a ``ckpt-<step>.orbax`` directory is whole from the moment it exists: an
interrupted save leaves only the partial folder, which is never listed and is removed
when the directory is next locked. Replacing a step moves the old directory to
``ckpt-<step>.orbax.kss-old`` first; if a save was killed between the two renames, the
old directory is put back.
"""

from __future__ import annotations

import os
import re
import shutil

from keras_stable_state.errors import CheckpointFormatError
from keras_stable_state.format import orbax_layout, summary

NAME = re.compile(r"^ckpt-(\d{10})\.orbax$")
SUFFIX = orbax_layout.SUFFIX
_PARTIAL = re.compile(r"^\.(ckpt-\d{10}\.orbax)\.kss-partial$")
_OLD = re.compile(r"^(ckpt-\d{10}\.orbax)\.kss-old$")


def uses_orbax(directory) -> bool:
    """Whether the checkpoints of ``directory`` are ``.orbax`` step directories (its name ends
    in ``.orbax``)."""
    return orbax_layout.is_orbax_path(directory)


def is_step(path) -> bool:
    """Whether ``path`` names a step directory (``ckpt-<10 digits>.orbax``)."""
    return NAME.match(os.path.basename(os.fsdecode(path).rstrip("/\\"))) is not None


def checkpoints(directory) -> list:
    """Paths of the step directories in ``directory``, newest first (``[]`` if it is not a folder).

    Anything else named ``ckpt-<10 digits>.orbax`` (a file, a symbolic link) is listed too:
    reading it fails, and it is moved aside as unreadable."""
    if not os.path.isdir(directory):
        return []
    names = sorted((n for n in os.listdir(directory) if NAME.match(n)), reverse=True)
    return [os.path.join(directory, n) for n in names]


def read_summary(path):
    """``(metadata, extra, format version)`` of the step directory ``path`` (its ``state.h5``)."""
    refuse_link(path)
    return summary.read_summary(os.path.join(path, orbax_layout.RECORD), "checkpoint")  # records.RECORD


def identity(path):
    """What tells one written step from another: the identity of its ``state.h5`` (written
    last, a new file for each save), or ``None`` if there is none."""
    try:
        st = os.stat(os.path.join(path, orbax_layout.RECORD), follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def size_of(path) -> int:
    """Bytes of the regular files under the step directory ``path`` (links not followed)."""
    if not os.path.isdir(path) or os.path.islink(path):
        return os.lstat(path).st_size
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            st = os.lstat(os.path.join(root, name))
            total += st.st_size if os.path.isfile(os.path.join(root, name)) else 0
    return total


def remove(path) -> None:
    """Remove the step directory ``path`` (a link or file of that name: itself, never what it
    names); ``FileNotFoundError`` if it is gone."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def remove_temporary(directory) -> list:
    """Remove the partial step directories of killed saves in ``directory``, and put back a
    step that a killed replacement had moved to ``*.kss-old``; the paths removed."""
    removed = []
    with os.scandir(directory) as entries:
        found = [(e.name, e.path, e.is_dir(follow_symlinks=False)) for e in entries]
    for name, path, is_dir in found:
        old = _OLD.match(name)
        if not is_dir or not (_PARTIAL.match(name) or old):
            continue
        if old and not os.path.lexists(os.path.join(directory, old.group(1))):
            os.rename(path, os.path.join(directory, old.group(1)))  # the only whole copy of that step
            continue
        shutil.rmtree(path, ignore_errors=False)
        removed.append(path)
    return removed


def refuse_link(path):
    if os.path.islink(path):
        raise CheckpointFormatError(
            f"{path!r} is a symbolic link; a checkpoint directory's '{SUFFIX}' steps are read only as "
            "directories of their own, never through a link. Replace it with the directory itself.",
            key=None,
            expected=f"a '{SUFFIX}' directory",
            received="a symbolic link",
        )
