"""Conformance of the families added by the generic head adapter (issue #22).

Each family is a tiny random-init classifier saved to disk with a real WordPiece tokenizer and
loaded as the sidecar loads it. Checked: probabilities equal transformers' own, NormXLogit
equals a direct computation (embedding-output norm × the head written out by hand from the
family's modules), every token is scored, and one job method runs. Mean- and late-pooled heads
(ModernBERT ``classifier_pooling="mean"``, EuroBERT) are checked the same way, and the gradient
methods are compared with autograd through transformers' own forward. The same checks over every
served family are ``slow``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from limelight.core.jobs import JobSpec
from limelight.jobs.runner import JobRunner
from limelight.methods.base import MethodRegistry
from limelight.methods.normxlogit import NormXLogit
from limelight.models import adapters
from limelight.models.loaded import LoadedModel, load_model
from limelight.models.tiny import NOT_BUILT, tiny_config
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings

TEXTS = ["a witty and gorgeous film , sadly too long", "dull"]
VOCAB = 30522  # the WordPiece tokenizer's


def _decoder(model: Any, h: torch.Tensor) -> torch.Tensor:
    return model.score(h)  # type: ignore[no-any-return]


def _tanh_dense_out(model: Any, h: torch.Tensor) -> torch.Tensor:
    head = model.classifier
    return head.out_proj(torch.tanh(head.dense(h)))  # type: ignore[no-any-return]


def _modernbert(model: Any, h: torch.Tensor) -> torch.Tensor:
    return model.classifier(model.head.norm(model.head.act(model.head.dense(h))))  # type: ignore[no-any-return]


def _eurobert(model: Any, h: torch.Tensor) -> torch.Tensor:
    return model.classifier(torch.nn.functional.gelu(model.dense(h)))  # type: ignore[no-any-return]


def _tanh_head(model: Any, h: torch.Tensor) -> torch.Tensor:
    head = model.classification_head  # BART-style encoder-decoders
    return head.out_proj(torch.tanh(head.dense(h)))  # type: ignore[no-any-return]


#: Encoder-decoders: their heads read the last end-of-sequence token, the WordPiece [SEP].
ENCODER_DECODERS = {"bart", "bigbird_pegasus", "mbart", "mt5", "mvp", "plbart", "t5", "umt5"}
SEP = 102


def _xlnet(model: Any, h: torch.Tensor) -> torch.Tensor:
    summary = model.sequence_summary
    return model.logits_proj(torch.tanh(summary.summary(h)))  # type: ignore[no-any-return]


#: Families tested with a pooling other than their default: name -> (model_type, config values).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "modernbert-mean": ("modernbert", {"classifier_pooling": "mean"}),
    "eurobert-late": ("eurobert", {"classifier_pooling": "late"}),
    "eurobert-mean": ("eurobert", {"classifier_pooling": "mean"}),
}


#: The head on one token's final hidden state, written out from each family's modules.
DIRECT_HEADS: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "albert": lambda m, h: m.classifier(torch.tanh(m.albert.pooler(h))),
    "electra": lambda m, h: m.classifier.out_proj(torch.nn.functional.gelu(m.classifier.dense(h))),
    "longformer": _tanh_dense_out,
    "modernbert": _modernbert,
    "modernbert-mean": _modernbert,
    "eurobert-late": _eurobert,
    "eurobert-mean": _eurobert,
    "mpnet": _tanh_dense_out,
    "bart": _tanh_head,
    "fnet": lambda m, h: m.classifier(torch.tanh(m.fnet.pooler.dense(h))),
    "gemma": _decoder,
    "gemma2": _decoder,
    "mixtral": _decoder,
    "phi": _decoder,
    "phi3": _decoder,
    "qwen2_moe": _decoder,
    "t5": _tanh_head,
    "xlnet": _xlnet,
    "yoso": lambda m, h: m.classifier.out_proj(torch.nn.functional.gelu(m.classifier.dense(h))),
}
FAMILIES = sorted(DIRECT_HEADS)
EVERY_FAMILY = [
    t
    for t in adapters.supported_model_types()
    if t not in NOT_BUILT and t not in DIRECT_HEADS and t != "eurobert"  # eurobert: VARIANTS
]


def build(name: str, directory: Path, tokenizer_dir: Path) -> LoadedModel:
    model_type, values = VARIANTS.get(name, (name, {}))
    torch.manual_seed(0)
    if model_type in ENCODER_DECODERS:
        values = {**values, "eos_token_id": SEP}
    config = tiny_config(model_type, vocab_size=VOCAB, **values)
    config.id2label = {0: "neg", 1: "mixed", 2: "pos"}
    config.label2id = {v: k for k, v in config.id2label.items()}
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return load_model(directory)


@pytest.fixture(scope="module")
def built(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Callable[[str], LoadedModel]:
    cache: dict[str, LoadedModel] = {}

    def get(model_type: str) -> LoadedModel:
        if model_type not in cache:
            cache[model_type] = build(
                model_type, tmp_path_factory.mktemp(model_type), tokenizer_dir
            )
        return cache[model_type]

    return get


def transformers_outputs(model: LoadedModel, text: str) -> tuple[torch.Tensor, ...]:
    """(probabilities [C], embedding output [n, K], final hidden states [n, K]) from
    transformers' own forward passes, one unpadded text."""
    enc = model.tokenizer(text, return_tensors="pt")
    kwargs: dict[str, Any] = {"input_ids": enc["input_ids"]}
    if adapters._accepts(model.model, "use_cache"):
        kwargs["use_cache"] = False
    base_kwargs = dict(kwargs)
    if model.architecture == "longformer":  # as its classifier does: CLS attends globally
        base_kwargs["global_attention_mask"] = torch.zeros_like(enc["input_ids"])
        base_kwargs["global_attention_mask"][:, 0] = 1
    with torch.no_grad():
        if model.architecture in ENCODER_DECODERS:  # encoder input embeddings, decoder states
            own = model.model(**kwargs, output_hidden_states=True)
            probs = torch.softmax(own.logits[0], -1)
            return probs, own.encoder_hidden_states[0][0], own.decoder_hidden_states[-1][0]
        logits = model.model(**kwargs).logits[0]
        base = model.model.base_model(**base_kwargs, output_hidden_states=True)
    return torch.softmax(logits, -1), base.hidden_states[0][0], base.last_hidden_state[0]


HeadFn = Callable[[Any, torch.Tensor], torch.Tensor]


def check_family(model: LoadedModel, direct_head: HeadFn, atol: float = 1e-5) -> None:
    """``atol``: on scores (norm × logit); batch padding may move logits by up to the 1e-4
    the load-time check allows in families whose mixing sees padded positions."""
    encoded = [model.encode(t) for t in TEXTS]
    outputs = TorchRuntime(model).run_inline(InlineBatch.from_encoded(encoded, model.pad_id))
    method = NormXLogit()
    for row, (text, enc) in enumerate(zip(TEXTS, encoded, strict=True)):
        probs, h0, hl = transformers_outputs(model, text)
        got = torch.softmax(torch.from_numpy(outputs.logits[row]), -1)
        torch.testing.assert_close(got, probs, atol=1e-5, rtol=1e-4)

        matrix = method.attribute(outputs, row, len(enc))
        assert matrix.shape == (len(enc), model.num_labels)  # every token, every class
        assert np.isfinite(matrix).all()
        assert (np.abs(matrix).sum(axis=1) > 0).all()
        with torch.no_grad():
            expected = h0.norm(dim=-1, keepdim=True) * direct_head(model.model, hl)
        np.testing.assert_allclose(matrix, expected.numpy(), rtol=1e-4, atol=atol)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_conformance(model_type: str, built: Callable[[str], LoadedModel]) -> None:
    check_family(built(model_type), DIRECT_HEADS[model_type])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_one_job_method_per_family(
    model_type: str, built: Callable[[str], LoadedModel], tmp_path: Path
) -> None:
    model = built(model_type)
    methods = MethodRegistry.load()
    settings = Settings(jobs="off", drift_enabled=False, cache_dir=tmp_path)
    method = "slalom"  # forward passes only, so it applies to every family
    params = methods.get(method).validate_params({"num_samples": 24, "epochs": 3, "batch_size": 8})
    spec = JobSpec(method=method, text=TEXTS[0], params=params)
    explanation = JobRunner(model, methods, settings).run(spec)
    scores = explanation.attribution.scores
    assert scores.shape == (len(model.encode(TEXTS[0])),)
    assert np.isfinite(scores).all()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", EVERY_FAMILY)
def test_every_served_family(model_type: str, built: Callable[[str], LoadedModel]) -> None:
    """Probabilities and NormXLogit for every other family (head as derived, checked by the
    load-time probe and here on real tokens)."""
    model = built(model_type)

    def derived(_: Any, h: torch.Tensor) -> torch.Tensor:
        return model.adapter.head(h)

    # ConvBERT's span convolution and Nystromformer's landmarks see padded positions.
    check_family(model, derived, atol=1e-3 if model_type in ("convbert", "nystromformer") else 1e-5)


def test_variants_serve_their_declared_pooling(built: Callable[[str], LoadedModel]) -> None:
    for name, (_, values) in VARIANTS.items():
        assert built(name).adapter.pooling == values["classifier_pooling"], name


def _job(model: LoadedModel, method: str, params: dict[str, Any], tmp_path: Path) -> np.ndarray:
    methods = MethodRegistry.load()
    settings = Settings(jobs="off", drift_enabled=False, cache_dir=tmp_path)
    spec = JobSpec(method=method, text=TEXTS[0], params=methods.get(method).validate_params(params))
    explanation = JobRunner(model, methods, settings).run(spec)
    assert explanation.attribution.target_index == explanation.label_index
    return np.asarray(explanation.attribution.scores)


def _target(model: LoadedModel, ids: torch.Tensor) -> int:
    with torch.no_grad():
        return int(model.model(input_ids=ids).logits[0].argmax())


@pytest.mark.parametrize("name", [f for f in FAMILIES if f not in ENCODER_DECODERS])
def test_gradient_matches_transformers_autograd(
    name: str, built: Callable[[str], LoadedModel], tmp_path: Path
) -> None:
    """``gradient``: ‖∂logit/∂e_i‖ through transformers' own classifier (its own pooling and
    head, inputs_embeds), so the served target logit is the model's on every pooling."""
    model = built(name)
    ids = model.tokenizer(TEXTS[0], return_tensors="pt")["input_ids"]
    target = _target(model, ids)
    embeds = model.model.get_input_embeddings()(ids).detach().requires_grad_(True)
    kwargs: dict[str, Any] = (
        {"use_cache": False} if adapters._accepts(model.model, "use_cache") else {}
    )
    if model.architecture == "longformer":  # its classifier builds this from input_ids only
        kwargs["global_attention_mask"] = torch.zeros_like(ids)
        kwargs["global_attention_mask"][:, 0] = 1
    logit = model.model(inputs_embeds=embeds.clone(), **kwargs).logits[0, target]
    (grad,) = torch.autograd.grad(logit, embeds)
    expected = grad[0].norm(dim=-1).numpy()
    np.testing.assert_allclose(
        _job(model, "gradient", {}, tmp_path), expected, rtol=1e-3, atol=1e-6
    )


@pytest.mark.parametrize(
    "name", ["albert", "electra", "longformer", "modernbert", "modernbert-mean", "mpnet"]
)
def test_grad_x_input_matches_the_embedding_module(
    name: str, built: Callable[[str], LoadedModel], tmp_path: Path
) -> None:
    """``grad_x_input`` equals Σ_k g·h0 at the output of the base's embeddings module, captured
    with a hook during transformers' own classifier forward on the token ids. Longformer pads
    to its attention window inside that forward and returns sliced copies of its hidden states,
    which is why the method cannot simply differentiate hidden_states[0]."""
    model = built(name)
    ids = model.tokenizer(TEXTS[0], return_tensors="pt")["input_ids"]
    n = ids.shape[1]
    target = _target(model, ids)
    captured: list[torch.Tensor] = []

    def keep(_m: torch.nn.Module, _i: Any, out: torch.Tensor) -> None:
        captured.append(out)

    hook = model.model.base_model.embeddings.register_forward_hook(keep)
    try:
        logit = model.model(input_ids=ids).logits[0, target]
    finally:
        hook.remove()
    (h0,) = [c for c in captured if c.shape[1] >= n]  # Longformer: padded to the window
    (grad,) = torch.autograd.grad(logit, h0)
    expected = (grad[0, :n] * h0[0, :n]).sum(dim=-1).detach().numpy()
    np.testing.assert_allclose(
        _job(model, "grad_x_input", {}, tmp_path), expected, rtol=1e-3, atol=1e-6
    )


def test_longformer_refuses_decoded_gradcam_with_the_reason(
    built: Callable[[str], LoadedModel],
) -> None:
    reason = MethodRegistry.load().get("decoded_gradcam").unavailable_reason(built("longformer"))
    assert "copies" in reason and "grad_x_input" in reason
