"""Build (or find) the inline explainer head beside a model: resumable and cached by recipe.

Used by `limelight distill` and by the demo build, so that the first `make serve` serves the
head. The recipe (teacher, budget, data, training) is hashed into the head's card; a head is
rebuilt exactly when its recipe or its model changes. Teacher labels are appended to a JSONL
file beside the head as they finish, so an interrupted build resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from limelight.build_progress import ProgressFile
from limelight.demo import datasets
from limelight.distill.config import DEFAULT_TEACHER, DEFAULT_TEACHER_PARAMS, Mixture, TrainConfig
from limelight.distill.train import LOOP_FRACTIONS, distill
from limelight.errors import InvalidArgument
from limelight.evaluation.figures import decimals, flat_note, number, plus_minus
from limelight.models.explainer_head import ExplainerHead, HeadCard, head_dir, read_card, save_head
from limelight.models.fingerprint import ModelIdentity
from limelight.models.loaded import LoadedModel
from limelight.models.tokenize import backend, check_has_tokens
from limelight.progress import progress_bar
from limelight.settings import Settings

log = logging.getLogger(__name__)

ADDED_LOOP_OPTIONS: dict[str, object] = {
    "loop_points": len(LOOP_FRACTIONS),
    "loop_shift_weight": 0.0,
    "loop_average": 0.0,
}
"""Loop settings added after loops were built, with the value every loop had before."""
ADDED_TRAIN_OPTIONS: dict[str, object] = {"read_precision": "float32"}
"""Settings added after heads were built, with the value every head had before."""

HEAD_RECIPE_VERSION = "2"


@dataclass(frozen=True)
class HeadRecipe:
    """Everything that determines a head. Change a field to rebuild it."""

    teacher: str = DEFAULT_TEACHER
    teacher_params: dict[str, Any] = field(
        default_factory=lambda: dict(DEFAULT_TEACHER_PARAMS[DEFAULT_TEACHER])
    )
    data: str = "rotten_tomatoes"
    """rotten_tomatoes or drugscom (train split), or a CSV/JSONL/text file."""
    n_texts: int = 1000
    validation_texts: int = 100
    """Held out from the end of the data, never trained on."""
    train: TrainConfig = field(default_factory=TrainConfig)
    mixture: Mixture | None = None
    """A second teacher mixed into the labels (``limelight distill --mix``)."""
    loop_texts: int = 0
    """More texts of the data, after the ``n_texts`` labelled ones, that only the ``policy``
    loop stage reads (it needs no labels: ``limelight distill --loop-texts``)."""
    version: str = HEAD_RECIPE_VERSION

    def digest(self) -> str:
        fields = asdict(self)
        if self.mixture is None:  # recipes without a mixture keep the digests they had
            del fields["mixture"]
        if not self.loop_texts or not self.train.loop_steps:  # the same: none read
            del fields["loop_texts"]
        if not self.train.loop_steps:  # the loop's settings cannot change a head without it
            for name in [n for n in fields["train"] if n.startswith("loop_") and n != "loop_steps"]:
                del fields["train"][name]
        else:  # options added later keep the digests of the loops made before them
            for name, before in ADDED_LOOP_OPTIONS.items():
                if fields["train"][name] == before:
                    del fields["train"][name]
        for name, before in ADDED_TRAIN_OPTIONS.items():
            if fields["train"][name] == before:
                del fields["train"][name]
        blob = json.dumps(fields, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def training_texts(data: str, n: int, validation: int) -> tuple[list[str], list[str]]:
    """The first ``n`` texts of ``data`` for training and the last ``validation`` for checking
    (disjoint; both from the training split of a built-in dataset, never its test split)."""
    if data == "rotten_tomatoes":
        examples = datasets.rotten_tomatoes("train")
    elif data == "drugscom":
        examples = datasets.drugscom("train")
    else:
        examples = datasets.read_labelled(Path(data))
    texts = [e.text for e in examples]
    validation = min(validation, max(0, len(texts) - 1))
    held_out = texts[len(texts) - validation :] if validation else []
    return texts[: min(n, len(texts) - validation)], held_out


def label_cache(directory: Path, teacher: str) -> Path:
    return directory.with_name(directory.name + f".teacher-{teacher}.jsonl")


def build_head(
    model: LoadedModel,
    settings: Settings,
    recipe: HeadRecipe,
    out: Path | None = None,
    progress: bool = True,
    progress_file: Path | None = None,
    built_by: str = "distill",
) -> tuple[ExplainerHead, HeadCard, Path]:
    """Label, train, validate and save a head for ``model`` following ``recipe``;
    ``progress_file``: also write the progress there, for another process (removed at the end);
    ``built_by``: who asked for it (``HeadCard.built_by``).
    """
    out = out or head_dir(model)
    check_head_destination(out, model.directory)
    extra = recipe.loop_texts if recipe.train.loop_steps else 0
    texts, held_out = training_texts(recipe.data, recipe.n_texts + extra, recipe.validation_texts)
    texts, loop_texts = texts[: recipe.n_texts], texts[recipe.n_texts :]
    if not texts:  # before anything is written: a head trained on nothing would still load
        raise InvalidArgument(f"no texts to train on in {recipe.data}")
    check_texts(model, recipe.data, [*texts, *loop_texts, *held_out])
    cache = label_cache(out, recipe.teacher)
    teachers = [recipe.teacher] + ([recipe.mixture.teacher] if recipe.mixture else [])
    bar = progress_bar(
        total=(len(texts) + len(held_out)) * len(teachers),
        desc=" + ".join(teachers) + " labels",
        unit="text",
        enabled=progress,
    )
    stages: dict[str, Any] = {}
    names = ["labels", "amortisation"]
    if recipe.train.loop_steps:
        names.append("classifier in the loop")
    shared = ProgressFile(progress_file, names) if progress_file else None

    def advance_labels(n: int) -> None:
        bar.update(n)
        if shared:
            shared.update("labels", bar.n, bar.total, "texts")

    def advance_training(stage: str, done: int, total: int) -> None:
        if shared:
            shared.update(stage, done, total, "steps" if "loop" in stage else "epochs")
        if not progress:
            return
        if stage not in stages:
            for earlier in [bar, *stages.values()]:  # done: their last lines come first
                earlier.close()
            stages[stage] = progress_bar(total=total, desc=stage, unit="step")
        stages[stage].update(done - stages[stage].n)

    try:
        head, card = distill(
            model,
            settings,
            texts,
            recipe.teacher,
            recipe.teacher_params,
            cache,
            config=recipe.train,
            progress=advance_labels,
            train_progress=advance_training,
            data_name=f"{recipe.data} (first {len(texts)} of the training split)",
            validation_texts=held_out,
            mixture=recipe.mixture,
            loop_texts=loop_texts,
        )
    finally:
        bar.close()
        for stage_bar in stages.values():
            stage_bar.close()
        if shared:
            shared.close()
    card.recipe_hash = recipe.digest()
    card.built_by = built_by
    staging = out.with_name(f".{out.name}.{os.getpid()}")
    save_head(head, card, staging)
    if out.exists():
        shelve_head(out)
    staging.rename(out)
    return head, card, out


def check_texts(model: LoadedModel, data: str, texts: list[str]) -> None:
    """Refuse, before any label is computed, a text the teacher would refuse hours later: one
    the tokenizer keeps nothing of (zero-width or control characters only)."""
    encoder = backend(model.tokenizer, None)
    for text in texts:
        try:
            check_has_tokens(encoder.encode(text))
        except InvalidArgument as exc:
            shown = repr(text) if len(text) <= 40 else repr(text[:40]) + "…"
            raise InvalidArgument(f"{data}: the text {shown}: {exc.message}") from None


def check_head_destination(out: Path, model_dir: Path) -> None:
    """Refuse, before any label is computed, a destination the build would destroy: a head
    replaces only a head (a directory with a card), never a folder of something else — the
    model's own directory included — nor a file."""
    if out.resolve() in (model_dir.resolve(), *model_dir.resolve().parents):
        raise InvalidArgument(f"{out} holds the model itself: write the head to another folder")
    if out.exists() and not out.is_dir():
        raise InvalidArgument(f"{out} exists and is not a folder: choose another --out")
    if out.exists() and read_card(out) is None and any(out.iterdir()):
        raise InvalidArgument(
            f"{out} exists and is not a distilled head (no card.json), and a head written "
            "there would replace what it holds: choose a new folder, or empty this one"
        )


#: How many replaced heads are kept beside the model (the most recently replaced first).
SHELVED_HEADS = 3


def shelved_head_dir(directory: Path, recipe_hash: str) -> Path:
    """Where a head replaced by another recipe's is kept, named by its own recipe."""
    return directory.with_name(f"{directory.name}.recipe-{recipe_hash[:16]}")


def shelve_head(directory: Path, keep: int = SHELVED_HEADS) -> None:
    """Move the head at ``directory`` aside under its recipe's name rather than delete it: two
    checkouts of different versions sharing one cache then swap heads instead of retraining
    them in turn. Only the ``keep`` most recently shelved heads stay."""
    card = read_card(directory)
    if card is None or not card.recipe_hash:  # not a head a recipe can ask for again
        log.warning(
            "removing the inline head at %s: its card records no recipe, so none can ask for "
            "it again",
            directory,
        )
        shutil.rmtree(directory)
        return
    shelf = shelved_head_dir(directory, card.recipe_hash)
    if shelf.exists():
        shutil.rmtree(shelf)
    directory.rename(shelf)
    os.utime(shelf)  # the shelf's age is when it was shelved
    log.warning(
        "replacing the inline head at %s (recipe %s, built by %s): it is kept at %s until %d "
        "more recently replaced heads push it out",
        directory,
        card.recipe_hash,
        card.built_by or "an earlier Limelight",
        shelf,
        keep,
    )
    shelves = sorted(
        directory.parent.glob(f"{directory.name}.recipe-*"),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in shelves[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def restore_head(model: ModelIdentity, recipe: HeadRecipe, directory: Path | None = None) -> bool:
    """Put back a shelved head built by ``recipe`` for this model (shelving the current one);
    False when there is none and the head must be built."""
    out = directory or head_dir(model)
    shelf = shelved_head_dir(out, recipe.digest())
    if not head_is_current(model, recipe, shelf):
        return False
    if out.exists():
        shelve_head(out)
    shelf.rename(out)
    return True


def head_is_current(
    model: ModelIdentity, recipe: HeadRecipe, directory: Path | None = None
) -> bool:
    card = read_card(directory or head_dir(model))
    return (
        card is not None
        and card.model_version == model.version
        and card.recipe_hash == recipe.digest()
    )


def report(card: HeadCard) -> str:
    """A few readable lines about a head's held-out quality, with a warning when it is not
    better than NormXLogit."""
    v = card.validation
    teacher = card.teacher
    if card.mixture:
        w = float(card.mixture["weight"])
        teacher = f"{1 - w:g} {card.teacher} + {w:g} {card.mixture['teacher']}"
    lines = [f"head: {card.parameters:,} parameters, teacher {teacher} on {card.train_texts} texts"]
    if "deletion_aopc_head" in v:
        # A standard error is missing where fewer than two texts were held out.
        head = (v["deletion_aopc_head"], v.get("deletion_aopc_head_se"))
        teacher_aopc = (v["deletion_aopc_teacher"], v.get("deletion_aopc_teacher_se"))
        nxl = (v["deletion_aopc_normxlogit"], v.get("deletion_aopc_normxlogit_se"))
        diff = (
            v.get("deletion_aopc_head_minus_normxlogit", 0.0),
            v.get("deletion_aopc_head_minus_normxlogit_se"),
        )
        places = decimals([*head, *teacher_aopc, *nxl, *diff])
        spearman = v.get("spearman_vs_teacher")
        lines.append(
            f"held-out deletion AOPC ({v.get('texts', 0):.0f} texts): head "
            f"{_pm(*head, places)}, teacher {_pm(*teacher_aopc, places)}, "
            f"normxlogit {_pm(*nxl, places)}; head minus normxlogit "
            f"{_pm(*diff, places, signed=True)} (paired); Spearman with the teacher "
            f"{'n/a' if spearman is None else format(spearman, '.3f')}"
        )
        if diff[1] is None or diff[0] - 2 * diff[1] <= 0.0:
            lines.append(
                "WARNING: the head is not clearly more faithful than NormXLogit on held-out "
                "texts (its paired lead is not above twice its standard error, or one text "
                "gives no standard error); try more texts (--n, --validation) or another "
                "teacher before serving it by default"
            )
        flat = flat_note([head[0], teacher_aopc[0], nxl[0]], LOOP_FRACTIONS)
        if flat:
            lines.append(f"note: {flat}")
    else:
        lines.append(
            "not validated: no held-out texts (--validation 0, or data too small to hold any "
            "out), so nothing says whether the head is more faithful than NormXLogit"
        )
    return "\n".join(lines)


def _pm(value: float, se: float | None, places: int, signed: bool = False) -> str:
    """``value ± se``, or ``value (no standard error)`` where there is none."""
    if se is None:
        return f"{number(value, places, signed)} (no standard error)"
    return plus_minus(value, se, places, signed)


def texts_for(data: str, n: int) -> Sequence[str]:
    return training_texts(data, n, 0)[0]
