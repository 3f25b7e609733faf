"""The pure pre-body checks: path normalization, Host/Origin/Content-Type, one Authorization."""

from __future__ import annotations

import pytest

from mlxcel.http.guards import (
    check_browser_safety,
    host_name,
    normalized_path,
    single_authorization,
    trusted_hosts_for,
)
from mlxcel.types import InvalidRequest


@pytest.mark.parametrize(("raw", "expected"), [
    ("/v1/cache/reset", "/v1/cache/reset"),
    ("/v1//cache/reset", "/v1/cache/reset"),
    ("//v1/cache/reset", "/v1/cache/reset"),
    ("/v1/models/../cache/reset", "/v1/cache/reset"),
    ("/v1/./cache//reset/", "/v1/cache/reset/"),
    ("/", "/"),
])
def test_paths_are_checked_as_routing_will_see_them(raw: str, expected: str) -> None:
    assert normalized_path(raw) == expected


def test_trusted_hosts_follow_the_bind_address() -> None:
    assert trusted_hosts_for("127.0.0.1") >= {"localhost", "127.0.0.1", "::1"}
    assert trusted_hosts_for("::1") >= {"localhost", "::1"}
    assert trusted_hosts_for("0.0.0.0") is None
    assert trusted_hosts_for("10.0.0.5") == frozenset({"10.0.0.5"})


@pytest.mark.parametrize(("header", "name"), [
    ("localhost:8080", "localhost"), ("[::1]:8080", "::1"), ("Example.COM", "example.com"), ("::1", "::1"),
])
def test_host_names(header: str, name: str) -> None:
    assert host_name(header) == name


def _check(**changes: object) -> None:
    arguments = dict(method="POST", host="127.0.0.1:8080", origin=None, content_type="application/json",
                     has_body=True, trusted_hosts=trusted_hosts_for("127.0.0.1"))
    arguments.update(changes)
    check_browser_safety(**arguments)  # type: ignore[arg-type]


def test_what_local_clients_send_passes() -> None:
    _check()
    _check(content_type="application/json; charset=utf-8", origin="http://localhost:8080", host="localhost:8080")
    _check(method="POST", content_type=None, has_body=False)
    _check(trusted_hosts=None, host="192.168.1.4:8080", origin="http://192.168.1.4:8080")


@pytest.mark.parametrize(("changes", "status", "code"), [
    ({"host": "evil.example:8080"}, 403, "untrusted_host"),
    ({"origin": "https://evil.example"}, 403, "untrusted_origin"),
    ({"origin": "null"}, 403, "untrusted_origin"),
    ({"trusted_hosts": None, "host": "10.0.0.5:80", "origin": "http://evil.example"}, 403, "untrusted_origin"),
    ({"content_type": "text/plain"}, 415, "unsupported_media_type"),
    ({"content_type": None}, 415, "unsupported_media_type"),
    ({"content_type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
])
def test_what_a_web_page_could_send_is_refused(changes: dict[str, object], status: int, code: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _check(**changes)
    assert (caught.value.status, caught.value.code) == (status, code)


def test_one_authorization_header() -> None:
    assert single_authorization([]) == ""
    assert single_authorization(["Bearer a"]) == "Bearer a"
    with pytest.raises(InvalidRequest) as caught:
        single_authorization(["Bearer a", "Bearer b"])
    assert caught.value.code == "duplicate_authorization"
