"""The ``keras-stable-state`` command: ``argparse``, the commands and their exit codes.

Importing this module imports ``argparse`` and :mod:`keras_stable_state.errors`
only; a command imports what it needs when it runs (:mod:`~keras_stable_state.cli.data`:
NumPy, h5py, xxhash; :mod:`~keras_stable_state.cli.render`; ``rich`` on a terminal),
so ``--help`` returns before NumPy loads. No command imports Keras or a backend.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from keras_stable_state.errors import NewerFormatError, StateError

__all__ = [
    "EXIT_DAMAGED",
    "EXIT_ERROR",
    "EXIT_NEWER",
    "EXIT_OK",
    "PROG",
    "backend_failure",
    "build_parser",
    "main",
]

EXIT_OK = 0
EXIT_DAMAGED = 1
EXIT_ERROR = 2
EXIT_NEWER = 3

PROG = "keras-stable-state"
_BACKENDS = ("jax", "tensorflow", "torch")
_BACKEND_MODULES = {"keras", "jaxlib", *_BACKENDS}


def _safe(text) -> str:
    from keras_stable_state.cli.output import safe

    return safe(text)


def _cmd_inspect(args) -> int:
    from keras_stable_state.cli import data, output, render

    result = data.inspect_file(args.file)
    if args.json:
        output.print_json(result.to_json())
    else:
        render.render_inspection(result)
    return EXIT_OK


def _cmd_verify(args) -> int:
    from keras_stable_state.cli import data, output, render
    from keras_stable_state.errors import CheckpointFormatError, CorruptCheckpointError

    try:
        f = data.open_checkpoint(args.file)
    except NewerFormatError:
        raise  # not damaged: main() exits with EXIT_NEWER
    except (CorruptCheckpointError, CheckpointFormatError) as err:
        result = data.refused(args.file, err)
    else:
        with f, output.progress(data.bytes_to_verify(f), f"verifying {os.path.basename(f.path)}") as advance:
            result = data.verify_file(f, advance)
    if args.json:
        output.print_json(result.to_json())
    else:
        render.render_verification(result)
    if result.error is not None:
        print(f"{PROG} verify: DAMAGED: {_safe(result.error)}", file=sys.stderr)
    return EXIT_OK if result.ok else EXIT_DAMAGED


def _cmd_diff(args) -> int:
    from keras_stable_state.cli import data, diff, output, render

    files = []
    try:
        for path in (args.file_a, args.file_b):
            files.append(data.open_checkpoint(path))
        fa, fb = files
        with output.progress(fa.total_bytes + fb.total_bytes, "comparing") as advance:
            result = diff.diff_files(fa, fb, advance)
    finally:
        for f in files:
            f.close()
    if args.json:
        output.print_json(result.to_json())
    else:
        render.render_diff(result, show_all=args.all)
    return EXIT_ERROR if result.damaged else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The ``argparse`` parser of the ``keras-stable-state`` command."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Inspect, verify and compare training-state files written by keras_stable_state "
            "(.keras, .h5) and stock Keras .keras / .weights.h5 files."
        ),
        epilog=(
            "Exit codes: 0 done (verify: intact); 1 verify found damage; 2 usage error, missing "
            "file, or a file inspect/diff cannot read; 3 a file written by a newer "
            "keras_stable_state (not damaged: upgrade to read it)."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = sub.add_parser(
        "inspect",
        help="show what a file holds: writer, keys, shapes, slots, contract, other state",
        description="Show what a file holds without reading its array data.",
    )
    p.add_argument("file", metavar="FILE", help=".keras or .h5 file")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=_cmd_inspect)
    p = sub.add_parser(
        "verify",
        help="read every array and check its checksum; exit 1 naming damaged keys",
        description="Read every array and check its checksum (stock Keras files: that it can be read).",
    )
    p.add_argument("file", metavar="FILE", help=".keras or .h5 file")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=_cmd_verify)
    p = sub.add_parser(
        "diff",
        help="compare two files: keys, shapes, dtypes, contract, largest difference per key",
        description="Compare two files key by key; values are compared in float64.",
    )
    p.add_argument("file_a", metavar="FILE_A", help=".keras or .h5 file")
    p.add_argument("file_b", metavar="FILE_B", help=".keras or .h5 file")
    p.add_argument("--all", action="store_true", help="list identical arrays too (text output)")
    p.add_argument("--json", action="store_true", help="print one JSON document (always every key)")
    p.set_defaults(run=_cmd_diff)
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


def main(argv=None) -> int:
    """Run the command line.

    Args:
        argv: Arguments without the program name; default ``sys.argv[1:]``.

    Returns:
        The exit code: :data:`EXIT_OK` (0) when done (``verify``: every array is intact);
        :data:`EXIT_DAMAGED` (1) when ``verify`` found damage (an array fails its checksum
        or cannot be read, an archive member fails its zip CRC, the file is truncated);
        :data:`EXIT_ERROR` (2) for a usage error, a missing file, a file ``inspect`` or
        ``diff`` cannot read, ``diff`` meeting an array it cannot read, or Keras failing to
        load its backend; :data:`EXIT_NEWER` (3) for a file written by a newer
        keras_stable_state (:class:`~keras_stable_state.NewerFormatError`: not damaged,
        upgrade to read it). Errors are printed on stderr as one line, never as a traceback.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else EXIT_ERROR
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader went away (`| head`); say nothing more.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except NewerFormatError as err:
        print(f"{PROG} {args.command}: newer format: {_safe(err)}", file=sys.stderr)
        return EXIT_NEWER
    except (StateError, OSError) as err:
        print(f"{PROG} {args.command}: error: {_safe(err)}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as err:  # noqa: BLE001 (the command line never prints a traceback)
        message = backend_failure(err)
        if message is not None:
            print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
            return EXIT_ERROR
        print(
            f"{PROG} {args.command}: internal error: {type(err).__name__}: {_safe(err)}. Please report it "
            "with the file that caused it.",
            file=sys.stderr,
        )
        return EXIT_ERROR
