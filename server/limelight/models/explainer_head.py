"""The explainer head, its card, and loading it beside the model it belongs to.

The head reads only what the inline forward pass already has — the hidden states of a few
layers, the embedding norms and the per-token head logits — and emits one score per token
and class. A token's importance depends on its neighbours ("not good"), so after a per-token
projection one small self-attention block mixes context before the scores are read out.
It is bound to one model by the model's fingerprint: a head distilled for another model
refuses to load.

It lives in ``models`` (not in ``distill``, which trains it) so that the runtimes, the
``distilled`` method and everything that serves a model can load it without importing the
training code.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn
from torch.nn import functional as F

from limelight.errors import FailedPrecondition
from limelight.files import write_atomically
from limelight.models.fingerprint import ModelIdentity
from limelight.models.loaded import LoadedModel
from limelight.models.tensor_files import load_tensors, save_tensors

log = logging.getLogger(__name__)

HEAD_DIRNAME = "limelight_distilled"
CARD_FORMAT = "limelight-distilled-head/2"
"""A context head's card (a projection, an optional context block, a readout): the layout
every Limelight since the head's second version loads."""
LINEAR_CARD_FORMAT = "limelight-distilled-head/3"
"""A linear head's card (``width`` 0: one map and the ``feature_mean``/``feature_scale``
buffers). Its own format because readers before the linear head compare the card's format
with ``CARD_FORMAT`` and nothing else: with ``/2`` they built a context head of width 0 and
crashed in ``load_state_dict``; with ``/3`` they refuse it with a message and serve the model
without it. Linear heads written before this format existed carry ``/2`` and still load
here. Context heads keep ``/2``: every reader loads them. The format is not part of the
recipe's hash (``HeadRecipe.digest``), so a head already built is not rebuilt for it."""
READABLE_FORMATS = (CARD_FORMAT, LINEAR_CARD_FORMAT)
OUTPUT_NAME = "distilled"
"""The name of the head's output among a runtime's extra inline outputs."""


@dataclass
class HeadCard:
    """What the head is, what it learned from and how well it did on held-out texts."""

    model_version: str
    layers: list[int]
    hidden_size: int
    num_labels: int
    width: int
    teacher: str
    teacher_params: dict[str, Any] = field(default_factory=dict)
    mixture: dict[str, Any] = field(default_factory=dict)
    """A second teacher mixed into the labels (teacher, params, weight); empty when none."""
    attention_heads: int = 4
    data: str = ""
    train_texts: int = 0
    validation_texts: int = 0
    validation: dict[str, float] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    """How it was trained: epochs, the classifier-in-the-loop steps, seconds."""
    recipe_hash: str = ""
    """Digest of everything that determines the head (see ``HeadRecipe``); empty for heads
    trained by hand with `limelight distill`."""
    built_by: str = ""
    """``demo`` for a head the demo build trained, ``distill`` for one trained with `limelight
    distill`; empty in cards written before this field (the demo build's: a start replaces
    those, never a user's own head)."""
    parameters: int = 0
    seed: int = 0
    format: str = CARD_FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> HeadCard:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a card is a JSON object, not {type(data).__name__}")
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass
class UnreadableCard(HeadCard):
    """A card that is there but cannot be read (cut short by a copy, not JSON, not readable by
    this user): ``check_card`` refuses it with ``reason``, as it refuses another model's head,
    so that whatever asks whether the head fits the model gets an answer naming the file
    instead of a traceback, and a start serves the model without it."""

    reason: str = ""


class _ContextBlock(nn.Module):
    """Pre-norm self-attention and feed-forward over the tokens of each text.

    torch runs the attention as one fused ``scaled_dot_product_attention``: on a 512-token
    text the written-out version (scores, softmax, product as separate ops on permuted
    views) took 14 ms against 3 ms, most of the head's time next to MiniLM's forward pass.
    The ONNX graph does not trace this module: ``limelight.runtimes.onnx_head`` writes the
    same computation with ONNX Runtime's fused operators.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by {heads} heads")
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        d = w // self.heads
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        bias = key_bias[:, None, None, :].to(q.dtype)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        mixed = attended.transpose(1, 2).reshape(b, n, w)
        x = x + self.out(mixed)
        return x + self.ff(self.norm2(x))  # type: ignore[no-any-return]


class ExplainerHead(nn.Module):
    """[h_l for l in layers] ⊕ log‖h_0‖ ⊕ LogAt → projection → context block → score per class.

    ``width=0`` makes it a *linear* head: the hidden states as they are, standardised per
    feature with constants fixed from the training texts (:meth:`standardise_from`), through
    one linear map to a score per class. Affine all the way, so serving folds the
    standardisation into the map (:meth:`folded`): one product over the hidden states, the
    cheapest head that reads context (through the classifier's own layers).
    """

    def __init__(
        self,
        layers: list[int],
        hidden_size: int,
        num_labels: int,
        width: int,
        attention_heads: int = 4,
    ) -> None:
        super().__init__()
        self.layers = list(layers)
        self.hidden_size = hidden_size
        self.linear = width == 0
        self.context: _ContextBlock | None = None
        self.readout: nn.Sequential | None = None
        if self.linear:
            if attention_heads:
                raise ValueError("a linear head (width 0) has no context block: attention heads 0")
            features = hidden_size * len(layers)
            self.proj = nn.Linear(features, num_labels)
            self.register_buffer("feature_mean", torch.zeros(features))
            self.register_buffer("feature_scale", torch.ones(features))
            return
        features = hidden_size * len(layers) + 1 + num_labels
        self.proj = nn.Linear(features, width)
        # 0 heads: no context block, a per-token head (the cheapest; reads context only through
        # the classifier's own hidden states).
        self.context = _ContextBlock(width, attention_heads) if attention_heads else None
        self.readout = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, num_labels))

    def features(
        self,
        hidden_states: tuple[torch.Tensor, ...] | list[torch.Tensor],
        embedding_norms: torch.Tensor,
        token_logits: torch.Tensor,
    ) -> torch.Tensor:
        """[B, n, F]: each group normalised on its own (layers differ in scale by orders); a
        linear head's are the hidden states as they are (its standardisation is affine)."""
        if self.linear:
            return torch.cat([hidden_states[layer].float() for layer in self.layers], dim=-1)
        parts = [
            _standardise(hidden_states[layer].float(), self.hidden_size) for layer in self.layers
        ]
        parts.append(torch.log1p(embedding_norms.float()).unsqueeze(-1))
        parts.append(token_logits.float())
        return torch.cat(parts, dim=-1)

    def score(self, features: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, n, C] scores from features [B, n, F] and the padding mask [B, n]."""
        if self.linear:
            mean, scale = self.standardisation()
            return self.proj((features - mean) / scale)  # type: ignore[no-any-return]
        return self._from_projected(self.proj(features), attention_mask)

    def _from_projected(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.context is not None:
            x = self.context(x, (1.0 - attention_mask.to(x.dtype)) * -1e4)
        assert self.readout is not None
        return self.readout(x)  # type: ignore[no-any-return]

    def standardisation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A linear head's per-feature mean and scale (the buffers)."""
        return self.get_buffer("feature_mean"), self.get_buffer("feature_scale")

    @torch.no_grad()
    def standardise_from(self, features: list[torch.Tensor]) -> None:
        """Fix a linear head's standardisation from training features (each [n, F]): the
        hidden states of different layers, and features within one, differ in scale by
        orders, which a single learning rate cannot fit. A context head ignores this."""
        if not self.linear or not features:
            return
        count = sum(len(f) for f in features)
        mean = torch.stack([f.double().sum(0) for f in features]).sum(0) / count
        square = torch.stack([((f.double() - mean) ** 2).sum(0) for f in features]).sum(0)
        scale = (square / max(count - 1, 1)).sqrt().clamp(min=1e-6)
        dest_mean, dest_scale = self.standardisation()
        dest_mean.copy_(mean.to(dest_mean.dtype))
        dest_scale.copy_(scale.to(dest_scale.dtype))

    @torch.no_grad()
    def folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A linear head as one map on the raw hidden states: weight [C, F] and bias [C]
        with the standardisation folded in (the same scores up to float rounding)."""
        if not self.linear:
            raise ValueError("only a linear head (width 0) folds into one map")
        mean, scale = self.standardisation()
        weight = self.proj.weight / scale
        return weight.contiguous(), (self.proj.bias - weight @ mean).contiguous()

    def forward(
        self,
        hidden_states: tuple[torch.Tensor, ...] | list[torch.Tensor],
        embedding_norms: torch.Tensor,
        token_logits: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """``score(features(...))`` without building the wide feature matrix: each hidden
        state goes through its own slice of the projection and the slices are summed. On the
        serving path that copy and the element-wise standardisation were most of the head's
        time; the result is the same up to float rounding (tested)."""
        if self.linear:
            return self.score(
                self.features(hidden_states, embedding_norms, token_logits), attention_mask
            )
        k = self.hidden_size
        weight = self.proj.weight
        tail = len(self.layers) * k
        x = self.proj.bias + F.linear(
            torch.log1p(embedding_norms.float()).unsqueeze(-1), weight[:, tail : tail + 1]
        )
        x = x + F.linear(token_logits.float(), weight[:, tail + 1 :])
        for i, layer in enumerate(self.layers):
            x = x + F.linear(
                _standardise(hidden_states[layer].float(), self.hidden_size),
                weight[:, i * k : (i + 1) * k],
            )
        return self._from_projected(x, attention_mask)


class FrozenHead:
    """An ``ExplainerHead``'s forward pass for serving, as plain tensor functions.

    The same computation, up to float rounding (tested, padding included), without what a
    module pays on every call and a small head cannot hide: each submodule's ``__call__``,
    the projection's weight sliced and transposed again per layer, the attention mask built
    as an additive bias in three operations. On BERT-tiny (a 1.5 ms forward at batch 1) that
    took the head from 0.38 to 0.23 ms. Training and evaluation keep using the module; the
    torch runtime serves this (the ONNX graph has its own version, ``runtimes.onnx_head``).
    The weights are copied at freezing: a module trained further afterwards is not seen.
    """

    def __init__(self, head: ExplainerHead) -> None:
        def own(t: torch.Tensor) -> torch.Tensor:
            return t.detach().contiguous()

        k = head.hidden_size
        weight = head.proj.weight
        tail = len(head.layers) * k
        self.layers = list(head.layers)
        self.hidden_size = k
        self.width = weight.shape[0]
        # a linear head: one product over the concatenated hidden states, nothing else
        self.folded = head.folded() if head.linear else None
        if self.folded is not None:
            self.heads, self.params = 0, []
            return
        self.layer_weights = [own(weight[:, i * k : (i + 1) * k]) for i in range(len(head.layers))]
        # log‖h_0‖ and the token logits enter through one product with the bias folded in
        self.extra_weight, self.bias = own(weight[:, tail:]), own(head.proj.bias)
        context = head.context
        self.heads = context.heads if context is not None else 0
        params = (
            [
                context.norm1,
                context.qkv,
                context.out,
                context.norm2,
                context.ff[0],
                context.ff[2],
            ]
            if context is not None
            else []
        ) + ([head.readout[0], head.readout[1]] if head.readout is not None else [])
        self.params = [
            (own(m.get_parameter("weight")), own(m.get_parameter("bias"))) for m in params
        ]

    def __call__(
        self,
        hidden_states: tuple[torch.Tensor, ...] | list[torch.Tensor],
        embedding_norms: torch.Tensor,
        token_logits: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        if self.folded is not None:
            states = [hidden_states[layer] for layer in self.layers]
            x = states[0] if len(states) == 1 else torch.cat(states, dim=-1)
            return F.linear(x.float(), *self.folded)
        k, w = self.hidden_size, self.width
        extra = torch.cat(
            [torch.log1p(embedding_norms.float()).unsqueeze(-1), token_logits.float()], dim=-1
        )
        x = F.linear(extra, self.extra_weight, self.bias)
        for layer, weight in zip(self.layers, self.layer_weights, strict=True):
            x = x + F.linear(F.layer_norm(hidden_states[layer].float(), (k,), eps=1e-5), weight)
        if self.heads:
            norm1, qkv, out, norm2, ff1, ff2 = self.params[:6]
            b, n, _ = x.shape
            q, key, v = (
                F.linear(F.layer_norm(x, (w,), *norm1), *qkv)
                .view(b, n, 3, self.heads, w // self.heads)
                .permute(2, 0, 3, 1, 4)
            )
            # a boolean mask: the additive -1e4 of the module, exactly, in float32
            keep = attention_mask.bool()[:, None, None, :]
            attended = F.scaled_dot_product_attention(q, key, v, attn_mask=keep)
            x = x + F.linear(attended.transpose(1, 2).reshape(b, n, w), *out)
            x = x + F.linear(F.gelu(F.linear(F.layer_norm(x, (w,), *norm2), *ff1)), *ff2)
        norm, readout = self.params[-2:]
        return F.linear(F.layer_norm(x, (w,), *norm), *readout)


def _standardise(x: torch.Tensor, width: int) -> torch.Tensor:
    """Per-token standardisation over features (LayerNorm without weights, one fused kernel):
    never across positions, so a token's features do not depend on the padding of its batch."""
    return F.layer_norm(x, (width,), eps=1e-5)  # a constant width: the ONNX trace needs one


def head_dir(model: ModelIdentity) -> Path:
    return model.directory / HEAD_DIRNAME


def building_lock(model_dir: Path) -> Path:
    """The lock a process holds while it builds the demo's head beside ``model_dir``."""
    return model_dir.parent / f".{model_dir.name}.inline-head.lock"


def building_progress(model_dir: Path) -> Path:
    """Where that process writes how far it has got (limelight.build_progress)."""
    return model_dir.parent / f".{model_dir.name}.inline-head.progress.json"


def save_head(head: ExplainerHead, card: HeadCard, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    card.parameters = sum(p.numel() for p in head.parameters())
    card.format = card_format(head)
    save_tensors(head.state_dict(), directory / "head.safetensors")
    # The card last: a directory with a card is a complete head.
    write_atomically(directory / "card.json", card.to_json())
    return directory


def card_format(head: ExplainerHead) -> str:
    """The format a card of ``head`` is written with: the oldest whose readers all load it."""
    return LINEAR_CARD_FORMAT if head.linear else CARD_FORMAT


def read_card(directory: Path) -> HeadCard | None:
    """The card in ``directory``; None when there is none; an :class:`UnreadableCard` when one
    is there that cannot be read."""
    path = directory / "card.json"
    try:
        return HeadCard.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:  # TypeError: a field missing
        # Beside a model, the command that writes this very folder; elsewhere (``--out``),
        # the model is not known here.
        again = (
            f"`limelight distill --model {directory.parent}`"
            if directory.name == HEAD_DIRNAME
            else "`limelight distill`"
        )
        reason = (
            f"the distilled head's card {path} cannot be read ({type(exc).__name__}: {exc}); "
            f"run {again} again, or restore the file"
        )
        return UnreadableCard(
            model_version="",
            layers=[],
            hidden_size=0,
            num_labels=0,
            width=0,
            teacher="",
            format="",
            reason=reason,
        )


def check_card(card: HeadCard, model: LoadedModel) -> str:
    """Empty when ``card`` belongs to ``model``; otherwise why not and what to do."""
    if isinstance(card, UnreadableCard):
        return card.reason
    if card.format not in READABLE_FORMATS:
        readable = " and ".join(repr(f) for f in READABLE_FORMATS)
        return (
            f"the distilled head has format {card.format!r}; this Limelight reads "
            f"{readable}: run `limelight distill --model {model.directory}` again"
        )
    if card.model_version != model.version:
        return (
            f"the distilled head was trained for model version {card.model_version}, but this "
            f"model is {model.version}; run `limelight distill --model {model.directory}` again"
        )
    if card.hidden_size != model.hidden_size or card.num_labels != model.num_labels:
        return "the distilled head does not match this model's hidden size or labels"
    return ""


def new_head(card: HeadCard) -> ExplainerHead:
    return ExplainerHead(
        card.layers, card.hidden_size, card.num_labels, card.width, card.attention_heads
    )


def load_head(model: LoadedModel, directory: Path | None = None) -> ExplainerHead:
    """Load the head beside ``model`` (or from ``directory``); refuses another model's head."""
    directory = directory or head_dir(model)
    card = read_card(directory)
    if card is None:
        raise FailedPrecondition(
            f"no distilled head at {directory}; create one with "
            f"`limelight distill --model {model.directory}`"
        )
    reason = check_card(card, model)
    if reason:
        raise FailedPrecondition(reason)
    weights = directory / "head.safetensors"
    try:
        head = new_head(card)
        head.load_state_dict(load_tensors(weights))
    except (OSError, ValueError, TypeError, RuntimeError, SafetensorError) as exc:
        # Cut short, unreadable, or not the weights its card describes (a copy half done):
        # RuntimeError is load_state_dict's for keys or shapes that do not match.
        raise FailedPrecondition(
            f"the distilled head's weights {weights} cannot be loaded "
            f"({type(exc).__name__}: {_first_line(exc)}); run `limelight distill --model "
            f"{model.directory}` again, or restore the file"
        ) from exc
    return head.eval().to(model.device)


def _first_line(exc: BaseException) -> str:
    """load_state_dict lists every key that does not match, one a line: the first says enough."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def check_head_readable(model: LoadedModel) -> None:
    """Raise the ``FailedPrecondition`` naming the file when the head beside ``model`` is there,
    its card not refused as another model's, but it cannot be read or loaded; nothing when it
    can, or when there is none. The reloader's test of a build that left the served head out:
    a half-written or unreadable head is a failed build, tried again, not a head gone."""
    card = read_card(head_dir(model))
    if isinstance(card, UnreadableCard):
        raise FailedPrecondition(card.reason)
    if card is not None and not check_card(card, model):
        load_head(model)


def inline_heads(model: LoadedModel) -> dict[str, ExplainerHead]:
    """The extra inline heads served beside ``model``, by output name: what the sidecar, the
    benchmarks, the ONNX export and the evaluation hand to a runtime, so that all of them
    compute the same outputs. A head whose card does not match the model, or whose card or
    weights cannot be read (a copy cut short), is logged and left out (the model is then
    served without it: a start does not fail on it, and the warning names the file)."""
    card = read_card(head_dir(model))
    if card is None:
        return {}
    reason = check_card(card, model)
    if reason:
        log.warning("not loading the distilled head: %s", reason)
        return {}
    try:
        return {OUTPUT_NAME: load_head(model)}
    except FailedPrecondition as exc:
        log.warning("not loading the distilled head: %s", exc.message)
        return {}
