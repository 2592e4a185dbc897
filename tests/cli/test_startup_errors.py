"""Start-up and CLI mistakes read as one sentence on stderr with a non-zero exit status."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from limelight.cli.main import EXIT_FAILURE, EXIT_USAGE, main


def limelight(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "limelight.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def error_line(stderr: str) -> str:
    """The last line of stderr: the error sentence (log lines may come before it)."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    return lines[-1]


SERVE = ("serve", "--port", "0", "--metrics-port", "0", "--jobs", "off")


# --- as a subprocess: what a user sees -------------------------------------------------------


def test_missing_model_directory_is_one_line(tmp_path: Path) -> None:
    out = limelight(*SERVE, "--model", str(tmp_path / "no-such-dir"))
    assert out.returncode == EXIT_FAILURE
    line = error_line(out.stderr)
    assert line.startswith("limelight serve: error: model directory")
    assert "does not exist" in line


def test_invalid_setting_from_the_environment_exits_2() -> None:
    out = limelight(*SERVE, env={"LIMELIGHT_TRUNCATION": "sometimes"})
    assert out.returncode == EXIT_USAGE
    line = error_line(out.stderr)
    assert "invalid setting truncation" in line and "LIMELIGHT_TRUNCATION" in line


def test_workers_refuse_the_one_process_job_backend() -> None:
    out = limelight("serve", "--port", "0", "--metrics-port", "0", "--workers", "2")
    assert out.returncode == EXIT_USAGE
    line = error_line(out.stderr)
    assert "--workers 2 needs --jobs off or --jobs redis://" in line and "SQLite" in line


def test_debug_log_level_shows_the_traceback(tmp_path: Path) -> None:
    out = limelight(*SERVE, "--model", str(tmp_path / "missing"), "--log-level", "debug")
    assert out.returncode == EXIT_FAILURE
    assert "Traceback" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("limelight serve: error:")


def test_an_unknown_job_backend_is_refused_before_the_model_is_built(tmp_path: Path) -> None:
    """Checked with the settings, not after a first start built the demo model for minutes;
    the rejected address is repeated without its password, even where it is malformed."""
    cache = tmp_path / "cache"
    for given in ("redis:/limelight:s3cret@queue:6379/0", "postgres://limelight:s3cret@db/0"):
        out = limelight(
            "serve", "--port", "0", "--metrics-port", "0",
            env={"LIMELIGHT_JOBS": given, "LIMELIGHT_CACHE_DIR": str(cache)},
        )  # fmt: skip
        assert out.returncode == EXIT_USAGE, out.stderr
        line = error_line(out.stderr)
        assert out.stderr.strip().count("\n") == 0, out.stderr  # nothing ran before it
        assert line.startswith("limelight serve: error: invalid setting jobs: unknown job backend")
        assert "LIMELIGHT_JOBS" in line and "s3cret" not in line and "Value error" not in line
    assert not cache.exists()  # no demo model was built


def test_a_misspelt_variable_is_named_before_anything_else(tmp_path: Path) -> None:
    """The settings ignore variables they do not know: without a word, LIMELIGHT_MAX_BATCHSIZE
    would leave the batch size at its default."""
    out = limelight(
        *SERVE, "--model", str(tmp_path / "missing"),
        env={"LIMELIGHT_MAX_BATCHSIZE": "8", "LIMELIGHT_TRUNCATION": "sometimes"},
    )  # fmt: skip
    assert out.returncode == EXIT_USAGE, out.stderr
    first, *_ = out.stderr.strip().splitlines()
    assert first == (
        "warning: LIMELIGHT_MAX_BATCHSIZE is not a Limelight setting and is ignored; "
        "did you mean LIMELIGHT_MAX_BATCH_SIZE?"
    )
    assert "invalid setting truncation" in error_line(out.stderr)


@pytest.mark.parametrize(
    ("variable", "value", "said", "how"),
    [
        # gRPC's keepalive is 32-bit milliseconds: inf and 1e10 crashed the start unnamed.
        ("LIMELIGHT_KEEPALIVE_TIME_S", "inf", "finite number", "set it with LIMELIGHT_KEEPALIVE"),
        ("LIMELIGHT_KEEPALIVE_TIME_S", "1e10", "less than or equal", "LIMELIGHT_KEEPALIVE_TIME_S"),
        ("LIMELIGHT_GRACE_PERIOD_S", "nan", "finite number", "--grace-period-s or LIMELIGHT_"),
        ("LIMELIGHT_JOB_TIMEOUT_S", "-5", "greater than 0", "LIMELIGHT_JOB_TIMEOUT_S"),
        ("LIMELIGHT_DRIFT_ALERT_THRESHOLD", "-1", "greater than or equal to 0", "THRESHOLD"),
        ("LIMELIGHT_DRIFT_BOOTSTRAP_N", "0", "greater than 0", "BOOTSTRAP_N"),
        ("LIMELIGHT_LABEL_THRESHOLD", "1.5", "less than or equal to 1", "LABEL_THRESHOLD"),
        # at 0 every label is predicted: refused here, not by the model's load
        ("LIMELIGHT_LABEL_THRESHOLD", "0", "greater than 0", "--label-threshold or LIMELIGHT"),
        # A flag named in the hint exists: this one's is --viewer, not --viewer-enabled.
        ("LIMELIGHT_VIEWER_ENABLED", "maybe", "valid boolean", "set it with --viewer or"),
    ],
)
def test_a_value_no_setting_can_take_is_one_line_naming_how_to_set_it(
    tmp_path: Path, variable: str, value: str, said: str, how: str
) -> None:
    out = limelight(*SERVE, "--model", str(tmp_path / "unused"), env={variable: value})
    assert out.returncode == EXIT_USAGE, out.stderr
    line = error_line(out.stderr)
    setting = variable.removeprefix("LIMELIGHT_").lower()
    assert line.startswith(f"limelight serve: error: invalid setting {setting}: "), line
    assert said in line and how in line, line


def test_invalid_batch_size_is_refused_before_anything_starts(tmp_path: Path) -> None:
    # Settings are checked before a port opens or the model loads: no log line comes first.
    for args, env in (
        (("--max-batch-size", "-3"), None),
        ((), {"LIMELIGHT_MAX_BATCH_SIZE": "-3"}),
    ):
        out = limelight(*SERVE, "--model", str(tmp_path / "unused"), *args, env=env)
        assert out.returncode == EXIT_USAGE, out.stderr
        assert out.stderr.strip().count("\n") == 0, out.stderr
        line = error_line(out.stderr)
        assert line.startswith("limelight serve: error: invalid setting max_batch_size:"), line
        assert "--max-batch-size" in line and "LIMELIGHT_MAX_BATCH_SIZE" in line


# --- in-process: the same handler for every mistake and every command -----------------------


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    status = main(list(args))
    return status, error_line(capsys.readouterr().err)


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_pickle_only_weights(
    capsys: pytest.CaptureFixture[str], random_bert_dir: Path, tmp_path: Path
) -> None:
    model = copy_model(random_bert_dir, tmp_path / "pickled")
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    status, line = run_main(capsys, *SERVE, "--model", str(model))
    assert status == EXIT_FAILURE
    assert "safetensors only" in line and "pytorch_model.bin" in line


def test_remote_code(
    capsys: pytest.CaptureFixture[str], random_bert_dir: Path, tmp_path: Path
) -> None:
    model = copy_model(random_bert_dir, tmp_path / "remote")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForSequenceClassification": "evil.Model"}
    (model / "config.json").write_text(json.dumps(config))
    status, line = run_main(capsys, *SERVE, "--model", str(model))
    assert status == EXIT_FAILURE and "trust_remote_code" in line


def test_refused_architecture(
    capsys: pytest.CaptureFixture[str], random_bert_dir: Path, tmp_path: Path
) -> None:
    model = copy_model(random_bert_dir, tmp_path / "funnel")
    (model / "config.json").write_text(json.dumps({"model_type": "funnel", "vocab_size": 30522}))
    status, line = run_main(capsys, *SERVE, "--model", str(model))
    assert status == EXIT_FAILURE
    assert "'funnel' is not supported: the encoder pools the sequence" in line


def test_a_checkpoint_without_its_classifier(
    capsys: pytest.CaptureFixture[str], random_bert_dir: Path, tmp_path: Path
) -> None:
    """Weights missing from the checkpoint would be random: the start stops and says which."""
    from safetensors.torch import load_file, save_file

    model = copy_model(random_bert_dir, tmp_path / "headless")
    weights = load_file(model / "model.safetensors")
    kept = {k: v for k, v in weights.items() if not k.startswith("classifier.")}
    save_file(kept, model / "model.safetensors", metadata={"format": "pt"})
    status, line = run_main(capsys, *SERVE, "--model", str(model))
    assert status == EXIT_FAILURE
    assert (
        "lacks weights the sequence classifier needs (classifier.bias, classifier.weight)" in line
    )


def test_a_drift_reference_of_another_method(
    capsys: pytest.CaptureFixture[str], random_bert_dir: Path, tmp_path: Path
) -> None:
    """This model serves NormXLogit (no distilled head beside it): a reference built from a
    head's attributions would report drift on unchanged traffic, so the server refuses it."""
    from limelight.drift import ReferenceFile
    from limelight.drift.profile import Profile
    from limelight.models.loaded import load_model

    labels = list(load_model(random_bert_dir).labels)
    reference = tmp_path / "reference.json"
    ReferenceFile(profile=Profile(labels, 8), labels=labels, method="distilled").save(reference)
    status, line = run_main(
        capsys, *SERVE, "--model", str(random_bert_dir), "--drift-reference", str(reference)
    )
    assert status == EXIT_FAILURE
    assert "holds distilled attributions, but the server explains with normxlogit" in line


def test_a_named_lexicon_default_that_cannot_be_built(
    capsys: pytest.CaptureFixture[str], random_bert_dir: Path, tmp_path: Path
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    status, line = run_main(
        capsys, *SERVE, "--model", str(random_bert_dir), "--cache-dir", str(blocked),
        "--default-method", "lexicon_lookup", "--lexicon-build",
    )  # fmt: skip
    assert status == EXIT_FAILURE
    assert "the lexicon table could not be built into" in line
    assert "set LIMELIGHT_CACHE_DIR to a writable directory" in line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        # Below the special tokens the tokenizer ignored the limit (1) or every text came
        # out empty (2): the requests failed, the start did not.
        (("--max-tokens", "1"), "max_tokens 1 leaves no room for text"),
        (("--max-tokens", "2"), "max_tokens 2 leaves no room for text"),
        # Four text tokens a window (six less [CLS] and [SEP]): an overlap of three leaves
        # one new token a window, not half (at 4 tokens and 2 of overlap, tokenizers
        # panicked on every long text and the call hung until its deadline).
        (
            ("--max-tokens", "6", "--truncation", "window", "--window-stride", "3"),
            "window_stride 3 must be between 0 and half the text tokens a window holds (2",
        ),
    ],
)
def test_a_token_limit_or_overlap_the_tokenizer_cannot_take(
    capsys: pytest.CaptureFixture[str], random_bert_dir: Path, args: tuple[str, ...], said: str
) -> None:
    status, line = run_main(capsys, *SERVE, "--model", str(random_bert_dir), *args)
    assert status == EXIT_USAGE, line
    assert said in line, line


def test_grpc_port_in_use(
    capsys: pytest.CaptureFixture[str], random_bert_dir: Path, busy_port: int
) -> None:
    status, line = run_main(
        capsys, "serve", "--model", str(random_bert_dir), "--port", str(busy_port),
        "--metrics-port", "0", "--jobs", "off",
    )  # fmt: skip
    assert status == EXIT_FAILURE
    assert f"cannot listen on 127.0.0.1:{busy_port}" in line and "--port" in line


def test_metrics_port_in_use(
    capsys: pytest.CaptureFixture[str], random_bert_dir: Path, busy_port: int
) -> None:
    status, line = run_main(
        capsys, "serve", "--model", str(random_bert_dir), "--port", "0",
        "--metrics-port", str(busy_port), "--jobs", "off",
    )  # fmt: skip
    assert status == EXIT_FAILURE
    assert "address already in use" in line and "--metrics-port" in line


def test_unreadable_tls_files(
    capsys: pytest.CaptureFixture[str], random_bert_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "server.pem"
    status, line = run_main(
        capsys, *SERVE, "--model", str(random_bert_dir),
        "--tls-cert", str(missing), "--tls-key", str(missing),
    )  # fmt: skip
    assert status == EXIT_USAGE and f"--tls-cert {missing}: cannot read it" in line

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    status, line = run_main(
        capsys, *SERVE, "--model", str(random_bert_dir),
        "--tls-cert", str(garbage), "--tls-key", str(garbage),
    )  # fmt: skip
    assert status == EXIT_USAGE and "not a PEM file" in line

    status, line = run_main(capsys, *SERVE, "--tls-cert", str(garbage))
    assert status == EXIT_USAGE and "--tls-cert and --tls-key go together" in line


def test_a_cut_client_ca_bundle_is_one_line_naming_it(
    capsys: pytest.CaptureFixture[str], random_bert_dir: Path, tmp_path: Path
) -> None:
    """A usage error that names the file and the fault, without a type name or a pointer to a
    traceback that would add nothing."""
    from tests.pki import make_pki

    pki = make_pki(tmp_path / "pki")
    cut = tmp_path / "ca-cut.pem"
    text = (pki / "ca.pem").read_text()
    cut.write_text(text[: len(text) // 2])
    status, line = run_main(
        capsys, *SERVE, "--model", str(random_bert_dir), "--port", "0", "--metrics-port", "0",
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
        "--tls-client-ca", str(cut),
    )  # fmt: skip
    assert status == EXIT_USAGE and f"--tls-client-ca {cut}" in line
    assert "TlsConfigError" not in line and "--log-level debug" not in line


@pytest.mark.parametrize(
    "command",
    [
        ("export-onnx",),
        ("explain", "some text", "--local"),
        ("calibrate-heads",),
        ("fit-lm-head",),
        ("drift-reference", "build"),
        ("eval", "--methods", "normxlogit"),
        ("distill",),
        ("lexicon",),
    ],
)
def test_every_command_reports_a_missing_model_in_one_line(
    capsys: pytest.CaptureFixture[str], command: tuple[str, ...], tmp_path: Path
) -> None:
    status, line = run_main(capsys, *command, "--model", str(tmp_path / "gone"))
    assert status == EXIT_FAILURE
    name = " ".join(c for c in command[:2] if not c.startswith("-") and " " not in c)
    assert line.startswith(f"limelight {name}: error: model directory"), line
    assert "does not exist" in line


def test_errors_a_command_finds_itself_read_like_every_other(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Errors a command reports itself take the form of those main() and argparse report."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    status, line = run_main(capsys, "drift-reference", "build", "--data", str(empty))
    assert status == EXIT_USAGE
    assert line == f"limelight drift-reference build: error: no texts in {empty}"
    status, line = run_main(capsys, "explain")
    assert (status, line) == (
        EXIT_USAGE,
        "limelight explain: error: give either a TEXT or --lines FILE",
    )
    status, line = run_main(capsys, "explain", "--lines", str(tmp_path / "none.txt"))
    assert status == EXIT_USAGE
    assert line.startswith(f"limelight explain: error: cannot read {tmp_path / 'none.txt'}: ")


@pytest.mark.parametrize(
    ("args", "env", "setting"),
    [
        (("--port", "70000"), {}, "port"),
        (("--grace-period-s", "-1"), {}, "grace_period_s"),
        ((), {"LIMELIGHT_MAX_PENDING": "0"}, "max_pending"),
        ((), {"LIMELIGHT_MAX_BATCH_WAIT_MS": "soon"}, "max_batch_wait_ms"),
        ((), {"LIMELIGHT_LABEL_THRESHOLDS": "toxic=0.3"}, "label_thresholds"),
    ],
)
def test_invalid_settings_read_as_one_line_naming_the_setting(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    env: dict[str, str],
    setting: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    status, line = run_main(capsys, *SERVE, *args)
    assert status == EXIT_USAGE
    assert line.startswith(f"limelight serve: error: invalid setting {setting}:"), line
    assert f"LIMELIGHT_{setting.upper()}" in line


def test_calibrate_heads_reports_errors_like_every_other_command(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, line = run_main(capsys, "calibrate-heads", "--model", str(tmp_path / "gone"))
    serve_status, serve_line = run_main(capsys, *SERVE, "--model", str(tmp_path / "gone"))
    assert status == serve_status == EXIT_FAILURE
    assert line.startswith("limelight calibrate-heads: error: model directory"), line
    assert line.removeprefix("limelight calibrate-heads") == serve_line.removeprefix(
        "limelight serve"
    )


def test_an_argument_the_sidecar_refuses_is_a_usage_error_as_the_epilog_says() -> None:
    """The same invalid input exited 2 in-process (``--local``) but 1 against a sidecar,
    which refuses it with INVALID_ARGUMENT; the --help epilog promises 2 for both."""
    import argparse

    import grpc

    from limelight.cli.main import build_parser, describe_error
    from limelight_client.errors import DeadlineExceeded, InvalidArgument

    args = argparse.Namespace(command="drift", target="host:50051", timeout=5.0)
    refused = InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "top_k must be at least 1")
    assert describe_error(refused, args) == (
        "INVALID_ARGUMENT: top_k must be at least 1",
        EXIT_USAGE,
    )
    late = DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert describe_error(late, args) == (
        "no answer from the sidecar at host:50051 within --timeout 5 s; raise --timeout or "
        "check it is serving",
        EXIT_FAILURE,
    )
    epilog = " ".join((build_parser().epilog or "").split())
    assert (
        "exit status 2 (invalid arguments or settings, the sidecar's refusal of an argument "
        "included) or 1 (anything else)"
    ) in epilog


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_help_prints_on_a_terminal_that_cannot_encode_all_of_it(encoding: str) -> None:
    """A character standard output cannot encode (distill's help has a dash, worker's an
    ellipsis) is printed as "?" rather than ending the command with UnicodeEncodeError."""
    for command in ("distill", "worker"):
        out = subprocess.run(
            [sys.executable, "-m", "limelight.cli.main", command, "--help"],
            capture_output=True,
            timeout=300,
            env={**os.environ, "PYTHONIOENCODING": encoding},
        )
        assert out.returncode == 0, out.stderr.decode(errors="replace")
        assert out.stdout.decode(encoding).startswith(f"usage: limelight {command}")


def test_a_path_that_cannot_be_used_is_named_by_its_flag_and_direction(tmp_path: Path) -> None:
    """A file the command writes reads "cannot write", one it reads "cannot read"; a folder on
    the way that is missing is named after the flag's own value."""
    import argparse
    import errno

    from limelight.cli.main import describe_error

    args = argparse.Namespace(
        command="explain", html="nodir/x.html", lines="in.txt", plot="/no/such/d.png"
    )
    missing = errno.ENOENT, "No such file or directory"
    assert describe_error(FileNotFoundError(*missing, "nodir/x.html"), args) == (
        "cannot write --html nodir/x.html: No such file or directory",
        EXIT_FAILURE,
    )
    assert describe_error(FileNotFoundError(*missing, "in.txt"), args)[0] == (
        "cannot read --lines in.txt: No such file or directory"
    )
    assert describe_error(FileNotFoundError(*missing, "/no/such"), args)[0] == (
        "cannot write --plot /no/such/d.png: No such file or directory (/no/such)"
    )
    assert describe_error(FileNotFoundError(*missing, "/elsewhere"), args)[0] == (
        "cannot read /elsewhere: No such file or directory"
    )


def test_bench_refuses_a_job_method_it_cannot_run_before_the_model_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["bench", "--model", str(tmp_path / "gone"), "--sections", "jobs"]
    status, line = run_main(capsys, *argv, "--job-methods", "lrp,normxlogit,nope")
    assert status == EXIT_USAGE
    assert line.startswith(
        "limelight bench: error: --job-methods: 'normxlogit', 'nope' not a job method (job "
        "methods: "
    ), line


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["calibrate-heads", "--model", "m", "--output", "mask.json"],
            "limelight calibrate-heads: error: unrecognized arguments: --output mask.json "
            "(--output: did you mean --out?)",
        ),
        (
            ["jobs", "list", "--limt", "3"],
            "limelight jobs list: error: unrecognized arguments: --limt 3 (--limt: did you mean "
            "--limit?)",
        ),
        (["explain", "a", "b"], "limelight explain: error: unrecognized arguments: b"),
        (["--bogus"], "limelight: error: unrecognized arguments: --bogus"),
        # After `--` every argument is text: a flag there is not offered as itself ("--json:
        # did you mean --json?"); the line says where options go.
        (
            ["explain", "--", "-awful", "--json"],
            "limelight explain: error: unrecognized arguments: --json (after -- every argument "
            "is text, not an option; put options before --: limelight explain --json -- -awful)",
        ),
        (
            ["explain", "--top", "2", "--", "-awful", "--jsn", "--top=3"],
            "limelight explain: error: unrecognized arguments: --jsn --top=3 (--jsn: did you mean "
            "--json?; after -- every argument is text, not an option; put options before --: "
            "limelight explain --top 2 --jsn --top=3 -- -awful)",
        ),
        (
            ["explain", "--", "great", "movie"],
            "limelight explain: error: unrecognized arguments: movie (after -- every argument is "
            "text, and the command takes one: quote a text of several words)",
        ),
    ],
)
def test_an_unknown_argument_is_reported_by_its_command_with_the_nearest_flag(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == said
    assert err.startswith(f"usage: {said.split(': error')[0]}")  # the command's own usage


def test_fit_lm_head_takes_out_as_the_other_commands_do() -> None:
    from limelight.cli.main import build_parser

    for flag in ("--out", "--output"):
        args = build_parser().parse_args(["fit-lm-head", flag, "head"])
        assert str(args.output) == "head"
