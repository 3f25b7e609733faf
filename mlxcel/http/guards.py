"""Request checks that run before any body is read: who may call what, from where.

Pure functions over header values, so each rule is a plain call in tests.
"""

from __future__ import annotations

import ipaddress
import posixpath
from urllib.parse import urlsplit

from mlxcel.errors import InvalidRequest

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def normalized_path(path: str) -> str:
    """The path routing will end up at: repeated slashes merged, dot segments resolved.

    Access rules are checked on this, so `/v1//cache/reset` or
    `/v1/x/../cache/reset` needs the same key as `/v1/cache/reset`.
    """
    normalized = posixpath.normpath("/" + path.lstrip("/"))
    # normpath keeps a leading "//"; routing merges it.
    normalized = "/" + normalized.lstrip("/")
    return normalized + "/" if path.endswith("/") and normalized != "/" else normalized


def trusted_hosts_for(bind_host: str) -> frozenset[str] | None:
    """Host names a keyless server answers to, or None when it cannot know (a wildcard bind).

    Only loopback and literal-address binds are checked: that is what stops a web
    page the local user visits from reaching the server through DNS rebinding.
    """
    host = bind_host.strip("[]").lower()
    if host in LOOPBACK_NAMES or _is_loopback_address(host):
        return LOOPBACK_NAMES | {host}
    if host in ("", "0.0.0.0", "::"):
        return None
    return frozenset({host})


def host_name(value: str) -> str:
    """The name part of a `Host` header or an origin's netloc (`[::1]:8080` -> `::1`)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        return value.partition(":")[0]
    return value


def check_browser_safety(
    *, method: str, host: str | None, origin: str | None, content_type: str | None,
    has_body: bool, trusted_hosts: frozenset[str] | None,
) -> None:
    """Refuse what a hostile web page could make a browser send to a keyless server.

    DNS rebinding shows as a foreign `Host`; a cross-site request shows as a
    foreign `Origin`; a body that is not `application/json` is what a page can
    post without a CORS preflight.
    """
    if trusted_hosts is not None and host_name(host or "") not in trusted_hosts:
        raise InvalidRequest(
            f"the Host header {host!r} is not a name this server answers to without an API key",
            status=403, code="untrusted_host", error_type="permission_error",
        )
    if origin and origin != "null":
        origin_host = host_name(urlsplit(origin).netloc)
        allowed = trusted_hosts if trusted_hosts is not None else frozenset({host_name(host or "")})
        if origin_host not in allowed:
            raise InvalidRequest(
                f"cross-origin requests from {origin!r} are refused without an API key",
                status=403, code="untrusted_origin", error_type="permission_error",
            )
    elif origin == "null":
        raise InvalidRequest(
            "requests from an opaque origin are refused without an API key",
            status=403, code="untrusted_origin", error_type="permission_error",
        )
    if method == "POST" and has_body and (content_type or "").split(";")[0].strip().lower() != "application/json":
        raise InvalidRequest(
            f"the request body must be sent as `Content-Type: application/json`, not {content_type!r}",
            status=415, code="unsupported_media_type",
        )


def single_authorization(values: list[str], name: str = "Authorization") -> str:
    """The one `Authorization` (or ``name``) header; two are refused rather than picking one."""
    if len(values) > 1:
        raise InvalidRequest(
            f"send exactly one {name} header", status=400, code="duplicate_authorization",
        )
    return values[0] if values else ""


def _is_loopback_address(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
