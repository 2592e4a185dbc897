"""The SDK must install and import without the server's heavy dependencies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import limelight_client

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"

HEAVY = ("torch", "transformers", "numpy", "tokenizers", "safetensors", "limelight")
# grpcio itself peeks at grpc_health when it is installed, so it is only blocked, not checked:
# the SDK's health check must work without grpcio-health-checking.
BLOCKED = (*HEAVY, "grpc_health", "grpc_tools")


def test_import_pulls_in_no_heavy_modules() -> None:
    code = (
        "import sys, limelight_client, limelight_client.render, limelight_client.aio\n"
        "from limelight_client import Client, AsyncClient, Explanation, Token, Job, errors\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print(limelight_client.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == limelight_client.__version__


def test_import_with_heavy_packages_blocked() -> None:
    # Stronger than the check above: make importing torch/numpy/transformers fail outright.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {BLOCKED!r}:\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import limelight_client\n"
        "from limelight_client import Client, Explanation\n"
        "from limelight_client.proto import explainer_pb2 as pb\n"
        "msg = pb.ExplainResponse(label='a', labels=['a'], probabilities=[1.0])\n"
        "exp = Explanation.from_proto(msg, text='')\n"
        "exp.to_html(); exp.to_terminal()\n"
        "c = Client('127.0.0.1:1', retries=0)\n"
        "try:\n"
        "    c.wait_ready(timeout=0.2, poll=0.05)\n"
        "except TimeoutError:\n"
        "    pass\n"
        "c.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr


def test_package_metadata_lists_only_grpc_and_protobuf() -> None:
    text = (CLIENT_DIR / "pyproject.toml").read_text()
    deps_block = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    names = sorted(
        line.strip().strip('",').split(">")[0].split("=")[0].split("<")[0]
        for line in deps_block.splitlines()
        if line.strip()
    )
    assert names == ["grpcio", "protobuf"]


def test_public_exports() -> None:
    for name in ("Client", "AsyncClient", "Explanation", "Token", "Job", "errors", "__version__"):
        assert hasattr(limelight_client, name), name
    assert limelight_client.errors.LimelightError is limelight_client.LimelightError
