"""The SDK on the oldest Python it declares (``requires-python`` of client/pyproject.toml), with
the lowest grpcio and protobuf it accepts, against a real sidecar: installed from the source
tree into a fresh virtual environment of that interpreter, as a user on that Python would.

The rest of the suite runs the SDK on the server's Python only; this catches syntax and
library calls newer than the declared floor (``typing.Self``, ``asyncio.timeout``, ...).
Skipped, saying why, where no such interpreter is installed."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from limelight_client import Client
from tests.conftest import RunningSidecar

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"

# Runs in the old interpreter: every kind of call, printed as JSON for the test to compare.
SCRIPT = r"""
import asyncio, json, sys
from limelight_client import AsyncClient, Client
from limelight_client.render import to_html, to_terminal

target, text = sys.argv[1], sys.argv[2]
out = {"python": list(sys.version_info[:2])}
with Client(target) as client:
    one = client.explain(text)
    out["label"] = one.label
    out["tokens"] = [[t.text, t.start, t.end, t.special] for t in one.tokens]
    out["scores"] = one.scores
    out["words"] = [w.text for w in one.words()]
    out["many"] = [e.label for e in client.explain_many([text, text + " again"])]
    out["batch"] = [e.label for e in client.explain_batch([text, text])]
    out["html"] = "<span" in to_html(one)
    out["terminal"] = "gorgeous" in to_terminal(one, color=True)
    out["model"] = client.model().labels
    job = client.submit(text, "integrated_gradients", steps=4)
    out["job"] = job.result(timeout=120).method

async def main():
    async with AsyncClient(target) as client:
        answers = await asyncio.gather(*(client.explain(text) for _ in range(4)))
        return [a.label for a in answers]

out["async"] = asyncio.run(main())
print(json.dumps(out))
"""


def _declared_floor() -> tuple[int, int]:
    declared = tomllib.loads((CLIENT_DIR / "pyproject.toml").read_text())["project"]
    match = re.fullmatch(r">=\s*3\.(\d+)", declared["requires-python"])
    assert match, f"unexpected requires-python {declared['requires-python']!r}"
    return 3, int(match.group(1))


def _dependency_floors() -> list[str]:
    """``grpcio==1.85.1``-style pins of each dependency's lowest accepted version."""
    declared = tomllib.loads((CLIENT_DIR / "pyproject.toml").read_text())["project"]
    pins = []
    for requirement in declared["dependencies"]:
        match = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", requirement)
        assert match, f"no lower bound in {requirement!r}"
        pins.append(f"{match.group(1)}=={match.group(2)}")
    return pins


def _interpreter(version: tuple[int, int]) -> str | None:
    """``LIMELIGHT_TEST_OLDEST_PYTHON``, else ``python3.X`` on PATH, else a pyenv build: the
    first that runs and is that version (a pyenv shim of an inactive version does not)."""
    root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates = [
        os.environ.get("LIMELIGHT_TEST_OLDEST_PYTHON"),
        shutil.which(f"python{version[0]}.{version[1]}"),
        *sorted(glob.glob(f"{root}/versions/{version[0]}.{version[1]}.*/bin/python"), reverse=True),
    ]
    for candidate in candidates:
        if not candidate:
            continue
        probe = subprocess.run(
            [candidate, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode == 0 and probe.stdout.split() == [str(v) for v in version]:
            return candidate
    return None


@pytest.fixture(scope="module")
def oldest_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The SDK installed from the source tree into a fresh venv of the oldest Python."""
    version = _declared_floor()
    interpreter = _interpreter(version)
    if interpreter is None:
        pytest.skip(
            f"no Python {version[0]}.{version[1]} here (the SDK's declared floor); set "
            "LIMELIGHT_TEST_OLDEST_PYTHON to one to run this test"
        )
    work = tmp_path_factory.mktemp("oldest-python")
    # A copy: pip builds in the source folder it is given, and the tree stays as it is.
    source = work / "client"
    shutil.copytree(
        CLIENT_DIR, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    venv = work / "venv"
    subprocess.run([interpreter, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", str(source), *_dependency_floors()],
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    return python


def test_the_sdk_works_on_its_oldest_python(oldest_python: str, sidecar: RunningSidecar) -> None:
    text = "a gorgeous, witty, seductive movie"
    run = subprocess.run(
        [oldest_python, "-c", SCRIPT, sidecar.target, text],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd="/",  # never the source tree: the installed package only
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert tuple(out["python"]) == _declared_floor() != sys.version_info[:2]
    # The same answers as the SDK on the server's Python.
    with Client(sidecar.target) as client:
        here = client.explain(text)
    assert out["label"] == here.label
    assert out["tokens"] == [[t.text, t.start, t.end, t.special] for t in here.tokens]
    assert out["scores"] == pytest.approx(here.scores, abs=1e-5)
    assert out["words"] == [w.text for w in here.words()]
    assert out["many"] == [here.label, out["many"][1]] and len(out["many"]) == 2
    assert out["batch"] == [here.label] * 2
    assert out["async"] == [here.label] * 4
    assert out["html"] and out["terminal"]
    assert out["model"] == ["rotten", "fresh"]
    assert out["job"] == "integrated_gradients"
