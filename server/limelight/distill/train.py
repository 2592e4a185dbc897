"""Distillation: teacher attributions (resumable), head training, held-out validation.

Targets: for each text the teacher explains the model's predicted class; the head's column of
that class is trained on the teacher's scores standardised per text (only the ranking and the
relative size of scores matter for an attribution). Special tokens are ignored.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import spearmanr

from limelight.core.jobs import JobSpec
from limelight.core.types import Encoded
from limelight.distill.head import ExplainerHead, HeadCard
from limelight.methods.base import MethodRegistry
from limelight.models.loaded import LoadedModel
from limelight.settings import Settings

TEACHERS = ("slalom", "integrated_gradients", "lrp", "grad_x_input")
Progress = Callable[[int], None]


@dataclass
class TeacherExample:
    text: str
    target: int
    scores: list[float]


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def teacher_attributions(
    model: LoadedModel,
    settings: Settings,
    teacher: str,
    params: dict[str, Any],
    texts: Sequence[str],
    cache: Path,
    progress: Progress | None = None,
) -> list[TeacherExample]:
    """Teacher scores for every text; finished ones are kept in ``cache`` (JSONL), so an
    interrupted run resumes where it stopped."""
    from limelight.jobs.runner import JobRunner

    methods = MethodRegistry.builtin()
    method = methods.get(teacher)
    checked = method.validate_params(params)
    done: dict[str, TeacherExample] = {}
    stamp = {"model": model.version, "teacher": teacher, "params": checked}
    if cache.exists():
        lines = cache.read_text().splitlines()
        if lines and json.loads(lines[0]) == stamp:
            for line in lines[1:]:
                row = json.loads(line)
                done[row["key"]] = TeacherExample(row["text"], row["target"], row["scores"])
    if not done:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(stamp) + "\n")
    runner = JobRunner(model, methods, settings)
    out = []
    with cache.open("a") as fh:
        for text in texts:
            key = _key(text)
            if key not in done:
                result = runner.run(JobSpec(method=teacher, text=text, params=checked))
                example = TeacherExample(
                    text, result.attribution.target_index, result.attribution.scores.tolist()
                )
                fh.write(json.dumps({"key": key, **example.__dict__}) + "\n")
                fh.flush()
                done[key] = example
            out.append(done[key])
            if progress is not None:
                progress(1)
    return out


def _standardise(scores: np.ndarray, keep: np.ndarray) -> np.ndarray:
    values = scores[keep]
    std = float(values.std()) if values.size > 1 else 1.0
    return (scores - float(values.mean())) / (std if std > 1e-12 else 1.0)


@torch.inference_mode()
def _features(model: LoadedModel, head: ExplainerHead, encoded: Encoded) -> torch.Tensor:
    ids = torch.tensor([encoded.input_ids], device=model.device)
    mask = torch.ones_like(ids)
    types = (
        torch.tensor([encoded.token_type_ids], device=model.device)
        if encoded.token_type_ids is not None
        else None
    )
    out = model.adapter.run_base(ids, mask, types)
    token_logits = model.adapter.head(out.last_hidden_state)
    norms = out.hidden_states[0].float().norm(dim=-1)
    return head.features(out.hidden_states, norms, token_logits)[0].cpu()


def default_layers(model: LoadedModel) -> list[int]:
    """The embedding output, a middle layer and the last layer."""
    n = model.num_layers
    return sorted({0, n // 2, n})


def train_head(
    model: LoadedModel,
    examples: Sequence[TeacherExample],
    layers: Sequence[int] | None = None,
    width: int = 64,
    epochs: int = 200,
    lr: float = 3e-3,
    seed: int = 0,
) -> ExplainerHead:
    """Fit the head to the teacher's standardised scores (deterministic for ``seed``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = ExplainerHead(
            list(layers or default_layers(model)), model.hidden_size, model.num_labels, width
        )
    feats, targets, columns, weights = [], [], [], []
    for ex in examples:
        encoded = model.encode(ex.text)
        keep = ~encoded.special_mask
        scores = np.asarray(ex.scores, dtype=np.float32)
        feats.append(_features(model, head, encoded)[torch.from_numpy(keep)])
        targets.append(torch.from_numpy(_standardise(scores, keep)[keep]).float())
        columns.append(torch.full((int(keep.sum()),), ex.target, dtype=torch.long))
        weights.append(torch.full((int(keep.sum()),), 1.0 / max(int(keep.sum()), 1)))
    x = torch.cat(feats)
    y, col, w = torch.cat(targets), torch.cat(columns), torch.cat(weights)
    w = w / w.sum()  # every text counts the same, whatever its length
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    head.train()
    for _ in range(epochs):  # full batch: a few thousand tokens, deterministic
        pred = head.score(x).gather(1, col[:, None])[:, 0]
        loss = (w * (pred - y) ** 2).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return head.eval().to(model.device)


@torch.inference_mode()
def validate(
    model: LoadedModel, head: ExplainerHead, examples: Sequence[TeacherExample]
) -> dict[str, float]:
    """Mean per-text Spearman correlation between the head and the teacher (held-out)."""
    correlations = []
    for ex in examples:
        encoded = model.encode(ex.text)
        keep = ~encoded.special_mask
        if keep.sum() < 2:
            continue
        pred = head.score(_features(model, head, encoded))[:, ex.target].numpy()
        rho = spearmanr(pred[keep], np.asarray(ex.scores)[keep]).statistic
        if np.isfinite(rho):
            correlations.append(float(rho))
    return {
        "spearman_vs_teacher": float(np.mean(correlations)) if correlations else float("nan"),
        "texts": float(len(correlations)),
    }


def distill(
    model: LoadedModel,
    settings: Settings,
    texts: Sequence[str],
    teacher: str,
    teacher_params: dict[str, Any],
    cache: Path,
    validation_fraction: float = 0.2,
    seed: int = 0,
    width: int = 64,
    epochs: int = 200,
    progress: Progress | None = None,
    data_name: str = "",
) -> tuple[ExplainerHead, HeadCard]:
    examples = teacher_attributions(
        model, settings, teacher, teacher_params, texts, cache, progress
    )
    order = np.random.default_rng(seed).permutation(len(examples))
    n_val = max(1, round(validation_fraction * len(examples)))
    val = [examples[i] for i in order[:n_val]]
    train = [examples[i] for i in order[n_val:]]
    head = train_head(model, train, width=width, epochs=epochs, seed=seed)
    card = HeadCard(
        model_version=model.version,
        layers=head.layers,
        hidden_size=model.hidden_size,
        num_labels=model.num_labels,
        width=width,
        teacher=teacher,
        teacher_params=MethodRegistry.builtin().get(teacher).validate_params(teacher_params),
        data=data_name,
        train_texts=len(train),
        validation_texts=len(val),
        validation=validate(model, head, val),
        seed=seed,
    )
    return head, card
