"""Adapters from Limelight's methods (and optional peer explainers) to ``Explainer`` callables.

Peers: LIME over token positions (a token is "off" when replaced by the mask token) and SHAP's
Partition explainer with its text masker; both at a stated budget of model evaluations per
input. They are only available with the optional ``peers`` extra (lime, shap).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping
from typing import Any

import numpy as np

from limelight.core.types import Encoded, FloatArray
from limelight.errors import InvalidArgument
from limelight.evaluation.perturbation import probabilities
from limelight.evaluation.runner import Explainer
from limelight.evaluation.store import AttributionStore
from limelight.methods.base import InlineMethod, JobContext, JobMethod, MethodRegistry
from limelight.models.loaded import LoadedModel
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.serving import torch_serving_runtime
from limelight.settings import Settings

PEERS: tuple[str, ...] = ("lime", "shap")
UNSTORED: frozenset[str] = frozenset({"decoded_gradcam"})
"""Job methods whose answers a store keeps no copy of: Decoded Grad-CAM also reads a masked-LM
head, found beside the model or elsewhere and rebuilt on its own schedule, which the store's key
(the model's weights, the method's parameters) does not see."""


def _inline(model: LoadedModel, method: InlineMethod, settings: Settings) -> Explainer:
    # The same extra outputs as the server (the distilled head, the lexicon table).
    runtime = torch_serving_runtime(model, settings.cache_dir)

    def explain(enc: Encoded, target: int) -> FloatArray:
        outputs = runtime.run_inline(InlineBatch.from_encoded([enc], model.pad_id))
        return np.asarray(method.attribute(outputs, 0, len(enc))[:, target], dtype=np.float32)

    return explain


def _job(
    model: LoadedModel, method: JobMethod, settings: Settings, params: Mapping[str, Any]
) -> Explainer:
    ctx = JobContext(model=model, settings=settings)
    checked = method.validate_params(params)

    def explain(enc: Encoded, target: int) -> FloatArray:
        return np.asarray(method.run(ctx, enc, target, checked).scores, dtype=np.float32)

    return explain


def lime_explainer(model: LoadedModel, budget: int, seed: int) -> Explainer:
    """LIME over the input's non-special token positions, ``budget`` perturbed samples."""
    from lime.lime_text import LimeTextExplainer

    mask_id = model.mask_token_id if model.mask_token_id is not None else model.pad_id

    def explain(enc: Encoded, target: int) -> FloatArray:
        positions = [i for i, t in enumerate(enc.tokens) if not t.special]
        feature_of = {pos: k for k, pos in enumerate(positions)}
        scores = np.zeros(len(enc), dtype=np.float32)
        if not positions:
            return scores

        # LIME perturbs "words" of a string; our words are position numbers, so a removed word
        # tells which position to mask.
        def classify(texts: list[str]) -> np.ndarray:
            variants = []
            for text in texts:
                kept = {int(w) for w in text.split() if w.isdigit()}
                ids = [
                    tid if feature_of.get(k, -1) in kept or k not in feature_of else int(mask_id)
                    for k, tid in enumerate(enc.input_ids)
                ]
                variants.append(Encoded(ids, enc.token_type_ids, enc.tokens, False))
            return probabilities(model, variants)

        explainer = LimeTextExplainer(
            bow=False, split_expression=lambda s: s.split(" "), random_state=seed
        )
        words = " ".join(str(k) for k in range(len(positions)))
        explanation = explainer.explain_instance(
            words, classify, labels=(target,), num_features=len(positions), num_samples=budget
        )
        for feature, weight in explanation.as_map()[target]:
            scores[positions[feature]] = weight
        return scores

    return explain


def shap_explainer(model: LoadedModel, budget: int) -> Explainer:
    """SHAP's Partition explainer with its text masker, ``budget`` model evaluations."""
    import shap

    def predict(texts: np.ndarray) -> np.ndarray:
        return probabilities(model, [model.encode(str(t)) for t in texts])

    masker = shap.maskers.Text(model.tokenizer, collapse_mask_token=False)
    explainer = shap.explainers.Partition(predict, masker, output_names=model.labels)

    def explain(enc: Encoded, target: int) -> FloatArray:
        text = model.tokenizer.decode(enc.input_ids, skip_special_tokens=True)
        values = np.asarray(
            explainer([text], max_evals=budget, batch_size=64, silent=True).values[0]
        )[:, target]
        if len(values) != len(enc):  # re-tokenisation changed the length: align by position
            out = np.zeros(len(enc), dtype=np.float32)
            m = min(len(values), len(enc))
            out[:m] = values[:m]
            return out
        return values.astype(np.float32)

    return explain


def build_explainers(
    model: LoadedModel,
    names: list[str],
    settings: Settings,
    params: Mapping[str, Mapping[str, Any]] | None = None,
    registry: MethodRegistry | None = None,
    peer_budget: int = 200,
    seed: int = 0,
    store: AttributionStore | None = None,
) -> tuple[dict[str, Explainer], dict[str, str]]:
    """Explainers for ``names`` and, for each that cannot run here, the reason it is skipped.
    With a ``store``, the expensive ones (the peers and the job methods) keep their answers
    there and reuse them (:mod:`limelight.evaluation.store`)."""
    registry = registry or MethodRegistry.load(settings)  # built-ins, plug-ins, configured
    params = params or {}
    ready: dict[str, Explainer] = {}
    skipped: dict[str, str] = {}
    for name in names:
        if name in PEERS:
            if importlib.util.find_spec(name) is None:
                skipped[name] = f"{name} is not installed (pip install 'limelight[peers]')"
            else:
                peer = (
                    lime_explainer(model, peer_budget, seed)
                    if name == "lime"
                    else shap_explainer(model, peer_budget)
                )
                ready[name] = peer
                if store is not None:
                    ready[name] = store.wrap(name, _peer_key(name, peer_budget, seed), peer)
            continue
        try:
            method = registry.get(name)
        except InvalidArgument as exc:  # unknown method: say so and go on with the others
            skipped[name] = str(exc)
            continue
        reason = method.unavailable_reason(model)
        if reason:
            skipped[name] = reason
            continue
        given = dict(params.get(name, {}))
        if name == "random":
            given.setdefault("seed", seed)
        if isinstance(method, InlineMethod):
            if given:
                method.validate_params(given)
            ready[name] = _inline(model, method, settings)
        elif isinstance(method, JobMethod):
            ready[name] = _job(model, method, settings, given)
            if store is not None and name not in UNSTORED:
                ready[name] = store.wrap(name, method.validate_params(given), ready[name])
    return ready, skipped


def _peer_key(name: str, budget: int, seed: int) -> dict[str, Any]:
    """What decides a peer's answer besides the model and the text."""
    key: dict[str, Any] = {"budget": budget, name: importlib.metadata.version(name)}
    if name == "lime":  # sampled; SHAP's Partition explainer is deterministic
        key["seed"] = seed
    return key
