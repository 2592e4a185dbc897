"""Tokenising through private backends: the Hugging Face wrapper's answer, from any thread."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from limelight.core.service import encode_batch
from limelight.core.types import Encoded
from limelight.core.windows import encode_windows
from limelight.demo.synthetic import build_word_tokenizer
from limelight.models.loaded import load_model
from limelight.models.tokenize import backend, to_encoded

CORPUS = [
    "a gorgeous, witty, seductive movie",
    "the plot is thin and the jokes fall flat",
    "an unwatchable, overwrought misfire of a film",
    "naïve café, déjà vu: a film about films",
] * 20
TEXTS: list[tuple[str, str | None]] = [
    ("a gorgeous, witty, seductive movie", None),
    ("the plot is thin", "a person rests"),
    ("naïve café — déjà vu 🎬 ", None),  # characters the trained vocabularies never saw
    ("  leading and trailing spaces  ", None),
    ("the jokes fall flat " * 40, None),  # over every limit below
    ("a film about films " * 20, "the plot is thin " * 20),  # a pair over the limit
    ("", None),
]
SPECIALS = ["<s>", "</s>", "<pad>", "<unk>", "<mask>"]


def special_ids(core: Tokenizer) -> tuple[int, int]:
    bos, eos = core.token_to_id("<s>"), core.token_to_id("</s>")
    assert bos is not None and eos is not None
    return bos, eos


def wrapped(core: Tokenizer) -> PreTrainedTokenizerFast:
    """The Hugging Face wrapper of a trained backend, with its special tokens named."""
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
    )


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """A RoBERTa-style tokenizer (byte-level BPE, ``Ġ`` word starts), trained here."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(CORPUS, trainer)
    bos, eos = special_ids(core)
    core.post_processor = processors.RobertaProcessing(
        ("</s>", eos), ("<s>", bos), trim_offsets=True
    )
    return wrapped(core)


def unigram() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Unigram, ``▁`` word starts), trained here."""
    core = Tokenizer(models.Unigram())
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=SPECIALS, unk_token="<unk>")
    core.train_from_iterator(CORPUS, trainer)
    bos, eos = special_ids(core)
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> $B:1 </s>:1",
        special_tokens=[("<s>", bos), ("</s>", eos)],
    )
    return wrapped(core)


def wordpiece(bert_tiny_dir: Path) -> Any:
    return load_model(bert_tiny_dir).tokenizer


TOKENIZERS = ["wordpiece", "byte-level-bpe", "unigram", "word-level"]


@pytest.fixture(scope="module", params=TOKENIZERS)
def tokenizer(request: pytest.FixtureRequest, bert_tiny_dir: Path) -> Any:
    if request.param == "wordpiece":
        return wordpiece(bert_tiny_dir)
    if request.param == "byte-level-bpe":
        return byte_level_bpe()
    if request.param == "unigram":
        return unigram()
    return build_word_tokenizer()


def wrapper_rows(tokenizer: Any, text: str, pair: str | None, **kw: Any) -> list[Encoded]:
    """The reference: what the Hugging Face wrapper gives, one ``Encoded`` per row."""
    out = tokenizer(
        text,
        pair,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
        return_token_type_ids=True,
        **kw,
    )
    rows = out["input_ids"] if kw.get("return_overflowing_tokens") else [out["input_ids"]]
    encoded = []
    for r, ids in enumerate(rows):

        def field(name: str, r: int = r) -> Any:
            return out[name][r] if kw.get("return_overflowing_tokens") else out[name]

        paired = pair is not None
        encoding = out.encodings[r]
        segments = [s or 0 for s in encoding.sequence_ids] if paired else [0] * len(ids)
        assert list(ids) == encoding.ids
        assert [tuple(o) for o in field("offset_mapping")] == encoding.offsets
        assert list(field("special_tokens_mask")) == encoding.special_tokens_mask
        assert list(field("token_type_ids")) == encoding.type_ids
        assert [t for t in tokenizer.convert_ids_to_tokens(ids)] == [
            t if i != tokenizer.unk_token_id else tokenizer.unk_token
            for t, i in zip(encoding.tokens, ids, strict=True)
        ]
        encoded.append(to_encoded(encoding, paired, True, False))
        assert encoded[-1].tokens.segments == segments  # type: ignore[attr-defined]
    return encoded


@pytest.mark.parametrize("limit", [None, 9, 24])
def test_a_private_backend_encodes_as_the_wrapper_does(tokenizer: Any, limit: int | None) -> None:
    for text, pair in TEXTS:
        want = wrapper_rows(tokenizer, text, pair, truncation=limit is not None, max_length=limit)
        got = backend(tokenizer, limit).encode(text, pair, add_special_tokens=True)
        assert [to_encoded(got, pair is not None, True, False)] == want
        if limit is not None:
            assert len(got.ids) <= limit


@pytest.mark.parametrize(("limit", "stride"), [(12, 0), (12, 4), (24, 8)])
def test_a_private_backend_cuts_windows_as_the_wrapper_does(
    tokenizer: Any, limit: int, stride: int
) -> None:
    for text, pair in TEXTS:
        if pair is not None:
            continue
        want = wrapper_rows(
            tokenizer,
            text,
            None,
            truncation=True,
            max_length=limit,
            stride=stride,
            return_overflowing_tokens=True,
        )
        first = backend(tokenizer, limit, stride).encode(text, add_special_tokens=True)
        got = [to_encoded(w, False, True, False) for w in [first, *first.overflowing]]
        assert got == want
        assert all(len(w) <= limit for w in got)


def test_one_backend_per_setting_and_the_wrappers_own_left_alone(tokenizer: Any) -> None:
    before = tokenizer.backend_tokenizer.truncation
    assert backend(tokenizer, 24) is backend(tokenizer, 24)
    assert backend(tokenizer, 24) is not backend(tokenizer, 24, 8)
    assert backend(tokenizer, None) is not tokenizer.backend_tokenizer
    assert backend(tokenizer, None).truncation is None
    assert backend(tokenizer, 24, 8).truncation["max_length"] == 24
    assert backend(tokenizer, 24, 8).truncation["stride"] == 8
    assert tokenizer.backend_tokenizer.truncation == before


def test_tokenising_from_many_threads_at_once_gives_what_one_thread_gives(
    bert_tiny_dir: Path,
) -> None:
    """The request path's tokenizer thread, job workers and the windows of long documents
    tokenise at the same time. Through the Hugging Face wrapper, which reconfigures its one
    backend on every call, a document cut into windows once came back as a single window of
    3,002 tokens and its forward pass failed. Here every path runs in several threads at once,
    beside a thread that keeps reconfiguring the wrapper itself, and each result must be the
    one a single thread gets."""
    model = load_model(bert_tiny_dir)
    document = " ".join(
        f"the jokes fall flat in scene {i} but the cast is witty" for i in range(60)
    )
    texts = [(document, None), ("a gorgeous, witty, seductive movie", None), (document, "why")]
    limit, stride = 64, 16
    expected_windows = encode_windows(model, document, limit, stride)
    assert len(expected_windows) > 5 and all(len(w) <= limit for w in expected_windows)
    expected_encode = [model.encode(text, pair, limit) for text, pair in texts]
    expected_batch = encode_batch(model, texts, limit)
    assert expected_batch == expected_encode
    failures: list[str] = []
    stop = threading.Event()

    def check(name: str, work: Any, want: Any) -> None:
        for _ in range(60):
            try:
                got = work()
            except Exception as exc:  # "Already borrowed" and the like are failures too
                failures.append(f"{name}: {exc!r}")
                return
            if got != want:
                failures.append(f"{name}: a different result")
                return

    def wrapper_user() -> None:  # someone else's code using the wrapper meanwhile
        while not stop.is_set():
            model.tokenizer(document, truncation=False)
            model.tokenizer(document, truncation=True, max_length=7)

    paths: list[tuple[str, Any, Any]] = [
        ("windows", lambda: encode_windows(model, document, limit, stride), expected_windows),
        ("encode", lambda: [model.encode(t, p, limit) for t, p in texts], expected_encode),
        ("batch", lambda: encode_batch(model, texts, limit), expected_batch),
    ]
    workers = [threading.Thread(target=check, args=path) for path in paths * 2]
    stranger = threading.Thread(target=wrapper_user)
    stranger.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    stranger.join()
    assert not failures, failures[:5]
