"""Inline explain vs plain forward and gRPC end to end, torch and ONNX Runtime.

    .venv/bin/python bench/bench_inline.py [--demo minilm|bert-tiny] [--quick] [--out DIR]

A thin wrapper over `limelight bench` without the job methods.
"""

from __future__ import annotations

import sys

from limelight.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--job-methods", "", *sys.argv[1:]]))
