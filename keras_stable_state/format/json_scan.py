"""The model's class name from a Keras ``config.json`` without holding the document: the
member is streamed through in chunks (so the zip's CRC-32 is still checked at its end) and
scanned for the top-level ``"class_name"`` string, with memory bounded by one chunk whatever
the member's size (a 300 MB config prints its class name as a 3 KB one does)."""

from __future__ import annotations

import codecs
import json
import re
import sys
from typing import IO

__all__ = ["CHUNK", "top_level_class_name"]

CHUNK = 1 << 20
"""Bytes read at a time from the member (the scanner's memory bound, with one string)."""
_STRING_LIMIT = 4096  # a class name longer than this is not one: stop keeping its characters

# Below the top-level object only brackets matter: one match passes over a run of other
# characters and whole string literals (a 300 MB vocabulary list in one C-level call
# instead of a Python step per character). Python 3.11's possessive quantifiers keep the
# match from backtracking (about 100 MB/s here against 20 MB/s without them).
if sys.version_info >= (3, 11):
    _NESTED = re.compile(r'(?:[^"{}\[\]]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+', re.DOTALL)
else:  # pragma: no cover - Python 3.10
    _NESTED = re.compile(r'(?:[^"{}\[\]]|"[^"\\]*(?:\\.[^"\\]*)*")*', re.DOTALL)
_IN_STRING = re.compile(r'[^"\\]*')  # the rest of a string literal up to a quote or escape


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
        text_of_chunk = decoder.decode(chunk, final=not chunk)
        i, n = 0, len(text_of_chunk)
        while i < n:
            if depth >= 2:  # below the top-level object: skip to the next bracket or open string
                if in_string:
                    if not escape:
                        i = _IN_STRING.match(text_of_chunk, i).end()
                else:
                    i = _NESTED.match(text_of_chunk, i).end()
                if i >= n:
                    break
            ch = text_of_chunk[i]
            i += 1
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
