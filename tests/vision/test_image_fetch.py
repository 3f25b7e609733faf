"""Remote image fetches: public addresses only (after DNS, every redirect hop), one deadline for the whole
fetch, errors in this server's words, and fetches kept off what text requests need (issue 33)."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from mlxcel.config import EngineConfig, SchedulerConfig, parse_fetch_allow
from mlxcel.engine import run_engine
from mlxcel.errors import InvalidRequest
from mlxcel.fixtures import vision_fixture_path
from mlxcel.types import ImageSource
from mlxcel.vision.images import MAX_REDIRECTS, resolve
from tests.support import TEST_CACHE
from tests.vision.test_images import png

IMAGE = png()


class _Handler(http.server.BaseHTTPRequestHandler):
    """/image: a PNG; /drip: headers, then a byte every 0.2 s; /to?url: a redirect; /loop: itself."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/image":
            self._send(200, IMAGE, {"Content-Type": "image/png"})
        elif self.path.startswith("/to?"):
            self._send(302, b"", {"Location": self.path.removeprefix("/to?")})
        elif self.path == "/loop":
            self._send(302, b"", {"Location": "/loop"})
        elif self.path == "/drip":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(IMAGE)))
            self.end_headers()
            try:
                for byte in IMAGE:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                return
        else:
            self._send(404, b"Not Found: secret-internal-detail", {})

    def _send(self, status: int, data: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def fetch(url: str, **changes) -> bytes:
    return resolve(ImageSource(param="p", url=url, **changes))


def refusal(url: str, **changes) -> str:
    with pytest.raises(InvalidRequest) as caught:
        fetch(url, **changes)
    assert caught.value.param == "p"
    return caught.value.message


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:9/a.png", "http://localhost/a.png", "http://[::1]/a.png", "http://10.1.2.3/a.png",
    "http://192.168.0.1/a.png", "http://169.254.169.254/latest/meta-data/", "http://[::ffff:127.0.0.1]/a.png",
    "http://100.100.100.200/", "http://0.0.0.0/a.png", "http://[fd00:ec2::254]/",
])
def test_loopback_private_link_local_and_metadata_addresses_are_refused(url: str) -> None:
    assert "loopback, private, link-local or metadata" in refusal(url, timeout_s=2)


def test_the_allowlist_names_hosts_and_networks(image_server: str) -> None:
    port = image_server.rsplit(":", 1)[1]
    assert fetch(f"{image_server}/image", fetch_allow=("127.0.0.1",)) == IMAGE
    assert fetch(f"{image_server}/image", fetch_allow=("127.0.0.0/8",)) == IMAGE
    assert fetch(f"http://localhost:{port}/image", fetch_allow=("localhost",)) == IMAGE
    assert "metadata" in refusal(f"{image_server}/image", fetch_allow=("10.0.0.0/8",))


def test_every_redirect_hop_is_checked(image_server: str) -> None:
    allow = ("127.0.0.1",)
    # To an allowed host: followed; to another loopback address, a private one or another scheme: refused.
    assert fetch(f"{image_server}/to?{image_server}/image", fetch_allow=allow) == IMAGE
    assert "metadata" in refusal(f"{image_server}/to?http://127.0.0.2/image", fetch_allow=allow)
    assert "metadata" in refusal(f"{image_server}/to?http://169.254.169.254/", fetch_allow=allow)
    assert "only http and https" in refusal(f"{image_server}/to?ftp://example.com/a.png", fetch_allow=allow)
    assert "only http and https" in refusal(f"{image_server}/to?file:///etc/passwd", fetch_allow=allow)
    assert f"more than {MAX_REDIRECTS} times" in refusal(f"{image_server}/loop", fetch_allow=allow)


def test_errors_do_not_echo_the_remote(image_server: str) -> None:
    port = image_server.rsplit(":", 1)[1]
    message = refusal(f"{image_server}/missing", fetch_allow=("127.0.0.1",))
    for leak in ("404", "secret", port):
        assert leak not in message
    # A closed port reads like any other failure: no "refused", no port.
    closed = refusal("http://127.0.0.1:9/a.png", fetch_allow=("127.0.0.1",))
    for leak in ("refused", ":9", "errno"):
        assert leak not in closed.lower()


def test_the_timeout_bounds_the_whole_fetch_not_each_read(image_server: str) -> None:
    """A server dripping a byte every 0.2 s never trips a per-read timeout of 1 s."""
    started = time.monotonic()
    message = refusal(f"{image_server}/drip", fetch_allow=("127.0.0.1",), timeout_s=1.0)
    assert time.monotonic() - started < 2.0
    assert "longer than the 1 s this server allows" in message


def test_the_allow_flag_takes_hosts_addresses_and_networks() -> None:
    assert parse_fetch_allow(" 10.0.0.0/8 ") == "10.0.0.0/8"
    assert parse_fetch_allow("images.internal") == "images.internal"
    assert parse_fetch_allow("::1") == "::1"
    for bad in ("10.0.0.0/33", "a b", "http://x"):
        with pytest.raises(ValueError, match="host name, an address or a network"):
            parse_fetch_allow(bad)


@pytest.mark.slow
async def test_dripping_image_urls_do_not_hold_up_text_requests(nursery, start_server, image_server) -> None:
    """Four requests whose image drips (and more than there are render slots) leave text requests alone."""
    import trio

    config = EngineConfig(model_path=vision_fixture_path("llava"), prompt_cache=TEST_CACHE,
                          scheduler=SchedulerConfig(prefill_step_size=512, device_warmup=False))
    engine = await nursery.start(run_engine, config)
    base_url = await start_server(engine, allow_image_urls=True, image_fetch_timeout=4.0,
                                  image_fetch_allow=("127.0.0.1",))
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        async def dripping() -> None:
            response = await client.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{image_server}/drip"}},
                                             {"type": "text", "text": "what is this?"}]}]})
            statuses.append(response.status_code)

        async with trio.open_nursery() as attackers:
            for _ in range(6):
                attackers.start_soon(dripping)
            await trio.sleep(0.5)
            started = time.monotonic()
            text = await client.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
                {"role": "user", "content": "hello"}]})
            elapsed = time.monotonic() - started
            assert text.status_code == 200
            assert elapsed < 2.0
        # Each dripping fetch ended at its deadline with a 400.
        assert statuses == [400] * 6
