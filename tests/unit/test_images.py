"""Images in, safely: ``resolve_image`` (the tokenizer stage's reader) and ``conveyor.vl.load_image``.

Data URLs of each format decode to the right size in RGB; every refusal is a 400 naming its
limit or problem: not an image, a format off the list, a truncated file, a decompression bomb
(refused on its header, before a pixel is decoded), too many images, too many bytes (data URL,
Content-Length, a body with no length), remote fetching off, file:// and paths from a server, an
HTTP error, a redirect to file://, a redirect loop, an unreachable port, a server that never sends
its body, and one that drips its headers a byte at a time (only a total deadline stops that). The
http cases run against a local server on 127.0.0.1.
"""

from __future__ import annotations

import base64
import io
import shutil
import socket
import ssl
import subprocess
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

Image = pytest.importorskip("PIL.Image")

from conveyor.protocol.errors import EngineConfigError, InvalidRequestError  # noqa: E402
from conveyor.services.tokenizer import images  # noqa: E402
from conveyor.services.tokenizer.images import (  # noqa: E402
    LOCAL_IMAGE_LIMITS,
    ImageLimits,
    check_image_count,
    resolve_image,
)
from conveyor.vl import load_image  # noqa: E402

SERVER = ImageLimits()
LOCAL = ImageLimits(allow_local_files=True)


def encode(image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0):
    """Random pixels: incompressible, so a cut file really lacks pixel data."""
    channels = {"RGB": 3, "RGBA": 4}[mode]
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode)


def data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(raw).decode()


def bomb_png(width: int, height: int) -> bytes:
    """A real 1-bit black PNG of ``width`` x ``height``: a few KB that decode to width*height pixels."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte, then the packed bits
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row * 500) for _ in range(height // 500)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def refused(source, limits: ImageLimits, *words: str) -> str:
    """The refusal's message, checked to be a 400 on ``messages`` that says each of ``words``."""
    with pytest.raises(InvalidRequestError) as info:
        resolve_image(source, limits)
    message = str(info.value)
    assert info.value.param == "messages"
    for word in words:
        assert word in message, (word, message)
    return message


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt,media", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                       ("BMP", "image/bmp"), ("TIFF", "image/tiff")])
def test_data_url_of_each_format_decodes_to_its_size_in_rgb(fmt, media):
    image = resolve_image(data_url(encode(noise(37, 21), fmt), media), SERVER)
    assert image.size == (37, 21) and image.mode == "RGB"
    image.tobytes()  # loaded: no lazy file behind it


def test_pixels_survive_a_lossless_round_trip():
    original = noise(16, 9)
    assert resolve_image(data_url(encode(original, "PNG")), SERVER).tobytes() == original.tobytes()


def test_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (20, 10), color) for color in ((255, 0, 0), (0, 0, 255))]
    raw = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    image = resolve_image(data_url(raw, "image/gif"), SERVER)
    assert image.size == (20, 10) and image.mode == "RGB"
    assert image.getpixel((5, 5)) == (255, 0, 0)


def test_transparency_goes_onto_white():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))  # invisible dark pixels
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    image = resolve_image(data_url(encode(rgba, "PNG")), SERVER)
    assert image.mode == "RGB"
    assert image.getpixel((1, 1)) == (255, 255, 255)  # not the hidden (10, 20, 30), nor black
    assert image.getpixel((0, 0)) == (10, 20, 30)
    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([0, 0, 0, 200, 0, 0])
    palette.putpixel((0, 0), 1)
    raw = encode(palette, "PNG", transparency=0)  # palette index 0 transparent
    image = resolve_image(data_url(raw), SERVER)
    assert image.getpixel((2, 2)) == (255, 255, 255) and image.getpixel((0, 0)) == (200, 0, 0)


def test_grayscale_and_cmyk_become_rgb():
    assert resolve_image(data_url(encode(Image.new("L", (3, 3), 7), "PNG")), SERVER).getpixel((1, 1)) == (7, 7, 7)
    cmyk = resolve_image(data_url(encode(Image.new("CMYK", (3, 3), (0, 0, 0, 0)), "JPEG")), SERVER)
    assert cmyk.mode == "RGB" and cmyk.size == (3, 3)


def test_a_data_url_without_subtype_or_base64_flag():
    raw = encode(noise(5, 5), "PNG")
    assert resolve_image("data:image;base64," + base64.b64encode(raw).decode(), SERVER).size == (5, 5)
    from urllib.parse import quote_from_bytes

    assert resolve_image("data:image/png," + quote_from_bytes(raw), SERVER).size == (5, 5)


# ---------------------------------------------------------------- bad images


def test_not_an_image():
    refused(data_url(b"hello, world: certainly not pixels"), SERVER, "not a file of a format", "PNG")
    refused(data_url(b"hello", "text/plain"), SERVER, "'text/plain' is not an image")
    refused("data:image/png;base64,@@not base64@@", SERVER, "base64 is malformed")
    refused("data:image/png;base64", SERVER, "needs a comma")


def test_a_format_off_the_list_is_refused():
    refused(data_url(encode(noise(8, 8), "PCX")), SERVER, "not a file of a format")


def test_truncated_png_fails_at_load_not_later():
    raw = encode(noise(64, 64), "PNG")
    refused(data_url(raw[: len(raw) // 2]), SERVER, "truncated or corrupt", "complete file")


def test_decompression_bomb_is_refused_on_its_header(monkeypatch):
    from PIL import ImageFile

    loads = []
    real_load = ImageFile.ImageFile.load  # the decoder of every file Pillow opens (PNG's too)
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self) or real_load(self))
    raw = bomb_png(8000, 8000)  # 64 MP: over max_pixels, under Pillow's own warning threshold
    assert len(raw) < 20_000
    refused(data_url(raw), SERVER, "8000 x 8000 = 64000000", "max_pixels (36000000)", "--max-image-pixels")
    raw = bomb_png(20000, 20000)  # 400 MP: Pillow itself refuses it at open
    refused(data_url(raw), SERVER, "max_pixels")
    assert loads == []  # no pixel decoded
    refused(data_url(encode(noise(30, 20), "PNG")), ImageLimits(max_pixels=599), "30 x 20 = 600")
    assert resolve_image(data_url(encode(noise(30, 20), "PNG")), ImageLimits(max_pixels=600)).size == (30, 20)
    assert loads  # the one under the limit was decoded


def test_too_many_images():
    check_image_count(8, SERVER)
    with pytest.raises(InvalidRequestError, match=r"9 images but max_images is 8.*--max-images-per-request") as info:
        check_image_count(9, SERVER)
    assert info.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="max_images is 1"):
        check_image_count(2, ImageLimits(max_images=1))


def test_data_url_over_the_byte_cap():
    raw = encode(noise(40, 40), "PNG")
    limits = ImageLimits(max_bytes=len(raw) - 1)
    refused(data_url(raw), limits, f"is {len(raw)} bytes", f"max_bytes ({len(raw) - 1})", "--max-image-bytes")
    assert resolve_image(data_url(raw), ImageLimits(max_bytes=len(raw))).size == (40, 40)
    refused("data:image/png;base64," + "A" * 4_000_000, limits, "about 3000000")  # refused before decoding


def test_limits_validate():
    for bad in ({"max_images": 0}, {"max_pixels": -1}, {"max_bytes": 1.5}, {"fetch_timeout_s": 0}):
        with pytest.raises(EngineConfigError):
            ImageLimits(**bad)


# ---------------------------------------------------------------- sources a server refuses


def test_file_urls_and_paths_only_with_allow_local_files(tmp_path):
    path = tmp_path / "cat 1.png"
    path.write_bytes(encode(noise(6, 5), "PNG"))
    url = path.as_uri()
    refused(url, SERVER, "file:// image URLs are refused", "never reads its own files")
    refused(str(path), SERVER, "is not an image URL", "never reads its own files")
    refused(path, SERVER, "a path is not an image URL")
    refused(path.read_bytes(), SERVER, "raw bytes is not an image URL")
    refused(Image.new("RGB", (2, 2)), SERVER, "a PIL image is not an image URL")
    refused(123, SERVER, "got int")
    for source in (url, str(path), path, path.read_bytes()):
        assert resolve_image(source, LOCAL).size == (6, 5)
    refused(str(tmp_path / "missing.png"), LOCAL, "cannot read the image file")
    refused(str(path), ImageLimits(allow_local_files=True, max_bytes=10), "max_bytes (10)")


def test_other_schemes_are_refused():
    refused("ftp://127.0.0.1/cat.png", LOCAL, "ftp:// image URLs are not supported")
    refused("gopher://127.0.0.1/cat.png", SERVER, "gopher://")


# ---------------------------------------------------------------- http


GOOD_PNG = encode(noise(33, 17), "PNG")
GOOD_JPEG = encode(noise(29, 31), "JPEG")
BIG = encode(noise(64, 64), "PNG")


class Handler(BaseHTTPRequestHandler):
    stop: threading.Event  # set at teardown: frees the handlers that hold their connection open

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None, length: bool = True) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if length:
            self.send_header("Content-Length", str(len(body)))
        else:
            self.send_header("Connection", "close")  # the body ends when the connection does
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path
        if path == "/good.png":
            self._send(200, GOOD_PNG, {"Content-Type": "image/png"})
        elif path == "/good.jpg":
            self._send(200, GOOD_JPEG, {"Content-Type": "image/jpeg"})
        elif path == "/big":
            self._send(200, BIG, {"Content-Type": "image/png"})
        elif path == "/big-no-length":
            self.close_connection = True
            self._send(200, BIG, length=False)
        elif path == "/slow":  # headers, then never the body
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.flush()
            self.stop.wait(10)
        elif path == "/drip":  # a byte of headers every 50 ms: no single read ever times out
            self.close_connection = True
            for byte in b"HTTP/1.1 200 OK\r\nX-Padding: " + b"a" * 400:
                if self.stop.wait(0.05):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
        elif path == "/missing":
            self._send(404, b"no such image")
        elif path == "/to-file":
            self._send(302, b"", {"Location": "file:///etc/passwd"})
        elif path == "/loop":
            self._send(302, b"", {"Location": "/loop"})
        elif path == "/redirect":
            self._send(301, b"", {"Location": "/good.png"})
        elif path == "/to-localhost":  # the same server under another host name
            self._send(302, b"", {"Location": f"http://localhost:{self.server.server_address[1]}/good.png"})
        elif path == "/text":
            self._send(200, b"<html>not an image</html>", {"Content-Type": "text/html"})
        else:
            self._send(500, b"")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    stop = threading.Event()
    handler = type("H", (Handler,), {"stop": stop})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    stop.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """The same server over TLS, with a self-signed certificate for 127.0.0.1 (and that certificate's file)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    stop = threading.Event()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (Handler,), {"stop": stop}))
    httpd.daemon_threads = True
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{httpd.server_address[1]}", str(cert)
    stop.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    """The local server is reached directly, whatever proxy the environment names."""
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


FAST = ImageLimits(fetch_timeout_s=0.3)


def test_http_images(server):
    image = resolve_image(f"{server}/good.png", SERVER)
    assert image.size == (33, 17) and image.mode == "RGB" and image.tobytes() == noise(33, 17).tobytes()
    assert resolve_image(f"{server}/good.jpg", SERVER).size == (29, 31)
    assert resolve_image(f"{server}/redirect", SERVER).size == (33, 17)


def test_http_refusals(server):
    refused(f"{server}/missing", SERVER, "HTTP 404")
    refused(f"{server}/to-file", SERVER, "redirects to 'file:///etc/passwd'", "only http(s)")
    refused(f"{server}/loop", SERVER, f"more than {images.MAX_REDIRECTS} times")
    refused(f"{server}/text", SERVER, "not a file of a format")
    refused(f"{server}/good.png", ImageLimits(allow_remote=False), "--disable-image-fetch", "data:image")


def test_allowed_hosts_bound_the_url_and_every_redirect(server):
    allowed = ImageLimits(allowed_hosts=("127.0.0.1",))
    assert resolve_image(f"{server}/good.png", allowed).size == (33, 17)
    assert resolve_image(f"{server}/redirect", allowed).size == (33, 17)
    refused(f"{server}/to-localhost", allowed, "http://localhost:", "does not fetch from", "127.0.0.1", "data:image")
    refused(f"{server}/good.png", ImageLimits(allowed_hosts=("example.com",)), "does not fetch from")
    # a subdomain of an allowed host is allowed, a look-alike is not
    sub = ImageLimits(allowed_hosts=("Example.com.",))
    assert sub.host_allowed("https://cdn.example.com/a.png") and sub.host_allowed("http://EXAMPLE.com:8080/a")
    assert not sub.host_allowed("https://badexample.com/a.png") and not sub.host_allowed("https://example.com.evil.io/")
    assert ImageLimits().host_allowed("http://10.0.0.1/a.png")
    with pytest.raises(EngineConfigError, match="allowed-media-domains"):
        ImageLimits(allowed_hosts=("https://example.com",))


def test_http_byte_cap(server):
    limits = ImageLimits(max_bytes=len(BIG) - 1)
    refused(f"{server}/big", limits, f"is {len(BIG)} bytes", "max_bytes")  # by Content-Length
    refused(f"{server}/big-no-length", limits, f"more than {len(BIG) - 1}", "max_bytes")  # by bytes read
    assert resolve_image(f"{server}/big-no-length", SERVER).size == (64, 64)


@pytest.mark.parametrize("path", ["/slow", "/drip"])
def test_fetch_time_is_bounded_in_all(server, path):
    start = time.monotonic()
    refused(f"{server}{path}", FAST, "timed out after 0.3 s", "--image-fetch-timeout")
    assert time.monotonic() - start < 1.5


def test_https_and_its_deadline(tls_server, monkeypatch):
    url, cert = tls_server
    refused(f"{url}/good.png", SERVER, "unreachable", "CERTIFICATE_VERIFY_FAILED")  # an untrusted certificate
    monkeypatch.setenv("SSL_CERT_FILE", cert)  # httpx trusts it from here on
    assert resolve_image(f"{url}/good.png", SERVER).size == (33, 17)
    start = time.monotonic()
    refused(f"{url}/drip", FAST, "timed out after 0.3 s")  # the TLS socket is the one closed at the deadline
    assert time.monotonic() - start < 1.5


def test_unreachable_port_is_a_quick_400():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    refused(f"http://127.0.0.1:{port}/cat.png", SERVER, "unreachable")
    assert time.monotonic() - start < 2


# ---------------------------------------------------------------- load_image


def test_load_image_takes_every_kind_of_source(server, tmp_path):
    raw = encode(noise(12, 7, "RGBA"), "PNG")
    path = tmp_path / "image.png"
    path.write_bytes(raw)
    for source in (str(path), path, path.as_uri(), raw, data_url(raw), Image.open(io.BytesIO(raw))):
        image = load_image(source)
        assert image.size == (12, 7) and image.mode == "RGB", source
    assert load_image(f"{server}/good.jpg").size == (29, 31)
    pil = Image.new("RGBA", (3, 3), (0, 0, 0, 0))
    assert load_image(pil).getpixel((0, 0)) == (255, 255, 255) and pil.mode == "RGBA"  # the caller's is untouched


def test_load_image_raises_instead_of_a_blank_picture(tmp_path):
    with pytest.raises(InvalidRequestError, match="not a file of a format"):
        load_image(b"not an image")
    with pytest.raises(InvalidRequestError, match="cannot read"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(InvalidRequestError, match="max_pixels"):
        load_image(Image.new("RGB", (10, 10)), ImageLimits(allow_local_files=True, max_pixels=99))
    with pytest.raises(InvalidRequestError, match="max_pixels"):  # the caller's own images keep Pillow's bomb guard
        load_image(bomb_png(20000, 20000))


def test_the_callers_own_images_have_roomier_limits():
    assert LOCAL_IMAGE_LIMITS.allow_local_files and LOCAL_IMAGE_LIMITS.max_pixels > 48_000_000
    assert LOCAL_IMAGE_LIMITS.max_bytes > 200 * 1024 * 1024  # a 48 MP photo as PNG
    assert not SERVER.allow_local_files and SERVER.allow_remote
    assert (SERVER.max_images, SERVER.max_pixels, SERVER.max_bytes, SERVER.fetch_timeout_s) == (
        8, 36_000_000, 20 * 1024 * 1024, 10.0)
