"""The ``keras-stable-state`` command: ``argparse``, the commands and their exit codes.

Importing this module imports ``argparse`` and `keras_stable_state.errors`
only; a command imports what it needs when it runs (`data`:
NumPy, h5py, xxhash; `render`; ``rich`` on a terminal),
so ``--help`` returns before NumPy loads. No command imports Keras or a backend.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from keras_stable_state.errors import NewerFormatError, StateError

if TYPE_CHECKING:
    from typing import Protocol

    class _Result(Protocol):
        def to_json(self) -> dict[str, Any]: ...


__all__ = [
    "EXIT_CODES",
    "EXIT_DAMAGED",
    "EXIT_DIFFERENT",
    "EXIT_ERROR",
    "EXIT_NEWER",
    "EXIT_OK",
    "PROG",
    "Refusal",
    "backend_failure",
    "build_parser",
    "error_kind",
    "main",
    "refusing",
]

EXIT_OK = 0
EXIT_DAMAGED = 1
EXIT_DIFFERENT = 1
EXIT_ERROR = 2
EXIT_NEWER = 3

PROG = "keras-stable-state"
_BACKENDS = ("jax", "tensorflow", "torch")
_BACKEND_MODULES = {"keras", "jaxlib", *_BACKENDS}

EXIT_CODES = (
    "Exit codes: 0 done (verify: intact; diff: the states are equal within --atol); "
    "1 verify: the file is damaged (its bytes are wrong: a checksum, hash or seal fails, it is "
    "truncated), diff: the states differ; 2 a usage error, or a path that cannot be used: missing, "
    "not a checkpoint (a folder, a FIFO or device, another kind of file), permission denied, in use "
    "by another process, a missing extra, and (inspect, diff, ls) a damaged file; 3 a file written "
    "by a newer keras_stable_state (not damaged: upgrade to read it). Every refusal is one line on "
    'stderr, or with --json one {"error": {"kind", "file", "message"}} document on stdout '
    "and nothing else."
)


class Refusal(Exception):
    """A command could not use ``file``: ``error`` says why (raised by `refusing`)."""

    def __init__(self, file: str | None, error: BaseException) -> None:
        super().__init__(str(error))
        self.file, self.error = file, error


@contextlib.contextmanager
def refusing(file: object) -> Iterator[None]:
    """Turn the errors of reading ``file`` into a `Refusal` naming it."""
    try:
        yield
    except (StateError, OSError) as err:
        raise Refusal(
            os.fsdecode(os.fspath(file)) if isinstance(file, str | os.PathLike) else str(file), err
        ) from err


def error_kind(err: BaseException) -> str:
    """What a refusal is, for ``--json``: ``"newer_format"``, ``"damaged"``, ``"in_use"``,
    ``"missing_extra"``, ``"not_found"``, ``"unreadable"`` (the path is not a checkpoint
    file, or cannot be read), ``"backend"`` or ``"internal"``."""
    from keras_stable_state.errors import CheckpointInUseError, CorruptCheckpointError, StorageBackendError

    if isinstance(err, NewerFormatError):
        return "newer_format"
    if isinstance(err, CorruptCheckpointError):
        return "damaged"
    if isinstance(err, CheckpointInUseError):
        return "in_use"
    if isinstance(err, StorageBackendError) or "keras-stable-state[" in str(err):
        return "missing_extra"
    if isinstance(err, FileNotFoundError):
        return "not_found"
    if isinstance(err, StateError | OSError):
        return "unreadable"
    return "backend" if backend_failure(err) is not None else "internal"


def _safe(text: object) -> str:
    from keras_stable_state.cli.output import safe

    return safe(text)


def _print(args: argparse.Namespace, result: _Result, render: Callable[[Any], object]) -> None:
    from keras_stable_state.cli import output

    if args.json:
        output.print_json(result.to_json())
    else:
        render(result)


def _is_listing(path: object) -> bool:
    """Whether ``path`` is a checkpoint directory: a local folder (not ``.orbax``), or an
    object-store URL under which objects are but none at the URL itself."""
    from keras_stable_state._engines.object_store import RemotePath
    from keras_stable_state.format import orbax_layout, urls

    if not isinstance(path, str):
        return False
    if urls.is_remote(path):
        if path.rstrip("/").endswith((".h5", ".keras", ".orbax")):
            return False
        with refusing(path):
            folder = RemotePath(path)
            return not folder.is_object() and folder.exists()
    path = urls.resolve(path, "path") if urls.is_url(path) else path
    return os.path.isdir(path) and not orbax_layout.is_orbax_path(path)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from keras_stable_state.cli import data, render

    if _is_listing(args.file):  # `inspect DIR` is `ls DIR`
        args.verify, args.monitor, args.mode = False, None, None
        return _cmd_ls(args)
    with refusing(args.file):
        result = data.inspect_file(args.file)
    _print(args, result, render.render_inspection)
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from keras_stable_state.cli import data, output, render

    with refusing(args.file):
        f = data.open_checkpoint_or_damage(args.file)
        if isinstance(f, data.Verification):
            result = f
        else:
            with (
                f,
                output.progress(data.bytes_to_verify(f), f"verifying {os.path.basename(f.path)}") as advance,
            ):
                result = data.verify_file(f, advance)
    if result.error is not None and not args.json:
        # refused as a whole on opening (truncated, failing its seal): one line, on stderr
        print(f"{PROG} verify: DAMAGED: {_safe(result.error)}", file=sys.stderr)
    else:
        _print(args, result, render.render_verification)
    return EXIT_OK if result.ok else EXIT_DAMAGED


def _cmd_diff(args: argparse.Namespace) -> int:
    from keras_stable_state.cli import data, diff, output, render

    files = []
    try:
        for path in (args.file_a, args.file_b):
            with refusing(path):
                files.append(data.open_checkpoint(path))
        fa, fb = files
        with output.progress(fa.total_bytes + fb.total_bytes, "comparing") as advance:
            result = diff.diff_files(fa, fb, advance)
    finally:
        for f in files:
            f.close()
    if result.damaged:
        first = result.damaged[0]
        raise Refusal(first.file, data.damaged_array(first))
    _print(args, result, lambda r: render.render_diff(r, show_all=args.all, atol=args.atol))
    return EXIT_DIFFERENT if result.differs(args.atol) else EXIT_OK


def _cmd_ls(args: argparse.Namespace) -> int:
    from keras_stable_state.cli import listing, render

    with refusing(args.file):
        result = listing.list_directory(args.file, verify=args.verify, monitor=args.monitor, mode=args.mode)
    _print(args, result, render.render_listing)
    return EXIT_OK


def _atol(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (received {text!r})")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``argparse`` parser of the ``keras-stable-state`` command."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Inspect, verify and compare training-state files written by keras_stable_state "
            "(.keras, .h5, .orbax folders) and stock Keras .keras / .weights.h5 files; list "
            "checkpoint directories."
        ),
        epilog=EXIT_CODES,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    what = ".keras or .h5 file, or .orbax folder"
    p = sub.add_parser(
        "inspect",
        help="show what a file holds: writer, keys, shapes, slots, contract, other state (a directory: ls)",
        description="Show what a file holds without reading its array data; a checkpoint directory is listed as by ls.",
        epilog=EXIT_CODES,
    )
    p.add_argument("file", metavar="FILE", help=f"{what}, or a checkpoint directory")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=_cmd_inspect)
    p = sub.add_parser(
        "verify",
        help="read every array and check its checksum; exit 1 naming damaged keys",
        description=(
            "Read every array and check its checksum (.orbax: its hash in the sealed index; stock Keras "
            "files: that it can be read). Exit 1 if the file is damaged, 2 if it cannot be read or is "
            "not a checkpoint file, 3 if a newer keras_stable_state wrote it."
        ),
        epilog=EXIT_CODES,
    )
    p.add_argument("file", metavar="FILE", help=what)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=_cmd_verify)
    p = sub.add_parser(
        "diff",
        help="compare two files: keys, shapes, dtypes, contract, largest difference per key; exit 1 if they differ",
        description=(
            "Compare two files key by key; values are compared in float64. Exit 0 when the states are "
            "equal (same keys, shapes, dtypes, contract and other state, every |A - B| <= --atol), 1 when "
            "they differ; the writer's metadata (backend, Keras version) is shown but not compared."
        ),
        epilog=EXIT_CODES,
    )
    p.add_argument("file_a", metavar="FILE_A", help=what)
    p.add_argument("file_b", metavar="FILE_B", help=what)
    p.add_argument(
        "--atol",
        type=_atol,
        default=0.0,
        metavar="ATOL",
        help="absolute tolerance: arrays whose largest |A - B| (in float64) is <= ATOL count as equal (default 0: bit-equal values; NaN equals NaN)",
    )
    p.add_argument("--all", action="store_true", help="list identical arrays too (text output)")
    p.add_argument("--json", action="store_true", help="print one JSON document (always every key)")
    p.set_defaults(run=_cmd_diff)
    p = sub.add_parser(
        "ls",
        help="list the checkpoints of a directory: steps, sizes, metrics, status, which one fit resumes, the best",
        description=(
            "List the ckpt-<step>.h5 checkpoints of a StableCheckpoint or CheckpointManager directory, "
            "newest first: step, epoch, size, metrics, status (OK, damaged, unreadable, newer format, in "
            "use, incomplete), which one fit would resume from (the newest that reads whole, the rule "
            "the manager uses; it is read and checked in full) and the best by the monitor the manager "
            "recorded. Nothing is changed."
        ),
        epilog=EXIT_CODES,
    )
    p.add_argument("file", metavar="DIR", help="a checkpoint directory")
    p.add_argument("--verify", action="store_true", help="read and check every array of every checkpoint")
    p.add_argument(
        "--monitor", metavar="NAME", help="the metric that ranks the best (default: the recorded one)"
    )
    p.add_argument(
        "--mode", choices=("auto", "min", "max"), help="whether lower (min) or higher (max) is better"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=_cmd_ls)
    return parser


def backend_failure(err: BaseException) -> str | None:
    """If ``err`` is Keras failing to load its backend, a one-line fix naming ``KERAS_BACKEND``, else ``None``.

    That is an ``ImportError`` raised from inside ``keras``, ``jax``, ``tensorflow`` or
    ``torch`` (or naming one of them as the missing module), or Keras' ``ValueError``
    ``"Unable to import backend"`` for an unknown ``KERAS_BACKEND``.
    """
    if isinstance(err, ValueError):
        if not str(err).startswith("Unable to import backend"):
            return None
    elif isinstance(err, ImportError):
        roots = {(err.name or "").split(".")[0]}
        tb = err.__traceback__
        while tb is not None:
            roots.add(str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0])
            tb = tb.tb_next
        if not roots & _BACKEND_MODULES:
            return None
    else:
        return None
    backend = os.environ.get("KERAS_BACKEND")
    if backend in _BACKENDS:
        fix = (
            f'install it with pip install "keras-stable-state[{backend}]", or set KERAS_BACKEND to '
            "an installed backend (jax, tensorflow, torch)"
        )
    else:
        fix = (
            "set KERAS_BACKEND to jax, tensorflow or torch and install it with "
            'pip install "keras-stable-state[jax]" (or [tensorflow], [torch])'
        )
    named = f"KERAS_BACKEND={backend}" if backend else "KERAS_BACKEND is not set"
    return f"Keras cannot load its backend ({named}): {_safe(err)}. To fix it, {fix}."


def _refused(args: argparse.Namespace, file: str | None, err: BaseException) -> int:
    """Print one refusal once (stderr, or the ``--json`` error object on stdout); its exit code."""
    from keras_stable_state.errors import CorruptCheckpointError

    kind = error_kind(err)
    message = backend_failure(err) if kind == "backend" else None
    if message is None:
        text = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in text:
            text = f"{err.filename}: {text}"
        message = _safe(text)
        if kind == "internal":
            message = f"{type(err).__name__}: {message}. Please report it with the file that caused it."
    if kind == "newer_format":
        code = EXIT_NEWER
    elif isinstance(err, CorruptCheckpointError) and args.command == "verify":
        code = EXIT_DAMAGED
    else:
        code = EXIT_ERROR
    if getattr(args, "json", False):
        import json

        doc = {"error": {"kind": kind, "file": file, "message": message, "exit_code": code}}
        print(json.dumps(doc, indent=2), file=sys.stdout)
        return code
    label = {"newer_format": "newer format", "damaged": "DAMAGED", "internal": "internal error"}.get(
        kind, "error"
    )
    print(f"{PROG} {args.command}: {label}: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: Arguments without the program name; default ``sys.argv[1:]``.

    Returns:
        The exit code: `EXIT_OK` (0) when done (``verify``: every array is intact;
        ``diff``: the states are equal within ``--atol``); `EXIT_DAMAGED` (1) when
        ``verify`` found damage (an array fails its checksum or hash or cannot be read, an
        archive member fails its zip CRC-32, the file is truncated or fails its seal), and
        `EXIT_DIFFERENT` (also 1) when ``diff`` found the states different;
        `EXIT_ERROR` (2) for a usage error or a path that cannot be used: missing,
        not a checkpoint file (a folder, a FIFO or device, a file of another kind),
        unreadable (permissions), in use by another process, an extra that is not
        installed, Keras failing to load its backend, and for ``inspect``, ``diff`` and
        ``ls`` a damaged file; `EXIT_NEWER` (3) for a file written by a newer
        keras_stable_state ([`NewerFormatError`][keras_stable_state.NewerFormatError]: not damaged,
        upgrade to read it). A refusal is printed once: one line on stderr, never a
        traceback, or with ``--json`` the document ``{"error": {"kind", "file",
        "message", "exit_code"}}`` on stdout and nothing else (``kind``: see
        `error_kind`).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else EXIT_ERROR
    try:
        run: Callable[[argparse.Namespace], int] = args.run  # set_defaults(run=_cmd_...)
        return run(args)
    except BrokenPipeError:
        # The reader went away (`| head`); say nothing more.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except Refusal as refusal:
        return _refused(args, refusal.file, refusal.error)
    except Exception as err:  # noqa: BLE001 (the command line never prints a traceback)
        return _refused(args, None, err)
