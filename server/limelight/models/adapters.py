"""Head-on-top adapters: apply a classifier's own head to every token's final hidden state.

NormXLogit needs LogAt_i = f_cls(h_L[i]) for every token i, where f_cls is the part of the
classifier that maps the pooled vector to logits. One mechanism serves every architecture:

* the **base** is the model's ``base_model`` (transformers' ``base_model_prefix``);
* the **embedding-layer output** is ``hidden_states[0]`` of the base forward and the **final
  hidden states** its ``last_hidden_state``;
* the **head** is derived from the modules the classifier registers beside its base — each
  applied to a one-token sequence, so that every module's own pooling (first token, last token,
  mean) picks that token — optionally preceded by the base's own pooler;
* the **pooling** (first token, last non-pad token, or masked mean) is the one under which the
  derived head reproduces the model's logits.

Several candidate heads and poolings are tried on a probe input and the first one that
reproduces the model's own logits within ``PROBE_TOLERANCE`` is kept; when none does, the model
is refused with one line. A few families declare a small override (:data:`OVERRIDES`) where the
head applies a functional activation or the base needs an extra input. Architectures that cannot
be served at all are declared in :data:`REFUSED` with the reason.

Per-token forms: with first/last-token pooling, the model's logit is the head output at the
pooled position. With mean pooling (ModernBERT's ``classifier_pooling="mean"``) LogAt_i is the
head applied to h_L[i] alone — the logits of a sequence whose mean representation were token
i's — and the model's logit is the head applied to the masked mean, computed by
:meth:`HeadAdapter.pooled_logits` (the gradient methods use it; the runtimes read the same
logits with :meth:`HeadAdapter.logits_from`, which reuses the per-token logits). With late
pooling (EuroBERT's default) the model's logit is the masked mean of the LogAt_i. See
docs/methods/normxlogit.md.

Encoder-decoders (BART, mBART, PLBART, MVP, BigBird-Pegasus, T5, mT5, UMT5) classify from the
decoder's final state at the last end-of-sequence token, with the input ids shifted right as the
decoder's input. Their per-token form: the embedding output is the encoder's input embeddings
(``hidden_states[0]``), the final hidden state of token i is the decoder's at position i (it has
read the whole encoded input and the input up to token i-1), and the pooling is the last non-pad
token — the last end-of-sequence token for tokenizers that end every text with it, which the
load-time probe with the model's own tokenizer checks.
"""

from __future__ import annotations

import functools
import inspect
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from limelight.errors import FailedPrecondition, ModelLoadError

Pooling = Literal["first", "last", "mean", "late"]
"""Which vector(s) the head sees: the first token's, the last non-pad token's, the masked mean
of the tokens' (then the head), or every token's with the logits averaged ("late")."""
#: Largest |derived - model| logit difference accepted at load time.
PROBE_TOLERANCE = 1e-4


class HeadAdapter(ABC):
    """Access to a sequence classifier's base model, its head and its pooling."""

    #: Whether the base model takes token_type_ids.
    uses_token_type_ids = False
    #: Which position's head output is the model's logit.
    pooling: Pooling = "first"
    #: Whether the base returns copies of its hidden states rather than the tensors its blocks
    #: compute with (Longformer pads to its attention window and slices every state back), so
    #: that no gradient can be taken at ``hidden_states[l]``.
    hidden_state_copies = False
    #: Why feeding the word embeddings (``inputs_embeds``, as the gradient methods do) does not
    #: reproduce the model's logits; empty when it does (checked on the load-time probe).
    inputs_embeds_problem = ""

    def __init__(self, model: nn.Module) -> None:
        # Any: transformers' per-architecture attributes (bert, classifier, ...) are untyped.
        self.model: Any = model

    @property
    @abstractmethod
    def base(self) -> nn.Module:
        """The transformer without the classification head."""

    @abstractmethod
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., n, K] final hidden states -> [..., n, C] logits, each token pooled alone."""

    @property
    def pools_last_token(self) -> bool:
        """Decoder classifiers pool the last non-pad token."""
        return self.pooling == "last"

    def pooled_index(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B] the position whose head output is the model's logit (right padding assumed)."""
        if self.pooling in ("mean", "late"):
            raise FailedPrecondition(
                "this classifier mean-pools its tokens: no single position carries its logit; "
                "use pooled_logits()"
            )
        if self.pooling == "last":
            return attention_mask.long().sum(dim=1) - 1
        return torch.zeros(attention_mask.shape[0], dtype=torch.long, device=attention_mask.device)

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, n, K] final hidden states -> [B, K] the vector the model's head sees."""
        if self.pooling == "late":
            raise FailedPrecondition("this classifier averages per-token logits: no pooled vector")
        if self.pooling == "mean":
            weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
            return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden[rows, self.pooled_index(attention_mask)]

    def pooled_logits(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, n, K] final hidden states -> [B, C] the model's own logits."""
        if self.pooling == "late":
            weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
            token_logits = self.head(hidden)
            return (token_logits * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)
        return self.head(self.pool(hidden, attention_mask)[:, None, :])[:, 0]

    def logits_from(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor, token_logits: torch.Tensor
    ) -> torch.Tensor:
        """[B, C] the model's own logits, reusing ``token_logits`` = ``head(hidden)`` where the
        pooling allows (first, last and late pooling); mean pooling applies the head to the
        masked mean of ``hidden``."""
        if self.pooling == "first":
            return token_logits[:, 0]  # one slice instead of an index over arange and zeros
        if self.pooling == "last":
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            return token_logits[rows, self.pooled_index(attention_mask)]
        if self.pooling == "late":
            weights = attention_mask.to(token_logits.dtype).unsqueeze(-1)
            return (token_logits * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)
        return self.pooled_logits(hidden, attention_mask)

    def base_inputs(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"attention_mask": attention_mask}
        if inputs_embeds is not None:
            # A copy: some bases scale their input embeddings in place (CTRL), which would
            # change the caller's tensor or fail on a leaf that requires grad.
            kwargs["inputs_embeds"] = inputs_embeds.clone()
        else:
            kwargs["input_ids"] = input_ids
        if self.uses_token_type_ids and token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        if self.turns_off_cache:
            kwargs["use_cache"] = False
        return kwargs

    @property
    def turns_off_cache(self) -> bool:
        """Whether to pass ``use_cache=False`` (decoders would otherwise build a KV cache)."""
        return self.pools_last_token

    def logits(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, C] the model's own logits of a right-padded batch, computed as the inline path
        computes them: the base's final hidden states, then the head under the pooling (both
        checked against the classifier's own logits on a padded probe at load time).

        Unlike the classifier's forward, the pooled position comes from the attention mask:
        no ``pad_token_id`` is needed in the config (transformers' last-token classifiers,
        GPT-2's among them, refuse batches of more than one row without one), and a real
        token that happens to equal the pad id is never mistaken for padding (nor is a pad
        position read when the rows come as ``inputs_embeds``, which transformers' last-token
        classifiers cannot search for pad ids)."""
        kwargs = self.base_inputs(input_ids, attention_mask, token_type_ids, inputs_embeds)
        out = self.base(**kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return self.pooled_logits(hidden, attention_mask)

    def run_base(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> Any:
        """Base forward with hidden states; returns the transformers output object."""
        kwargs = self.base_inputs(input_ids, attention_mask, token_type_ids, inputs_embeds)
        return self.base(**kwargs, output_hidden_states=True, output_attentions=output_attentions)

    @property
    def takes_inputs_embeds(self) -> bool:
        """Whether the base accepts ``inputs_embeds`` (the gradient methods feed it)."""
        return _accepts(self.base, "inputs_embeds")

    def embed_words(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, n] ids -> [B, n, K] the word embeddings the base would look up for them."""
        out = self.word_embeddings()(ids)
        if isinstance(out, tuple):  # I-BERT's quantised embedding: (values, scaling factor)
            out = out[0]
        assert isinstance(out, torch.Tensor)
        return out

    def word_embeddings(self) -> nn.Module:
        emb = self.model.get_input_embeddings()
        assert isinstance(emb, nn.Module)
        return emb

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)


# --- the generic adapter ---------------------------------------------------------------------


def _one_token_each(module: Callable[[torch.Tensor], Any], x: torch.Tensor) -> torch.Tensor:
    """Apply ``module`` to every vector of x [N, K] as its own one-token sequence -> [N, D]."""
    out = module(x[:, None, :])
    if isinstance(out, tuple):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{type(module).__name__} returned {type(out).__name__}")
    if out.dim() == 3:
        out = out[:, 0]
    return out


HeadFn = Callable[[Any, torch.Tensor], torch.Tensor]
"""(model, x [N, K]) -> [N, C]: the head on N pooled vectors."""


@dataclass(frozen=True)
class Override:
    """What one family declares where the generic derivation does not fit."""

    #: The head on pooled vectors, when the classifier applies functional steps between
    #: its modules (e.g. DistilBERT's ReLU).
    head: HeadFn | None = None
    #: Extra inputs of the base forward: (model, input_ids or inputs_embeds, mask) -> kwargs.
    base_kwargs: Callable[[Any, torch.Tensor, torch.Tensor], dict[str, Any]] | None = None
    #: Config overrides that select the pooling, e.g. ModernBERT's classifier_pooling.
    pooling: Callable[[Any], Pooling] | None = None
    #: See :attr:`HeadAdapter.hidden_state_copies`.
    hidden_state_copies: bool = False
    #: Run once on the classifier when the adapter is built (e.g. XLNet: make its own forward
    #: read each row's last non-pad token, so padded batches give every row its own logits).
    prepare: Callable[[Any], None] | None = None
    note: str = ""


def _distilbert_head(model: Any, x: torch.Tensor) -> torch.Tensor:
    return model.classifier(torch.relu(model.pre_classifier(x)))  # type: ignore[no-any-return]


def _longformer_globals(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    # As LongformerForSequenceClassification: global attention on the first token.
    glob = torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
    glob[:, 0] = 1
    return {"global_attention_mask": glob}


def _modernbert_pooling(config: Any) -> Pooling:
    return "mean" if getattr(config, "classifier_pooling", "cls") == "mean" else "first"


def _eurobert_pooling(config: Any) -> Pooling:
    kinds: dict[str, Pooling] = {"bos": "first", "mean": "mean", "late": "late"}
    return kinds.get(str(getattr(config, "classifier_pooling", "late")), "late")


def _xlnet_summary_on_last_non_pad(model: Any) -> None:
    """XLNet's sequence summary reads the last position whatever the padding, so the
    classifier's own forward on a right-padded batch reads a pad token's state for the shorter
    rows. Two hooks make it read each row's last non-pad token instead: one keeps the
    attention mask of the classifier's call, the other moves that token's state to the last
    position of the tensor the summary sees (a copy; the base's outputs are untouched). The
    mask is kept per thread: the inference thread and job workers run the model at once."""
    if getattr(model, "_limelight_last_non_pad", False):
        return
    seen = threading.local()

    def keep_mask(_m: nn.Module, _args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.mask = kwargs.get("attention_mask")

    def read_last_non_pad(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        mask = getattr(seen, "mask", None)
        if not args or not isinstance(args[0], torch.Tensor) or mask is None:
            return None
        hidden = args[0]
        if hidden.dim() != 3 or mask.shape != hidden.shape[:2]:
            return None
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last = mask.long().sum(dim=1).clamp_min(1) - 1
        moved = hidden.clone()
        moved[:, -1] = hidden[rows, last.to(hidden.device)]
        return (moved, *args[1:])

    model.register_forward_pre_hook(keep_mask, with_kwargs=True)
    model.sequence_summary.register_forward_pre_hook(read_last_non_pad)
    model._limelight_last_non_pad = True


def _pad_positions(t: torch.Tensor, n: int, dims: int) -> torch.Tensor:
    """Zero-pad the last ``dims`` position axes of t (before the feature axis for states)."""
    if dims == 1:  # [1, L, K] -> [1, n, K]
        return torch.nn.functional.pad(t, (0, 0, 0, n - t.shape[1]))
    return torch.nn.functional.pad(t, (0, n - t.shape[-1], 0, n - t.shape[-2]))


def _rows_unpadded(model: Any) -> None:
    """Make the base run every row of a right-padded batch at its own length and zero-pad the
    outputs back, for bases whose mixing does not honour the attention mask (YOSO's attention
    weights pad keys like real ones; FNet's Fourier mixing takes no mask). Patches the base's
    forward, so that the classifier's own forward (perturbation methods) and the adapter's
    base forward both get it; one forward pass per row. A classifier that does not hand the
    mask on to its base (FNet's) has it kept by a hook for the duration of its call, per
    thread (the inference thread and job workers run the model at once)."""
    base = model.base_model
    if getattr(base, "_limelight_rows_unpadded", False):
        return
    original = base.forward
    signature = inspect.signature(original)
    held = threading.local()

    def hold(_m: nn.Module, _args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        held.mask = kwargs.get("attention_mask")

    def release(_m: nn.Module, _args: tuple[Any, ...], _out: Any) -> None:
        held.mask = None

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        mask = kwargs.pop("attention_mask", None)
        if mask is None:
            mask = getattr(held, "mask", None)
        bound = signature.bind(*args, **kwargs)
        values = dict(bound.arguments)
        extra = values.pop(
            next((k for k, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), ""), {}
        )
        values.update(extra)
        takes_mask = "attention_mask" in signature.parameters
        if mask is None or mask.dim() != 2 or bool(mask.all()):
            if takes_mask and mask is not None:
                values["attention_mask"] = mask
            return original(**values)
        n = mask.shape[1]
        outs = []
        for i, length in enumerate(mask.long().sum(dim=1).clamp_min(1).tolist()):
            row = {
                k: v[i : i + 1, :length]
                if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[:2] == mask.shape
                else v
                for k, v in values.items()
            }
            if takes_mask:
                row["attention_mask"] = mask[i : i + 1, :length]
            outs.append(original(**row))
        merged: dict[str, Any] = {}
        for key, first in outs[0].items():
            if key in ("last_hidden_state", "hidden_states", "attentions"):
                dims = 2 if key == "attentions" else 1
                if isinstance(first, tuple):
                    merged[key] = tuple(
                        torch.cat([_pad_positions(o[key][j], n, dims) for o in outs])
                        for j in range(len(first))
                    )
                else:
                    merged[key] = torch.cat([_pad_positions(o[key], n, dims) for o in outs])
            elif isinstance(first, torch.Tensor):
                merged[key] = torch.cat([o[key] for o in outs])
        return type(outs[0])(**merged)

    base.forward = forward
    base._limelight_rows_unpadded = True
    model.register_forward_pre_hook(hold, with_kwargs=True)
    model.register_forward_hook(release)


def _t5_decoder_inputs(model: Any, source: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    # T5's base does not build the decoder's input itself (its classifier shifts the ids).
    if source.is_floating_point():
        return {}  # inputs_embeds: GenericAdapter.base_inputs adds decoder_inputs_embeds
    return {"decoder_input_ids": model._shift_right(source)}


OVERRIDES: dict[str, Override] = {
    **{
        t: Override(
            base_kwargs=_t5_decoder_inputs,
            note="declared input: the decoder reads the ids shifted right, as its classifier",
        )
        for t in ("t5", "mt5", "umt5")
    },
    "fnet": Override(
        prepare=_rows_unpadded,
        note="declared: rows run unpadded, one forward pass each (its Fourier transform mixes "
        "every position and takes no attention mask); it has no attention weights",
    ),
    "yoso": Override(
        prepare=_rows_unpadded,
        note="declared: rows run unpadded, one forward pass each (its attention weights every "
        "key by int(1 + mask/10000), so pad tokens would be attended like real ones)",
    ),
    "xlnet": Override(
        pooling=lambda _config: "last",
        prepare=_xlnet_summary_on_last_non_pad,
        note="declared pooling: its sequence summary on the last non-pad token (transformers "
        "reads the last position whatever the padding; Limelight's padded batches read each "
        "row's own last token, as one unpadded text would)",
    ),
    "distilbert": Override(
        head=_distilbert_head, note="ReLU between pre_classifier and classifier"
    ),
    "longformer": Override(
        base_kwargs=_longformer_globals,
        hidden_state_copies=True,
        note="declared input: global attention on the first token, as its classifier; its "
        "hidden states are sliced copies (padded to the attention window inside the base)",
    ),
    "modernbert": Override(
        pooling=_modernbert_pooling,
        note="declared pooling from classifier_pooling (cls or mean; the table's tiny model "
        "uses its default)",
    ),
    "eurobert": Override(
        pooling=_eurobert_pooling,
        note="declared pooling from classifier_pooling: bos, mean or late (mean of per-token "
        "logits; the table's tiny model uses its default)",
    ),
}

#: Architectures refused before loading, with the reason (one line each).
REFUSED: dict[str, str] = {
    **{
        t: "encoder-decoder built from separate encoder and decoder configs: its tiny model "
        "did not finish building and checking here (two minutes), so it is refused rather "
        "than served unchecked"
        for t in ("t5gemma", "t5gemma2")
    },
    **{
        t: "not text-only: built for layout, image, entity or table inputs besides the tokens"
        for t in (
            "layoutlm",
            "layoutlmv2",
            "layoutlmv3",
            "lilt",
            "luke",
            "markuplm",
            "modernvbert",
            "perceiver",
            "tapas",
            "ultravbert",
        )
    },
    "gemma3": "multimodal classifier with a vision tower; text classifiers of this family are "
    "gemma3_text, which is served",
    "qwen3_5": "multimodal classifier with a vision tower; text classifiers of this family are "
    "qwen3_5_text, which is served",
    "funnel": "the encoder pools the sequence to fewer positions, so final hidden states do "
    "not line up with the input tokens",
    "canine": "character-level: its deep stack runs on characters downsampled by "
    "downsampling_rate (4 by default), so its inner hidden states have fewer positions than "
    "the input; only the character embeddings and the upsampled final states are per character",
    "reformer": "its base pads the input to a multiple of its attention chunk length and its "
    "reversible layers return two concatenated streams, so its hidden states have neither one "
    "position per input token nor the embedding width; its LSH attention also draws new random "
    "rotations on every forward unless the config sets hash_seed",
}

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d)


@dataclass
class _Candidate:
    name: str
    head: HeadFn
    poolings: Sequence[Pooling] = field(default_factory=lambda: ("first", "last", "mean"))
    #: The modules ``head`` chains, when it only chains modules (not a declared head).
    modules: Sequence[nn.Module] = ()


#: Parameterless activation modules that are not elementwise: never taken as row-wise.
_NOT_ELEMENTWISE = (nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d, nn.MultiheadAttention)
_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")
_ROW_WISE_LAYERS = (nn.Linear, nn.LayerNorm, nn.Dropout, nn.Identity)


def _rowwise_leaves(modules: Sequence[nn.Module]) -> list[nn.Module] | None:
    """The leaf modules of ``modules`` in registration order when each one acts on the last axis
    alone (linear layers, layer norms, dropout, parameterless elementwise activations); None when
    any other module is among them. Whether running them in this order *is* the head (a module's
    forward may apply functional steps between its children) is checked by the caller."""
    leaves: list[nn.Module] = []
    for module in modules:
        for leaf in module.modules():
            if next(leaf.children(), None) is not None:
                continue  # a container: its children follow
            elementwise = (
                type(leaf).__module__ in _ACTIVATION_MODULES
                and not isinstance(leaf, _NOT_ELEMENTWISE)
                and next(leaf.parameters(recurse=False), None) is None
            )
            if not elementwise and not isinstance(leaf, _ROW_WISE_LAYERS):
                return None
            leaves.append(leaf)
    return leaves or None


def _accepts(module: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params


class GenericAdapter(HeadAdapter):
    """Head, pooling and base derived from the model, checked against its logits on a probe."""

    def __init__(self, model: nn.Module, override: Override | None = None) -> None:
        super().__init__(model)
        config = self.model.config
        self.model_type = str(getattr(config, "model_type", ""))
        self.override = override or OVERRIDES.get(self.model_type, Override())
        if self.override.prepare is not None:
            self.override.prepare(self.model)
        base = getattr(self.model, "base_model", None)
        if not isinstance(base, nn.Module) or base is self.model:
            raise ModelLoadError(
                f"architecture {self.model_type!r}: no base model under the classification head"
            )
        self._base: nn.Module = base
        self.uses_token_type_ids = (
            _accepts(base, "token_type_ids") and int(getattr(config, "type_vocab_size", 0) or 0) > 1
        )
        self._use_cache = _accepts(base, "use_cache")
        #: Encoder-decoder classifiers (BART-style): see :meth:`run_base`.
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        self.hidden_state_copies = self.override.hidden_state_copies
        self._head_fn: HeadFn | None = None
        #: The derived head as modules applied to the last axis of a tensor of any shape, when
        #: it is one (checked at derivation): what :meth:`head` runs then, with no reshapes and
        #: no one-token sequences — fewer operations per pass, and a shorter exported graph.
        self._rowwise: tuple[nn.Module, ...] | None = None
        self.derivation = ""

    @property
    def base(self) -> nn.Module:
        return self._base

    @property
    def row_wise(self) -> bool:
        """Whether :meth:`head` runs the derived head's modules on the last axis directly
        (checked against the one-token form on the probe) rather than on one-token sequences."""
        return self._rowwise is not None

    def one_token_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The derived head applied to each vector of ``hidden`` [..., K] as a one-token
        sequence -> [..., C]: what :meth:`head` computes, in the form every head allows."""
        if self._head_fn is None:
            raise FailedPrecondition("the adapter's head has not been derived (call derive())")
        lead, k = hidden.shape[:-1], hidden.shape[-1]
        out = self._head_fn(self.model, hidden.reshape(-1, k))
        return out.reshape(*lead, out.shape[-1])

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._rowwise is None:
            return self.one_token_head(hidden)
        for module in self._rowwise:
            hidden = module(hidden)
        return hidden

    @property
    def turns_off_cache(self) -> bool:
        return bool(self._use_cache)

    def base_inputs(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        kwargs = super().base_inputs(input_ids, attention_mask, token_type_ids, inputs_embeds)
        if self.encoder_decoder and inputs_embeds is not None:
            kwargs["decoder_inputs_embeds"] = self._shifted_right(kwargs["inputs_embeds"])
        if self.override.base_kwargs is not None:
            source = inputs_embeds if inputs_embeds is not None else input_ids
            assert source is not None
            kwargs.update(self.override.base_kwargs(self.model, source, attention_mask))
        return kwargs

    def _shifted_right(self, embeds: torch.Tensor) -> torch.Tensor:
        """The decoder's input embeddings for ``embeds``: the decoder start token's, then every
        input token's but the last (what the base builds from token ids by shifting them)."""
        config = self.model.config
        start = getattr(config, "decoder_start_token_id", None)
        if not isinstance(start, int):
            start = self._pad_id()
        ids = torch.full(embeds.shape[:1], start, dtype=torch.long, device=embeds.device)
        first = self.embed_words(ids[:, None]).to(embeds.dtype)
        return torch.cat([first, embeds[:, :-1]], dim=1)

    def run_base(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> Any:
        """Base forward with hidden states. An encoder-decoder's is given one position per input
        token: ``hidden_states`` are the encoder's (its input embeddings first) followed by the
        decoder's layers, and ``last_hidden_state`` is the decoder's final state — at position
        i, after reading the input up to token i-1 (shifted right) and the whole encoded input,
        which is what its classification head reads at the last end-of-sequence token."""
        out = super().run_base(
            input_ids, attention_mask, token_type_ids, inputs_embeds, output_attentions
        )
        if not self.encoder_decoder:
            return out
        from transformers.modeling_outputs import BaseModelOutput

        encoder = tuple(out.encoder_hidden_states or ())
        decoder = tuple(out.decoder_hidden_states or ())
        return BaseModelOutput(
            last_hidden_state=out.last_hidden_state,
            hidden_states=(*encoder, *decoder[1:]) if encoder and decoder else None,
            attentions=out.encoder_attentions,
        )

    # --- derivation ----------------------------------------------------------------------

    def _candidates(self) -> list[_Candidate]:
        model, base = self.model, self._base
        poolings: Sequence[Pooling] = ("first", "last", "mean")
        if isinstance(getattr(model, "score", None), nn.Module):  # decoder-style score head
            poolings = ("last", "first", "mean")
        if self.override.pooling is not None:
            poolings = (self.override.pooling(model.config),)
        if self.override.head is not None:
            return [_Candidate("declared head", self.override.head, poolings)]
        beside = [
            (name, m)
            for name, m in model.named_children()
            if m is not base and not isinstance(m, _DROPOUT)
        ]
        chain = [m for _, m in beside]
        names = "+".join(name for name, _ in beside)
        out: list[_Candidate] = []

        def chained(modules: Sequence[Callable[[torch.Tensor], Any]]) -> HeadFn:
            def run(_: Any, x: torch.Tensor) -> torch.Tensor:
                for module in modules:
                    x = _one_token_each(module, x)
                return x

            return run

        if chain:
            out.append(_Candidate(names, chained(chain), poolings, chain))
        pooler = getattr(base, "pooler", None)
        if isinstance(pooler, nn.Module) and chain:
            act = getattr(base, "pooler_activation", None)
            pre = [pooler, act] if isinstance(act, nn.Module) else [pooler]
            out.append(
                _Candidate(f"pooler+{names}", chained([*pre, *chain]), poolings, [*pre, *chain])
            )
        return out

    def derive(self, probe_ids: Sequence[Sequence[int]] | None = None) -> GenericAdapter:
        """Find the head and pooling that reproduce the model's logits; refuse otherwise.

        The probe runs in eval mode (no dropout); the model's mode is restored afterwards.
        """
        training = bool(self.model.training)
        self.model.eval()
        try:
            return self._derive(probe_ids)
        finally:
            self.model.train(training)

    def _derive(self, probe_ids: Sequence[Sequence[int]] | None) -> GenericAdapter:
        self._rowwise = None  # derived again: the candidates run in their one-token form
        rows = [list(r) for r in probe_ids] if probe_ids else self._synthetic_probe()
        if len(rows) < 2 or min(len(r) for r in rows) < 2:
            raise ValueError("the probe needs two rows of at least two tokens")
        device = next(self.model.parameters()).device
        width = max(len(r) for r in rows)
        pad = self._pad_id()
        ids = torch.full((len(rows), width), pad, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long, device=device)
            mask[i, : len(r)] = 1
        with torch.no_grad():
            try:
                expected = torch.cat(
                    [
                        self.model(
                            input_ids=torch.tensor([r], device=device),
                            **({"use_cache": False} if _accepts(self.model, "use_cache") else {}),
                        ).logits
                        for r in rows
                    ]
                ).float()
                out = self.run_base(ids, mask)
            except Exception as exc:  # any failure of an untested family: one line
                raise ModelLoadError(
                    f"architecture {self.model_type!r}: its forward pass fails on a probe "
                    f"input ({type(exc).__name__}: {_first_line(exc)})"
                ) from exc
            hidden = out.last_hidden_state
            states = getattr(out, "hidden_states", None)
            if hidden is None or not states:
                raise ModelLoadError(
                    f"architecture {self.model_type!r}: the base model returns no hidden states"
                )
            if any(s.shape[:2] != ids.shape for s in (*states, hidden)):
                raise ModelLoadError(
                    f"architecture {self.model_type!r}: its hidden states do not have one "
                    "position per input token"
                )
            best = float("inf")
            for cand in self._candidates():
                for pooling in cand.poolings:
                    self._head_fn, self.pooling = cand.head, pooling
                    try:
                        got = self.pooled_logits(hidden, mask).float()
                    except Exception:  # a candidate that does not fit this model
                        continue
                    if got.shape != expected.shape:
                        continue
                    diff = float((got - expected).abs().max())
                    best = min(best, diff)
                    if diff <= PROBE_TOLERANCE:
                        self.derivation = f"{cand.name}, {pooling} pooling"
                        self._rowwise = self._check_rowwise(cand.modules, hidden)
                        self.inputs_embeds_problem = self._check_inputs_embeds(ids, mask, got)
                        return self
        self._head_fn = self._rowwise = None
        closest = f" (closest: max |Δlogit| {best:.2g})" if best < float("inf") else ""
        raise ModelLoadError(
            f"architecture {self.model_type!r}: no head derived from the model reproduces its "
            f"own logits within {PROBE_TOLERANCE:g}{closest}; refusing rather than explaining "
            "wrongly"
        )

    def _check_rowwise(
        self, modules: Sequence[nn.Module], hidden: torch.Tensor
    ) -> tuple[nn.Module, ...] | None:
        """``modules``' leaves, when running them in turn gives the derived head's output for
        every token (:func:`_rowwise_leaves`): checked on the probe's final hidden states
        [B, n, K] and on random ones ten times their spread, where a skipped or added step of a
        module's own forward (a pooler that does not apply its dense layer) cannot hide."""
        leaves = _rowwise_leaves(modules)
        if leaves is None:
            return None
        generator = torch.Generator(device=hidden.device).manual_seed(0)
        spread = 10 * float(hidden.float().std()) + 1.0
        noise = torch.randn(hidden.shape, generator=generator, device=hidden.device) * spread
        for probe in (hidden, noise.to(hidden.dtype)):
            expected = self.one_token_head(probe)
            got = probe
            try:
                for leaf in leaves:
                    got = leaf(got)
            except Exception:  # children whose forward expects other shapes
                return None
            scale = max(1.0, float(expected.abs().max()))
            if got.shape != expected.shape or float((got - expected).abs().max()) > 1e-5 * scale:
                return None
        return tuple(leaves)

    def _check_inputs_embeds(
        self, ids: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor
    ) -> str:
        """Why the base fed ``inputs_embeds`` instead of ``ids`` gives other logits ("" if not)."""
        if not self.takes_inputs_embeds:
            return "its base takes token ids only (no inputs_embeds)"
        try:
            out = self.run_base(None, mask, inputs_embeds=self.embed_words(ids))
            got = self.pooled_logits(out.last_hidden_state, mask).float()
        except Exception as exc:  # a base that accepts the argument but fails on it
            return f"its base fails on inputs_embeds ({type(exc).__name__}: {_first_line(exc)})"
        diff = float((got - logits).abs().max())
        if diff > PROBE_TOLERANCE and self.encoder_decoder:
            return (
                f"feeding its word embeddings instead of the token ids changes its logits by "
                f"{diff:.2g} (its base builds the decoder's input from the token ids otherwise "
                "than shifting them right after the decoder start token, e.g. mBART-style "
                "wrapping of the last token)"
            )
        if diff > PROBE_TOLERANCE:
            return (
                f"feeding its word embeddings instead of the token ids changes its logits by "
                f"{diff:.2g} (its base treats token ids specially, e.g. ESM's token-dropout "
                "rescaling)"
            )
        return ""

    def _pad_id(self) -> int:
        pad = getattr(self.model.config, "pad_token_id", None)
        return int(pad) if isinstance(pad, int) else 0

    def _synthetic_probe(self) -> list[list[int]]:
        config = self.model.config
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        if vocab <= 0:
            weight = self.word_embeddings().weight
            assert isinstance(weight, torch.Tensor)
            vocab = int(weight.shape[0])
        special: set[Any] = set()
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id"):
            value = getattr(config, name, None)
            special.update(value if isinstance(value, list | tuple) else [value])
        generator = torch.Generator().manual_seed(7)
        pool = [
            t
            for t in torch.randperm(vocab, generator=generator)[:64].tolist()
            if t not in special and t > 3
        ]
        rows = [pool[:9], pool[9:14]]
        eos = getattr(config, "eos_token_id", None)
        if self.encoder_decoder and isinstance(eos, int):  # their heads read the last EOS
            rows = [[*r, eos] for r in rows]
        return rows


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def sequence_classification_types() -> list[str]:
    """Every model_type the installed transformers has a sequence classifier for."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    return sorted(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)


def check_architecture(config: Any) -> None:
    """Refuse, before loading weights, an architecture that is declared unservable."""
    model_type = str(getattr(config, "model_type", ""))
    if model_type in REFUSED:
        raise ModelLoadError(f"architecture {model_type!r} is not supported: {REFUSED[model_type]}")
    if model_type not in sequence_classification_types():
        raise ModelLoadError(
            f"architecture {model_type!r} has no sequence-classification model in the "
            "installed transformers"
        )


def supported_model_types() -> list[str]:
    """Architectures not refused up front (each is still checked on a probe at load time)."""
    return [t for t in sequence_classification_types() if t not in REFUSED]


def declare_pad_token(model: nn.Module, pad_id: int, probe_ids: Sequence[Sequence[int]]) -> bool:
    """Set ``config.pad_token_id`` to ``pad_id`` where the config declares none (as stock
    GPT-2's does), so that the classifier's own forward takes right-padded batches of several
    rows: transformers' last-token classifiers refuse them without a pad id, and read each
    row's rightmost token that is not the pad id with one. Kept only when that changes nothing
    on the probe: the padded probe batch must give each row the logits it gets alone with no
    pad id (where a tokenizer ends every text with the pad id, e.g. its end-of-sequence token,
    it would not, and the config is left as it was). Limelight's own batched passes do not
    depend on it (:meth:`HeadAdapter.logits`); it is for code that runs the classifier's own
    forward on batches. Returns whether the pad id was declared."""
    config: Any = getattr(model, "config", None)
    if config is None or getattr(config, "pad_token_id", None) is not None:
        return False
    rows = [list(r) for r in probe_ids if len(r) > 0]
    if len(rows) < 2:
        return False
    device = next(model.parameters()).device
    extra = {"use_cache": False} if _accepts(model, "use_cache") else {}
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long, device=device)
        mask[i, : len(r)] = 1
    training = bool(model.training)
    model.eval()
    try:
        with torch.no_grad():
            alone = torch.cat(
                [model(input_ids=torch.tensor([r], device=device), **extra).logits for r in rows]
            ).float()
            config.pad_token_id = int(pad_id)
            try:
                together = model(input_ids=ids, attention_mask=mask, **extra).logits.float()
            except Exception:  # a family that cannot take the pad id: as it was
                together = None
    finally:
        model.train(training)
    if (
        together is None
        or together.shape != alone.shape
        or float((together - alone).abs().max()) > PROBE_TOLERANCE
    ):
        config.pad_token_id = None
        return False
    return True


def adapter_for(
    model: nn.Module, probe_ids: Sequence[Sequence[int]] | None = None
) -> GenericAdapter:
    """The derived, probe-checked adapter of a sequence classifier (ModelLoadError if none)."""
    config = getattr(model, "config", None)
    check_architecture(config)
    adapter = GenericAdapter(model)
    adapter.derive(probe_ids)
    return adapter
