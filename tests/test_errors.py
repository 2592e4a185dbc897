"""``limelight.errors.redact_credentials``: what an error message may say about a URL."""

from __future__ import annotations

import pytest

from limelight.errors import redact_credentials


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("redis://limelight:s3cret@redis:6379/0", "redis://***@redis:6379/0"),
        ("rediss://:s3cret@redis:6380/1", "rediss://***@redis:6380/1"),
        ("redis://user:p@ss@host/0", "redis://***@host/0"),  # an unescaped @ in the password
        (
            "unix:///run/redis.sock?db=0&password=s3cret&x=1",
            "unix:///run/redis.sock?db=0&password=***&x=1",
        ),
        ("at redis://a:b@h/0 and http://c:d@e/f.", "at redis://***@h/0 and http://***@e/f."),
        ("redis://redis:6379/0", "redis://redis:6379/0"),  # nothing to hide
        ("sqlite", "sqlite"),
    ],
)
def test_credentials_in_urls_are_hidden(text: str, shown: str) -> None:
    assert redact_credentials(text) == shown


def test_every_kind_has_a_grpc_and_an_http_status() -> None:
    """One mapping table each; a kind added without its row would fail at the first call that
    raised it."""
    from limelight.api.errors import HTTP_STATUS_BY_KIND, STATUS_BY_KIND
    from limelight.errors import ErrorKind

    assert set(STATUS_BY_KIND) == set(ErrorKind) == set(HTTP_STATUS_BY_KIND)
    # Distinct kinds are distinct gRPC codes: a client tells them apart.
    assert len(set(STATUS_BY_KIND.values())) == len(ErrorKind)
