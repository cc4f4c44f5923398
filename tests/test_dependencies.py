"""The dependency check: a selected test whose dependency is missing fails, saying how to install it;
only deselecting it (-m) leaves it out."""

from __future__ import annotations

import dependencies
import pytest
from dependencies import NEEDS, Dependency, failure_message, missing_for

PLANTED = """
import pytest

@pytest.mark.mqtt
def test_needs_a_broker():
    pass

def test_needs_nothing():
    pass
"""


def absent(name: str, install: str) -> Dependency:
    return Dependency(name, lambda: False, install)


def run_planted(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """pytest on the planted files with only the dependency check as a plugin (the marker declared)."""
    pytester.makeini("[pytest]\nmarkers =\n    mqtt: needs a broker\n")
    return pytester.runpytest_inprocess("-p", "dependencies", "-p", "no:asyncio",
                                        "-W", "ignore::pytest.PytestAssertRewriteWarning", *args)


def test_a_missing_dependency_is_named_with_its_install_command() -> None:
    needs = {"vllm": (absent("fake vLLM", "bash scripts/setup --vllm"),),
             "mqtt": (Dependency("here", lambda: True, "unused"),)}
    missing = missing_for(["slow", "vllm", "mqtt", "vllm"], needs, lambda dependency: dependency.is_present())
    assert [(marker, dependency.name) for marker, dependency in missing] == [("vllm", "fake vLLM")]
    message = failure_message(missing)
    assert "'vllm'" in message and "fake vLLM" in message and "`bash scripts/setup --vllm`" in message
    assert 'pytest -m "not (vllm)"' in message


def test_every_marker_with_a_dependency_says_how_to_install_it() -> None:
    assert set(NEEDS) == {"vllm", "mqtt", "browser"}
    installs = {dependency.install for needs in NEEDS.values() for dependency in needs}
    assert installs == {"bash scripts/setup --vllm", "bash scripts/setup", "bash scripts/system-deps"}


def test_a_selected_test_with_a_missing_dependency_fails_instead_of_skipping(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dependencies, "NEEDS", {"mqtt": (absent("a planted broker", "bash scripts/system-deps"),)})
    pytester.makepyfile(test_planted=PLANTED)
    result = run_planted(pytester)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*a planted broker; install it with `bash scripts/system-deps`",
                                 "FAILED test_planted.py::test_needs_a_broker - Failed: missing dependency*"])


def test_deselecting_the_marker_leaves_the_test_out_without_failing(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dependencies, "NEEDS", {"mqtt": (absent("a planted broker", "bash scripts/system-deps"),)})
    pytester.makepyfile(test_planted=PLANTED)
    result = run_planted(pytester, "-m", "not mqtt")
    result.assert_outcomes(passed=1, deselected=1)


def test_each_dependency_is_probed_once_however_many_tests_need_it(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    probes: list[str] = []
    broker = Dependency("a counted broker", lambda: probes.append("probe") is None, "bash scripts/system-deps")
    monkeypatch.setattr(dependencies, "NEEDS", {"mqtt": (broker,)})
    pytester.makepyfile(test_planted=PLANTED, test_more=PLANTED.replace("test_needs", "test_also_needs"))
    run_planted(pytester).assert_outcomes(passed=4)
    assert probes == ["probe"]
