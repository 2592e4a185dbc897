"""The distilled inline explainer on the SLALOM paper's synthetic linear-words task."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from limelight.demo.synthetic import build_synthetic_model, sample_linear_dataset
from limelight.distill.head import head_dir, load_head, read_card, save_head
from limelight.distill.train import distill
from limelight.errors import FailedPrecondition
from limelight.methods.distilled import DistilledExplainer
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.onnx_export import export_onnx
from limelight.runtimes.onnx_runtime import OnnxRuntime
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar

TEACHER = "integrated_gradients"
PARAMS = {"steps": 16}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_synthetic_model(tmp_path_factory.mktemp("synthetic"), seed=0, n_train=3000)


@pytest.fixture(scope="module")
def distilled(synthetic: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic model with a head distilled from integrated gradients beside it."""
    model = load_model(synthetic)
    texts = sample_linear_dataset(150, seed=1).texts()
    work = tmp_path_factory.mktemp("distill")
    head, card = distill(
        model, Settings(jobs="off"), texts, TEACHER, PARAMS, work / "teacher.jsonl", seed=0
    )
    save_head(head, card, head_dir(model))
    return synthetic


def test_head_reproduces_the_teachers_ranking_on_held_out_texts(distilled: Path) -> None:
    card = read_card(head_dir(load_model(distilled)))
    assert card is not None and card.teacher == TEACHER and card.validation_texts >= 20
    assert card.validation["spearman_vs_teacher"] >= 0.9, card.validation


def test_served_inline_and_onnx_match_the_head(
    distilled: Path, tmp_path: Path, start_sidecar: Callable[..., RunningSidecar]
) -> None:
    model = load_model(distilled)
    head = load_head(model)
    runtime = TorchRuntime(model, {"distilled": head})
    text = "the good movie we watch"
    encoded = model.encode(text)
    outputs = runtime.run_inline(InlineBatch.from_encoded([encoded], model.pad_id))
    scores = DistilledExplainer().attribute(outputs, 0, len(encoded))
    with torch.inference_mode():
        ids = torch.tensor([encoded.input_ids])
        out = model.adapter.run_base(ids, torch.ones_like(ids))
        direct = head(
            out.hidden_states,
            out.hidden_states[0].norm(dim=-1),
            model.adapter.head(out.last_hidden_state),
        )[0].numpy()
    np.testing.assert_allclose(scores, direct, atol=1e-5)

    graph = export_onnx(model, tmp_path / "g.onnx", heads={"distilled": head})
    onnx_out = OnnxRuntime(graph, model).run_inline(
        InlineBatch.from_encoded([encoded], model.pad_id)
    )
    np.testing.assert_allclose(onnx_out.extra["distilled"][0], scores, atol=1e-4)

    side = start_sidecar(model_dir=distilled, default_method="distilled", jobs="off")
    reply = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(side.target)).Explain(
        pb.ExplainRequest(text=text), timeout=30
    )
    assert reply.explanation.method == "distilled"
    np.testing.assert_allclose(
        reply.explanation.scores, scores[:, reply.explanation.target_index], atol=1e-5
    )


def test_head_refuses_another_models_weights(distilled: Path, random_bert_dir: Path) -> None:
    other = load_model(random_bert_dir)
    with pytest.raises(FailedPrecondition, match="limelight distill"):
        load_head(other, head_dir(load_model(distilled)))
    assert "distill" in DistilledExplainer().unavailable_reason(other)


def test_distillation_is_deterministic_for_a_seed(synthetic: Path, tmp_path: Path) -> None:
    model = load_model(synthetic)
    texts = sample_linear_dataset(30, seed=2).texts()
    heads = [
        distill(
            model, Settings(jobs="off"), texts, TEACHER, PARAMS, tmp_path / f"t{i}.jsonl", seed=7,
            epochs=50,
        )[0]
        for i in range(2)
    ]  # fmt: skip
    for a, b in zip(heads[0].state_dict().values(), heads[1].state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_teacher_cache_resumes(synthetic: Path, tmp_path: Path) -> None:
    from limelight.distill.train import teacher_attributions

    model = load_model(synthetic)
    texts = sample_linear_dataset(6, seed=3).texts()
    cache = tmp_path / "teacher.jsonl"
    first = teacher_attributions(model, Settings(jobs="off"), TEACHER, PARAMS, texts[:3], cache)
    calls = []
    both = teacher_attributions(
        model, Settings(jobs="off"), TEACHER, PARAMS, texts, cache, progress=calls.append
    )
    assert [e.scores for e in both[:3]] == [e.scores for e in first]
    assert len(cache.read_text().splitlines()) == 1 + 6 and len(calls) == 6
