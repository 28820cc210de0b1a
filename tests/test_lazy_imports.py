"""``import funcaccel`` leaves the modules most scripts need only later unimported.

The checkpoint, tracking, profiler, environment-report and plot modules and the
toolkit (join, local SGD, process helpers, seeding, batch-size search, sync
contexts, scheduler rules) load on first access of one of their names; every
exported name still resolves, through ``funcaccel.X`` and ``from funcaccel import X``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Final

import funcaccel
from tests._scripts import REPO

LOADED_LATER: Final = frozenset(
    {
        "funcaccel.batch_size",
        "funcaccel.checkpoint",
        "funcaccel.envreport",
        "funcaccel.join",
        "funcaccel.local_sgd",
        "funcaccel.pipeline",
        "funcaccel.plot",
        "funcaccel.planning",
        "funcaccel.process",
        "funcaccel.profiler",
        "funcaccel.scheduler",
        "funcaccel.seeding",
        "funcaccel.sync",
        "funcaccel.tracking",
    }
)

_PROBE: Final = """
import json, sys
import funcaccel
at_import = sorted(m for m in sys.modules if m.startswith("funcaccel"))
from funcaccel import set_seed, save_checkpoint
after = sorted(m for m in sys.modules if m.startswith("funcaccel"))
print(json.dumps({"at_import": at_import, "after": after}))
"""


def _loaded() -> dict[str, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, list[str]] = json.loads(done.stdout)
    return result


def test_the_later_modules_load_on_first_use_only() -> None:
    loaded = _loaded()
    at_import = set(loaded["at_import"])
    assert "funcaccel.loader" in at_import  # the probe sees what is imported
    early = {m for m in at_import if ".".join(m.split(".")[:2]) in LOADED_LATER}
    assert early == set(), early
    after = set(loaded["after"])
    assert {"funcaccel.seeding", "funcaccel.checkpoint"} <= after
    assert "funcaccel.tracking" not in after  # only what was asked for


def test_the_one_list_of_imports_gives_all_and_the_lazy_names() -> None:
    # __all__ and the lazy map are read from the package's import lines; a parse
    # that found nothing would leave the other tests here nothing to check.
    exported = set(funcaccel.__all__)
    assert {"wrap_model", "accumulate_step", "save_checkpoint", "set_seed"} <= exported
    assert len(exported) >= 100
    lazy = dict(funcaccel._LAZY)
    assert lazy["save_checkpoint"] == "funcaccel.checkpoint"
    assert set(lazy) <= exported
    assert {m.split(".")[1] for m in lazy.values()} == {
        m.split(".")[1] for m in LOADED_LATER
    }
    assert not any(name.startswith("_") for name in exported)


def test_every_exported_name_resolves() -> None:
    missing = [name for name in funcaccel.__all__ if not hasattr(funcaccel, name)]
    assert missing == []
    assert set(funcaccel.__all__) <= set(dir(funcaccel))
    # A lazily loaded name is the object its module defines, not the module.
    from funcaccel.seeding import set_seed

    assert funcaccel.set_seed is set_seed
    assert callable(funcaccel.maybe_step_scheduler)
