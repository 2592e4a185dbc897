"""`limelight export-onnx` as a user runs it: the inline graph with the model's head, and the
int8 copy with its fidelity report."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from limelight.cli.main import main
from limelight.models.explainer_head import OUTPUT_NAME, inline_heads
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.onnx_export import EXTRA_PREFIX, heads_mismatch
from limelight.runtimes.onnx_runtime import DEFAULT_GRAPH, OnnxRuntime


def test_int8_keeps_the_head_in_float_and_reports_its_fidelity(
    bert_tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo model carries its distilled head: the quantiser (which cannot type ONNX
    Runtime's own operators) quantises the classifier and leaves the head's nodes in float; the
    int8 graph serves the head and says so in its description."""
    out = tmp_path / "g.onnx"
    args = ["--model", str(bert_tiny_dir), "--out", str(out), "--int8", "--fidelity-n", "8"]
    code = main(["export-onnx", *args])
    assert code == 0
    printed = capsys.readouterr().out
    assert "included inline heads: distilled" in printed
    # the outputs the graph has, the head's among them
    listed = printed.split("outputs: ", 1)[1].split(";", 1)[0].split(", ")
    assert listed == [o.name for o in onnx.load(str(out)).graph.output]
    assert f"{EXTRA_PREFIX}distilled" in listed
    assert "Spearman of the distilled head vs fp32:" in printed
    quantised = tmp_path / "g.int8.onnx"
    assert f"or the int8 graph: limelight serve --model {bert_tiny_dir} " in printed
    assert printed.rstrip().endswith(f"--runtime onnx --onnx-path {quantised}")
    nodes = onnx.load(str(quantised)).graph.node
    ops = {n.op_type for n in nodes}
    assert ops & {"MatMulInteger", "DynamicQuantizeMatMul"}  # the classifier is quantised
    head_ops = {n.op_type for n in nodes if n.name.startswith(EXTRA_PREFIX)}
    # the demo head (linear: Concat, MatMul, Add) stays in float
    assert "MatMul" in head_ops and not head_ops & {"MatMulInteger", "DynamicQuantizeMatMul"}

    model = load_model(bert_tiny_dir)
    assert heads_mismatch(quantised, inline_heads(model)) == ""
    encoded = [model.encode(t) for t in ("a witty film", "dull , slow and far too long")]
    batch = InlineBatch.from_encoded(encoded, model.pad_id)
    full = OnnxRuntime(out, model).run_inline(batch).extra[OUTPUT_NAME]
    int8 = OnnxRuntime(quantised, model).run_inline(batch).extra[OUTPUT_NAME]
    assert int8.shape == full.shape and np.isfinite(int8).all()
    assert not np.array_equal(int8, full)  # it reads the quantised classifier's hidden states


def test_a_graph_beside_the_model_is_served_without_pinning_it(
    bert_tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Written beside the model, the graph is found there: the printed command leaves out
    `--onnx-path`, which would pin it (a head written later would not be served)."""
    model = Path(shutil.copytree(bert_tiny_dir, tmp_path / "model"))
    for old in model.glob("*.onnx*"):
        old.unlink()
    assert main(["export-onnx", "--model", str(model)]) == 0
    printed = capsys.readouterr().out
    assert (model / DEFAULT_GRAPH).exists()
    assert printed.rstrip().endswith(
        f"serve it with: limelight serve --model {model} --runtime onnx"
    )


def test_a_demo_exported_by_name_is_served_by_name(
    bert_tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The printed command names the demo (`--demo bert-tiny`), not its cache directory: served
    by directory, a demo loses what its name brings (its base checkpoint's LM head)."""
    out = tmp_path / "g.onnx"
    cache = bert_tiny_dir.parent.parent
    argv = ["export-onnx", "--demo", "bert-tiny", "--cache-dir", str(cache), "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith(
        f"serve it with: limelight serve --demo bert-tiny --cache-dir {cache} --runtime onnx "
        f"--onnx-path {out}"
    )


def test_a_multi_label_prediction_is_its_label_set() -> None:
    """int8 and fp32 agree on a multi-label model's prediction when they predict the same
    labels (each sigmoid at or over its threshold), whatever their arg-max says."""
    from limelight.cli.export_onnx import same_prediction

    thresholds = [0.5, 0.5, 0.3]
    # the same top label, but the int8 graph's second label falls under its threshold
    assert same_prediction(np.array([2.0, 1.0, -3.0]), np.array([2.0, -1.0, -3.0]), None)
    assert not same_prediction(np.array([2.0, 1.0, -3.0]), np.array([2.0, -1.0, -3.0]), thresholds)
    # another top label, the same set
    assert same_prediction(np.array([2.0, 1.0, -3.0]), np.array([1.0, 2.0, -3.0]), thresholds)
    assert not same_prediction(np.array([2.0, 1.0, -3.0]), np.array([1.0, 2.0, -3.0]), None)
    # nothing predicted by either: agreement; by its own threshold, not 0.5
    assert same_prediction(np.array([-2.0, -1.0, -0.5]), np.array([-1.0, -2.0, -0.6]), thresholds)
    assert not same_prediction(np.array([0, 0, -0.5]), np.array([0, 0, -1.0]), thresholds)


def test_the_int8_report_of_the_multi_label_demo_compares_label_sets_on_its_own_data(
    bert_tiny_multilabel_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The report read rotten_tomatoes movie reviews by arg-max on the drugsCom tagger: now
    the demo's own held-out reviews, and whether int8 predicts the same label set."""
    from limelight.demo.datasets import drugscom

    out = tmp_path / "g.onnx"
    cache = str(bert_tiny_multilabel_dir.parent.parent)
    demo = ["--demo", "bert-tiny-multilabel", "--cache-dir", cache]
    assert main(["export-onnx", *demo, "--out", str(out), "--int8", "--fidelity-n", "24"]) == 0
    printed = capsys.readouterr().out
    assert "int8 fidelity on 24 held-out texts of drugscom (test):" in printed
    said = "(the same labels predicted, at sigmoid >= negative 0.5, side_effects 0.5, "
    line = next(ln for ln in printed.splitlines() if "prediction agreement with fp32" in ln)
    assert said in line, line
    from limelight.cli.export_onnx import held_out_texts, same_prediction

    texts = held_out_texts("drugscom", 24)
    assert texts == [e.text for e in drugscom("test")[:24]]
    model = load_model(bert_tiny_multilabel_dir)
    fp32, int8 = OnnxRuntime(out, model), OnnxRuntime(tmp_path / "g.int8.onnx", model)
    agree = 0
    for start in (0, 16):  # batched as the report batches (int8 scales its inputs per batch)
        encoded = [model.encode(t) for t in texts[start : start + 16]]
        batch = InlineBatch.from_encoded(encoded, model.pad_id)
        a, b = fp32.run_inline(batch).logits, int8.run_inline(batch).logits
        agree += sum(same_prediction(x, y, [0.5] * 4) for x, y in zip(a, b, strict=True))
    assert f"fp32:        {agree / 24:.3f} (" in line, line


def test_an_export_that_fails_leaves_the_graph_beside_the_model_as_it_was(
    bert_tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sidecar may be serving the graph beside the model (and reloads it when it changes): an
    export stopped after the exporter wrote (a full disk, Ctrl-C) must leave the old graph and
    its description, not a new graph bound by the old description, nor partial files."""
    import torch.onnx

    model = Path(shutil.copytree(bert_tiny_dir, tmp_path / "model"))
    for old in model.glob("*.onnx*"):
        old.unlink()
    assert main(["export-onnx", "--model", str(model)]) == 0
    before = {p.name: p.read_bytes() for p in model.glob("*.onnx*")}
    assert set(before) == {DEFAULT_GRAPH, DEFAULT_GRAPH + ".json"}
    exporter = torch.onnx.export

    def written_then_stopped(*args: object, **kwargs: object) -> None:
        exporter(*args, **kwargs)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.onnx, "export", written_then_stopped)
    shutil.rmtree(model / "limelight_distilled")  # the next graph would have no head
    assert main(["export-onnx", "--model", str(model)]) != 0
    after = {p.name: p.read_bytes() for p in model.iterdir() if ".onnx" in p.name}
    assert after == before


def test_an_export_into_a_read_only_folder_names_the_target_and_a_way_out(
    bert_tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A model folder mounted read-only: the error is about writing the graph the user asked
    for, not about reading a hidden staging file."""
    import errno
    import os

    import limelight.runtimes.onnx_export as onnx_export

    def read_only(model: object, partial: Path, **kwargs: object) -> Path:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(partial))

    monkeypatch.setattr(onnx_export, "export_onnx", read_only)
    out = tmp_path / "graphs" / "served.onnx"
    out.parent.mkdir()
    assert main(["export-onnx", "--model", str(bert_tiny_dir), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"limelight export-onnx: error: cannot write {out} (Read-only file")
    assert "--out" in err and "--runtime onnx" in err
    assert not list(out.parent.iterdir())
