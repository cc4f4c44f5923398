"""A full disk is said plainly and costs nothing: no traceback, no half-written file, no lost record.

The command line says a full disk in one line (status 2) whatever library raised it; files written
whole leave no temporary behind when a write fails; a spool that cannot store a record says so
(naming the spool) without acknowledging it, and takes it once there is room; health names the
background tasks failing now.
"""

from __future__ import annotations

import argparse
import errno
import sqlite3
import uuid
from pathlib import Path

import pytest

import specd.cli.main as cli
from specd.core.errors import out_of_space
from specd.core.files import write_text_atomic
from specd.core.records import TrajectoryRecord
from specd.core.threads import BackgroundHealth
from specd.learner.spool import RecordSpool, SpoolConfig, SpoolFull


def test_a_full_disk_is_recognised_through_the_wrappers_libraries_put_around_it() -> None:
    assert out_of_space(OSError(errno.ENOSPC, "No space left on device"))
    assert out_of_space(sqlite3.OperationalError("database or disk is full"))
    assert out_of_space(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise ValueError("could not save") from inner
    except ValueError as outer:
        assert out_of_space(outer)
    assert not out_of_space(OSError(errno.EACCES, "Permission denied"))


def test_the_command_line_says_a_full_disk_in_one_line(monkeypatch, capsys) -> None:
    def full(args: argparse.Namespace) -> int:
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    def parser() -> argparse.ArgumentParser:
        built = argparse.ArgumentParser()
        built.set_defaults(run=full)
        return built

    monkeypatch.setattr(cli, "build_parser", parser)
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specd: error: no space left on the device:") and err.count("\n") == 1

    def bug(args: argparse.Namespace) -> int:
        raise RuntimeError("a bug")

    built = argparse.ArgumentParser()
    built.set_defaults(run=bug)
    monkeypatch.setattr(cli, "build_parser", lambda: built)
    with pytest.raises(RuntimeError, match="a bug"):  # anything else is a bug, and shows as one
        cli.main([])


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        write_text_atomic(target, 123)  # type: ignore[arg-type]  # fails inside the write
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
    write_text_atomic(target, "new", fsync=True)
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def record(i: int) -> dict:
    return TrajectoryRecord(uuid.UUID(int=i).hex, "server-x", list(range(1, 200)), list(range(1, 400)), [],
                            0.0, 1.0, 0.0, 0.0, "chat").to_dict()


def test_a_full_spool_says_so_stores_nothing_and_takes_the_record_once_there_is_room(tmp_path: Path) -> None:
    spool = RecordSpool(tmp_path, SpoolConfig(), keep=lambda: 1000)
    list(spool.load())
    assert spool.add(record(0))
    pages = spool._conn.execute("PRAGMA page_count").fetchone()[0]
    spool._conn.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full from here
    stored = spool.records_in
    with pytest.raises(SpoolFull, match=r"spool\.sqlite3 cannot store a record") as refused:
        for i in range(1, 50):
            spool.add(record(i))
    assert "comes again" in str(refused.value)
    before = spool.records_in  # records 0 .. before - 1 went in; record `before` did not
    assert before >= stored and not spool._conn.in_transaction
    spool._conn.execute(f"PRAGMA max_page_count = {pages * 100}")  # room again
    assert spool.add(record(before))  # the broker sends it again: not a duplicate, stored now
    assert spool.records_in == before + 1
    spool.close()


def test_health_names_the_background_tasks_that_failed_in_the_last_minute() -> None:
    health = BackgroundHealth()
    health.register("announcer")
    health.failed("mqtt-subscriber", RuntimeError("database or disk is full"))
    assert health.failing() == ["mqtt-subscriber"]
    assert health.failing(within_s=-1) == []
