"""Distillation: teacher attributions (resumable), head training, held-out validation.

Two stages, both deterministic for a seed:

1. **Amortisation.** For each training text the teacher explains the model's predicted class
   (default: Shapley values of its log-odds from two antithetic permutations — cheap, noisy and
   unbiased, so many texts beat few exact labels). The head's column of that class is fitted to
   the teacher's scores divided by their root mean square per text (rankings, relative sizes
   and signs matter, scales do not: a token against the class stays negative in the heat-map);
   with two (softmax) classes the other column gets the negated scores, which is exact for
   log-odds. Special tokens are ignored.
2. **The classifier in the loop** (``loop_steps`` > 0). The head's scores define a
   Plackett–Luce distribution over token orders; sampled orders are scored by the frozen
   classifier's own curves (deletion with the mask token by default, ``loop_reward``), and the
   head follows the policy gradient of the orders that beat its own. It reads no labels, so it
   can train on texts that have none (``loop_texts``). ``loop_estimator="straight_through"``
   keeps the earlier first-order loop (a relaxed top-k mask with the labels as an anchor).

Multi-label models (an independent sigmoid per label) are taught per (text, label): the
teacher explains every label the sidecar explains for the text — those at or above their
served thresholds (``Settings.label_threshold``, ``label_thresholds``), or the most probable
one when none is — so one text gives as many examples as it has predicted labels. Each
example teaches its label's column only (no negated column: the labels are independent), the
loop stage reads that label's sigmoid instead of a softmax, and validation is per (text,
label). Texts are held out whole, never some of their labels.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import spearmanr

from limelight.core.jobs import JobSpec
from limelight.core.prediction import label_thresholds, predict
from limelight.core.service import explained_targets
from limelight.core.types import Encoded, TargetSpec
from limelight.distill.config import (
    Mixture,
    TrainConfig,
)
from limelight.methods.base import MethodRegistry
from limelight.models.explainer_head import ExplainerHead, HeadCard
from limelight.models.loaded import LoadedModel
from limelight.models.precision import read_precision, reading
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.torch_runtime import batch_tensors
from limelight.settings import Settings

Progress = Callable[[int], None]


@dataclass
class TeacherExample:
    text: str
    target: int
    scores: list[float]


def mixture_cache(cache: Path, teacher: str) -> Path:
    """Where a mixture's second teacher keeps its labels: beside the first's, never on it."""
    return cache.with_name(f"{cache.stem}.mix-{teacher}.jsonl")


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
    methods: MethodRegistry | None = None,
) -> list[TeacherExample]:
    """Teacher scores for every text (multi-label: for every label the sidecar explains for
    it, see :func:`explained_labels`), in the order of ``texts``; finished ones are kept in
    ``cache`` (JSONL), so an interrupted run resumes where it stopped. ``methods``: the
    registry to take the teacher from (default: ``MethodRegistry.load(settings)``, plug-ins
    included)."""
    per_text = _teacher_examples(model, settings, teacher, params, texts, cache, progress, methods)
    return [example for examples in per_text for example in examples]


def explained_labels(
    model: LoadedModel, settings: Settings, encoded: Sequence[Encoded]
) -> list[list[int]]:
    """Multi-label: per text, the labels an inline explanation of it explains (those at or
    above their served thresholds, most probable first, or the most probable label when none
    is), from the model's sigmoid outputs on ``encoded``."""
    thresholds = label_thresholds(model.labels, settings.label_threshold, settings.label_thresholds)
    logits = _sequence_logits(model, encoded)
    return [
        explained_targets(model, None, predict(row, model.problem_type, thresholds))
        for row in logits
    ]


def _teacher_examples(
    model: LoadedModel,
    settings: Settings,
    teacher: str,
    params: dict[str, Any],
    texts: Sequence[str],
    cache: Path,
    progress: Progress | None = None,
    methods: MethodRegistry | None = None,
    precision: str = "float32",
) -> list[list[TeacherExample]]:
    """:func:`teacher_attributions` grouped by text: one example per text, or per (text,
    explained label) for multi-label models; the teacher reads the model in ``precision``
    (:func:`read_precision`), which its cache records."""
    from limelight.jobs.runner import JobRunner

    methods = methods if methods is not None else MethodRegistry.load(settings)
    method = methods.get(teacher)
    checked = method.validate_params(params)
    done: dict[str, TeacherExample] = {}
    stamp: dict[str, Any] = {"model": model.version, "teacher": teacher, "params": checked}
    if precision != "float32":  # float32 caches keep the stamp they were written with
        stamp["precision"] = precision
    labels: list[list[int]] | None = None
    if model.is_multi_label:
        # The labels taught depend on the thresholds: other thresholds, another label set.
        stamp["thresholds"] = label_thresholds(
            model.labels, settings.label_threshold, settings.label_thresholds
        )
        encoded = [model.encode(t, None, settings.max_tokens) for t in texts]
        labels = explained_labels(model, settings, encoded)
    _swap_label_files(cache, stamp)
    if cache.exists():
        content = cache.read_text()
        if content and not content.endswith("\n"):  # a write cut by a kill: end that line
            with cache.open("a") as fh:
                fh.write("\n")
        lines = content.splitlines()
        if lines and _read_stamp(lines[0]) == stamp:
            for line in lines[1:]:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill: recompute that text
                    continue
                done[row["key"]] = TeacherExample(row["text"], row["target"], row["scores"])
    if not done:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(stamp) + "\n")
    runner = JobRunner(model, methods, settings)
    out: list[list[TeacherExample]] = []
    with cache.open("a") as fh:
        for i, text in enumerate(texts):
            # Single-label: the job explains the predicted class; multi-label: each label.
            targets: list[int | None] = list(labels[i]) if labels is not None else [None]
            group = []
            for target in targets:
                key = _key(text) if target is None else f"{_key(text)}:{target}"
                if key not in done:
                    spec = JobSpec(
                        method=teacher,
                        text=text,
                        params=checked,
                        target=TargetSpec(index=target) if target is not None else None,
                    )
                    with reading(model.device, precision):
                        result = runner.run(spec)
                    example = TeacherExample(
                        text, result.attribution.target_index, result.attribution.scores.tolist()
                    )
                    fh.write(json.dumps({"key": key, **example.__dict__}) + "\n")
                    fh.flush()
                    done[key] = example
                group.append(done[key])
            out.append(group)
            if progress is not None:
                progress(1)
    return out


#: How many label files of other stamps (teacher parameters, model, precision) are kept
#: beside the current one, the most recently set aside first.
SHELVED_LABEL_FILES = 3


def _read_stamp(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:  # a header cut by a kill
        return None


def shelved_label_file(cache: Path, stamp: Any) -> Path:
    """Where the labels of ``stamp`` wait while another stamp's use ``cache``."""
    digest = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:12]
    return cache.with_name(f"{cache.stem}.stamp-{digest}{cache.suffix}")


def _swap_label_files(cache: Path, stamp: dict[str, Any]) -> None:
    """Make ``cache`` hold the labels of ``stamp``: labels of another stamp there are moved
    aside under their own stamp's name rather than overwritten (hours of a search teacher's
    work: a run with other parameters must not cost the demo its labels), and ``stamp``'s own,
    if an earlier run set them aside, come back. Only the newest few set aside are kept."""
    if cache.exists():
        with cache.open() as fh:
            current = _read_stamp(fh.readline())
        if current == stamp:
            return
        if current is not None:
            aside = shelved_label_file(cache, current)
            cache.replace(aside)
            aside.touch()  # its age is when it was set aside
    mine = shelved_label_file(cache, stamp)
    if mine.exists():
        mine.replace(cache)
    shelves = sorted(
        cache.parent.glob(f"{cache.stem}.stamp-*{cache.suffix}"),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in shelves[SHELVED_LABEL_FILES:]:
        old.unlink(missing_ok=True)


@torch.inference_mode()
def _sequence_logits(
    model: LoadedModel, items: Sequence[Encoded], batch_size: int = 32
) -> np.ndarray:
    """[len(items), C] the classifier's logits."""
    out = []
    for start in range(0, len(items), batch_size):
        ids, mask, types = _tensors(model, items[start : start + batch_size])
        out.append(model.adapter.logits(ids, mask, types).float().cpu().numpy())
    return np.concatenate(out, axis=0) if out else np.zeros((0, model.num_labels), np.float32)


def normalise_labels(scores: np.ndarray, keep: np.ndarray, scale: str = "rms") -> np.ndarray:
    """One text's teacher scores on a common scale. ``rms``: divided by their root mean square
    over the non-special tokens — signs and zero kept, so a token the teacher found against
    the class stays negative in the head's heat-map. ``standard``: centred and divided by the
    standard deviation (the sign of every token then depends on the text's mean)."""
    values = scores[keep]
    if scale == "standard":
        std = float(values.std()) if values.size > 1 else 1.0
        return (scores - float(values.mean())) / (std if std > 1e-12 else 1.0)
    rms = float(np.sqrt(np.mean(values**2))) if values.size else 0.0
    return scores / (rms if rms > 1e-12 else 1.0)


def mix_labels(
    model: LoadedModel,
    first: Sequence[list[TeacherExample]],
    second: Sequence[list[TeacherExample]],
    weight: float,
    scale: str = "rms",
) -> list[list[TeacherExample]]:
    """Per text, ``(1 - weight) * first + weight * second`` of the two teachers' scores, each
    scaled by :func:`normalise_labels` over the text's non-special tokens. An example the
    second teacher explained for another label or length keeps the first's scores."""
    out: list[list[TeacherExample]] = []
    for group_a, group_b in zip(first, second, strict=True):
        by_target = {ex.target: ex for ex in group_b}
        mixed = []
        for a in group_a:
            b = by_target.get(a.target)
            if b is None or len(b.scores) != len(a.scores):
                mixed.append(a)
                continue
            keep = ~model.encode(a.text).special_mask
            if len(keep) != len(a.scores):
                mixed.append(a)
                continue
            x = normalise_labels(np.asarray(a.scores, dtype=np.float64), keep, scale)
            y = normalise_labels(np.asarray(b.scores, dtype=np.float64), keep, scale)
            mixed.append(TeacherExample(a.text, a.target, ((1 - weight) * x + weight * y).tolist()))
        out.append(mixed)
    return out


def default_layers(model: LoadedModel) -> list[int]:
    """Every hidden state, the embedding output included: the projection learns which count."""
    return list(range(model.num_layers + 1))


@dataclass
class _Item:
    encoded: Encoded
    features: torch.Tensor  # [n, F]
    target: int
    labels: torch.Tensor  # [n] teacher scores on a per-text scale (normalise_labels)
    keep: torch.Tensor  # [n] bool: non-special


def _tensors(
    model: LoadedModel, items: Sequence[Encoded]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return batch_tensors(InlineBatch.from_encoded(list(items), model.pad_id), model.device)


def head_features(
    model: LoadedModel, head: ExplainerHead, items: Sequence[Encoded], batch_size: int = 32
) -> list[torch.Tensor]:
    """Per text, the head's input features [n, F] from one inline forward pass."""
    return _features_and_logits(model, head, items, batch_size)[0]


@torch.inference_mode()
def _features_and_logits(
    model: LoadedModel, head: ExplainerHead, items: Sequence[Encoded], batch_size: int = 32
) -> tuple[list[torch.Tensor], np.ndarray]:
    """:func:`head_features` and the classifier's logits [len(items), C], from the same pass."""
    out: list[torch.Tensor] = []
    logits = [np.zeros((0, model.num_labels), np.float32)]
    for start in range(0, len(items), batch_size):
        chunk = list(items[start : start + batch_size])
        ids, mask, types = _tensors(model, chunk)
        base = model.adapter.run_base(ids, mask, types)
        token_logits = model.adapter.head(base.last_hidden_state)
        norms = base.hidden_states[0].float().norm(dim=-1)
        feats = head.features(base.hidden_states, norms, token_logits).cpu()
        out += [feats[row, : len(e)].clone() for row, e in enumerate(chunk)]
        pooled = model.adapter.logits_from(base.last_hidden_state, mask, token_logits)
        logits.append(pooled.float().cpu().numpy())
    return out, np.concatenate(logits, axis=0)


def _items(
    model: LoadedModel,
    head: ExplainerHead,
    examples: Sequence[TeacherExample],
    label_scale: str = "rms",
) -> list[_Item]:
    encoded = [model.encode(ex.text) for ex in examples]
    feats = head_features(model, head, encoded)
    items = []
    for ex, enc, f in zip(examples, encoded, feats, strict=True):
        keep = ~enc.special_mask
        if keep.sum() == 0 or len(ex.scores) != len(enc):
            continue
        labels = normalise_labels(np.asarray(ex.scores, dtype=np.float32), keep, label_scale)
        items.append(
            _Item(enc, f, ex.target, torch.from_numpy(labels).float(), torch.from_numpy(keep))
        )
    return items


def _unlabelled_items(
    model: LoadedModel, head: ExplainerHead, texts: Sequence[str], config: TrainConfig
) -> list[_Item]:
    """Items for the policy loop alone: the predicted class as target, no labels (zeros)."""
    if config.loop_estimator != "policy" or model.is_multi_label:
        raise ValueError("texts without labels train only the policy loop of single-label models")
    encoded = [model.encode(text) for text in texts]
    features, logits = _features_and_logits(model, head, encoded)
    items = []
    for enc, f, target in zip(encoded, features, logits.argmax(1), strict=True):
        keep = ~enc.special_mask
        if keep.sum():
            items.append(_Item(enc, f, int(target), torch.zeros(len(enc)), torch.from_numpy(keep)))
    return items


def _pad(items: Sequence[_Item]) -> tuple[torch.Tensor, ...]:
    width = max(len(i.encoded) for i in items)
    b, f = len(items), items[0].features.shape[1]
    x = torch.zeros((b, width, f))
    mask = torch.zeros((b, width))
    y = torch.zeros((b, width))
    keep = torch.zeros((b, width), dtype=torch.bool)
    for row, item in enumerate(items):
        n = len(item.encoded)
        x[row, :n] = item.features
        mask[row, :n] = 1
        y[row, :n] = item.labels
        keep[row, :n] = item.keep
    target = torch.tensor([i.target for i in items])
    return x, mask, y, keep, target


def negates_other_class(model: LoadedModel) -> bool:
    """Whether the other column learns the negated scores: two softmax classes share one
    log-odds, so one class's attribution is the other's negated. Multi-label sigmoids are
    independent: every label's column is taught by its own examples only."""
    return model.num_labels == 2 and not model.is_multi_label


def amortisation_loss(
    scores: torch.Tensor,
    y: torch.Tensor,
    keep: torch.Tensor,
    target: torch.Tensor,
    negate_other: bool,
) -> torch.Tensor:
    """Per-example mean squared error on the target column (every example weighs the same);
    with ``negate_other`` (see :func:`negates_other_class`) the other of two columns learns
    the negated scores (exact for log-odds)."""
    rows = torch.arange(scores.shape[0])
    pred = scores[rows, :, target]  # [B, n]
    k = keep.float()
    per_text = ((pred - y) ** 2 * k).sum(1) / k.sum(1).clamp(min=1)
    loss = per_text.mean()
    if negate_other:
        other = scores[rows, :, 1 - target]
        loss = loss + (((other + y) ** 2 * k).sum(1) / k.sum(1).clamp(min=1)).mean()
    return loss


def _batches(
    n: int, size: int, rng: np.random.Generator, lengths: Sequence[int]
) -> list[list[int]]:
    """Shuffled batches of similar lengths (little padding), in random order."""
    order = rng.permutation(n)
    pool = sorted(order.tolist(), key=lambda i: lengths[i])
    batches = [pool[i : i + size] for i in range(0, n, size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def train_head(
    model: LoadedModel,
    examples: Sequence[TeacherExample],
    config: TrainConfig | None = None,
    layers: Sequence[int] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    loop_texts: Sequence[str] = (),
) -> tuple[ExplainerHead, dict[str, Any]]:
    """Train a head on ``examples`` (stage 1, then stage 2 if ``config.loop_steps``).

    ``loop_texts``: more texts for the ``policy`` loop stage, beside the examples' own. That
    stage reads the classifier, never the labels, so its texts need none; each explains the
    model's predicted class (single-label models only)."""
    config = config or TrainConfig()
    started = time.monotonic()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        head = ExplainerHead(
            list(layers or default_layers(model)),
            model.hidden_size,
            model.num_labels,
            config.width,
            config.attention_heads,
        ).to(model.device)
    items = _items(model, head, examples, config.label_scale)
    head.standardise_from([i.features for i in items])  # a linear head's; others ignore it
    rng = np.random.default_rng(config.seed)
    lengths = [len(i.encoded) for i in items]
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=1e-2)
    steps_per_epoch = max(1, -(-len(items) // config.batch_size))
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=config.lr, total_steps=config.epochs * steps_per_epoch
    )
    negate_other = negates_other_class(model)
    head.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        for epoch in range(config.epochs):
            for batch in _batches(len(items), config.batch_size, rng, lengths):
                x, mask, y, keep, target = _pad([items[i] for i in batch])
                loss = amortisation_loss(head.score(x, mask), y, keep, target, negate_other)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
            if progress is not None:
                progress("amortisation", epoch + 1, config.epochs)
        if config.loop_steps:
            if loop_texts:
                items = items + _unlabelled_items(model, head, loop_texts, config)
            _train_in_the_loop(model, head, items, config, rng, progress)
    head.eval()
    info: dict[str, Any] = {
        "epochs": config.epochs,
        "loop_steps": config.loop_steps,
        "width": config.width,
        "seconds": round(time.monotonic() - started, 1),
    }
    if config.loop_steps:
        info["loop_reward"] = config.loop_reward
        info["loop_points"] = config.loop_points
        info["loop_samples"] = config.loop_samples
        info["loop_shift_weight"] = config.loop_shift_weight
        info["loop_average"] = config.loop_average
        info["loop_texts"] = len(loop_texts)
    return head, info


def _train_in_the_loop(
    model: LoadedModel,
    head: ExplainerHead,
    items: Sequence[_Item],
    config: TrainConfig,
    rng: np.random.Generator,
    progress: Callable[[str, int, int], None] | None,
) -> None:
    """Stage 2: the head's own top tokens masked in the frozen classifier (``_policy_loop``,
    or ``_loop`` with straight-through masks on the input embeddings)."""
    classifier = model.model
    frozen = [p for p in classifier.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        if config.loop_estimator == "policy":
            _policy_loop(_Stage2(model, head, items, config, rng, progress))
        elif config.loop_estimator == "straight_through":
            _loop(_Stage2(model, head, items, config, rng, progress))
        else:
            raise ValueError(f"unknown loop estimator {config.loop_estimator!r}")
    finally:
        for p in frozen:
            p.requires_grad_(True)


@dataclass
class _Stage2:
    """What a stage-2 loop works on."""

    model: LoadedModel
    head: ExplainerHead
    items: Sequence[_Item]
    config: TrainConfig
    rng: np.random.Generator
    progress: Callable[[str, int, int], None] | None

    def optimizer(self, default_lr: float) -> torch.optim.Optimizer:
        lr = self.config.loop_lr if self.config.loop_lr is not None else default_lr
        return torch.optim.AdamW(self.head.parameters(), lr=lr, weight_decay=1e-2)

    def batches(self) -> Iterator[list[_Item]]:
        """Stage 2's batches, one per step: ``config.loop_steps`` of them, reshuffled after
        every pass; a step is reported done when the next batch is asked for (or at the end)."""
        lengths = [len(i.encoded) for i in self.items]
        size, steps = self.config.loop_batch_size, self.config.loop_steps
        step = 0
        while True:
            for batch in _batches(len(self.items), size, self.rng, lengths):
                if step >= steps:
                    self._report(step)
                    return
                if step:
                    self._report(step)
                step += 1
                yield [self.items[i] for i in batch]

    def _report(self, step: int) -> None:
        if self.progress is not None and step:
            self.progress("classifier in the loop", step, self.config.loop_steps)


def _loop(run: _Stage2) -> None:
    model, head, config, rng = run.model, run.head, run.config, run.rng
    classifier = model.model
    embed = classifier.get_input_embeddings()
    mask_id = model.mask_token_id if model.mask_token_id is not None else model.pad_id
    mask_vector = embed.weight[int(mask_id)].detach()
    optimizer = run.optimizer(default_lr=5e-4)
    fractions = torch.tensor(LOOP_FRACTIONS)
    for chosen in run.batches():
        x, mask, y, keep, target = _pad(chosen)
        scores = head.score(x, mask)
        rows = torch.arange(len(chosen))
        s = scores[rows, :, target]  # [B, n]
        # Per text: a random share k of its tokens; threshold halfway between the k-th and
        # the (k+1)-th highest score, temperature from the spread of its scores.
        frac = fractions[torch.as_tensor(rng.integers(0, len(fractions), len(chosen)))]
        n_keep = keep.sum(1)
        k = torch.clamp((frac * n_keep).round().long(), min=1)
        masked = s.masked_fill(~keep, float("-inf"))
        ordered = masked.sort(dim=1, descending=True).values
        hi = ordered[rows, k - 1]
        lo = torch.where(k < n_keep, ordered[rows, k.clamp(max=ordered.shape[1] - 1)], hi - 1)
        threshold = ((hi + lo) / 2).detach()
        spread = s.masked_fill(~keep, 0).std(dim=1).clamp(min=1e-3).detach()
        soft = torch.sigmoid((s - threshold[:, None]) / (0.25 * spread[:, None]))
        hard = (s >= threshold[:, None]).float()
        top = (hard + soft - soft.detach()) * keep.float()  # 1 = among the head's top k
        ids, attn, types = _tensors(model, [c.encoded for c in chosen])
        words = embed(ids)
        deleted = words * (1 - top[..., None]) + mask_vector * top[..., None]
        kept_only = (
            words * (top + (~keep).float())[..., None]
            + mask_vector * ((1 - top) * keep.float())[..., None]
        )
        both = torch.cat([deleted, kept_only])
        logits = model.adapter.logits(
            None,
            torch.cat([attn, attn]),
            None if types is None else torch.cat([types, types]),
            inputs_embeds=both,
        ).float()
        p = _class_probability(model, logits, torch.cat([target, target]))
        faithfulness = p[: len(chosen)].mean() - p[len(chosen) :].mean()
        anchor = amortisation_loss(scores, y, keep, target, negates_other_class(model))
        loss = config.loop_weight * faithfulness + anchor
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


LOOP_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5)
"""The shares of each text's tokens that the stage-2 loops mask (where the curves are read)."""
LOOP_REWARDS = ("mask", "delete", "keep")


def _class_probability(
    model: LoadedModel, logits: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """The explained class's probability per row: a multi-label example is about its own
    label's sigmoid, not a share of a softmax."""
    probs = torch.sigmoid(logits) if model.is_multi_label else torch.softmax(logits, dim=-1)
    return probs[torch.arange(len(target)), target]


@torch.no_grad()
def perturbation_curve(
    model: LoadedModel,
    order: torch.Tensor,
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    keep: torch.Tensor,
    target: torch.Tensor,
    replace: str = "mask",
    keep_top: bool = False,
    points: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per text, the mean class probability with the first 10, 20, … 50 % of its tokens in
    ``order`` ([B, n] positions, most important first) replaced by the mask token (``replace
    ="mask"``) or cut out of the text (``"delete"``): the curve the deletion metric reads,
    lower is better. ``keep_top``: every token but those replaced instead, the curve the
    sufficiency metric reads (higher is better). ``points`` ([B, m] indices into
    ``LOOP_FRACTIONS``): read only these fractions of each text (default: all five)."""
    ids, attn, types = tensors
    mask_id = int(model.mask_token_id if model.mask_token_id is not None else model.pad_id)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))
    n = keep.sum(1)
    if points is None:
        points = torch.arange(len(LOOP_FRACTIONS)).expand(len(order), -1)
    total = torch.zeros(len(order))
    for column in points.T.tolist():
        # The evaluator's count of tokens (round half to even in float64, at least one).
        k = torch.tensor(
            [
                max(1, min(m, round(LOOP_FRACTIONS[i] * m)))
                for i, m in zip(column, n.tolist(), strict=True)
            ]
        )
        top = (rank < k[:, None]) & keep
        drop = keep & ~top if keep_top else top
        if replace == "mask":
            kwargs = _inputs(ids.masked_fill(drop, mask_id), attn, types)
        elif replace == "delete":
            kwargs = _cut(model, drop, ids, attn, types)
        else:
            raise ValueError(f"unknown replacement {replace!r}")
        logits = model.adapter.logits(
            kwargs["input_ids"], kwargs["attention_mask"], kwargs.get("token_type_ids")
        )
        total += _class_probability(model, logits.float(), target)
    return total / points.shape[1]


def _inputs(
    ids: torch.Tensor, attn: torch.Tensor, types: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    kwargs = {"input_ids": ids, "attention_mask": attn}
    if types is not None:
        kwargs["token_type_ids"] = types
    return kwargs


def _cut(
    model: LoadedModel,
    drop: torch.Tensor,
    ids: torch.Tensor,
    attn: torch.Tensor,
    types: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The batch with the ``drop`` positions cut out: each row's remaining tokens move left
    in their order (positions renumbered, as in a text without them), padding after them."""
    present = attn.bool() & ~drop
    # A stable sort of "absent" flags: the present positions first, in their order.
    moved = torch.argsort((~present).int(), dim=1, stable=True)
    width = int(present.sum(1).max())
    moved = moved[:, :width]
    left = present.gather(1, moved)
    new_ids = ids.gather(1, moved).masked_fill(~left, model.pad_id)
    new_types = types.gather(1, moved).masked_fill(~left, 0) if types is not None else None
    return _inputs(new_ids, left.to(attn.dtype), new_types)


def reward_curve(
    model: LoadedModel,
    order: torch.Tensor,
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    keep: torch.Tensor,
    target: torch.Tensor,
    config: TrainConfig,
    points: torch.Tensor | None = None,
    precision: str = "float32",
) -> torch.Tensor:
    """The policy loop's reading of ``order``, lower is better: the weighted mean of its
    deletion curves less the weighted sufficiency curve (``config.loop_reward``), at
    ``points`` (see :func:`perturbation_curve`), the classifier read in ``precision``
    (:func:`read_precision`)."""
    terms = loop_reward_terms(config.loop_reward)
    args = (model, order, tensors, keep, target)
    total = torch.zeros(len(order))
    deleted = {t: w for t, w in terms.items() if t != "keep"}
    with reading(model.device, precision):
        for replace, weight in deleted.items():
            curve = perturbation_curve(*args, replace, points=points)
            total += weight / sum(deleted.values()) * curve
        if "keep" in terms:
            kept = perturbation_curve(*args, "mask", keep_top=True, points=points)
            total -= terms["keep"] * kept
    return total


_REWARD_TERM = re.compile(r"(\d+(?:\.\d*)?|\.\d+)?([a-z]+)")


def loop_reward_terms(reward: str) -> dict[str, float]:
    """``"mask+0.25keep"`` → ``{"mask": 1.0, "keep": 0.25}``; a ValueError for anything else
    (an unknown or repeated term, a weight that is not positive)."""
    terms: dict[str, float] = {}
    for part in reward.split("+"):
        match = _REWARD_TERM.fullmatch(part.strip())
        weight = float(match.group(1) or 1) if match else 0.0
        if not match or match.group(2) not in LOOP_REWARDS or match.group(2) in terms or not weight:
            raise ValueError(
                f"unknown loop reward {reward!r}: {'+'.join(LOOP_REWARDS)} or a part, each "
                "term with an optional positive weight in front (mask+0.25keep)"
            )
        terms[match.group(2)] = weight
    return terms


def plackett_luce_log_prob(
    logits: torch.Tensor, order: torch.Tensor, first: torch.Tensor
) -> torch.Tensor:
    """Per row, the log-probability that a Plackett–Luce model with ``logits`` ([B, n]; -inf
    for positions never drawn) draws the first ``first[b]`` positions of ``order`` in that
    order."""
    ordered = logits.gather(1, order)
    finite = torch.isfinite(ordered)
    # The denominator of each draw: every position not drawn yet.
    remaining = torch.logcumsumexp(ordered.flip(1), dim=1).flip(1)
    terms = (ordered - remaining).masked_fill(~finite, 0.0)
    drawn = torch.arange(order.shape[1])[None, :] < first[:, None]
    return (terms * drawn).sum(1)


def _policy_loop(run: _Stage2) -> None:
    """Stage 2, zeroth order: orders of each text's tokens are sampled from the head's scores
    (Gumbel noise, ``loop_temperature``), each is scored by the frozen classifier's deletion
    curve, and the head moves towards the orders that beat its own (the baseline)."""
    model, head, config = run.model, run.head, run.config
    loop_reward_terms(config.loop_reward)
    if not 1 <= config.loop_points <= len(LOOP_FRACTIONS):
        raise ValueError(f"loop_points {config.loop_points}: 1 to {len(LOOP_FRACTIONS)}")
    optimizer = run.optimizer(default_lr=1e-3)
    stage1 = copy.deepcopy(head).eval() if config.loop_shift_weight else None
    precision = read_precision(model.device, config.read_precision)
    average = _WeightAverage(head, config.loop_average) if config.loop_average else None
    for chosen in run.batches():
        x, mask, _, keep, target = _pad(chosen)
        rows = torch.arange(len(chosen))
        scores = head.score(x, mask)[rows, :, target]
        logits = scores.masked_fill(~keep, float("-inf")) / config.loop_temperature
        tensors = _tensors(model, [c.encoded for c in chosen])
        # The curve points this step reads, per text; its orders share them (paired). All
        # five draw nothing (the random stream of the heads measured before the option).
        points = None
        if config.loop_points < len(LOOP_FRACTIONS):
            draw = torch.rand((len(chosen), len(LOOP_FRACTIONS)))
            points = draw.argsort(1)[:, : config.loop_points]
        reward = partial(
            reward_curve, model, tensors=tensors, keep=keep, target=target, config=config,
            points=points, precision=precision,
        )  # fmt: skip
        own = reward(logits.detach().argsort(1, descending=True))
        half = torch.clamp((max(LOOP_FRACTIONS) * keep.sum(1)).round().long(), min=1)
        loss = torch.zeros(())
        for _ in range(config.loop_samples):
            u = torch.rand(logits.shape).clamp(1e-9, 1 - 1e-9)
            order = (logits.detach() - torch.log(-torch.log(u))).argsort(1, descending=True)
            advantage = own - reward(order)
            log_prob = plackett_luce_log_prob(logits, order, half)
            loss = loss - (advantage * log_prob).mean() / config.loop_samples
        if stage1 is not None:
            with torch.no_grad():
                before = stage1.score(x, mask)[rows, :, target]
            shift = ((scores - before) * keep).sum(1) / keep.sum(1).clamp(min=1)
            loss = loss + config.loop_shift_weight * (shift**2).mean()
        optimizer.zero_grad(set_to_none=True)
        (config.loop_weight * loss).backward()
        optimizer.step()
        if average is not None:
            average.update()
    if average is not None:
        average.apply()


class _WeightAverage:
    """An exponential moving average of a module's floating-point parameters and buffers."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"weight-average decay {decay}: between 0 and 1")
        self.module, self.decay = module, decay
        self.state = {
            k: v.detach().clone() for k, v in module.state_dict().items() if v.is_floating_point()
        }

    @torch.no_grad()
    def update(self) -> None:
        for k, v in self.module.state_dict().items():
            if k in self.state:
                self.state[k].lerp_(v.detach(), 1.0 - self.decay)

    @torch.no_grad()
    def apply(self) -> None:
        self.module.load_state_dict(self.state, strict=False)


@torch.inference_mode()
def predict_scores(model: LoadedModel, head: ExplainerHead, encoded: Encoded) -> np.ndarray:
    """[n, C] head scores for one encoded text (the same numbers the inline path serves)."""
    ids, mask, types = _tensors(model, [encoded])
    base = model.adapter.run_base(ids, mask, types)
    token_logits = model.adapter.head(base.last_hidden_state)
    norms = base.hidden_states[0].float().norm(dim=-1)
    return head(base.hidden_states, norms, token_logits, mask)[0].float().cpu().numpy()


def validate(
    model: LoadedModel,
    head: ExplainerHead,
    examples: Sequence[TeacherExample],
) -> dict[str, float]:
    """Held-out figures: mean per-example Spearman with the teacher, and deletion AOPC (mask,
    10-50 %) of the head, the teacher and NormXLogit on the same examples, with standard
    errors. Multi-label, an example is one (text, label): its column of each explainer, and
    the label's own sigmoid in the deletion curve. ``texts`` counts the examples with a
    defined correlation, ``examples`` those in the AOPC figures."""
    from limelight.evaluation.perturbation import deletion_curve

    correlations = []
    aopc: dict[str, list[float]] = {"head": [], "teacher": [], "normxlogit": []}
    for ex in examples:
        encoded = model.encode(ex.text)
        keep = ~encoded.special_mask
        if keep.sum() < 2 or len(ex.scores) != len(encoded):
            continue
        pred = predict_scores(model, head, encoded)[:, ex.target]
        rho = spearmanr(pred[keep], np.asarray(ex.scores)[keep]).statistic
        if np.isfinite(rho):
            correlations.append(float(rho))
        normx = _normxlogit(model, encoded)[:, ex.target]
        for name, scores in (
            ("head", pred),
            ("teacher", np.asarray(ex.scores)),
            ("normxlogit", normx),
        ):
            aopc[name].append(float(deletion_curve(model, encoded, scores, ex.target).mean()))
    # A figure that cannot be known is left out, never NaN: card.json is strict JSON, and a
    # NaN standard error hid the report's warning (every comparison with NaN is false).
    out = {"texts": float(len(correlations)), "examples": float(len(aopc["head"]))}
    if correlations:
        out["spearman_vs_teacher"] = float(np.mean(correlations))
    for name, values in aopc.items():
        if values:
            out[f"deletion_aopc_{name}"] = float(np.mean(values))
            se = standard_error(values)
            if se is not None:
                out[f"deletion_aopc_{name}_se"] = se
    if aopc["head"]:
        diff = np.asarray(aopc["head"]) - np.asarray(aopc["normxlogit"])
        out["deletion_aopc_head_minus_normxlogit"] = float(diff.mean())
        se = standard_error(diff)
        if se is not None:
            out["deletion_aopc_head_minus_normxlogit_se"] = se
    return out


def standard_error(values: Sequence[float] | np.ndarray) -> float | None:
    """The standard error of the mean of ``values``, or None under two values (a sample
    standard deviation of one value is undefined: numpy gives NaN and a RuntimeWarning)."""
    if len(values) < 2:
        return None
    return float(np.std(values, ddof=1) / np.sqrt(len(values)))


@torch.inference_mode()
def _normxlogit(model: LoadedModel, encoded: Encoded) -> np.ndarray:
    ids, mask, types = _tensors(model, [encoded])
    base = model.adapter.run_base(ids, mask, types)
    token_logits = model.adapter.head(base.last_hidden_state)[0].float()
    norms = base.hidden_states[0][0].float().norm(dim=-1)
    return (norms[:, None] * token_logits).cpu().numpy()  # type: ignore[no-any-return]


def distill(
    model: LoadedModel,
    settings: Settings,
    texts: Sequence[str],
    teacher: str,
    teacher_params: dict[str, Any],
    cache: Path,
    validation_fraction: float = 0.2,
    config: TrainConfig | None = None,
    progress: Progress | None = None,
    train_progress: Callable[[str, int, int], None] | None = None,
    data_name: str = "",
    validation_texts: Sequence[str] | None = None,
    mixture: Mixture | None = None,
    loop_texts: Sequence[str] = (),
) -> tuple[ExplainerHead, HeadCard]:
    """Teacher labels for ``texts`` (resumable), a head trained on them, validated on held-out
    texts: ``validation_texts`` when given, else a ``validation_fraction`` of ``texts``. With
    a ``mixture``, the second teacher labels the same texts (its own resumable cache beside
    ``cache``) and the head learns the per-text mixture of the two. ``loop_texts``: unlabelled
    texts for the loop stage (see :func:`train_head`)."""
    config = config or TrainConfig()
    started = time.monotonic()
    methods = MethodRegistry.load(settings)
    precision = read_precision(model.device, config.read_precision)

    def labels(chosen: Sequence[str], path: Path) -> list[list[TeacherExample]]:
        groups = _teacher_examples(
            model, settings, teacher, teacher_params, chosen, path, progress, methods, precision
        )
        if mixture is None:
            return groups
        other = _teacher_examples(
            model,
            settings,
            mixture.teacher,
            mixture.params,
            chosen,
            mixture_cache(path, mixture.teacher),
            progress,
            methods,
            precision,
        )
        return mix_labels(model, groups, other, mixture.weight, config.label_scale)

    groups = labels(texts, cache)
    # Held out by text: a multi-label text's examples (one per label) stay on one side.
    if validation_texts is None:
        order = np.random.default_rng(config.seed).permutation(len(groups))
        n_val = max(1, round(validation_fraction * len(groups)))
        val_groups = [groups[i] for i in order[:n_val]]
        train_groups = [groups[i] for i in order[n_val:]]
    else:
        train_groups = groups
        val_groups = labels(validation_texts, cache.with_name(cache.stem + ".validation.jsonl"))
    train = [example for group in train_groups for example in group]
    val = [example for group in val_groups for example in group]
    labelled = time.monotonic()
    head, info = train_head(model, train, config, progress=train_progress, loop_texts=loop_texts)
    # Labels resumed from the cache cost nothing here: this is the time of this run.
    info["label_seconds"] = round(labelled - started, 1)
    info["read_precision"] = precision
    # The path a build takes depends on it (MiniLM's reads round differently on 1 and 2 threads;
    # the loop's sampled orders then part): what a rebuild needs to take the same path.
    info["threads"] = torch.get_num_threads()
    card = HeadCard(
        model_version=model.version,
        layers=head.layers,
        hidden_size=model.hidden_size,
        num_labels=model.num_labels,
        width=config.width,
        attention_heads=config.attention_heads,
        teacher=teacher,
        teacher_params=methods.get(teacher).validate_params(teacher_params),
        mixture=(
            {}
            if mixture is None
            else Mixture(
                mixture.teacher,
                methods.get(mixture.teacher).validate_params(mixture.params),
                mixture.weight,
            ).describe()
        ),
        data=data_name,
        train_texts=len(train_groups),
        validation_texts=len(val_groups),
        validation=validate(model, head, val),
        training=info,
        seed=config.seed,
    )
    return head, card
