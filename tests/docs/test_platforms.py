"""The platforms the package claims are the ones its pages name, in the same words.

The wheel's classifiers claim what CI tests (Linux); every page of the README and the docs
that speaks of another platform says which directory lock it uses and that it is not
tested, in one sentence written the same way everywhere.
"""

import re
from pathlib import Path

import kit

ROOT = Path(kit.ROOT)
SENTENCE = (
    "Platforms: on Linux and macOS (POSIX) the directory lock is an exclusive `flock` and a marker "
    "file `.stable-checkpoint.lock.owner` created exclusively (through `filelock`); where there is "
    "no `fcntl` (Windows) it is the portable lock, that marker file alone, and "
    "`KSS_DIRECTORY_LOCK=portable` chooses that one on any platform (for file systems where `flock` "
    "fails, such as some network file systems; where `flock` works it is taken too, so writers of "
    "the two locks on one directory exclude each other). CI tests on Linux only, with both locks; "
    "Windows and macOS are not tested in CI. The package metadata claims Linux only (`Operating "
    "System :: POSIX :: Linux`)."
)


def _classifiers():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^classifiers = \[(.*?)^\]", text, re.S | re.M).group(1)
    return re.findall(r'^\s*"([^"]+)"', block, re.M)


def test_the_classifiers_claim_the_tested_platform_only():
    systems = [c for c in _classifiers() if c.startswith("Operating System")]
    assert systems == ["Operating System :: POSIX :: Linux"]
    assert "`Operating System :: POSIX :: Linux`" in SENTENCE


def test_every_page_that_names_another_platform_says_the_same_sentence():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    naming = [p for p in pages if re.search(r"\b(Windows|macOS)\b", p.read_text(encoding="utf-8"))]
    assert ROOT / "README.md" in naming  # the README states the platforms
    for page in naming:
        flat = " ".join(page.read_text(encoding="utf-8").split())
        assert SENTENCE in flat, f"{page.relative_to(ROOT)} names a platform without the platform sentence"
