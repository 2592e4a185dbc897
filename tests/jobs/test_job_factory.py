"""create_backend picks the backend named by settings.jobs."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from limelight.jobs.factory import create_backend
from limelight.jobs.priority import InlineGate
from limelight.jobs.redis_backend import RedisJobBackend
from limelight.jobs.sqlite_backend import SqliteJobBackend
from limelight.settings import Settings


def test_factory(tmp_path: Path) -> None:
    gate = InlineGate()
    sqlite = create_backend(Settings(jobs="sqlite", cache_dir=tmp_path), None, None, gate)
    assert isinstance(sqlite, SqliteJobBackend) and sqlite.gate is gate
    assert sqlite.path == tmp_path / "jobs.sqlite3"
    own = create_backend(Settings(jobs="sqlite", jobs_db=tmp_path / "x.db"), None)
    assert isinstance(own, SqliteJobBackend) and own.path == tmp_path / "x.db"
    redis = create_backend(Settings(jobs="redis://127.0.0.1:1/0"), None)
    assert isinstance(redis, RedisJobBackend)
    assert create_backend(Settings(jobs="off"), None) is None
    with pytest.raises(ValidationError, match="unknown job backend"):
        Settings(jobs="postgres://x")  # refused with the settings, before any backend
