"""An image part's bytes: where they come from, fetched within limits, decoded and checked.

Pure: no Trio, no MLX. Validation (`mlxcel/http/validation.py`) decodes
``data:`` URLs at once and checks the policy of ``file://`` and remote URLs;
the router fetches remote images first (`fetch_remote`, in threads of their
own, outside its render slots), reads files in its worker thread
(`resolve`) and decodes every image (`decode`) before the prompt is
tokenized. Every failure is an `InvalidRequest` naming the part; a failed
fetch says why in this server's words, never the remote server's (no
status codes, addresses or ports).
"""

from __future__ import annotations

import contextlib
import http.client
import io
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from mlxcel.errors import InvalidRequest
from mlxcel.types import ImageSource as ImageSource

# What a content part's text stands for until the router swaps in the model's own placeholder.
IMAGE_SENTINEL = "\ue000mlxcel:image\ue000"
# Formats by their first bytes: what PIL decodes here and what clients send.
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"\xff\xd8\xff", "jpeg"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
)
# Redirects one image fetch follows at most.
MAX_REDIRECTS = 3
FORMATS = ("png", "jpeg", "gif", "webp", "bmp")
# Larger images are refused before decoding (a decompression bomb of a few kilobytes can be gigapixels).
MAX_IMAGE_PIXELS = 50_000_000
# Sides that differ more are refused before decoding: a processor that scales the short side up to its
# resolution would make a 1 x 7,000,000 strip gigapixels (Qwen2-VL's own processor refuses past 200).
MAX_ASPECT_RATIO = 200


def image_format(data: bytes) -> str | None:
    """The image format the bytes begin with, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    return None


def check_bytes(data: bytes, param: str, max_bytes: int) -> bytes:
    if len(data) > max_bytes:
        raise InvalidRequest(f"{param}: the image is {len(data)} bytes, over this server's limit of {max_bytes}",
                             param=param, code="invalid_value")
    if not data:
        raise InvalidRequest(f"{param}: the image is empty", param=param, code="invalid_value")
    if image_format(data) is None:
        raise InvalidRequest(f"{param}: not an image this server reads (expected one of {', '.join(FORMATS)})",
                             param=param, code="invalid_value")
    return data


def resolve(source: ImageSource) -> bytes:
    """The part's bytes: already there (data URL), read from a file, or fetched (allowed by validation)."""
    if source.data is not None:
        return source.data
    url = source.url
    assert url is not None, "validation gives every part data or a URL"
    if url.startswith("file://"):
        return _read_file(Path(url.removeprefix("file://")), source)
    return _fetch(url, source)


def _read_file(path: Path, source: ImageSource) -> bytes:
    try:
        with path.open("rb") as file:
            data = file.read(source.max_bytes + 1)
    except OSError as error:
        raise InvalidRequest(f"{source.param}: cannot read the image file: {error.strerror or error}",
                             param=source.param, code="invalid_value") from None
    return check_bytes(data, source.param, source.max_bytes)


def fetch_remote(sources: Sequence[ImageSource]) -> tuple[ImageSource, ...]:
    """The sources with every http(s) image fetched into its bytes (the router does this outside its render slots)."""
    return tuple(attrs.evolve(source, data=_fetch(source.url, source), url=None)
                 if source.data is None and source.url is not None and is_remote(source) else source
                 for source in sources)


def is_remote(source: ImageSource) -> bool:
    return source.url is not None and source.url.startswith(("http://", "https://"))


class FetchRefused(Exception):
    """Why a fetch stopped, in words that say nothing of what the remote server answered."""


def _fetch(url: str, source: ImageSource) -> bytes:
    """The image at url, within one deadline for the whole fetch, from public addresses only.

    Every hop (at most ``MAX_REDIRECTS`` redirects) is checked: http(s)
    only, and every address its host resolves to must be global unless
    ``source.fetch_allow`` names the host or a network holding it; the
    connection goes to the address that was checked (no second lookup).
    """
    deadline = time.monotonic() + source.timeout_s
    try:
        for _hop in range(MAX_REDIRECTS + 1):
            location = _fetch_once(url, source, deadline)
            if isinstance(location, bytes):
                return check_bytes(location, source.param, source.max_bytes)
            url = urllib.parse.urljoin(url, location)
        raise FetchRefused(f"it redirected more than {MAX_REDIRECTS} times")
    except FetchRefused as error:
        raise InvalidRequest(f"{source.param}: cannot fetch the image: {error}", param=source.param,
                             code="invalid_value") from None


def _fetch_once(url: str, source: ImageSource, deadline: float) -> bytes | str:
    """One hop: the body of a 200, or a redirect's Location."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchRefused("only http and https URLs are fetched")
    host = parts.hostname
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise FetchRefused("the URL's port is not valid") from None
    address = _checked_address(host, port, source.fetch_allow, deadline)
    connection_type = _PinnedHTTPSConnection if parts.scheme == "https" else _PinnedHTTPConnection
    connection = connection_type(host, port, address=address, timeout=max(deadline - time.monotonic(), 0.001))
    # The socket timeout bounds each read; this bounds them all together (a server dripping a byte a second).
    watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), connection.abort)
    watchdog.daemon = True
    watchdog.start()
    response: http.client.HTTPResponse | None = None
    try:
        path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        connection.request("GET", path, headers={"User-Agent": "mlxcel", "Accept": "image/*"})
        response = connection.getresponse()
        if response.status in (301, 302, 303, 307, 308):
            location = response.getheader("Location")
            if not location:
                raise FetchRefused("the image server answered with a redirect without a location")
            return location
        if response.status != 200:
            raise FetchRefused("the image server did not return the image")
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > source.max_bytes:
            raise FetchRefused(f"the image is over this server's limit of {source.max_bytes} bytes")
        data = response.read(source.max_bytes + 1)
        if connection.aborted:
            raise FetchRefused(f"it took longer than the {source.timeout_s:g} s this server allows a fetch")
        return data
    except FetchRefused:
        raise
    except (OSError, http.client.HTTPException, ValueError):
        if connection.aborted or time.monotonic() >= deadline:
            raise FetchRefused(f"it took longer than the {source.timeout_s:g} s this server allows a fetch") from None
        raise FetchRefused("the image server could not be reached or broke off") from None
    finally:
        watchdog.cancel()
        if response is not None:
            response.close()
        connection.close()
        connection.close_socket()


def _checked_address(host: str, port: int, allow: Sequence[str], deadline: float) -> str:
    """The address to connect to: host resolved (within the deadline), every answer allowed."""
    allowed_host = host.lower().rstrip(".") in {entry.lower() for entry in allow}
    networks = [network for network in (_network(entry) for entry in allow) if network is not None]
    answer: list[Any] = []
    resolver = threading.Thread(target=_resolve, args=(host, port, answer), daemon=True)
    resolver.start()
    resolver.join(max(deadline - time.monotonic(), 0.0))
    if not answer:
        raise FetchRefused("its host name did not resolve in time" if resolver.is_alive()
                           else "its host name does not resolve")
    addresses = answer[0]
    if not addresses:
        raise FetchRefused("its host name does not resolve")
    for address in addresses:
        if not allowed_host and not _public(address) and not any(address in network for network in networks):
            raise FetchRefused("its host is a loopback, private, link-local or metadata address, which this "
                               "server does not fetch from (--image-fetch-allow lists exceptions)")
    return str(addresses[0])


def _resolve(host: str, port: int, answer: list[Any]) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        answer.append([])
        return
    addresses = []
    for info in infos:
        try:
            addresses.append(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]))
        except ValueError:
            continue
    answer.append(addresses)


def _public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A globally routed unicast address: not loopback, private, link-local (cloud metadata), shared or reserved."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


def _network(entry: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return None


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to the address that was checked, not to a fresh lookup of the host (DNS rebinding)."""

    def __init__(self, host: str, port: int, *, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address
        self.aborted = False
        # http.client hands the socket to the response (and forgets it) once the response is read to close.
        self._socket: socket.socket | None = None

    def connect(self) -> None:
        self.sock = self._socket = socket.create_connection((self._address, self.port), self.timeout)
        if self.aborted:  # the deadline passed while connecting
            raise TimeoutError("the fetch's deadline passed")

    def close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close()

    def abort(self) -> None:
        """Called by the watchdog thread: a blocked read returns at once."""
        self.aborted = True
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)


class _PinnedHTTPSConnection(_PinnedHTTPConnection):
    default_port = 443

    def __init__(self, host: str, port: int, *, address: str, timeout: float) -> None:
        super().__init__(host, port, address=address, timeout=timeout)
        self._tls = ssl.create_default_context()

    def connect(self) -> None:
        super().connect()
        assert self.sock is not None
        self.sock = self._socket = self._tls.wrap_socket(self.sock, server_hostname=self.host)


def check_dimensions(width: int, height: int, param: str) -> None:
    """Refuse, from the header's size alone, an image no model here can take (before any pixel is decoded)."""
    if width < 1 or height < 1:
        raise InvalidRequest(f"{param}: the image is {width}x{height} pixels", param=param, code="invalid_value")
    if width * height > MAX_IMAGE_PIXELS:
        raise InvalidRequest(f"{param}: the image is {width}x{height} pixels, over this server's limit of "
                             f"{MAX_IMAGE_PIXELS}", param=param, code="invalid_value")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise InvalidRequest(f"{param}: the image is {width}x{height} pixels; its sides may differ at most "
                             f"{MAX_ASPECT_RATIO}-fold", param=param, code="invalid_value")


def decode(data: bytes, param: str, check: Callable[[int, int], None] | None = None) -> Any:
    """The image as an RGB PIL image; a 400 naming the part when it does not decode.

    PIL's ``open`` reads only the header, so the size is checked (and then
    ``check``, a model's bound on what its processor would resize it to)
    before the pixels are decoded.
    """
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as opened:
            width, height = opened.size
            check_dimensions(width, height, param)
            if check is not None:
                check(width, height)
            opened.load()
            return opened.convert("RGB")
    except InvalidRequest:
        raise
    except Exception as error:  # noqa: BLE001 - PIL raises many kinds for a corrupt file (MemoryError included)
        raise InvalidRequest(f"{param}: the image cannot be decoded: {error}", param=param,
                             code="invalid_value") from None
