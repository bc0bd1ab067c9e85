"""The model's class name from a Keras ``config.json`` without holding the document: the
member is streamed through in chunks (so the zip's CRC-32 is still checked at its end) and
scanned for the top-level ``"class_name"`` string, with memory bounded by one chunk whatever
the member's size (a 300 MB config prints its class name as a 3 KB one does)."""

from __future__ import annotations

import codecs
import json
from typing import IO

__all__ = ["CHUNK", "top_level_class_name"]

CHUNK = 1 << 20
"""Bytes read at a time from the member (the scanner's memory bound, with one string)."""
_STRING_LIMIT = 4096  # a class name longer than this is not one: stop keeping its characters


def top_level_class_name(stream: IO[bytes], max_depth: int) -> str | None:
    """The value of the top-level object's ``"class_name"`` key if it is a string, else
    ``None``, reading ``stream`` (UTF-8 JSON) to its end in `CHUNK`-byte pieces.

    Raises:
        ValueError: if the bytes are not UTF-8, a string literal of the key or its value
            is not valid JSON (an escape sequence JSON does not have), or the document is
            nested deeper than ``max_depth`` (as the records' own JSON is refused).
        OSError, zipfile.BadZipFile, zlib.error, EOFError: the stream's own errors (a zip
            member failing its CRC-32 raises at its end).
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    depth = 0
    in_string = escape = False
    text: list[str] = []  # the current string literal at depth 1 (quotes included), bounded
    last_key: str | None = None  # the key just read at depth 1
    expecting_value = False  # after that key's ':'
    found: str | None = None
    while True:
        chunk = stream.read(CHUNK)
        for ch in decoder.decode(chunk, final=not chunk):
            if in_string:
                if depth == 1 and len(text) <= _STRING_LIMIT:
                    text.append(ch)
                if escape:
                    escape = False
                elif ch == "\\":
                    escape = True
                elif ch == '"':
                    in_string = False
                    if depth == 1:
                        value = json.loads("".join(text)) if len(text) <= _STRING_LIMIT else None
                        if expecting_value:
                            if last_key == "class_name" and found is None and isinstance(value, str):
                                found = value
                            expecting_value, last_key = False, None
                        else:
                            last_key = value
                continue
            if ch in " \t\r\n":
                continue
            if ch == '"':
                in_string, text = True, ['"']
                continue
            expecting_value = False
            if ch in "{[":
                depth += 1
                if depth > max_depth:
                    raise ValueError(f"the JSON is nested deeper than {max_depth} levels")
            elif ch in "}]":
                depth -= 1
            elif ch == ":" and depth == 1:
                expecting_value = True
            elif ch == "," and depth == 1:
                last_key = None
        if not chunk:
            return found
