"""Every head-on-top adapter reproduces its model's own logits from the pooled position."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from limelight.errors import FailedPrecondition, ModelLoadError
from limelight.models import adapters
from limelight.models.adapters import GenericAdapter, Override, adapter_for, check_architecture
from limelight.models.loaded import load_model
from limelight.models.tiny import NOT_BUILT
from limelight.models.tiny import tiny_model as tiny_family

_SMALL = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    vocab_size=120,
    num_labels=3,
    max_position_embeddings=64,
)

# One row per architecture family the sidecar supports (random small configs).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "bert": {},
    "distilbert": dict(dim=32, hidden_dim=64, n_layers=2, n_heads=2),
    "roberta": dict(pad_token_id=1),
    "xlm-roberta": dict(pad_token_id=1),
    "deberta-v2": dict(relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"]),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, pad_token_id=0),
    "llama": dict(num_key_value_heads=2, pad_token_id=0),
}


def tiny_model(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**_SMALL, **ARCHITECTURES[model_type]})
    if model_type == "gpt2":
        config.bos_token_id = config.eos_token_id = 2
    return AutoModelForSequenceClassification.from_config(config).eval()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 120, (3, 11), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # a right-padded row
    mask[2, 4:] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_head_at_pooled_position_reproduces_logits(model_type: str) -> None:
    model = tiny_model(model_type)
    adapter = adapter_for(model)
    ids, mask = padded_batch()
    with torch.no_grad():
        # Reference: each row alone, unpadded, through the model's own forward.
        expected = torch.cat(
            [model(input_ids=ids[i : i + 1, : int(mask[i].sum())]).logits for i in range(3)]
        )
        out = adapter.run_base(ids, mask)
        token_logits = adapter.head(out.last_hidden_state)
        got = token_logits[torch.arange(3), adapter.pooled_index(mask)]
    assert token_logits.shape == (3, 11, 3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_real_weights_bert_tiny(bert_tiny_dir: Path) -> None:
    loaded = load_model(bert_tiny_dir)
    enc = loaded.tokenizer(["a witty, gorgeous film", "dull"], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = loaded.model(**enc).logits
        out = loaded.adapter.run_base(
            enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]
        )
        got = loaded.adapter.head(out.last_hidden_state)[:, 0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_real_weights_minilm(minilm_dir: Path) -> None:
    loaded = load_model(minilm_dir)
    enc = loaded.tokenizer(["an utterly charming movie"], return_tensors="pt")
    with torch.no_grad():
        expected = loaded.model(**enc).logits
        out = loaded.adapter.run_base(enc["input_ids"], enc["attention_mask"])
        got = loaded.adapter.head(out.last_hidden_state)[:, 0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_refused_architecture_is_named_with_its_reason() -> None:
    model = tiny_family("canine")
    with pytest.raises(ModelLoadError, match=r"'canine' is not supported: character-level"):
        adapter_for(model)


def test_a_head_that_does_not_reproduce_the_logits_is_refused() -> None:
    model = tiny_family("bert")
    wrong = Override(head=lambda m, x: m.classifier(x))  # skips BERT's pooler
    with pytest.raises(ModelLoadError, match=r"reproduces its own logits within 0.0001"):
        GenericAdapter(model, wrong).derive()


def test_probe_leaves_the_training_mode_alone() -> None:
    model = tiny_family("electra").train()
    GenericAdapter(model).derive()
    assert model.training


# Every family that is not refused up front and builds from a tiny config offline.
FAMILIES = [t for t in adapters.supported_model_types() if t not in NOT_BUILT]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_generic_head_reproduces_logits_of_every_family(model_type: str) -> None:
    model = tiny_family(model_type, vocab_size=120)
    adapter = GenericAdapter(model).derive()
    ids, mask = padded_batch()
    config: Any = model.config
    if config.is_encoder_decoder:  # their heads read each row's last end-of-sequence token
        ids[torch.arange(3), mask.sum(dim=1) - 1] = int(config.eos_token_id)
    extra = {"use_cache": False} if adapters._accepts(model, "use_cache") else {}
    with torch.no_grad():
        expected = torch.cat(
            [
                model(input_ids=ids[i : i + 1, : int(mask[i].sum())], **extra).logits
                for i in range(3)
            ]
        )
        out = adapter.run_base(ids, mask)
        token_logits = adapter.head(out.last_hidden_state)
        got = adapter.pooled_logits(out.last_hidden_state, mask)
    assert token_logits.shape == (3, 11, 3)
    assert all(h.shape[:2] == (3, 11) for h in out.hidden_states)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    if adapter.pooling in ("first", "last"):
        at_index = token_logits[torch.arange(3), adapter.pooled_index(mask)]
        torch.testing.assert_close(at_index, got, atol=1e-5, rtol=1e-5)
    if adapter.row_wise:  # served as modules on the last axis: the one-token form's scores
        hidden = torch.randn(2, 5, out.last_hidden_state.shape[-1], generator=SEEDED)
        with torch.no_grad():
            torch.testing.assert_close(
                adapter.head(hidden), adapter.one_token_head(hidden), atol=1e-5, rtol=1e-5
            )


SEEDED = torch.Generator().manual_seed(3)


@pytest.mark.parametrize(
    ("model_type", "row_wise"),
    [
        ("bert", True),  # pooler (dense, tanh) and classifier: modules only
        ("roberta", False),  # its classification head applies torch.tanh between its modules
    ],
)
def test_row_wise_head_only_where_the_modules_are_the_head(model_type: str, row_wise: bool) -> None:
    adapter = GenericAdapter(tiny_family(model_type, vocab_size=120)).derive()
    assert adapter.row_wise is row_wise


def test_a_declared_head_keeps_the_one_token_form() -> None:
    model = tiny_family("bert")
    declared = Override(head=lambda m, x: m.classifier(m.bert.pooler(x[:, None, :])))
    assert not GenericAdapter(model, declared).derive().row_wise


@pytest.mark.parametrize(
    ("model_type", "setting", "pooling"),
    [
        ("modernbert", "mean", "mean"),
        ("modernbert", "cls", "first"),
        ("eurobert", "late", "late"),
        ("eurobert", "mean", "mean"),
        ("eurobert", "bos", "first"),
    ],
)
def test_declared_pooling(model_type: str, setting: str, pooling: str) -> None:
    model = tiny_family(model_type, vocab_size=120, classifier_pooling=setting)
    adapter = GenericAdapter(model).derive()
    assert adapter.pooling == pooling
    check_architecture(model.config)  # every pooling is served
    if pooling in ("mean", "late"):
        with pytest.raises(FailedPrecondition, match="no single position"):
            adapter.pooled_index(torch.ones(1, 4))
    # What the runtime serves (logits_from, reusing the per-token logits) is the model's own
    # logit of each row alone, unpadded, on a right-padded batch.
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = torch.cat(
            [model(input_ids=ids[i : i + 1, : int(mask[i].sum())]).logits for i in range(3)]
        )
        hidden = adapter.run_base(ids, mask).last_hidden_state
        served = adapter.logits_from(hidden, mask, adapter.head(hidden))
    torch.testing.assert_close(served, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("model_type", "problem"),
    [("bert", ""), ("esm", "changes its logits by"), ("esmc", "token ids only")],
)
def test_inputs_embeds_are_checked_on_the_probe(model_type: str, problem: str) -> None:
    """The gradient methods feed word embeddings; the probe says where that changes the logits
    (ESM rescales embeddings from the token ids) or is impossible (ESMC)."""
    adapter = GenericAdapter(tiny_family(model_type, vocab_size=120)).derive()
    if problem:
        assert problem in adapter.inputs_embeds_problem
    else:
        assert adapter.inputs_embeds_problem == ""


@pytest.mark.parametrize("model_type", ["xlnet", "fnet", "yoso"])
def test_padding_hooks_keep_each_threads_mask(model_type: str) -> None:
    """XLNet's summary and FNet's / YOSO's unpadded rows read the attention mask of the call
    through hooks. The inference thread and job workers run the model at once, so each call must
    read its own mask, never another thread's: two threads run the classifier's own forward on
    differently padded batches, over and over, and each must get what it gets alone."""
    import threading

    model = tiny_family(model_type, vocab_size=120)
    GenericAdapter(model).derive()
    ids, mask = padded_batch()
    batches = [(ids, mask), (ids[:2, :8].clone(), mask[:2, :8].clone())]
    batches[1][1][0, 5:] = 0
    with torch.no_grad():
        expected = [model(input_ids=i, attention_mask=m).logits for i, m in batches]
    wrong: list[str] = []

    def run(k: int) -> None:
        i, m = batches[k]
        for _ in range(40):
            with torch.no_grad():
                try:
                    got = model(input_ids=i, attention_mask=m).logits
                except Exception as exc:
                    wrong.append(repr(exc))
                    return
            if not torch.allclose(got, expected[k], atol=1e-5, rtol=1e-5):
                wrong.append(f"batch {k}: another call's mask")
                return

    threads = [threading.Thread(target=run, args=(k % 2,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, wrong[:3]
