"""The benchmarks' sidecar in a child process: it serves, stops, and leaves nothing behind."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from limelight.api.server_process import start_server_process
from limelight.evaluation.benchmark import workdir
from limelight_client import Client
from limelight_client.errors import LimelightError


def test_serves_then_leaves_no_scratch_folder(
    bert_tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp would put it
    server = start_server_process({"model_dir": bert_tiny_dir})
    try:
        assert list(tmp_path.iterdir()) == []  # the ready file's folder is gone once read
        with Client(server.target) as client:
            assert client.explain("a gorgeous, witty film").tokens
    finally:
        server.stop()
    assert server.process.returncode == 0
    with pytest.raises(LimelightError), Client(server.target, timeout=2, retries=0) as client:
        client.explain("a gorgeous, witty film")


def test_bench_workdir_is_removed() -> None:
    with workdir() as folder:
        (folder / "inline.onnx").write_bytes(b"x")
        assert folder.is_dir()
    assert not folder.exists()
