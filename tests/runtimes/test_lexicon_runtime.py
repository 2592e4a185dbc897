"""The lexicon lookup rides on any runtime: torch and ONNX Runtime give the same table rows,
and the wrapped runtime's own outputs are untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from limelight.models.lexicon_table import load_lexicon
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.lexicon import LexiconRuntime
from limelight.runtimes.onnx_export import export_onnx
from limelight.runtimes.onnx_runtime import OnnxRuntime
from limelight.runtimes.serving import torch_serving_runtime, with_lexicon
from limelight.runtimes.torch_runtime import TorchRuntime

TEXTS = ["a witty film", "a long and very boring movie about nothing at all , really"]


def test_rows_are_the_tables_and_the_rest_is_the_inner_runtimes(lexicon_bert_dir: Path) -> None:
    model = load_model(lexicon_bert_dir)
    table = load_lexicon(model)
    assert table is not None
    batch = InlineBatch.from_encoded([model.encode(t) for t in TEXTS], model.pad_id)
    plain = TorchRuntime(model)
    wrapped = torch_serving_runtime(model)
    assert isinstance(wrapped, LexiconRuntime) and wrapped.name == "torch"
    assert wrapped.head_names == {"lexicon"}
    a, b = plain.run_inline(batch), wrapped.run_inline(batch)
    np.testing.assert_array_equal(b.extra["lexicon"], table[batch.input_ids])
    for field in ("logits", "embedding_norms", "token_logits"):
        np.testing.assert_array_equal(getattr(b, field), getattr(a, field))
    np.testing.assert_array_equal(wrapped.forward_logits(batch), plain.forward_logits(batch))


def test_onnx_runtime_gets_the_same_rows(lexicon_bert_dir: Path, tmp_path: Path) -> None:
    model = load_model(lexicon_bert_dir)
    batch = InlineBatch.from_encoded([model.encode(t) for t in TEXTS], model.pad_id)
    onnx = with_lexicon(OnnxRuntime(export_onnx(model, tmp_path / "g.onnx"), model), model)
    assert onnx.name == "onnx" and "lexicon" in onnx.head_names
    np.testing.assert_array_equal(
        onnx.run_inline(batch).extra["lexicon"],
        torch_serving_runtime(model).run_inline(batch).extra["lexicon"],
    )


def test_without_a_table_the_runtime_is_left_as_it_is(random_bert_dir: Path) -> None:
    model = load_model(random_bert_dir)
    runtime = TorchRuntime(model)
    assert with_lexicon(runtime, model) is runtime
