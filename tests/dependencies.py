"""What marked tests need, checked before they run: a missing dependency fails its tests.

Contract: a test marked `vllm`, `mqtt` or `browser` needs the dependencies `NEEDS` names for
that marker. When one is missing, each selected test that needs it fails, naming what is missing
and the command that installs it; nothing skips itself. Leaving such tests out is the choice of
whoever runs pytest, by deselecting them (`-m "not vllm"`), and deselected tests are not checked.
`tests/conftest.py` installs the hook; the probes are also where the tests find the binaries.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from specd.testing.processes import chromium_binary, mosquitto_binary


@dataclass(frozen=True)
class Dependency:
    name: str
    is_present: Callable[[], bool]
    install: str  # the command that installs it




def _has_module(name: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(name) is not None


SYSTEM_DEPS = "bash scripts/system-deps"
NEEDS: dict[str, tuple[Dependency, ...]] = {
    "vllm": (Dependency("vLLM (the vllm package)", _has_module("vllm"), "bash scripts/setup --vllm"),),
    "mqtt": (Dependency("the Mosquitto broker (mosquitto)", lambda: mosquitto_binary() is not None, SYSTEM_DEPS),),
    "browser": (Dependency("Playwright (the playwright package)", _has_module("playwright"), "bash scripts/setup"),
                Dependency("headless Chromium (chromium)", lambda: chromium_binary() is not None, SYSTEM_DEPS)),
}


def missing_for(markers: Iterable[str], needs: dict[str, tuple[Dependency, ...]],
                present: Callable[[Dependency], bool]) -> list[tuple[str, Dependency]]:
    """(marker, dependency) for each dependency these markers need that is not present."""
    return [(marker, dependency) for marker in dict.fromkeys(markers) for dependency in needs.get(marker, ())
            if not present(dependency)]


def failure_message(missing: list[tuple[str, Dependency]]) -> str:
    lines = [f"missing dependency for a test marked '{marker}': {dependency.name}; install it with "
             f"`{dependency.install}`" for marker, dependency in missing]
    markers = " or ".join(dict.fromkeys(marker for marker, _ in missing))
    lines.append(f"(to leave these tests out on purpose, deselect them: pytest -m \"not ({markers})\")")
    return "\n".join(lines)


class MissingDependency(pytest.Item):
    """Stands in for a selected test whose dependency is missing: it fails, saying what to install."""

    def __init__(self, *, message: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.message = message

    def runtest(self) -> None:
        pytest.fail(self.message, pytrace=False)

    def reportinfo(self) -> tuple[Path, None, str]:
        return self.path, None, self.name


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected what the person running pytest left out
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    checked: dict[str, bool] = {}

    def present(dependency: Dependency) -> bool:
        if dependency.name not in checked:
            checked[dependency.name] = dependency.is_present()
        return checked[dependency.name]

    for index, item in enumerate(items):
        missing = missing_for((mark.name for mark in item.iter_markers()), NEEDS, present)
        if missing:
            stand_in = MissingDependency.from_parent(item.parent, name=item.name, message=failure_message(missing))
            stand_in.own_markers = list(item.own_markers)
            items[index] = stand_in
