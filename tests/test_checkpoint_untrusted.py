"""A checkpoint directory is untrusted input: crafted names, links, FIFOs and pickles.

Nothing a manifest, ``latest`` or DCP's metadata names outside the checkpoint is
opened, hashed or deleted; no pickled code runs; pruning never follows a link.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import threading
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import funcaccel.checkpoint._layout
from funcaccel.checkpoint import latest_checkpoint
from funcaccel.checkpoint import list_checkpoints
from funcaccel.checkpoint import load_checkpoint
from funcaccel.checkpoint import read_checkpoint_meta
from funcaccel.checkpoint import save_checkpoint
from funcaccel.checkpoint._dcp_checks import check_dcp_value
from funcaccel.checkpoint._members import check_member_name
from funcaccel.checkpoint._members import member_path
from funcaccel.context import DistributedContext

ONE = DistributedContext()
CRAFTED = r"the checkpoint is damaged or crafted"


class _Payload:
    """Unpickling this runs code: it writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def _edit_manifest(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _list_file(path: Path, name: str) -> None:
    """Record ``name`` in the manifest with its real size and no hash."""
    size = os.lstat(path / name).st_size if (path / name).exists() else 0
    _edit_manifest(
        path, lambda m: m["files"].update({name: {"size": size, "sha256": None}})
    )


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every path the checkpoint code hashes, in order."""
    seen: list[Path] = []
    original = funcaccel.checkpoint._layout.sha256_of

    def recording(path: Path) -> str:
        seen.append(path)
        return original(path)

    monkeypatch.setattr(funcaccel.checkpoint._layout, "sha256_of", recording)
    return seen


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Callable[[Path], None]]:
    """Make FIFOs that report whether anything opened them for reading.

    A writer thread blocks on each until a reader opens it; at the end the test
    opens each itself, and the writer must still have been waiting.
    """
    made: list[tuple[Path, threading.Thread, threading.Event]] = []

    def make(path: Path) -> None:
        os.mkfifo(path)
        opened = threading.Event()

        def writer() -> None:
            with path.open("wb"):  # blocks until a reader opens the FIFO
                opened.set()

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        made.append((path, thread, opened))

    yield make
    for path, thread, opened in made:
        was_opened = opened.is_set()
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # releases the writer
        thread.join(timeout=10)
        os.close(reader)
        assert not was_opened, f"{path} was opened"


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return save_checkpoint(ONE, tmp_path / "run", models=nn.Linear(2, 1))


# --- names: pure checks and a Hypothesis property ------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "",
        "/etc/passwd",
        "../x",
        "a/../../x",
        "a/./b",
        "a//b",
        "a/",
        ".",
        "..",
        "a\\b",
        "a\x00b",
        "x" * 300,
        3,
        None,
    ],
)
def test_names_that_are_not_plain_relative_paths_are_refused(name: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"^f: the checkpoint names .* not a plain relative path .*" + CRAFTED,
    ):
        check_member_name("f", name)


@pytest.mark.parametrize(
    "name", ["model_0.pt", "dcp/__0_0.distcp", "dcp/.metadata", "a..b"]
)
def test_plain_names_are_accepted(name: str) -> None:
    assert check_member_name("f", name) == name


_PARTS = st.sampled_from(["a", "out", "loop", "..", ".", "", "b.pt", "\\", "/"])


@given(parts=st.lists(_PARTS, max_size=6), lead=st.sampled_from(["", "/"]))
def test_random_names_never_resolve_outside_the_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, parts: list[str], lead: str
) -> None:
    base = tmp_path_factory.mktemp("names")
    root, outside = base / "ckpt", base / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "a").mkdir()
    (root / "out").symlink_to(outside)  # a link out of the checkpoint
    (root / "loop").symlink_to(root / "a")  # a link that stays inside
    name = lead + "/".join(parts)
    try:
        path = member_path(root, name, caller="f")
    except ValueError as error:
        assert CRAFTED in str(error)
        return
    assert path.resolve().is_relative_to(root.resolve())
    assert ".." not in Path(name).parts and not Path(name).is_absolute()


@given(name=st.text(st.sampled_from("ab./\\\x00"), max_size=12))
def test_random_strings_are_refused_or_stay_inside(name: str) -> None:
    try:
        check_member_name("f", name)
    except ValueError:
        return
    joined = os.path.normpath(os.path.join("/root", name))
    assert joined.startswith("/root/") and joined != "/root"


# --- crafted manifests --------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (
            "../../secret",
            r"names '\.\./\.\./secret', which is not a plain relative path",
        ),
        ("a/../../../secret", r"not a plain relative path"),
        ("/ABSOLUTE", r"not a plain relative path"),
    ],
)
def test_manifest_entries_outside_the_checkpoint_are_refused_unhashed(
    ckpt: Path, hashed: list[Path], entry: str, match: str
) -> None:
    secret = ckpt.parent.parent / "secret"
    secret.write_bytes(b"not yours")
    entry = entry.replace("/ABSOLUTE", str(secret))
    _edit_manifest(
        ckpt, lambda m: m["files"].update({entry: {"size": 9, "sha256": "0" * 64}})
    )
    for call in (
        lambda: load_checkpoint(ONE, ckpt, models=nn.Linear(2, 1)),
        lambda: read_checkpoint_meta(ckpt, verify=True),
    ):
        with pytest.raises(ValueError, match=match + ".*" + CRAFTED):
            call()
    assert secret not in hashed and all(p.parent == ckpt for p in hashed)


def test_a_symlink_out_of_the_checkpoint_is_refused_even_with_the_right_hash(
    ckpt: Path, hashed: list[Path]
) -> None:
    copy = ckpt.parent.parent / "copy.pt"
    copy.write_bytes((ckpt / "model_0.pt").read_bytes())  # same size, same hash
    (ckpt / "model_0.pt").unlink()
    (ckpt / "model_0.pt").symlink_to(copy)
    with pytest.raises(
        ValueError, match=r"names 'model_0\.pt', which is a link out of .*" + CRAFTED
    ):
        load_checkpoint(ONE, ckpt, models=nn.Linear(2, 1))
    assert ckpt / "model_0.pt" not in hashed and copy not in hashed


def test_a_fifo_named_by_the_manifest_is_never_opened(
    ckpt: Path, fifo: Callable[[Path], None]
) -> None:
    fifo(ckpt / "extra.pt")
    _list_file(ckpt, "extra.pt")
    with pytest.raises(
        ValueError, match=r"extra\.pt is a FIFO, device or socket, not a regular file"
    ):
        load_checkpoint(ONE, ckpt, models=nn.Linear(2, 1))


def test_a_device_named_by_the_manifest_is_never_opened(ckpt: Path) -> None:
    (ckpt / "rng_rank_0.pt").unlink()
    (ckpt / "rng_rank_0.pt").symlink_to("/dev/zero")  # reading it never ends
    with pytest.raises(ValueError, match=r"which is a link out of"):
        load_checkpoint(ONE, ckpt, models=nn.Linear(2, 1))


def test_a_manifest_that_is_a_fifo_is_never_opened(
    ckpt: Path, fifo: Callable[[Path], None]
) -> None:
    (ckpt / "manifest.json").unlink()
    fifo(ckpt / "manifest.json")
    with pytest.raises(
        ValueError, match=r"manifest\.json is a FIFO, device or socket.*" + CRAFTED
    ):
        read_checkpoint_meta(ckpt)


def test_a_manifest_that_links_out_is_refused(ckpt: Path) -> None:
    elsewhere = ckpt.parent.parent / "manifest.json"
    (ckpt / "manifest.json").rename(elsewhere)
    (ckpt / "manifest.json").symlink_to(elsewhere)
    with pytest.raises(
        ValueError, match=r"names 'manifest\.json', which is a link out of"
    ):
        load_checkpoint(ONE, ckpt, models=nn.Linear(2, 1))


def test_a_file_the_load_reads_must_be_listed(ckpt: Path) -> None:
    _edit_manifest(ckpt, lambda m: m["files"].pop("model_0.pt"))
    with pytest.raises(
        ValueError,
        match=r"load_checkpoint: the manifest of .* does not list model_0\.pt, which the load reads.*"
        + CRAFTED,
    ):
        load_checkpoint(ONE, ckpt, models=nn.Linear(2, 1))


# --- latest -------------------------------------------------------------------------


def test_latest_naming_a_path_is_refused(ckpt: Path) -> None:
    other = ckpt.parent.parent / "other"
    save_checkpoint(ONE, other, models=nn.Linear(2, 1))
    (ckpt.parent / "latest").write_text("../other/checkpoint-000001\n")
    with pytest.raises(
        ValueError,
        match=r"^latest_checkpoint: .* names '\.\./other/checkpoint-000001', which is not a complete checkpoint",
    ):
        latest_checkpoint(ckpt.parent)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "huge"])
def test_latest_that_is_not_a_short_regular_file_is_refused(
    ckpt: Path, fifo: Callable[[Path], None], kind: str
) -> None:
    pointer = ckpt.parent / "latest"
    pointer.unlink()
    if kind == "symlink":
        pointer.symlink_to("/dev/zero")
    elif kind == "fifo":
        fifo(pointer)
    else:
        pointer.write_text("checkpoint-000001" + " " * 10_000)
    with pytest.raises(
        ValueError, match=r"^latest_checkpoint: .*latest (is a|has).*" + CRAFTED
    ):
        latest_checkpoint(ckpt.parent)


# --- pickles never run ----------------------------------------------------------------


def test_a_pickle_payload_in_a_state_file_is_refused_without_running(
    ckpt: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    (ckpt / "model_0.pt").unlink()
    torch.save({"weight": _Payload(marker)}, ckpt / "model_0.pt")
    digest = funcaccel.checkpoint._layout.sha256_of(ckpt / "model_0.pt")
    size = (ckpt / "model_0.pt").stat().st_size
    _edit_manifest(
        ckpt,
        lambda m: m["files"].update({"model_0.pt": {"size": size, "sha256": digest}}),
    )
    with pytest.raises(
        ValueError,
        match=r"model_0\.pt cannot be read .*crafted \(only tensors and plain values are loaded, weights_only=True\)",
    ):
        load_checkpoint(ONE, ckpt, models=nn.Linear(2, 1))
    assert not marker.exists()


def test_a_pickle_payload_in_dcp_metadata_is_refused_without_running(
    ckpt: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    (ckpt / "dcp").mkdir()
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _list_file(ckpt, "dcp/.metadata")
    _edit_manifest(ckpt, lambda m: m.update(state_format="dcp"))
    with pytest.raises(
        ValueError,
        match=r"\.metadata asks to build 'builtins\.exec', which is not part of DCP metadata.*"
        + CRAFTED,
    ):
        load_checkpoint(ONE, ckpt, models=nn.Linear(2, 1))
    assert not marker.exists()


def test_dcp_values_load_only_weights_only(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    evil = io.BytesIO()
    torch.save(_Payload(marker), evil)
    evil.seek(0)
    with pytest.raises(
        ValueError, match=r"^f: a value in the sharded state is not weights-only"
    ):
        check_dcp_value(evil, caller="f")
    assert not marker.exists()
    plain = io.BytesIO()
    torch.save({"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}, plain)
    plain.seek(0)
    check_dcp_value(plain, caller="f")
    assert plain.tell() == 0  # rewound for DCP


# --- per-rank parts -----------------------------------------------------------------


class _Counter:
    """A per-rank ``Stateful`` object holding one tensor."""

    def __init__(self, value: float) -> None:
        self.value = torch.tensor([value])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.value = state["value"].clone()


def _replace_part(path: Path, content: object) -> None:
    """Write ``content`` as rank 0's part and record its real size and hash."""
    part = path / "rank_part_0.pt"
    part.unlink()
    torch.save(content, part)
    entry = {"size": part.stat().st_size, "sha256": _layout_hash(part)}
    _edit_manifest(path, lambda m: m["files"].update({"rank_part_0.pt": entry}))


def _layout_hash(path: Path) -> str:
    return funcaccel.checkpoint._layout.sha256_of(path)


def _flip_first_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF  # the zip signature: same size, unreadable
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "verify", "match"),
    [
        (
            lambda p: (p / "rank_part_0.pt").unlink(),
            True,
            r"rank_part_0\.pt is missing; the checkpoint is damaged",
        ),
        (
            lambda p: _flip_first_byte(p / "rank_part_0.pt"),
            True,
            r"rank_part_0\.pt does not match the SHA-256 the manifest records",
        ),
        (
            lambda p: _flip_first_byte(p / "rank_part_0.pt"),
            False,
            r"rank_part_0\.pt cannot be read .*truncated, damaged or crafted",
        ),
        (
            lambda p: _edit_manifest(p, lambda m: m["files"].pop("rank_part_0.pt")),
            True,
            r"does not list rank_part_0\.pt, which the load reads.*" + CRAFTED,
        ),
        (
            lambda p: _replace_part(p, {"objects": {}}),
            True,
            r"rank_part_0\.pt holds \{'objects': \{\}\}, not a per-rank part; the "
            r"checkpoint is damaged \(or crafted\)",
        ),
        (
            lambda p: _replace_part(p, {"objects": {"other": {}}, "extra": None}),
            True,
            r"rank_part_0\.pt holds rank_objects \['other'\], but the manifest lists \['count'\]",
        ),
        (
            lambda p: _replace_part(
                p, {"objects": {"count": {"value": 1}}, "extra": [1]}
            ),
            True,
            r"rank_part_0\.pt holds rank_extra \[1\], not a dict with str keys",
        ),
        (
            lambda p: _replace_part(
                p, {"objects": {"count": {"wrong": 1}}, "extra": None}
            ),
            True,
            r"rank_part_0\.pt does not fit rank_objects\['count'\] \(KeyError",
        ),
    ],
    ids=[
        "missing",
        "flipped",
        "flipped-unverified",
        "unlisted",
        "not-a-part",
        "other-names",
        "bad-extra",
        "misfit",
    ],
)
def test_a_damaged_or_missing_per_rank_part_is_refused(
    tmp_path: Path, damage: Callable[[Path], None], verify: bool, match: str
) -> None:
    path = save_checkpoint(
        ONE, tmp_path, rank_objects={"count": _Counter(3.0)}, rank_extra={"n": 1}
    )
    damage(path)
    target = _Counter(0.0)
    with pytest.raises(ValueError, match=r"^load_checkpoint: .*" + match):
        load_checkpoint(ONE, path, rank_objects={"count": target}, verify=verify)


def test_a_pickle_payload_in_a_per_rank_part_is_refused_without_running(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "ran"
    path = save_checkpoint(ONE, tmp_path / "run", rank_extra={"n": 1})
    _replace_part(path, {"objects": {}, "extra": {"n": _Payload(marker)}})
    with pytest.raises(ValueError, match=r"rank_part_0\.pt cannot be read"):
        load_checkpoint(ONE, path)
    assert not marker.exists()


def test_a_manifest_whose_rank_objects_lack_a_part_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint(ONE, tmp_path, rank_objects={"count": _Counter(1.0)})
    _edit_manifest(path, lambda m: m.update(rank_part=False))
    with pytest.raises(
        ValueError, match=r"rank_objects must be \(\) when rank_part is False"
    ):
        read_checkpoint_meta(path)


# --- pruning never follows links ----------------------------------------------------


def test_pruning_never_deletes_through_a_link(tmp_path: Path) -> None:
    run, target = tmp_path / "run", tmp_path / "precious"
    target.mkdir()
    (target / "manifest.json").write_text("{}")
    (target / "data").write_text("keep me")
    run.mkdir()
    (run / "checkpoint-000001").symlink_to(target)  # looks like a complete checkpoint
    (run / ".checkpoint-000009.tmp").symlink_to(target)  # looks like a leftover
    first = save_checkpoint(ONE, run, models=nn.Linear(2, 1))
    assert first.name == "checkpoint-000002"  # the link's number is not reused
    (first / "inner-link").symlink_to(target)  # a link inside a real old checkpoint
    second = save_checkpoint(ONE, run, models=nn.Linear(2, 1), keep_last=1)
    assert list_checkpoints(run) == [second]
    assert not first.exists()
    assert sorted(p.name for p in target.iterdir()) == ["data", "manifest.json"]
    assert (run / "checkpoint-000001").is_symlink()
    assert (run / ".checkpoint-000009.tmp").is_symlink()
    assert latest_checkpoint(run) == second
