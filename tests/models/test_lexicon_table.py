"""The lexicon table on disk: bound to the model it was built from, like the distilled head."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from limelight.models.lexicon_table import (
    LexiconCard,
    find_lexicon_dir,
    lexicon_dir,
    lexicon_unavailable_reason,
    load_lexicon,
    save_lexicon,
)
from limelight.models.loaded import load_model


def test_the_saved_table_loads_back(lexicon_bert_dir: Path) -> None:
    model = load_model(lexicon_bert_dir)
    assert lexicon_unavailable_reason(model) == ""
    table = load_lexicon(model)
    assert table is not None and table.dtype == np.float32
    assert table.shape == (model.model.get_input_embeddings().num_embeddings, model.num_labels)
    special = list(model.tokenizer.all_special_ids)
    assert not table[special].any() and table.any()
    card = json.loads((lexicon_dir(model) / "card.json").read_text())
    assert card["model_version"] == model.version and card["reference"] == "empty text"


def copy_with_card(source: Path, target: Path, **changes: object) -> Path:
    shutil.copytree(source, target)
    path = target / "limelight_lexicon" / "card.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return target


def test_a_table_of_other_weights_is_refused_with_the_fix(
    lexicon_bert_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = load_model(copy_with_card(lexicon_bert_dir, tmp_path / "m", model_version="0123"))
    reason = lexicon_unavailable_reason(model)
    assert "built for model version 0123" in reason and "limelight lexicon --model" in reason
    with caplog.at_level(logging.WARNING):
        assert load_lexicon(model) is None
    assert "not loading the lexicon table" in caplog.text


def test_an_unreadable_or_foreign_card(lexicon_bert_dir: Path, tmp_path: Path) -> None:
    model = load_model(copy_with_card(lexicon_bert_dir, tmp_path / "a", format="other/9"))
    assert "format 'other/9'" in lexicon_unavailable_reason(model)
    broken = tmp_path / "b"
    shutil.copytree(lexicon_bert_dir, broken)
    (broken / "limelight_lexicon" / "card.json").write_text("{not json")
    assert "cannot be read" in lexicon_unavailable_reason(load_model(broken))


def test_a_table_whose_shape_is_not_the_models_is_not_loaded(
    lexicon_bert_dir: Path, tmp_path: Path
) -> None:
    target = tmp_path / "m"
    shutil.copytree(lexicon_bert_dir, target)
    model = load_model(target)
    card = LexiconCard(model.version, 10, model.num_labels, "empty text")
    save_lexicon(np.zeros((10, model.num_labels + 1), np.float32), card, lexicon_dir(model))
    assert load_lexicon(model) is None


def test_a_rebuild_that_fails_at_the_disk_leaves_the_old_table_whole(
    lexicon_bert_dir: Path, tmp_path: Path
) -> None:
    """A running sidecar reloads the table when it changes: a rebuild stopped by a full disk
    (a file-size limit here) must leave the old table, not half a new one under the old card."""
    import resource
    import signal

    target = tmp_path / "m"
    shutil.copytree(lexicon_bert_dir, target)
    model = load_model(target)
    old = load_lexicon(model)
    assert old is not None
    card = LexiconCard(model.version, old.shape[0], model.num_labels, "empty text")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (old.nbytes // 2, limit[1]))
    try:
        with pytest.raises(OSError):
            save_lexicon(np.ones_like(old), card, lexicon_dir(model))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    kept = load_lexicon(model)
    assert kept is not None and np.array_equal(kept, old)
    assert sorted(p.name for p in lexicon_dir(model).iterdir()) == ["card.json", "table.npy"]


def test_a_table_cut_short_is_not_loaded_and_the_warning_names_it(
    lexicon_bert_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A half-written table.npy stopped every start with numpy's "Failed to read all data for
    array" naming no file, and `limelight lexicon` called it current (the fix it would be told:
    run it again)."""
    target = Path(shutil.copytree(lexicon_bert_dir, tmp_path / "m"))
    path = target / "limelight_lexicon" / "table.npy"
    path.write_bytes(path.read_bytes()[:1000])
    model = load_model(target)
    reason = lexicon_unavailable_reason(model)
    assert str(path) in reason and "--force" in reason
    assert find_lexicon_dir(model) is None  # `limelight lexicon` builds it again
    with caplog.at_level(logging.WARNING):
        assert load_lexicon(model) is None
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert str(path) in warning.getMessage() and warning.exc_info is None


def test_the_sidecar_starts_without_a_table_cut_short(
    lexicon_bert_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.models.test_explainer_head import served_without

    target = Path(shutil.copytree(lexicon_bert_dir, tmp_path / "m"))
    path = target / "limelight_lexicon" / "table.npy"
    path.write_bytes(path.read_bytes()[:1000])
    named = served_without(target, path, "lexicon_lookup", tmp_path / "cache", caplog)
    assert str(path) in named.default_unavailable  # not ready, and says which file
