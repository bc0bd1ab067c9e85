"""URLs, told apart from local paths: pure grammar, no I/O.

A path that starts with a URL scheme (``<letters>://``, also chained as fsspec chains
them: ``simplecache::s3://...``) is never used as a local path: `is_remote` tells the
entry points to send it to the object-store engine
(``keras_stable_state._engines.object_store``, through fsspec), and `refuse_url` stops it
at every door of the file format that only takes local paths (`fs_path`, the atomic
writer, the reader), so no local folder ``./gs:/bucket/...`` is ever made. ``file://``
URLs are local paths written as URLs: `resolve` turns them into the path
(``file:///data/run.h5`` -> ``/data/run.h5``), which then gets every local guarantee
(atomic rename, the lock).

This module imports no Keras and no fsspec.
"""

from __future__ import annotations

import os
import re
import urllib.parse
import urllib.request
from typing import TypeGuard

from keras_stable_state.errors import CheckpointFormatError

__all__ = ["is_file_url", "is_remote", "is_url", "refuse_url", "resolve", "scheme_of"]

# A URL scheme (RFC 3986: a letter, then letters, digits, '+', '-', '.'), possibly after
# fsspec's '::' chaining ("simplecache::s3://bucket/key").
_URL = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.-]*::)*)([A-Za-z][A-Za-z0-9+.-]*)://")


def _drive_letter(scheme: str) -> bool:
    return os.name == "nt" and len(scheme) == 1  # "C://data" is a drive on Windows


def is_url(path: object) -> TypeGuard[str]:
    """Whether ``path`` (a ``str``; anything else is not a URL) starts with a URL scheme
    (``s3://``, ``gs://``, ``file://``, ``simplecache::s3://``...)."""
    if not isinstance(path, str):
        return False
    match = _URL.match(path)
    return match is not None and not (not match.group(1) and _drive_letter(match.group(2)))


def scheme_of(path: str) -> str | None:
    """The scheme of a URL (``"s3"`` for ``"s3://bucket/key"``, ``"simplecache"`` for
    ``"simplecache::s3://..."``), lower-cased; ``None`` for a local path."""
    if not is_url(path):
        return None
    match = _URL.match(path)
    if match is None:  # is_url matched it
        return None
    chained = match.group(1)
    return (chained.split("::")[0] if chained else match.group(2)).lower()


def is_file_url(path: str) -> bool:
    """Whether the URL ``path`` is a ``file://`` URL (not chained)."""
    match = _URL.match(path)
    if match is None:  # called on URLs only
        return False
    return not match.group(1) and match.group(2).lower() == "file"


def resolve(path: str, what: str = "path") -> str:
    """``path``, or the local path a ``file://`` URL names (``file:///data/run.h5`` ->
    ``/data/run.h5``; percent-escapes decoded).

    Raises:
        CheckpointFormatError: for a ``file://`` URL naming another host.
    """
    if not is_url(path) or not is_file_url(path):
        return path
    parts = urllib.parse.urlsplit(path)
    if parts.netloc not in ("", "localhost"):
        raise CheckpointFormatError(
            f"The {what} {path!r} is a file:// URL on host {parts.netloc!r}; only local files "
            "(file:///path or file://localhost/path) are file:// URLs here. Pass the local path, or "
            "the store's own URL (s3://, gs://...).",
            expected="file:///<local path>",
            received=path,
        )
    return urllib.request.url2pathname(parts.path)


def is_remote(path: object) -> bool:
    """Whether ``path`` is read and written through fsspec: a URL that is not ``file://``."""
    return is_url(path) and not is_file_url(path)


def refuse_url(path: object, what: str = "path", advice: str = "") -> None:
    """Refuse ``path`` if it is a URL, where only a local path can be used.

    Raises:
        CheckpointFormatError: naming ``path``, its scheme and ``advice``; nothing was
            read or written (and no local folder named after the scheme was made).
    """
    if not is_url(path):
        return
    advice = advice or (
        "Pass a local path here. (save_training_state, restore_training_state, CheckpointManager, "
        "StableCheckpoint and keras-stable-state ls, inspect, verify and diff take object-store URLs "
        "of .h5 and .keras objects and of checkpoint directories.)"
    )
    raise CheckpointFormatError(
        f"The {what} {path!r} is a URL ({scheme_of(path)}://), not a local path, and this step "
        f"reads and writes local files only; it was not used as one (no local folder named after "
        f"the scheme was made). {advice}",
        expected="a local path",
        received=path,
    )
