"""The key grammar: how variables and optimizer variables are named in a file.

This module imports no Keras: the command line and the file checks read keys
without a backend. Every module that makes, splits or parses a key uses it.

Variable keys ([`VariableKey`][keras_stable_state.VariableKey]):

* ``path:<stable path>``: a *named* key (``path:layers/dense/kernel``);
* ``order:<i>``: an *ordered* key, a registration index;
* ``var:<name>``: a variable outside the model that the caller named
  (``save_training_state(..., variables={"log_alpha": v})``).

Optimizer entry keys:

* ``<variable key>#<slot>``: a slot of one model variable
  (``path:layers/dense/kernel#momentums``);
* ``optimizer#<name>``: a variable of the optimizer itself (``optimizer#iteration``);
* the slot part of an optimizer other than ``model.optimizer`` starts with
  ``@<name>/`` (``path:generator/dense/kernel#@g_optimizer/momentums``), and
  wrapped optimizers add their place in the wrapper
  (``#inner_optimizer/momentums``, ``#optimizers/1/velocities``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from keras_stable_state.errors import BindingError, KeyFormatError, MalformedKeyError

__all__ = [
    "EXTRA",
    "GLOBAL",
    "MAIN",
    "NAMED",
    "ORDERED",
    "ParsedKeys",
    "VariableKey",
    "check_name",
    "decode_key_list",
    "encode_key_list",
    "entry_prefix",
    "file_label",
    "global_key",
    "malformed_key",
    "parse_entry_key",
    "parse_model_key",
    "parse_optimizer_key",
    "slot_key",
    "split_entry_key",
    "split_entry_name",
]

NAMED = "path"
ORDERED = "order"
EXTRA = "var"
GLOBAL = "optimizer"  # the owner part of an optimizer's own variables: "optimizer#iteration"
MAIN = "optimizer"  # the name of `model.optimizer` among several optimizers
_KEY_RE = re.compile(r"^(path):(.+)$|^(order):(0|[1-9][0-9]*)$|^(var):([^/#\s]+)$")


@dataclasses.dataclass(frozen=True, order=True)
class VariableKey:
    """A durable key for one variable.

    Attributes:
        kind: ``"path"`` (named, from a stable path), ``"order"`` (registration
            index) or ``"var"`` (a variable outside the model that the caller
            named, ``save_training_state(..., variables={"log_alpha": v})``).
        value: The stable path, the decimal registration index, or the caller's name.

    Examples:
        >>> key = VariableKey.parse("path:layers/dense/kernel")
        >>> key.named, str(key)
        (True, 'path:layers/dense/kernel')
        >>> VariableKey.parse("order:3").index
        3
    """

    kind: str
    value: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}"

    @property
    def named(self) -> bool:
        """``True`` for keys bound by name (``path:`` and ``var:``), ``False`` for ``order:``."""
        return self.kind in (NAMED, EXTRA)

    @property
    def index(self) -> int:
        """Registration index of an ordered key.

        Raises:
            KeyFormatError: if the key is named.
        """
        if self.kind != ORDERED:
            raise KeyFormatError(f"Key {self} is named; it has no registration index.", key=str(self))
        return int(self.value)

    @classmethod
    def parse(cls, text: str) -> VariableKey:
        """Parse ``"path:<path>"``, ``"order:<int>"`` or ``"var:<name>"``.

        Raises:
            KeyFormatError: if ``text`` is none of these forms (the file was
                written by something else, or damaged).
        """
        return cls._parse(text)

    @classmethod
    def _parse(cls, text: str) -> VariableKey:
        match = _KEY_RE.match(text) if isinstance(text, str) else None
        if match is None or (match.group(2) is not None and _bad_path(match.group(2))):
            raise KeyFormatError(
                f"Malformed variable key {text!r} in the file: expected 'path:<stable path>', "
                "'order:<non-negative integer>' or 'var:<name>'. The file was not written by "
                "keras_stable_state or is damaged; run `keras-stable-state verify FILE`.",
                key=text,
                expected="path:<path> | order:<int>",
                received=text,
            )
        if match.group(1):
            return cls(NAMED, match.group(2))
        if match.group(5):
            return cls(EXTRA, match.group(6))
        return cls(ORDERED, match.group(4))


class ParsedKeys:
    """The variable keys one save or restore has parsed, by their text: each text is parsed
    once (a restore meets every key of a file when it is read, when its contract is read and
    when it is bound; about 1.2 us each) and gives the same (immutable) key again. A text
    that is refused is not kept (it is refused again). Made per call (`ModelIndex` holds
    one), never shared between calls.

    Args:
        known: The dict to keep them in (used as it is, not copied: a file's reader keeps
            the keys it checked in its record's ``parsed_keys``); default a new one.

    Attributes:
        known: ``{text: VariableKey}`` of every text parsed (or added by `update`).
    """

    def __init__(self, known: dict[str, VariableKey] | None = None) -> None:
        self.known: dict[str, VariableKey] = {} if known is None else known

    def update(self, known: dict[str, VariableKey]) -> None:
        """Keep ``known`` (``{text: VariableKey}`` parsed elsewhere, e.g. as a file was read)."""
        self.known.update(known)

    def parse(self, text: str) -> VariableKey:
        """[`VariableKey.parse`][keras_stable_state.VariableKey.parse], once per text."""
        known = self.known.get(text) if isinstance(text, str) else None
        if known is None:
            known = VariableKey.parse(text)
            self.known[text] = known
        return known

    def model_key(self, key: str, where: str) -> VariableKey:
        """`parse_model_key`, once per text."""
        return parse_model_key(key, where, self)

    def optimizer_key(self, key: str, where: str) -> tuple[VariableKey | None, str]:
        """`parse_optimizer_key`, its variable part parsed once per text."""
        return parse_optimizer_key(key, where, self)


def _bad_path(path: str) -> bool:
    return path.startswith("/") or path.endswith("/") or "//" in path or any(c in path for c in "\n\r\t")


# -- optimizer entry keys ------------------------------------------------------------------
def slot_key(owner: VariableKey | str, slot: str) -> str:
    """``"<variable key>#<slot>"``: the key of a slot of the variable keyed ``owner``."""
    return f"{owner}#{slot}"


def global_key(name: str) -> str:
    """``"optimizer#<name>"``: the key of a variable of the optimizer itself."""
    return f"{GLOBAL}#{name}"


def split_entry_key(text: str) -> tuple[str | None, str]:
    """``(owner, slot)`` of an entry key as text: ``owner`` is the part before the last
    ``#`` (a variable key, or ``"optimizer"``), ``None`` when there is no ``#``."""
    owner, sep, slot = text.rpartition("#")
    return (owner if sep else None), slot


def parse_entry_key(text: str, parsed: ParsedKeys | None = None) -> tuple[VariableKey | None, str]:
    """Split an optimizer entry key into ``(VariableKey | None, slot name)`` (the variable
    part parsed through ``parsed`` when given).

    Raises:
        KeyFormatError: if the variable part of a slot key is malformed.
        BindingError: if the key has no ``#`` separator.
    """
    owner, sep, slot = text.rpartition("#")
    if not sep or not slot:
        raise BindingError(
            f"Malformed optimizer entry key {text!r}: expected '<variable key>#<slot>' or "
            "'optimizer#<name>'. The file is damaged or was not written by keras_stable_state.",
            key=text,
        )
    if owner == GLOBAL:
        return None, slot
    return (VariableKey.parse(owner) if parsed is None else parsed.parse(owner)), slot


def check_name(name: object, what: str = "optimizer name") -> None:
    """Refuse a name that cannot be part of a key (``/``, ``#``, ``@``, whitespace)."""
    if not isinstance(name, str) or not name or any(c in name for c in "/#@ \n\r\t"):
        raise ValueError(
            f"An {what} must be a non-empty string without '/', '#', '@' or whitespace: it becomes part "
            f"of the keys in the file. Received: {name!r}"
        )


def entry_prefix(name: str | None) -> str:
    """The slot-part prefix of entry keys of the optimizer named ``name``: ``""`` for
    ``"optimizer"`` (``model.optimizer``), else ``"@<name>/"``
    (``"path:generator/dense/kernel#@g_optimizer/momentums"``)."""
    return "" if name in (None, MAIN) else f"@{name}/"


def split_entry_name(slot: str) -> tuple[str, str]:
    """``(optimizer name, slot part without the prefix)`` of an entry key's slot part."""
    if slot.startswith("@") and "/" in slot:
        name, _, rest = slot[1:].partition("/")
        return name, rest
    return MAIN, slot


# -- codecs ------------------------------------------------------------------------------
def encode_key_list(keys: Iterable[str]) -> np.ndarray:
    """A list of keys as UTF-8 JSON bytes in a ``uint8`` array (the ``"keys"`` dataset)."""
    encoded: np.ndarray = np.frombuffer(json.dumps(list(keys)).encode(), dtype=np.uint8).copy()
    return encoded


def decode_key_list(array: Any) -> list[str]:
    """The inverse of `encode_key_list`."""
    decoded: list[str] = json.loads(np.asarray(array, dtype=np.uint8).tobytes().decode())
    return decoded


# -- keys read from a file ------------------------------------------------------------------
def file_label(filepath: str | os.PathLike[str] | None) -> str:
    """``filepath`` as messages name it (``"the file"`` when unknown)."""
    return repr(os.fsdecode(filepath)) if filepath is not None else "the file"


def malformed_key(where: str, section: str, key: str | None, err: BaseException) -> MalformedKeyError:
    """The [`MalformedKeyError`][keras_stable_state.MalformedKeyError] for ``key`` of ``section`` in the file ``where``."""
    reason = str(err).split(". ")[0]
    return MalformedKeyError(
        f"{where}: {section} key {key!r} is malformed ({reason}). Keys are 'path:<stable path>', "
        "'order:<index>' and, for optimizer variables, '<variable key>#<slot>' or "
        "'optimizer#<name>'. The file is damaged or was not written by keras_stable_state; it says "
        "nothing about your model, so do not pass strict=False for it: restore an earlier checkpoint "
        "(`keras-stable-state verify FILE` checks one).",
        key=key,
        expected="path:<path> | order:<int> [#<slot>]",
        received=key,
    )


def parse_model_key(key: str, where: str, parsed: ParsedKeys | None = None) -> VariableKey:
    """[`VariableKey.parse`][keras_stable_state.VariableKey.parse] (through ``parsed`` when
    given), a failure raised as [`MalformedKeyError`][keras_stable_state.MalformedKeyError]."""
    try:
        return VariableKey.parse(key) if parsed is None else parsed.parse(key)
    except KeyFormatError as err:
        raise malformed_key(where, "model variable", key, err) from err


def parse_optimizer_key(
    key: str, where: str, parsed: ParsedKeys | None = None
) -> tuple[VariableKey | None, str]:
    """`parse_entry_key` (through ``parsed`` when given), a failure raised as
    [`MalformedKeyError`][keras_stable_state.MalformedKeyError]."""
    try:
        return parse_entry_key(key if isinstance(key, str) else str(key), parsed)
    except (KeyFormatError, BindingError) as err:
        raise malformed_key(where, "optimizer variable", key, err) from err
