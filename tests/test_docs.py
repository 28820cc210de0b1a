"""Tests for ``docs/``: every Python example runs, every funcaccel name it uses exists.

Conventions the pages follow (see ``docs/index.md``):

- Every ```` ```python ```` block in ``docs/*.md`` and ``README.md`` is executed, in a
  fresh namespace (``__name__ == "__main__"``), at one process on CPU, from an empty
  temporary directory. A block whose first line starts with ``# not run`` (say, a
  script meant for ``torchrun``) is only compiled.
- In every Python block, run or not, each name imported from ``funcaccel`` and each
  attribute reached through ``funcaccel`` or its ``fa`` alias must exist.
- Every ``funcaccel.X`` written in backticks in the prose must exist; when it is
  written as a call, ``funcaccel.X(a, b=1, *, c)``, each parameter named must be a
  parameter of the real callable, so a rename breaks this test.
- Every relative link between pages points at a file that exists.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parent.parent
DOCS: Final = ROOT / "docs"
PAGES: Final = (
    "index.md",
    "context.md",
    "kwargs.md",
    "sharding.md",
    "loader.md",
    "collectives.md",
    "accumulate.md",
    "model.md",
    "mesh.md",
    "pipeline.md",
    "planning.md",
    "profiler.md",
    "tracking.md",
    "checkpoint.md",
    "launch.md",
    "toolkit.md",
    "migration.md",
)
NOT_RUN: Final = "# not run"
_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_DOTTED = re.compile(r"\bfuncaccel(?:\.[A-Za-z_]\w*)+")
_CALL = re.compile(r"^(funcaccel(?:\.[A-Za-z_]\w*)+)\((.*)\)$")
_LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """One fenced Python block of a page."""

    page: str
    line: int
    code: str

    @property
    def runnable(self) -> bool:
        return not self.code.lstrip().startswith(NOT_RUN)

    @property
    def label(self) -> str:
        return f"{self.page}:{self.line}"


def _page_paths() -> list[Path]:
    return sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]


def _strip_fences(text: str) -> str:
    """Return ``text`` with fenced blocks blanked out (line numbers kept)."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _blocks() -> list[Block]:
    found = []
    for path in _page_paths():
        text = path.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            if match.group(1) == "python":
                line = text.count("\n", 0, match.start()) + 2
                found.append(Block(path.name, line, match.group(2)))
    return found


BLOCKS: Final = _blocks()


def _resolve(dotted: str) -> object:
    """Import the longest module prefix of ``dotted``, then walk its attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    msg = f"no module in {dotted!r} can be imported"
    raise ModuleNotFoundError(msg)


def _missing(dotted: str) -> bool:
    try:
        _resolve(dotted)
    except (AttributeError, ModuleNotFoundError):
        return True
    return False


def _split_params(text: str) -> list[str]:
    """Split a documented parameter list at top-level commas."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _documented_params(text: str) -> list[str]:
    names = []
    for part in _split_params(text):
        name = part.split("=", 1)[0].split(":", 1)[0].strip().lstrip("*")
        if name.isidentifier():
            names.append(name)
    return names


def _names_used(code: str) -> set[str]:
    """Return the dotted funcaccel names a block imports or reaches as attributes."""
    tree = ast.parse(code)
    aliases = {"funcaccel": "funcaccel"}
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "funcaccel":
                    used.add(alias.name)
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] == "funcaccel":
                used.update(f"{node.module}.{a.name}" for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            base = aliases.get(node.value.id)
            if base is not None:
                used.add(f"{base}.{node.attr}")
    return used


def test_every_page_exists_and_has_a_title() -> None:
    for name in PAGES:
        text = (DOCS / name).read_text(encoding="utf-8")
        assert text.startswith("# "), f"docs/{name} must start with a '# ' title"


def test_every_page_is_listed_in_the_index() -> None:
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for path in sorted(DOCS.glob("*.md")):
        if path.name != "index.md":
            assert f"({path.name})" in index, f"docs/index.md does not link {path.name}"


def test_relative_links_point_at_existing_pages() -> None:
    broken = [
        f"{path.name}: {target}"
        for path in _page_paths()
        for target in _LINK.findall(path.read_text(encoding="utf-8"))
        if "://" not in target and not (path.parent / target).is_file()
    ]
    assert not broken, broken


@pytest.mark.parametrize("block", BLOCKS, ids=[b.label for b in BLOCKS])
def test_python_block_uses_only_existing_funcaccel_names(block: Block) -> None:
    try:
        used = _names_used(block.code)
    except SyntaxError as error:
        pytest.fail(f"{block.label}: not valid Python: {error}")
    missing = sorted(name for name in used if _missing(name))
    assert not missing, f"{block.label} uses names funcaccel lacks: {missing}"


RUNNABLE: Final = [b for b in BLOCKS if b.runnable]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.label for b in RUNNABLE])
def test_python_block_runs(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # One line offset so tracebacks point at the page's own line numbers.
    code = compile("\n" * (block.line - 1) + block.code, block.label, "exec")
    exec(code, {"__name__": "__main__"})


def test_backticked_funcaccel_names_exist() -> None:
    missing = []
    for path in _page_paths():
        prose = _strip_fences(path.read_text(encoding="utf-8"))
        for span in _INLINE.findall(prose):
            missing += [
                f"{path.name}: `{span}`" for n in _DOTTED.findall(span) if _missing(n)
            ]
    assert not missing, missing


def test_backticked_signatures_name_real_parameters() -> None:
    wrong = []
    for path in _page_paths():
        prose = _strip_fences(path.read_text(encoding="utf-8"))
        for span in _INLINE.findall(prose):
            match = _CALL.match(span.strip())
            if match is None or _missing(match.group(1)):
                continue
            target = _resolve(match.group(1))
            if not callable(target):
                continue
            real = inspect.signature(target).parameters
            wrong += [
                f"{path.name}: `{span}` names {name!r}, which "
                f"{match.group(1)} does not take"
                for name in _documented_params(match.group(2))
                if name not in real
            ]
    assert not wrong, wrong


def test_the_checks_see_the_pages() -> None:
    assert len(BLOCKS) >= len(PAGES), "fewer Python blocks than pages: parsing broke?"
    assert RUNNABLE, "no runnable block found"
