"""How the reader refuses a damaged file, and the probe process that names the damage.

`damaged` builds the [`CorruptCheckpointError`][keras_stable_state.CorruptCheckpointError]
every check raises. A file without a seal (stock Keras files, format-1 records)
is first read in a separate process (`keras_stable_state.format.sandbox`,
run as a script), so whatever HDF5 does with it (a crash, a hang) cannot kill
the caller; a file that fails its seal is probed briefly to name the arrays
whose own checksum fails. See ``docs/concepts/security.md``.

This module imports no Keras.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from keras_stable_state.errors import CorruptCheckpointError, NewerFormatError, listed
from keras_stable_state.format import files, sandbox

PROBE_TIMEOUT = 60.0
# A file that already failed its seal is probed only to name its damaged keys: never wait long.
DIAGNOSE_TIMEOUT = 5.0
_RESTORE_HINT = "restore from an earlier checkpoint"


def damaged(where: str, what: str, key=None, **kw) -> CorruptCheckpointError:
    """The error for damage ``what`` found in ``where`` (a path, or ``"<path>:<member>"``);
    ``key`` and the keyword arguments become its attributes."""
    return CorruptCheckpointError(f"{where}: {what}. The file is damaged; {_RESTORE_HINT}.", key=key, **kw)


def newer_format(where: str, version: int, unknown=()) -> NewerFormatError:
    """The refusal of a file written by a newer keras_stable_state: format ``version``
    (above the newest this version reads), or format ``version`` with the records,
    attributes or fields ``unknown`` this version does not know."""
    from keras_stable_state.format.record import READ_VERSIONS

    what = f"format {version}" + (f", with {listed(unknown)} this version does not know" if unknown else "")
    return NewerFormatError(
        f"{where}: written by a newer keras_stable_state ({what}); upgrade to read it (this version "
        f"reads formats {READ_VERSIONS[0]}-{READ_VERSIONS[-1]}). The file is not damaged and is left as it is.",
        path=where,
        version=version,
        unknown=list(unknown)[:5],
    )


def probe(path: str, member: str | None = None, timeout: float = PROBE_TIMEOUT, expect=None) -> dict:
    """Read an HDF5 file (or archive member) in a separate process.

    Args:
        path: The file (or the archive holding ``member``); a ``/dev/fd/<n>`` path
            (`inherited_path`) is passed on with its
            descriptor.
        member: An archive member to read instead of the file itself, or ``None``.
        timeout: Seconds the process may run.
        expect: Optional ``[[key, dtype, shape, dataset path, xxh3-64 hex]]`` rows whose
            datasets the probe also checks (`keras_stable_state.format.sandbox.check_expected`).

    Returns:
        The probe's findings (see `keras_stable_state.format.sandbox.probe`),
        or ``{"crashed": reason}`` when the process died, hung or raised.
    """
    with tempfile.TemporaryDirectory(prefix="kss-probe-") as folder:
        rows = ""
        if expect:
            rows = os.path.join(folder, "expect.json")
            with open(rows, "w") as fh:
                json.dump(expect, fh)
        cmd = [sys.executable, "-I", sandbox.__file__, path, member or "", rows]
        return _run(cmd, timeout, files.inherited_fds(path))


def _run(cmd: list, timeout: float, fds: tuple = ()) -> dict:
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False, pass_fds=fds)
    except subprocess.TimeoutExpired:
        return {"crashed": f"reading it did not finish within {timeout:.0f} s"}
    if done.returncode < 0:
        return {"crashed": f"reading it killed a probe process (signal {-done.returncode})"}
    if done.returncode != 0:
        last = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        return {"crashed": f"HDF5 cannot read it ({last[0][:300]})"}
    try:
        return json.loads(done.stdout)
    except ValueError:
        return {"crashed": "the probe process printed no result"}


def probe_or_refuse(where: str, path: str, member: str | None = None) -> None:
    """Refuse a file that crashes, hangs or fails a structure check in a probe process.

    Raises:
        CorruptCheckpointError: naming ``where`` and what the probe found.
    """
    result = probe(path, member)
    if "crashed" in result:
        raise damaged(where, f"{result['crashed']}; its HDF5 structure is broken")
    if result.get("structure"):
        raise damaged(where, f"HDF5 object {result['structure']}")


def diagnose(
    where: str, path: str, member: str | None, what: str, default_key=None, expect=None
) -> CorruptCheckpointError:
    """The refusal for a file that fails its seal (``what``), naming the damaged keys a
    probe of ``path`` (or its ``member``) finds; ``default_key`` when it finds none."""
    result = probe(path, member, timeout=DIAGNOSE_TIMEOUT, expect=expect)
    found = result.get("damaged", [])
    keys = [key for key, _ in found]
    if keys:
        named = listed(keys)[1:-1]
        # the probe's reason: "fails its xxh3-64 checksum" (format 3) or "fails its CRC-32 checksum" (formats 1-2)
        verb = found[0][1] if len(keys) == 1 else found[0][1].replace("fails its", "fail their") + "s"
        return damaged(where, f"{what}: {named} {verb}", key=keys[0])
    if "crashed" in result:
        return damaged(where, f"{what}; {result['crashed']}", key=default_key)
    return damaged(where, f"{what} (its metadata, a record or the layout was changed)", key=default_key)
