"""The distilled inline explainer's mechanics on the synthetic linear-words model: serving in
torch and ONNX Runtime, binding to one model, determinism, resumable labels, the recipe cache
and the ``auto`` default. Quality figures are measured by `limelight eval`, not asserted here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from limelight.demo.synthetic import build_synthetic_model, sample_linear_dataset
from limelight.distill.build import (
    HeadRecipe,
    build_head,
    head_is_current,
    report,
    restore_head,
    shelve_head,
    shelved_head_dir,
)
from limelight.distill.train import (
    SHELVED_LABEL_FILES,
    Mixture,
    TeacherExample,
    TrainConfig,
    distill,
    head_features,
    mix_labels,
    mixture_cache,
    normalise_labels,
    predict_scores,
    teacher_attributions,
)
from limelight.errors import FailedPrecondition, InvalidArgument
from limelight.methods.distilled import DistilledExplainer
from limelight.methods.normxlogit import NormXLogit
from limelight.models.explainer_head import (
    CARD_FORMAT,
    ExplainerHead,
    FrozenHead,
    HeadCard,
    head_dir,
    load_head,
    new_head,
    read_card,
    save_head,
)
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.onnx_export import export_onnx
from limelight.runtimes.onnx_runtime import OnnxRuntime
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar

TEACHER = "shapley"
PARAMS = {"permutations": 2}
CONFIG = TrainConfig(epochs=20, loop_steps=4, loop_batch_size=8)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_synthetic_model(tmp_path_factory.mktemp("synthetic"), seed=0, n_train=3000)


@pytest.fixture(scope="module")
def distilled(synthetic: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic model with a head distilled from Shapley labels beside it."""
    model = load_model(synthetic)
    texts = sample_linear_dataset(120, seed=1).texts()
    work = tmp_path_factory.mktemp("distill")
    head, card = distill(
        model, Settings(jobs="off"), texts, TEACHER, PARAMS, work / "teacher.jsonl", config=CONFIG
    )
    save_head(head, card, head_dir(model))
    return synthetic


def texts_file(directory: Path, n: int, seed: int) -> Path:
    """A JSONL file of ``n`` synthetic linear-words texts, as `--data` reads it."""
    data = directory / "texts.jsonl"
    rows = [json.dumps({"text": t}) for t in sample_linear_dataset(n, seed=seed).texts()]
    data.write_text("\n".join(rows) + "\n")
    return data


def test_card_records_the_held_out_validation(distilled: Path) -> None:
    card = read_card(head_dir(load_model(distilled)))
    assert card is not None and card.teacher == TEACHER and card.format == CARD_FORMAT
    assert card.validation_texts == 24 and card.train_texts == 96
    for key in ("spearman_vs_teacher", "deletion_aopc_head", "deletion_aopc_normxlogit"):
        assert np.isfinite(card.validation[key]), card.validation
    assert card.training["loop_steps"] == CONFIG.loop_steps


def test_the_head_files_are_as_readable_as_the_card(distilled: Path) -> None:
    """safetensors' own writer made the weights readable by their owner only (0600): a
    sidecar running as another user (the image's uid 10001) could not read a head that a
    `limelight distill` Job or the demo build wrote. They now get the mode of any other file."""
    directory = head_dir(load_model(distilled))
    card_mode = (directory / "card.json").stat().st_mode & 0o777
    assert (directory / "head.safetensors").stat().st_mode & 0o777 == card_mode
    if not card_mode & 0o044:
        pytest.skip("this umask keeps every file private: nothing to compare")


def test_served_inline_and_onnx_match_the_head(
    distilled: Path, tmp_path: Path, start_sidecar: Callable[..., RunningSidecar]
) -> None:
    model = load_model(distilled)
    head = load_head(model)
    runtime = TorchRuntime(model, {"distilled": head})
    text = "the good movie we watch"
    encoded = model.encode(text)
    longer = model.encode("a much longer text with many more words than the first one has")
    outputs = runtime.run_inline(InlineBatch.from_encoded([encoded, longer], model.pad_id))
    scores = DistilledExplainer().attribute(outputs, 0, len(encoded))
    # The same numbers alone and padded in a batch with a longer text.
    np.testing.assert_allclose(scores, predict_scores(model, head, encoded), atol=1e-5)

    graph = export_onnx(model, tmp_path / "g.onnx", heads={"distilled": head})
    onnx_out = OnnxRuntime(graph, model).run_inline(
        InlineBatch.from_encoded([encoded, longer], model.pad_id)
    )
    np.testing.assert_allclose(onnx_out.extra["distilled"][0, : len(encoded)], scores, atol=1e-4)

    side = start_sidecar(model_dir=distilled, default_method="auto", jobs="off")
    reply = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(side.target)).Explain(
        pb.ExplainRequest(text=text), timeout=30
    )
    e = reply.explanation
    assert e.method == "distilled"
    np.testing.assert_allclose(e.scores, scores[:, e.target_index], atol=1e-5)
    # NormXLogit rides along, equal to what method=normxlogit returns.
    normx = NormXLogit().attribute(outputs, 0, len(encoded))[:, e.target_index]
    np.testing.assert_allclose(e.extra_scores["normxlogit"].values, normx, atol=1e-5)


def test_auto_serves_normxlogit_without_a_head(
    synthetic: Path, tmp_path: Path, start_sidecar: Callable[..., RunningSidecar]
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in synthetic.iterdir():
        if f.is_file():
            (bare / f.name).write_bytes(f.read_bytes())
    side = start_sidecar(model_dir=bare, default_method="auto", jobs="off")
    reply = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(side.target)).Explain(
        pb.ExplainRequest(text="the good movie"), timeout=30
    )
    assert reply.explanation.method == "normxlogit"
    assert "normxlogit" not in reply.explanation.extra_scores


def test_head_refuses_another_models_weights(distilled: Path, random_bert_dir: Path) -> None:
    other = load_model(random_bert_dir)
    with pytest.raises(FailedPrecondition, match="limelight distill"):
        load_head(other, head_dir(load_model(distilled)))
    assert "distill" in DistilledExplainer().unavailable_reason(other)


def test_head_of_an_older_format_is_refused_with_the_fix(distilled: Path, tmp_path: Path) -> None:
    model = load_model(distilled)
    old = tmp_path / "old"
    old.mkdir()
    card = json.loads((head_dir(model) / "card.json").read_text())
    card["format"] = "limelight-distilled-head/1"
    (old / "card.json").write_text(json.dumps(card))
    with pytest.raises(FailedPrecondition, match="limelight distill"):
        load_head(model, old)


def test_distillation_is_deterministic_for_a_seed(synthetic: Path, tmp_path: Path) -> None:
    model = load_model(synthetic)
    texts = sample_linear_dataset(30, seed=2).texts()
    config = replace(CONFIG, seed=7)
    heads = [
        distill(
            model, Settings(jobs="off"), texts, TEACHER, PARAMS, tmp_path / f"t{i}.jsonl",
            config=config,
        )[0]
        for i in range(2)
    ]  # fmt: skip
    for a, b in zip(heads[0].state_dict().values(), heads[1].state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_teacher_labels_resume_after_an_interruption(synthetic: Path, tmp_path: Path) -> None:
    model = load_model(synthetic)
    texts = sample_linear_dataset(6, seed=3).texts()
    cache = tmp_path / "teacher.jsonl"
    settings = Settings(jobs="off")
    first = teacher_attributions(model, settings, TEACHER, PARAMS, texts[:3], cache)
    with cache.open("a") as fh:  # a kill in the middle of writing a line
        fh.write('{"key": "cut')
    calls: list[int] = []
    both = teacher_attributions(model, settings, TEACHER, PARAMS, texts, cache, calls.append)
    assert [e.scores for e in both[:3]] == [e.scores for e in first]
    lines = cache.read_text().splitlines()[1:]
    assert lines[3] == '{"key": "cut'  # the cut line stays a line of its own
    rows = [json.loads(line) for line in lines if line != lines[3]]
    assert len({r["key"] for r in rows}) == 6 and len(calls) == 6
    # Other parameters are another label set: the cache starts over, and the labels of the
    # earlier parameters are set aside, not lost — a run with other parameters once cost the
    # demo its 8,000 greedy labels. Asked for again, they come back without a recomputation.
    kept = cache.read_text()
    teacher_attributions(model, settings, TEACHER, {"permutations": 4}, texts[:1], cache)
    assert len(cache.read_text().splitlines()) == 2
    again: list[int] = []
    back = teacher_attributions(model, settings, TEACHER, PARAMS, texts, cache, again.append)
    assert cache.read_text() == kept and len(again) == 6  # progress, but no new line
    assert [e.scores for e in back] == [e.scores for e in both]
    for permutations in (6, 8, 10, 12):  # only the newest few other label sets stay
        teacher_attributions(model, settings, TEACHER, {"permutations": permutations}, [], cache)
    assert len(list(tmp_path.glob("teacher.stamp-*.jsonl"))) == SHELVED_LABEL_FILES


def test_a_head_replaces_only_a_head(synthetic: Path, tmp_path: Path) -> None:
    """`--out` at a folder of something else — the model's own included — was emptied and
    filled with the head, after all the labelling; now it is refused before any label."""
    data = texts_file(tmp_path, 10, seed=4)
    model = load_model(synthetic)
    recipe = HeadRecipe(data=str(data), n_texts=5, validation_texts=2, train=CONFIG)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("important")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    before = sorted(p.name for p in synthetic.iterdir())
    for out, said in (
        (precious, "is not a distilled head"),
        (synthetic, "holds the model itself"),
        (synthetic.parent, "holds the model itself"),
        (a_file, "is not a folder"),
    ):
        with pytest.raises(InvalidArgument, match=said):
            build_head(model, Settings(jobs="off"), recipe, out, progress=False)
    assert (precious / "notes.txt").read_text() == "important" and a_file.read_text() == "x"
    assert sorted(p.name for p in synthetic.iterdir()) == before
    assert not list(tmp_path.glob("*.teacher-*.jsonl"))  # refused before any label
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder is fine
    assert build_head(model, Settings(jobs="off"), recipe, empty, progress=False)[2] == empty
    assert read_card(empty) is not None


def test_a_text_empty_to_the_model_is_refused_before_any_label(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """A text of zero-width characters passed the data file's checks and stopped the build
    when the teacher reached it, after every label before it, with no word of which text.
    (BERT-tiny's WordPiece drops them; the synthetic model's tokenizer reads them as [UNK].)"""
    data = tmp_path / "texts.jsonl"
    texts = [*sample_linear_dataset(8, seed=4).texts(), "\u200b\u200b"]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    recipe = HeadRecipe(data=str(data), n_texts=6, validation_texts=3, train=CONFIG)
    with pytest.raises(InvalidArgument, match=r"the text '\\u200b\\u200b': text is empty to"):
        build_head(load_model(bert_tiny_dir), Settings(jobs="off"), recipe, tmp_path / "head")
    assert not list(tmp_path.glob("*.teacher-*.jsonl"))


def test_build_head_is_cached_by_recipe(synthetic: Path, tmp_path: Path) -> None:
    data = texts_file(tmp_path, 40, seed=4)
    model = load_model(synthetic)
    recipe = HeadRecipe(data=str(data), n_texts=30, validation_texts=10, train=CONFIG)
    out = tmp_path / "head"
    assert not head_is_current(model, recipe, out)
    _, card, where = build_head(model, Settings(jobs="off"), recipe, out, progress=False)
    assert where == out and card.recipe_hash == recipe.digest()
    assert head_is_current(model, recipe, out)
    assert not head_is_current(model, replace(recipe, n_texts=20), out)
    assert card.train_texts == 30 and card.validation_texts == 10


def test_a_replaced_head_is_shelved_by_recipe_and_restored(synthetic: Path, tmp_path: Path) -> None:
    """Two versions sharing one cache (another recipe each) swap heads, never retrain them."""
    data = texts_file(tmp_path, 40, seed=4)
    model = load_model(synthetic)
    first = HeadRecipe(data=str(data), n_texts=30, validation_texts=10, train=CONFIG)
    second = replace(first, n_texts=20)
    out = tmp_path / "head"
    settings = Settings(jobs="off")
    build_head(model, settings, first, out, progress=False)
    weights = (out / "head.safetensors").read_bytes()
    build_head(model, settings, second, out, progress=False)
    assert head_is_current(model, second, out)
    shelf = shelved_head_dir(out, first.digest())
    assert (shelf / "head.safetensors").read_bytes() == weights

    assert restore_head(model, first, out)  # the first recipe's head, as it was built
    assert head_is_current(model, first, out)
    assert (out / "head.safetensors").read_bytes() == weights
    assert head_is_current(model, second, shelved_head_dir(out, second.digest()))
    assert not restore_head(model, replace(first, n_texts=25), out)  # never built: build it
    assert head_is_current(model, first, out)

    # Only the most recently shelved heads are kept.
    shelve_head(out, keep=1)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.glob("head.recipe-*")) == [shelf.name]


def test_label_scaling_keeps_signs_unless_asked_to_centre() -> None:
    """``rms`` divides by the root mean square of the non-special tokens, so a token the
    teacher scored against the class stays negative; ``standard`` centres per text, which
    turns every all-positive label half negative."""
    scores = np.array([9.0, 3.0, 1.0, 2.0, -2.0, 9.0], dtype=np.float32)
    keep = np.array([False, True, True, True, True, False])
    rms = normalise_labels(scores, keep, "rms")
    assert np.array_equal(np.sign(rms[keep]), np.sign(scores[keep]))
    assert float(np.sqrt(np.mean(rms[keep] ** 2))) == pytest.approx(1.0)
    ranks = np.array([0.0, 4.0, 3.0, 2.0, 1.0, 0.0], dtype=np.float32)
    assert (normalise_labels(ranks, keep, "rms")[keep] > 0).all()
    centred = normalise_labels(ranks, keep, "standard")[keep]
    assert centred.mean() == pytest.approx(0.0, abs=1e-6) and (centred < 0).sum() == 2
    assert np.array_equal(normalise_labels(np.zeros(6, np.float32), keep), np.zeros(6))


def test_serving_forward_equals_the_training_path(distilled: Path) -> None:
    """The head serves through per-hidden-state slices of its projection; training reads the
    wide feature matrix (``features`` then ``score``). Both must give the same scores, padding
    included."""
    model = load_model(distilled)
    head = load_head(model)
    texts = sample_linear_dataset(3, seed=7).texts()
    batch = InlineBatch.from_encoded([model.encode(t) for t in texts], model.pad_id)
    ids, mask, types = TorchRuntime(model)._tensors(batch)
    with torch.inference_mode():
        out = model.adapter.run_base(ids, mask, types)
        logits = model.adapter.head(out.last_hidden_state)
        norms = out.hidden_states[0].float().norm(dim=-1)
        served = head(out.hidden_states, norms, logits, mask)
        trained = head.score(head.features(out.hidden_states, norms, logits), mask)
        frozen = FrozenHead(head)(out.hidden_states, norms, logits, mask)
    assert served.abs().max() > 0.1  # not a degenerate head
    torch.testing.assert_close(served, trained, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(frozen, served, atol=1e-5, rtol=1e-5)
    # ... and it is what the torch runtime serves
    assert isinstance(TorchRuntime(model, {"distilled": head}).heads["distilled"], FrozenHead)


@pytest.mark.parametrize(("attention_heads", "width"), [(0, 16), (2, 16), (0, 0)])
def test_the_frozen_head_equals_the_module_padding_included(
    attention_heads: int, width: int
) -> None:
    """The torch runtime serves ``FrozenHead``; the ONNX export and training use the module."""
    torch.manual_seed(0)
    head = ExplainerHead([0, 2], hidden_size=24, num_labels=3, width=width,
                         attention_heads=attention_heads).eval()  # fmt: skip
    for p in [*head.parameters(), *head.buffers()]:  # away from the initial ones and zeros
        p.data += 0.3 * torch.randn_like(p)
    hidden = tuple(torch.randn(3, 9, 24) * (i + 1) for i in range(3))
    norms, logits = torch.rand(3, 9) * 5, torch.randn(3, 9, 3)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 2:] = 0
    frozen = FrozenHead(head)
    with torch.inference_mode():
        expected = head(hidden, norms, logits, mask)
        got = frozen(hidden, norms, logits, mask)
        moved = tuple(h.clone() for h in hidden)
        moved[2][1, 6:] += 100.0  # padding content must not reach real tokens
        got_moved = frozen(moved, norms, logits, mask)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_moved[1, :6], got[1, :6], atol=1e-5, rtol=1e-5)


def test_distill_cli_with_a_search_teacher_and_an_out_directory(
    synthetic: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`limelight distill --teacher greedy_insertion --out DIR`: the head and its card land in
    DIR, labels beside it, nothing beside the model; the output says how to serve it."""
    from limelight.cli.main import main

    data = texts_file(tmp_path, 40, seed=3)
    out = tmp_path / "head"
    code = main(
        [
            "distill", "--model", str(synthetic), "--data", str(data),
            "--teacher", "greedy_insertion", "--param", "step=0.1", "--param", "signed=true",
            "--n", "30", "--validation", "8", "--epochs", "2", "--loop-steps", "0",
            "--out", str(out), "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    card = read_card(out)
    assert card is not None and card.teacher == "greedy_insertion"
    assert card.teacher_params["step"] == 0.1 and card.teacher_params["signed"] is True
    assert (tmp_path / "head.teacher-greedy_insertion.jsonl").exists()
    assert (
        not head_dir(load_model(synthetic))
        .with_name("limelight_distilled.teacher-greedy_insertion.jsonl")
        .exists()
    )
    printed = capsys.readouterr().out
    # the command that puts it beside the model (after moving aside a head already there)
    assert f"saved to {out}" in printed and f"mv {out} " in printed


def test_mixed_labels_are_the_weighted_mean_of_each_teachers_scaled_scores(
    synthetic: Path,
) -> None:
    """Per text: (1 - w) * first + w * second, each divided by its own root mean square over
    the non-special tokens; an example the second teacher explained for another label keeps
    the first teacher's scores."""
    model = load_model(synthetic)
    texts = sample_linear_dataset(3, seed=5).texts()
    rng = np.random.default_rng(0)
    first, second = [], []
    for i, text in enumerate(texts):
        n = len(model.encode(text))
        a, b = rng.normal(size=n), rng.normal(size=n) * 10.0
        first.append([TeacherExample(text, 1, a.tolist())])
        second.append([TeacherExample(text, 0 if i == 2 else 1, b.tolist())])
    mixed = mix_labels(model, first, second, 0.25)
    for i, text in enumerate(texts[:2]):
        keep = ~model.encode(text).special_mask
        a, b = np.asarray(first[i][0].scores), np.asarray(second[i][0].scores)
        rms_a, rms_b = np.sqrt(np.mean(a[keep] ** 2)), np.sqrt(np.mean(b[keep] ** 2))
        expected = 0.75 * a / rms_a + 0.25 * b / rms_b
        np.testing.assert_allclose(mixed[i][0].scores, expected, rtol=1e-6)
        assert mixed[i][0].target == 1
    assert mixed[2][0].scores == first[2][0].scores


def test_a_mixture_is_part_of_the_recipe_and_the_card(synthetic: Path, tmp_path: Path) -> None:
    data = texts_file(tmp_path, 24, seed=6)
    model = load_model(synthetic)
    plain = HeadRecipe(data=str(data), n_texts=18, validation_texts=6, train=CONFIG)
    mixture = Mixture("greedy_insertion", {"step": 0.2}, 0.5)
    mixed = replace(plain, mixture=mixture)
    assert mixed.digest() != plain.digest()
    assert mixed.digest() != replace(mixed, mixture=replace(mixture, weight=0.3)).digest()
    out = tmp_path / "head"
    _, card, _ = build_head(model, Settings(jobs="off"), mixed, out, progress=False)
    assert card.mixture["teacher"] == "greedy_insertion" and card.mixture["weight"] == 0.5
    assert card.mixture["params"]["step"] == 0.2 and card.teacher == "shapley"
    assert head_is_current(model, mixed, out) and not head_is_current(model, plain, out)
    first = tmp_path / "head.teacher-shapley.jsonl"
    second = mixture_cache(first, "greedy_insertion")
    for path in (first, second):  # each teacher's labels in its own resumable cache
        assert len(path.read_text().splitlines()) == 1 + 18
    assert json.loads(second.read_text().splitlines()[0])["teacher"] == "greedy_insertion"
    assert read_card(out) == card


def test_distill_cli_mix_flag(
    synthetic: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from limelight.cli.main import main

    data = texts_file(tmp_path, 20, seed=7)
    base = [
        "distill", "--model", str(synthetic), "--data", str(data), "--n", "14",
        "--validation", "6", "--epochs", "2", "--out", str(tmp_path / "head"), "--no-progress",
    ]  # fmt: skip
    for bad in ("greedy_insertion:1.5", "nonsense:0.5", "greedy_insertion"):
        assert main([*base, "--mix", bad]) == 2
        assert "--mix expects TEACHER:WEIGHT" in capsys.readouterr().err
    # A head shape that cannot be built is refused before any label is computed.
    assert main([*base, "--width", "16", "--attention-heads", "3"]) == 2
    assert "--width 16 must be a positive multiple of --attention-heads 3" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "head.teacher-shapley.jsonl").exists()
    # A --mix-param without --mix was ignored without a word.
    assert main([*base, "--mix-param", "step=0.2"]) == 2
    assert "give --mix too" in capsys.readouterr().err
    mix = ["--mix", "greedy_insertion:0.3", "--mix-param", "step=0.2"]
    assert main([*base, *mix]) == 0
    assert "teacher 0.7 shapley + 0.3 greedy_insertion on 14 texts" in capsys.readouterr().out
    card = read_card(tmp_path / "head")
    assert card is not None and card.mixture["params"]["step"] == 0.2
    # --width and --attention-heads shape the head and are recorded in its card.
    assert main([*base, "--width", "16", "--attention-heads", "2"]) == 0
    card = read_card(tmp_path / "head")
    assert card is not None and (card.width, card.attention_heads) == (16, 2)
    assert card.parameters == sum(p.numel() for p in new_head(card).parameters())
    # 0 attention heads: a per-token head without a context block, loaded as it was saved.
    assert main([*base, "--width", "16", "--attention-heads", "0"]) == 0
    card = read_card(tmp_path / "head")
    assert card is not None and card.attention_heads == 0
    assert new_head(card).context is None
    assert card.parameters == sum(p.numel() for p in new_head(card).parameters())
    with pytest.raises(SystemExit) as refused:  # argparse: a negative count never parses
        main([*base, "--attention-heads", "-1"])
    assert refused.value.code == 2
    assert "argument --attention-heads: must be at least 0" in capsys.readouterr().err


def test_the_report_warns_of_a_head_below_normxlogit_and_of_no_validation() -> None:
    card = HeadCard(
        model_version="v", layers=[0], hidden_size=8, num_labels=2, width=8, teacher="shapley",
        train_texts=10, parameters=100,
    )  # fmt: skip
    assert "not validated: no held-out texts" in report(card)
    measured = {
        "texts": 6.0, "deletion_aopc_head": 0.2, "deletion_aopc_head_se": 0.01,
        "deletion_aopc_teacher": 0.3, "deletion_aopc_teacher_se": 0.01,
        "deletion_aopc_normxlogit": 0.25, "deletion_aopc_normxlogit_se": 0.01,
        "spearman_vs_teacher": 0.5, "deletion_aopc_head_minus_normxlogit": -0.05,
        "deletion_aopc_head_minus_normxlogit_se": 0.0,
    }  # fmt: skip
    worse = report(replace(card, validation=measured))
    assert "head 0.200 ± 0.010" in worse and "head minus normxlogit -0.050 ± 0.000" in worse
    assert "WARNING: the head is not clearly more faithful" in worse
    better = report(
        replace(card, validation={**measured, "deletion_aopc_head_minus_normxlogit": 0.1})
    )
    assert "WARNING" not in better and "not validated" not in better and "note:" not in better
    # A lead within twice its standard error is no lead.
    unclear = {
        **measured,
        "deletion_aopc_head_minus_normxlogit": 0.01,
        "deletion_aopc_head_minus_normxlogit_se": 0.006,
    }
    assert "WARNING: the head is not clearly" in report(replace(card, validation=unclear))
    # One held-out text: no standard error, so no lead is clear.
    single = {k: v for k, v in measured.items() if not k.endswith("_se")}
    single["deletion_aopc_head_minus_normxlogit"] = 0.1
    lone = report(replace(card, validation=single))
    assert "head minus normxlogit +0.100 (no standard error)" in lone
    assert "WARNING: the head is not clearly" in lone


def test_the_report_of_a_model_that_hardly_responds_shows_its_figures_and_says_why() -> None:
    """An untrained (or saturated) model moves its probability by 1e-5: at three decimals every
    figure read "-0.000 ± 0.000"; now they have the digits they need, and a note says why."""
    card = HeadCard(
        model_version="v", layers=[0], hidden_size=8, num_labels=2, width=8, teacher="shapley",
        train_texts=10, parameters=100,
        validation={
            "texts": 20.0, "deletion_aopc_head": -4.13e-05, "deletion_aopc_head_se": 2.8e-06,
            "deletion_aopc_teacher": -2.94e-05, "deletion_aopc_teacher_se": 2.2e-06,
            "deletion_aopc_normxlogit": -5.84e-05, "deletion_aopc_normxlogit_se": 2.4e-06,
            "spearman_vs_teacher": 0.59, "deletion_aopc_head_minus_normxlogit": 1.71e-05,
            "deletion_aopc_head_minus_normxlogit_se": 1.8e-06,
        },
    )  # fmt: skip
    text = report(card)
    assert "head -0.000041 ± 0.000003" in text and "normxlogit -0.000058 ± 0.000002" in text
    assert "head minus normxlogit +0.000017 ± 0.000002" in text
    assert "-0.000 ±" not in text and "WARNING" not in text  # the lead is clear, if tiny
    assert "note: every method's deletion AOPC is under 0.01" in text


def test_a_per_token_head_reads_no_neighbour_and_exports_to_onnx(
    synthetic: Path, tmp_path: Path
) -> None:
    """Without a context block a token's score depends on its own features alone (they carry
    context only through the classifier's hidden states); torch and ONNX Runtime agree."""
    model = load_model(synthetic)
    torch.manual_seed(0)
    head = ExplainerHead([0, model.num_layers], model.hidden_size, model.num_labels, 8, 0).eval()
    encoded = model.encode("the good movie we watch")
    longer = model.encode("a much longer text with many more words than the first one has")
    batch = InlineBatch.from_encoded([encoded, longer], model.pad_id)
    served = TorchRuntime(model, {"distilled": head}).run_inline(batch).extra["distilled"]
    np.testing.assert_allclose(
        served[0, : len(encoded)], predict_scores(model, head, encoded), atol=1e-5
    )
    # Each token alone: the same score as among its neighbours (any features will do).
    with torch.no_grad():
        features = torch.randn(1, 7, head.proj.in_features)
        together = head.score(features, torch.ones(1, 7))[0]
        alone = [head.score(features[:, i : i + 1], torch.ones(1, 1))[0, 0] for i in range(7)]
    torch.testing.assert_close(torch.stack(alone), together, atol=1e-5, rtol=0)
    graph = export_onnx(model, tmp_path / "g.onnx", heads={"distilled": head})
    onnx_out = OnnxRuntime(graph, model).run_inline(batch).extra["distilled"]
    np.testing.assert_allclose(onnx_out[0, : len(encoded)], served[0, : len(encoded)], atol=1e-4)


def test_a_linear_head_standardises_its_features_and_folds_into_one_map(
    synthetic: Path, tmp_path: Path
) -> None:
    """``width=0``: the hidden states standardised with constants fixed from the training
    texts, then one linear map. It trains through the whole recipe (the loop included),
    saves and loads its standardisation, and serves folded — torch, ONNX Runtime and the
    module agree, and a token's score never reads a neighbour except through the classifier."""
    model = load_model(synthetic)
    texts = sample_linear_dataset(80, seed=4).texts()
    config = TrainConfig(width=0, attention_heads=0, epochs=5, loop_steps=3, loop_batch_size=8)
    head, card = distill(
        model, Settings(jobs="off"), texts, TEACHER, PARAMS, tmp_path / "t.jsonl", config=config
    )
    assert card.width == 0
    # Standardised: the training texts' features have mean 0 and scale 1 after it.
    encoded = [model.encode(t) for t in texts[:40]]
    feats = torch.cat(head_features(model, head, encoded))
    mean, scale = head.standardisation()
    standard = (feats - mean) / scale
    assert feats.std(0).max() > 2 * feats.std(0).min()  # there was something to standardise
    assert standard.mean(0).abs().max() < 0.5 and (standard.std(0) - 1).abs().max() < 0.5
    # Folded: the same scores from the raw features.
    weight, bias = head.folded()
    with torch.no_grad():
        np.testing.assert_allclose(
            (feats @ weight.T + bias).numpy(),
            head.score(feats[None], torch.ones(1, len(feats)))[0].numpy(),
            atol=1e-4,
            rtol=1e-4,
        )
    save_head(head, card, tmp_path / "head")
    assert card.parameters == head.proj.weight.numel() + model.num_labels  # the map, no more
    loaded = load_head(model, tmp_path / "head")
    torch.testing.assert_close(loaded.standardisation()[1], scale)
    one, longer = encoded[0], model.encode("a much longer text with many more words than the first")
    batch = InlineBatch.from_encoded([one, longer], model.pad_id)
    served = TorchRuntime(model, {"distilled": loaded}).run_inline(batch).extra["distilled"]
    np.testing.assert_allclose(served[0, : len(one)], predict_scores(model, head, one), atol=1e-5)
    graph = export_onnx(model, tmp_path / "g.onnx", heads={"distilled": loaded})
    onnx_out = OnnxRuntime(graph, model).run_inline(batch).extra["distilled"]
    np.testing.assert_allclose(onnx_out[0, : len(one)], served[0, : len(one)], atol=1e-4)


def test_a_linear_head_has_no_context_block() -> None:
    with pytest.raises(ValueError, match="linear head"):
        ExplainerHead([0], hidden_size=8, num_labels=2, width=0, attention_heads=2)


def test_distill_cli_loop_texts_and_reward(
    synthetic: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--loop-texts N`: N more texts of the data, after the labelled ones, for the policy
    loop only (never labelled); `--loop-reward` picks its curves and their weights,
    `--loop-points` how many points of them a step reads, `--loop-samples` how many orders,
    `--loop-average` the decay of the weight average it leaves, `--read-precision` the
    precision of the labels' and rewards' reads. The loop's options are part of the recipe
    only when there is a loop; bad values are refused before any label is computed (out-of-range
    numbers where argparse reads them: tests/cli/test_argument_ranges.py)."""
    from limelight.cli.main import main

    data = texts_file(tmp_path, 30, seed=8)
    base = [
        "distill", "--model", str(synthetic), "--data", str(data), "--n", "10",
        "--validation", "6", "--epochs", "1", "--out", str(tmp_path / "head"), "--no-progress",
    ]  # fmt: skip
    for bad, message in [
        (["--loop-steps", "2", "--loop-reward", "mask+nonsense"], "unknown loop reward"),
        (["--loop-steps", "2", "--loop-points", "6"], "--loop-points 6: 1 to 5"),
        (["--loop-steps", "2", "--loop-average", "1"], "--loop-average 1.0: 0 (off) or a decay"),
        (["--loop-texts", "5"], "--loop-texts trains the policy loop"),
        (
            ["--loop-steps", "2", "--loop-texts", "5", "--loop-estimator", "straight_through"],
            "--loop-texts trains the policy loop",
        ),
    ]:
        assert main([*base, *bad]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "head.teacher-shapley.jsonl").exists()
    loop = ["--loop-steps", "2", "--loop-texts", "8", "--loop-reward", "mask+0.5keep"]
    cheap = ["--loop-points", "1", "--loop-samples", "2", "--read-precision", "bfloat16"]
    cheap += ["--loop-average", "0.9"]
    assert main([*base, *loop, *cheap]) == 0
    card = read_card(tmp_path / "head")
    assert card is not None and card.train_texts == 10
    assert card.training["loop_texts"] == 8 and card.training["loop_reward"] == "mask+0.5keep"
    assert card.training["loop_points"] == 1 and card.training["loop_samples"] == 2
    assert card.training["loop_average"] == 0.9
    assert card.training["read_precision"] in ("bfloat16", "float32")  # float32: no bf16 here
    assert card.training["threads"] == torch.get_num_threads()
    labelled = (tmp_path / "head.teacher-shapley.jsonl").read_text().splitlines()
    assert len(labelled) == 1 + 10  # the loop's texts were never labelled

    # Progress into a log (standard error captured: not a terminal): plain lines, each stage
    # ending before the next begins.
    capsys.readouterr()
    assert main([a for a in base if a != "--no-progress"] + loop + cheap) == 0
    lines = capsys.readouterr().err.splitlines()
    stages = [line.split(":")[0] for line in lines if " elapsed" in line]
    order = ["shapley labels", "amortisation", "classifier in the loop"]
    assert [s for i, s in enumerate(stages) if i == 0 or stages[i - 1] != s] == order
    ends = [line for line in lines if "(100 %)" in line]
    assert [line.split(":")[0] for line in ends] == order
    assert not any("\r" in line or "\x1b" in line for line in lines)

    plain = HeadRecipe(train=CONFIG)
    assert replace(plain, loop_texts=8).digest() != plain.digest()
    no_loop = HeadRecipe(train=replace(CONFIG, loop_steps=0))
    assert replace(no_loop, loop_texts=8).digest() == no_loop.digest()


def test_distill_refuses_data_without_texts_and_says_when_it_held_fewer(
    synthetic: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from limelight.cli.main import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    base = ["distill", "--model", str(synthetic), "--epochs", "1", "--no-progress"]
    head = tmp_path / "head"
    assert main([*base, "--data", str(empty), "--out", str(head)]) == 2
    assert f"limelight distill: error: no texts to train on in {empty}" in capsys.readouterr().err
    assert not head.exists() and not list(tmp_path.glob("head.teacher-*"))
    few = texts_file(tmp_path, 12, seed=3)
    assert (
        main([*base, "--data", str(few), "--n", "50", "--validation", "4", "--out", str(head)]) == 0
    )
    said = capsys.readouterr().out
    assert "note: the data held 8 training texts of the 50 asked (--n), after 4 held out" in said


def test_one_held_out_text_gives_no_standard_error_and_strict_json(
    synthetic: Path, tmp_path: Path
) -> None:
    """`limelight distill --validation 1`: the sample standard deviation of one value is NaN
    (with numpy's RuntimeWarnings), which hid the report's warning (NaN compares false) and
    reached card.json as a bare NaN."""
    import warnings

    model = load_model(synthetic)
    texts = sample_linear_dataset(12, seed=3).texts()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        head, card = distill(
            model,
            Settings(jobs="off"),
            texts[:-1],
            TEACHER,
            PARAMS,
            tmp_path / "teacher.jsonl",
            config=TrainConfig(epochs=2, loop_steps=0),
            validation_texts=texts[-1:],
        )
    assert card.validation["examples"] >= 1.0 and "deletion_aopc_head" in card.validation
    assert not any(key.endswith("_se") for key in card.validation), card.validation
    save_head(head, card, tmp_path / "head")
    json.loads((tmp_path / "head" / "card.json").read_text(), parse_constant=_refuse)
    text = report(card)
    assert "(no standard error)" in text and "nan" not in text.lower()
    assert "WARNING: the head is not clearly more faithful" in text


def _refuse(name: str) -> float:
    raise AssertionError(f"card.json holds {name}, which is not JSON")
