"""Numbers on the command line are checked where argparse reads them: out of range, the command
names the flag and exits with status 2 before it loads a model or reaches a sidecar."""

from __future__ import annotations

import argparse

import pytest

from limelight.cli.common import listed, real, whole
from limelight.cli.main import _leaf_parsers, build_parser
from limelight.settings import Settings

#: Options any whole number suits.
UNBOUNDED: set[str] = set()


def _numeric_actions() -> list[tuple[str, argparse.Action]]:
    parser = build_parser()
    return [
        (leaf.prog, action)
        for leaf in dict.fromkeys(_leaf_parsers(parser))
        for action in leaf._actions
        if action.option_strings
    ]


def test_every_numeric_option_is_bounded_where_it_is_read() -> None:
    """A bare ``type=int``/``float`` lets ``--n -5`` through to the code (a hang, a Python
    error, a head trained on nothing); only Settings fields may use one, pydantic bounds those
    (with the LIMELIGHT_ variable in its message)."""
    raw = [
        f"{prog} {action.option_strings[0]}"
        for prog, action in _numeric_actions()
        if action.type in (int, float)
        and action.dest not in Settings.model_fields
        and action.dest not in UNBOUNDED
    ]
    assert raw == []


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["eval", "--n", "-1"], "argument --n: must be at least 0, got -1"),
        (["eval", "--fractions", "0.1,2"], "argument --fractions: must be above 0 and at most 1"),
        (["eval", "--fractions", "0"], "argument --fractions: must be above 0"),
        (["eval", "--fractions", "abc"], "argument --fractions: expects a number, got 'abc'"),
        (["eval", "--fractions", ","], "argument --fractions: expects a comma-separated list"),
        (["eval", "--overlap-k", "5,-3"], "argument --overlap-k: must be at least 1, got -3"),
        (["eval", "--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
        (["eval", "--game-steps", "0"], "argument --game-steps: must be at least 1"),
        (["eval", "--peer-budget", "0"], "argument --peer-budget: must be at least 1"),
        (["distill", "--n", "-5"], "argument --n: must be at least 1, got -5"),
        (["distill", "--n", "0"], "argument --n: must be at least 1, got 0"),
        (["distill", "--validation", "-1"], "argument --validation: must be at least 0"),
        (["distill", "--loop-samples", "0"], "argument --loop-samples: must be at least 1"),
        (["distill", "--width", "-2"], "argument --width: must be at least 0"),
        (["distill", "--epochs", "0"], "argument --epochs: must be at least 1, got 0"),
        (["distill", "--seed", "-1"], "argument --seed: must be at least 0, got -1"),
        (["eval", "--seed", "-1"], "argument --seed: must be at least 0, got -1"),
        (["calibrate-heads", "--seed", "-1"], "argument --seed: must be at least 0"),
        (["fit-lm-head", "--seed", "-1"], "argument --seed: must be at least 0"),
        (["fit-lm-head", "--eval-texts", "0"], "argument --eval-texts: must be at least 1"),
        (["drift-reference", "build", "--n", "-1"], "argument --n: must be at least 1"),
        (["drift-reference", "build", "--batch-size", "0"], "argument --batch-size: must be"),
        (["drift", "--top-k", "0"], "argument --top-k: must be at least 1"),
        (["explain", "x", "--top", "-1"], "argument --top: must be at least 0, got -1"),
        (["explain", "x", "--timeout", "0"], "argument --timeout: must be above 0, got 0"),
        (["explain", "x", "--timeout", "nan"], "argument --timeout: must be above 0"),
        (["explain", "x", "--timeout", "inf"], "argument --timeout: must be above 0"),
        (["explain", "--lines", "f", "--connections", "0"], "argument --connections: must be"),
        (["jobs", "list", "--limit", "0"], "argument --limit: must be 1 to 1000, got 0"),
        (["jobs", "list", "--limit", "1001"], "argument --limit: must be 1 to 1000, got 1001"),
        (["jobs", "show", "abc", "--top", "-2"], "argument --top: must be at least 0"),
        (["fit-lm-head", "--batch-size", "0"], "argument --batch-size: must be at least 1"),
        (["fit-lm-head", "--epochs", "0"], "argument --epochs: must be above 0, got 0"),
        (["fit-lm-head", "--lr=-1e-3"], "argument --lr: must be above 0"),
        (["lexicon", "--batch-size", "0"], "argument --batch-size: must be at least 1"),
        (["export-onnx", "--fidelity-n", "0"], "argument --fidelity-n: must be at least 1"),
        (["calibrate-heads", "--n", "-3"], "argument --n: must be at least 0"),
        (
            ["calibrate-heads", "--positional-threshold", "1.5"],
            "argument --positional-threshold: must be at least 0 and at most 1, got 1.5",
        ),
        (["bench", "--duration", "0"], "argument --duration: must be above 0"),
        (["bench", "--clients", "1,0"], "argument --clients: must be at least 1, got 0"),
        (["bench", "--clients", "a"], "argument --clients: expects a whole number, got 'a'"),
        (["bench", "--batches", "-1"], "argument --batches: must be at least 1"),
        (["bench", "--runtimes", "torch,tensorrt"], "argument --runtimes: unknown 'tensorrt'"),
        (["bench", "--sections", "served,foo"], "argument --sections: unknown 'foo'; use inline"),
        (["bench", "--mix", "8+x"], "argument --mix: expects a whole number, got 'x'"),
        (["bench", "--mix", "0+4"], "argument --mix: must be at least 1, got 0"),
        (["bench", "--mix", "8"], "argument --mix: expects SHORT+LONG clients, e.g. 8+4"),
        (["bench", "--channels", "0"], "argument --channels: must be at least 1"),
        (["build-demo", "--threads", "0"], "argument --threads: must be at least 1"),
        (["worker", "--workers", "0"], "argument --workers: must be at least 1"),
        (["eval", "--n", "1.5"], "argument --n: expects a whole number, got '1.5'"),
    ],
)
def test_out_of_range_numbers_stop_the_command_with_status_2(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"limelight {argv[0]}" in err and said in err, err


def test_the_types_accept_their_bounds() -> None:
    assert whole(1)("1") == 1 and whole(0, 5)("5") == 5 and whole(0)(" 7 ") == 7
    assert real(0.0, 1.0, above=True)("1") == 1.0 and real(0.0)("0") == 0.0
    # order kept, duplicates dropped, blanks ignored
    assert listed(whole(1))("20, 5,,5") == (20, 5)
    for parse, text in ((whole(1), "0"), (real(0.0, above=True), "0"), (real(0.0, 1.0), "1.01")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_defaults_pass_through_the_same_types() -> None:
    """argparse converts a string default with the option's type: the defaults must parse."""
    args = build_parser().parse_args(["eval"])
    assert args.fractions == (0.1, 0.2, 0.3, 0.4, 0.5) and args.overlap_k == (5, 10, 20, 50)
    bench = build_parser().parse_args(["bench"])
    assert bench.clients == (1, 8, 32) and bench.mix == (8, 4)
    assert bench.runtimes == ("torch", "onnx")
    assert build_parser().parse_args(["bench", "--mix", ""]).mix is None  # '' skips the section


def test_bench_writes_back_the_command_that_reproduces_it() -> None:
    from limelight.cli.bench import _argv

    argv = ["bench", "--demo", "bert-tiny", "--clients", "2,8", "--mix", "3+1"]
    again = _argv(build_parser().parse_args(argv))
    assert again[again.index("--clients") + 1] == "2,8"
    assert again[again.index("--mix") + 1] == "3+1"
    assert again[again.index("--runtimes") + 1] == "torch,onnx"
    reparsed = build_parser().parse_args(["bench", *again])
    assert (reparsed.clients, reparsed.mix) == ((2, 8), (3, 1))
