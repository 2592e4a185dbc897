"""The CLI answers `--help`, and lists the cache, without importing torch: importing it takes
seconds, which every `limelight --help` and `limelight cache` used to pay (a command module
that imported its machinery at the top, or built its help from a torch module's defaults)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "transformers", "onnxruntime", "scipy")


def modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return set(out.stdout.split())


def test_building_the_parser_imports_no_heavy_package() -> None:
    loaded = modules_after(
        "from limelight.cli.main import build_parser\n"
        "parser = build_parser()\n"
        "assert 'cache' in parser.format_help() and 'distill' in parser.format_help()"
    )
    assert "limelight.cli.distill" in loaded  # every command's module was registered
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_listing_the_cache_imports_no_heavy_package(tmp_path: Path) -> None:
    loaded = modules_after(
        "from limelight.cli.main import main\n"
        f"assert main(['cache', '--cache-dir', {str(tmp_path)!r}]) == 0\n"
        f"assert main(['cache', 'prune', '--cache-dir', {str(tmp_path)!r}]) == 0"
    )
    assert "limelight.cache_inventory" in loaded
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_every_option_of_every_command_says_what_it_does() -> None:
    """`limelight COMMAND --help` explains each flag: none is listed bare."""
    import argparse

    from limelight.cli.main import build_parser

    bare: list[str] = []

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in dict.fromkeys(action.choices.values()):
                    walk(child)
            elif action.option_strings and not action.help:
                bare.append(f"{parser.prog} {'/'.join(action.option_strings)}")

    walk(build_parser())
    assert not bare, bare
