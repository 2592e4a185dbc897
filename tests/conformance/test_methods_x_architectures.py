"""One table: every attribution method on every supported architecture.

Each cell either produces one finite score per token for the target class (and, inline, a full
token x class matrix) or the method declares itself unavailable for that model with a message
that says why; then the service refuses it with FAILED_PRECONDITION before anything is queued.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from limelight.cli.main import main
from limelight.core.jobs import JobSpec
from limelight.core.service import ExplanationService
from limelight.errors import FailedPrecondition
from limelight.jobs.runner import JobRunner
from limelight.methods.base import InlineMethod, MethodRegistry
from limelight.metrics import Metrics
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.serving import torch_serving_runtime
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings

SMALL = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    vocab_size=30522,
    max_position_embeddings=64,
    num_labels=3,
)
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "bert": {},
    "distilbert": dict(dim=32, hidden_dim=64, n_layers=2, n_heads=2),
    "roberta": dict(pad_token_id=1),
    "deberta-v2": dict(relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"]),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, pad_token_id=0),
    # As stock GPT-2: no pad_token_id in its config (its classifier refuses padded batches).
    "gpt2-nopad": dict(n_embd=32, n_layer=2, n_head=2, n_positions=64),
    "llama": dict(num_key_value_heads=2, pad_token_id=0),
}
#: Table entries that are variants of a family: name -> model_type.
VARIANTS = {"gpt2-nopad": "gpt2"}
# Cheap parameters so the whole table runs in seconds.
CHEAP: dict[str, dict[str, Any]] = {
    "integrated_gradients": {"steps": 4},
    "slalom": {"num_samples": 24, "epochs": 3, "batch_size": 8},
}
TEXT = "a witty and gorgeous film , sadly too long"
METHODS = MethodRegistry.load()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, LoadedModel]:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    out: dict[str, LoadedModel] = {}
    for name, extra in ARCHITECTURES.items():
        model_type = VARIANTS.get(name, name)
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, **{**SMALL, **extra})
        if model_type == "gpt2":
            config.bos_token_id = config.eos_token_id = 102
        assert name != "gpt2-nopad" or config.pad_token_id is None
        directory = tmp_path_factory.mktemp(name)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(
            directory, safe_serialization=True
        )
        tokenizer.save_pretrained(directory)
        # The lexicon table beside every model, so that its inline lookup has a cell too.
        assert (
            main(["lexicon", "--model", str(directory), "--batch-size", "4096", "--no-progress"])
            == 0
        )
        out[name] = load_model(directory)
    return out


def test_every_builtin_method_is_in_the_table() -> None:
    assert {"normxlogit", "decoded_gradcam", "lrp", "slalom", "integrated_gradients"} <= set(
        METHODS.names()
    )


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
@pytest.mark.parametrize("method_name", METHODS.names())
def test_method_on_architecture(
    method_name: str, model_type: str, models: dict[str, LoadedModel], tmp_path: Path
) -> None:
    model = models[model_type]
    method = METHODS.get(method_name)
    settings = Settings(jobs="off", drift_enabled=False, cache_dir=tmp_path)
    encoded = model.encode(TEXT)
    reason = method.unavailable_reason(model)
    if reason:
        assert len(reason) > 20, "an unavailable method must say why"
        service = ExplanationService(
            settings, model, TorchRuntime(model), METHODS, Metrics(), jobs=None
        )
        with pytest.raises(FailedPrecondition):
            if isinstance(method, InlineMethod):
                service._inline_method(method_name)
            else:
                service._job_method(method_name)
        return
    if isinstance(method, InlineMethod):
        # What the server runs: the extra outputs found beside the model (the lexicon table).
        runtime = torch_serving_runtime(model)
        outputs = runtime.run_inline(InlineBatch.from_encoded([encoded], model.pad_id))
        matrix = method.attribute(outputs, 0, len(encoded))
        assert matrix.shape == (len(encoded), model.num_labels)
        assert np.isfinite(matrix).all()
        return
    params = method.validate_params(CHEAP.get(method_name, {}))
    explanation = JobRunner(model, METHODS, settings).run(
        JobSpec(method=method_name, text=TEXT, params=params)
    )
    scores = explanation.attribution.scores
    assert scores.shape == (len(encoded),)
    assert np.isfinite(scores).all()
    assert explanation.attribution.target_index == explanation.label_index


def test_unavailable_cells_are_refused_by_the_service(models: dict[str, LoadedModel]) -> None:
    """At least LRP on decoders and Grad-CAM without an LM head must be refused, not crash."""
    refused = {
        (name, arch)
        for arch, model in models.items()
        for name in METHODS.names()
        if METHODS.get(name).unavailable_reason(model)
    }
    assert ("lrp", "gpt2") in refused and ("decoded_gradcam", "bert") in refused
    assert ("lrp", "gpt2-nopad") in refused
    assert not {arch for name, arch in refused if name == "lexicon_lookup"}  # a table for each
