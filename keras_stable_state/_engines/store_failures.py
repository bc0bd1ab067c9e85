"""An object store's failures in our words: `store_failure` turns an exception of the store
or of the library that reaches it (fsspec, s3fs, botocore, gcsfs, adlfs...) into a
[`StorageError`][keras_stable_state.StorageError] naming the URL and the operation, and
`talking_to` does so for every failure inside a block."""

from __future__ import annotations

import contextlib
from typing import Any

from keras_stable_state.errors import StateError, StorageError, StoragePermissionError

__all__ = ["store_failure", "talking_to"]


def _scheme(url: str) -> str:
    """The scheme of ``url`` (the last of a chain such as ``simplecache::s3://``), or ``""``."""
    head = url.split("://", 1)[0] if "://" in url else ""
    return head.rsplit("::", 1)[-1].lower()


# The libraries an object store is reached through: their exceptions are the store's failures.
_STORE_LIBRARIES = frozenset(
    {"fsspec", "s3fs", "botocore", "aiobotocore", "aiohttp", "urllib3", "gcsfs", "google", "adlfs", "azure"}
)
# The exceptions of those libraries that mean "no credentials, or refused ones".
_NO_CREDENTIALS = frozenset(
    {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "NoAuthTokenError",
     "UnauthorizedSSOTokenError", "DefaultCredentialsError", "RefreshError", "ClientAuthenticationError"}
)  # fmt: skip
_CREDENTIALS = {
    "s3": "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), AWS_PROFILE, "
    "~/.aws/credentials, or storage_options={'key': ..., 'secret': ...}",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`, or "
    "storage_options={'token': ...}",
    "az": "AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_ACCOUNT_KEY (or a SAS token), or "
    "storage_options={'account_name': ..., 'account_key': ...}",
}
_CREDENTIALS.update(s3a=_CREDENTIALS["s3"], gcs=_CREDENTIALS["gs"], abfs=_CREDENTIALS["az"])
_CREDENTIALS.update(abfss=_CREDENTIALS["az"])


def _is_store_failure(err: BaseException) -> bool:
    if isinstance(err, StateError):
        return False  # ours, already in our words
    if isinstance(err, OSError | TimeoutError):  # s3fs's translations, connections, timeouts
        return True
    import asyncio

    if isinstance(err, asyncio.TimeoutError):  # not an OSError before Python 3.11
        return True
    return any(
        (getattr(kind, "__module__", "") or "").split(".")[0] in _STORE_LIBRARIES
        for kind in type(err).__mro__[:-2]
    )


def _reason(err: BaseException) -> str:
    text = str(err).strip()
    if isinstance(err, OSError) and err.strerror:
        text = str(err.strerror)
    text = " ".join(text.split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _refused_credentials(err: BaseException) -> bool:
    if isinstance(err, PermissionError):
        return True
    return any(kind.__name__ in _NO_CREDENTIALS for kind in type(err).__mro__)


def store_failure(err: BaseException, url: str, operation: str, advice: str = "") -> StorageError | None:
    """``err`` (an exception of the store or of its library) as our
    [`StorageError`][keras_stable_state.StorageError] naming ``url`` and ``operation``
    (a [`StoragePermissionError`][keras_stable_state.StoragePermissionError] for refused or
    missing credentials, naming what to check), or ``None`` if ``err`` is not a failure of
    the store (one of ours, or a bug). ``advice``: what to do, in the caller's words
    (default: check the store, then try again). Raise it ``from err``.
    """
    if not _is_store_failure(err):
        return None
    if _refused_credentials(err):
        scheme = _scheme(url)
        where = _CREDENTIALS.get(scheme, "the credentials of the fsspec filesystem (storage_options)")
        return StoragePermissionError(
            f"The store refused the credentials to {operation} {url!r}, or found none ({_reason(err)}). "
            f"Check the credentials this process passes to {scheme or 'the'}:// store: {where}; that they "
            "are current, and that they allow this operation on this bucket and prefix. "
            + (advice or "Nothing was changed by this call; run it again once the credentials are right."),
            url=url,
            operation=operation,
        )
    return StorageError(
        f"Could not {operation} {url!r}: the store failed ({_reason(err)}). "
        + (
            advice
            or "Check that the store is reachable (its endpoint, the network) and answering, then run it again."
        ),
        url=url,
        operation=operation,
    )


@contextlib.contextmanager
def talking_to(url: str, operation: str, advice: str = "", keep: tuple[type[BaseException], ...] = ()) -> Any:
    """Raise every failure of the store inside the block as `store_failure` (from it); the
    exceptions of ``keep`` (``FileNotFoundError``...) and every other one as raised."""
    try:
        yield
    except keep:
        raise
    except Exception as err:
        failure = store_failure(err, url, operation, advice)
        if failure is None:
            raise
        raise failure from err
