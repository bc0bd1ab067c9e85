"""What every layout opened for reading derives from its list of arrays (``entries``): its
sections, its bytes, the name of its checksum, and the context manager that closes it
(`keras_stable_state.format.reader.CheckpointFile`,
`keras_stable_state.format.orbax_file.OrbaxFile`; see `keras_stable_state.format.layout`).

This module imports no Keras.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from keras_stable_state.format.record import Entry

__all__ = ["Opened"]

_Self = TypeVar("_Self", bound="Opened")


class Opened:
    """The base of a layout opened for reading: what follows from ``entries``; a subclass
    lists them and defines ``close``."""

    entries: list[Entry]

    def section(self, name: str) -> list[Entry]:
        """The entries of one section (``"model"``, ``"optimizer"``, ``"state"``), in file order."""
        return [e for e in self.entries if e.section == name]

    @property
    def total_bytes(self) -> int:
        """Bytes of array data."""
        return sum(e.nbytes for e in self.entries)

    @property
    def checksum(self) -> str | None:
        """The name of the checksum its arrays carry (``"xxh3-64"``...), ``None`` if none."""
        return (self.entries[0].checksum or None) if self.entries else None

    def close(self) -> None:
        """Close what is open; closing twice is harmless."""
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False
