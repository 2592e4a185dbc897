"""A model directory's version follows its weights' contents, whether in one file or shards."""

from __future__ import annotations

from pathlib import Path

from limelight.models.fingerprint import fingerprint


def write_model(folder: Path, shards: list[bytes]) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "bert"}')
    for i, data in enumerate(shards, start=1):
        (folder / f"model-{i:05d}-of-{len(shards):05d}.safetensors").write_bytes(data)
    return folder


def test_changed_shard_weights_of_the_same_size_change_the_version(tmp_path: Path) -> None:
    """Fine-tuning keeps every shard's size: the version must still move (it did not, and the
    cached ONNX graph, heads and tables of the old weights were served as current)."""
    before = write_model(tmp_path / "before", [b"\x00" * 64, b"\x01" * 64])
    after = write_model(tmp_path / "after", [b"\x00" * 64, b"\x02" * 64])
    again = write_model(tmp_path / "again", [b"\x00" * 64, b"\x01" * 64])
    assert fingerprint(before) != fingerprint(after)
    assert fingerprint(before) == fingerprint(again)


def test_a_single_weights_file_is_hashed_by_content(tmp_path: Path) -> None:
    one, other = tmp_path / "one", tmp_path / "other"
    for folder, data in ((one, b"\x00" * 64), (other, b"\x01" * 64)):
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "bert"}')
        (folder / "model.safetensors").write_bytes(data)
    assert fingerprint(one) != fingerprint(other)
