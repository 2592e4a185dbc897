"""Fixtures for the client SDK tests (the scripted server lives in llc_scripted.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from limelight_client.proto import explainer_pb2 as pb
from tests.client.llc_scripted import ScriptedExplainer, ScriptedServer, make_response, start_server


@pytest.fixture
def scripted() -> Iterator[ScriptedServer]:
    """A real gRPC server on a free loopback port running a ``ScriptedExplainer``."""
    running = start_server(ScriptedExplainer())
    yield running
    running.server.stop(grace=None)


@pytest.fixture
def response_factory() -> Callable[..., pb.ExplainResponse]:
    return make_response
