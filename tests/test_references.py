"""Every reference in code, tests and docs points at a file (and heading) in the repository.

Docstrings and comments cite the behaviour they implement as ``docs/<page>.md`` or
``docs/<page>.md#<anchor>``; the anchor is the GitHub slug of a heading of that page.
No file may cite a document that is not in the repository.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parent.parent
_REF: Final = re.compile(r"\bdocs/([a-z_]+\.md)(?:#([a-z0-9_-]+))?")
_HEADING: Final = re.compile(r"^#{1,6} +(.+?) *$", re.M)
# Spelled in pieces so that this file does not match itself.
_OUTSIDE: Final = re.compile(
    "|".join(["SPEC" + " §", "SPEC" + r"\.md", "TORCH" + "-NOTES"])
)


def _sources() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in ("funcaccel", "tests", "examples", "benchmarks"):
        files += sorted((ROOT / folder).rglob("*.py"))
    files += sorted((ROOT / "docs").glob("*.md"))
    files += [ROOT / "benchmarks" / "README.md"]
    return [f for f in files if f.is_file()]


def slug(heading: str) -> str:
    """Return GitHub's anchor for a Markdown heading.

    >>> slug("Semantics: resuming from a `LoaderState`")
    'semantics-resuming-from-a-loaderstate'
    """
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {slug(h) for h in _HEADING.findall(text)}


def test_slug_follows_github() -> None:
    assert slug("## 1. DistributedContext".lstrip("# ")) == "1-distributedcontext"
    assert slug("Semantics: option records and `to_kwargs`") == (
        "semantics-option-records-and-to_kwargs"
    )


@pytest.mark.parametrize("source", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_docs_reference_resolves(source: Path) -> None:
    text = source.read_text()
    for page, anchor in _REF.findall(text):
        target = ROOT / "docs" / page
        assert target.is_file(), (
            f"{source.name} cites docs/{page}, which does not exist"
        )
        if anchor:
            assert anchor in _anchors(target), (
                f"{source.name} cites docs/{page}#{anchor}, which is not a heading there"
            )


@pytest.mark.parametrize("source", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_cites_documents_outside_the_repository(source: Path) -> None:
    found = _OUTSIDE.findall(source.read_text())
    assert not found, f"{source.name} cites {sorted(set(found))}, not in the repository"
