"""Images in, safely: an image part's source fetched or decoded into an RGB PIL image, under limits.

The tokenizer stage calls ``resolve_image`` for each image part of a request (``multimodal.py``
counts them first with ``check_image_count``). A server request carries an ``image_url`` string:
a ``data:`` URL, or an ``http(s)://`` URL this process downloads. Everything a client controls is
bounded before it costs memory or time: bytes (a data URL's length, a download's Content-Length
and the bytes really read), pixels (the header's width x height, before a pixel is decoded: a
small PNG can claim 20000 x 20000), the download's total time (a watchdog closes the socket at
the deadline, so a server that drips a byte a second cannot hold a worker), redirects (a few, and
only to http(s)), and the formats Pillow may open. A request can never make the server read one
of its own files: paths and ``file://`` URLs are taken only with ``allow_local_files``, which
``pipeline()`` sets for its caller's own images (with paths, bytes and PIL images).

Every refusal is an ``InvalidRequestError`` (a 400) naming the problem or the limit and the fix.
No torch here: the stage of a text model imports this module too.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes, urljoin, urlsplit
from urllib.request import url2pathname

from PIL import Image, UnidentifiedImageError

from ...protocol.errors import EngineConfigError, InvalidRequestError

# The formats Pillow may open: OpenAI's (PNG, JPEG, WebP, GIF) and the common lossless ones (JPEG's
# reader also takes cameras' multi-picture MPO files). Naming them keeps Pillow's other readers
# (EPS, which runs Ghostscript; PSD, PCX, ...) off a server's attack surface.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
MAX_REDIRECTS = 3  # enough for http -> https -> CDN; more is a loop or an abuse
_PARAM = "messages"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_USER_AGENT = "conveyor-image-fetch"


@dataclass(frozen=True)
class ImageLimits:
    """What a request's images may be.

    ``max_pixels``: 36 million (6000 x 6000) takes any phone photo up to 24 MP, 8K-wide frames
    (7680 x 4320 = 33 MP) and long screenshots, while one decoded image stays under ~140 MiB (RGBA)
    in the worker; Pillow's own bomb guard (89 MP warning, 179 MP error) is looser than a server
    wants. ``max_bytes``: 20 MiB of encoded image, the cap OpenAI documents for image inputs.
    ``fetch_timeout_s`` bounds one download in all (connect, redirects, headers and body together;
    not the DNS lookup, which the resolver's own timeout bounds).
    ``allow_local_files``: paths, ``file://`` URLs, bytes and PIL images as sources, for
    ``pipeline()`` only; a server keeps it off.
    ``allowed_hosts``: when given, the only hosts an image URL (and every redirect) may name,
    each with its subdomains (``example.com`` takes ``cdn.example.com``); empty: any host. This
    is how a server keeps requests off its internal addresses (vLLM's ``--allowed-media-domains``).
    """

    max_images: int = 8
    max_pixels: int = 36_000_000
    max_bytes: int = 20 * 1024 * 1024
    allow_remote: bool = True
    fetch_timeout_s: float = 10.0
    allow_local_files: bool = False
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # EngineConfigError is a ValueError the CLI reports before any stage starts.
        flags = {"max_images": "--max-images-per-request", "max_pixels": "--max-image-pixels",
                 "max_bytes": "--max-image-bytes"}
        for name, flag in flags.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineConfigError(f"ImageLimits.{name}={value!r}: must be an int of at least 1 ({flag})")
        if not isinstance(self.fetch_timeout_s, int | float) or not self.fetch_timeout_s > 0:
            raise EngineConfigError(f"ImageLimits.fetch_timeout_s={self.fetch_timeout_s!r}: must be > 0 seconds "
                                    "(--image-fetch-timeout)")
        hosts = tuple(h.strip().lower().strip(".[]") for h in self.allowed_hosts)
        if not all(h and "/" not in h for h in hosts):
            raise EngineConfigError(f"ImageLimits.allowed_hosts={self.allowed_hosts!r}: give host names or IP "
                                    "addresses, without scheme or path (--allowed-media-domains)")
        object.__setattr__(self, "allowed_hosts", hosts)

    def host_allowed(self, url: str) -> bool:
        """Whether ``url``'s host is one of ``allowed_hosts`` or under one (always, when none is set)."""
        if not self.allowed_hosts:
            return True
        host = (urlsplit(url).hostname or "").lower().rstrip(".")
        return any(host == h or host.endswith("." + h) for h in self.allowed_hosts)


# The caller's own images (pipeline(), conveyor.vl.load_image): its files may be read, the count is
# left to session_len, a PIL image re-encoded as PNG (how pipeline() sends one) may be large, and
# only Pillow's own suspicion threshold (89 MP) bounds pixels, so a 48 MP phone photo passes.
LOCAL_IMAGE_LIMITS = ImageLimits(max_images=1024, max_pixels=int(Image.MAX_IMAGE_PIXELS or 89_478_485),
                                 max_bytes=1 << 30, allow_local_files=True)


def check_image_count(n: int, limits: ImageLimits) -> None:
    """A 400 naming ``max_images`` when a request holds more than ``limits.max_images`` images."""
    if n > limits.max_images:
        raise InvalidRequestError(
            f"the request has {n} images but max_images is {limits.max_images}: send at most "
            f"{limits.max_images} image parts, or raise the server's --max-images-per-request", param=_PARAM)


def resolve_image(source: Any, limits: ImageLimits) -> Image.Image:
    """The image ``source`` names, decoded, fully loaded and in RGB (transparency onto white).

    ``source``: a ``data:`` URL or an ``http(s)://`` URL; with ``limits.allow_local_files`` also
    a path (str or ``PathLike``), a ``file://`` URL, bytes or a PIL image. Raises
    ``InvalidRequestError`` naming the problem or the limit.
    """
    if isinstance(source, Image.Image):
        _local_only(limits, "a PIL image")
        return _finish(source, limits)
    if isinstance(source, bytes | bytearray | memoryview):
        _local_only(limits, "raw bytes")
        return _decode(bytes(source), limits)
    if isinstance(source, PathLike):
        _local_only(limits, "a path")
        return _decode(_read_file(Path(source), limits), limits)
    if not isinstance(source, str):
        raise InvalidRequestError(f"an image must be a data: URL or an http(s) URL string, got {type(source).__name__}"
                                  + (" (or a path, bytes or a PIL image)" if limits.allow_local_files else ""),
                                  param=_PARAM)
    source = source.strip()
    if source[:5].lower() == "data:":
        return _decode(_data_url_bytes(source, limits), limits)
    match = _SCHEME.match(source)
    scheme = match.group(1).lower() if match else ""
    if scheme in ("http", "https"):
        if not limits.allow_remote:
            raise InvalidRequestError(
                f"image URLs are not fetched by this server (--disable-image-fetch): send the image inline as "
                f"a data:image/...;base64 URL instead of {_show(source)}", param=_PARAM)
        return _decode(_fetch(source, limits), limits)
    if scheme == "file" or (not scheme and limits.allow_local_files):
        if not limits.allow_local_files:
            raise InvalidRequestError(
                f"file:// image URLs are refused ({_show(source)}): the server never reads its own files; "
                "send the image as a data:image/...;base64 URL or an http(s) URL", param=_PARAM)
        path = Path(url2pathname(urlsplit(source).path)) if scheme == "file" else Path(source)
        return _decode(_read_file(path, limits), limits)
    if scheme:
        raise InvalidRequestError(f"{scheme}:// image URLs are not supported ({_show(source)}): use a "
                                  "data:image/...;base64 URL or an http(s) URL", param=_PARAM)
    raise InvalidRequestError(
        f"{_show(source)} is not an image URL: use a data:image/...;base64 URL or an http(s) URL "
        "(the server never reads its own files)", param=_PARAM)


def _local_only(limits: ImageLimits, what: str) -> None:
    if not limits.allow_local_files:
        raise InvalidRequestError(f"{what} is not an image URL: send a data:image/...;base64 URL or an http(s) URL",
                                  param=_PARAM)


def _show(source: str) -> str:
    """A source as an error message may quote it (short: a data URL can be megabytes)."""
    return repr(source if len(source) <= 80 else source[:77] + "...")


def _too_big(n: int | str, where: str, limits: ImageLimits) -> InvalidRequestError:
    return InvalidRequestError(
        f"the image {where} is {n} bytes, more than max_bytes ({limits.max_bytes}): send a smaller or more "
        "compressed image (JPEG or WebP), or raise the server's --max-image-bytes", param=_PARAM)


def _data_url_bytes(url: str, limits: ImageLimits) -> bytes:
    """The bytes of a ``data:[<media type>][;base64],<data>`` URL; its size checked before decoding."""
    header, sep, data = url.partition(",")
    if not sep:
        raise InvalidRequestError("a data URL needs a comma before its data: data:image/png;base64,<base64 bytes>",
                                  param=_PARAM)
    params = header[5:].split(";")
    media_type = params[0].strip().lower()
    # pipeline() sends bytes of unknown format as "data:image;base64," and Pillow reads the format
    # from the bytes, so the media type only has to say "image" (or nothing, or octet-stream).
    if media_type and media_type.split("/")[0] != "image" and media_type != "application/octet-stream":
        raise InvalidRequestError(f"a data URL of type {media_type!r} is not an image: send data:image/png;base64,... "
                                  "(or image/jpeg, image/webp, image/gif)", param=_PARAM)
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raw = unquote_to_bytes(data)
        if len(raw) > limits.max_bytes:
            raise _too_big(len(raw), "in the data URL", limits)
        return raw
    data = re.sub(r"\s+", "", data)
    if len(data) * 3 // 4 > limits.max_bytes + 2:  # decoded size, known before decoding
        raise _too_big(f"about {len(data) * 3 // 4}", "in the data URL", limits)
    try:
        raw = base64.b64decode(data + "=" * (-len(data) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("the data URL's base64 is malformed: encode the image file's bytes with standard "
                                  "base64 (data:image/png;base64,iVBOR...)", param=_PARAM) from None
    if len(raw) > limits.max_bytes:
        raise _too_big(len(raw), "in the data URL", limits)
    return raw


def _read_file(path: Path, limits: ImageLimits) -> bytes:
    """A local image file's bytes (only with allow_local_files), at most max_bytes read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limits.max_bytes + 1)
    except OSError as exc:
        raise InvalidRequestError(f"cannot read the image file {str(path)!r}: {exc.strerror or exc}: give the path "
                                  "of a readable image file, or an http(s) or data: URL", param=_PARAM) from None
    if len(raw) > limits.max_bytes:
        raise _too_big(f"more than {limits.max_bytes}", f"file {str(path)!r}", limits)
    return raw


class _Deadline:
    """Closes a download's socket when its time is up, so no read outlives the fetch timeout.

    httpx's timeouts bound each connect and each read, not the whole: a server that sends a byte
    just inside the read timeout, again and again, would hold the worker for ever. httpcore's
    ``trace`` extension hands over each connection's stream as it opens; at the deadline the
    socket is shut down, which wakes the blocked read.
    """

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.expired = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def remaining(self) -> float:
        return max(self.end - time.monotonic(), 0.001)

    def trace(self, name: str, info: dict[str, Any]) -> None:
        """httpcore's trace callback: remember the newest socket (TCP, then the TLS one over it)."""
        if not (name.endswith("connect_tcp.complete") or name.endswith("start_tls.complete")):
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        with self._lock:
            self._sock = sock
            if self.expired:
                self._shutdown()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            self._shutdown()

    def _shutdown(self) -> None:
        if self._sock is not None:
            try:  # the plain socket's shutdown, also for a TLS socket: no TLS close_notify from this thread
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


def _fetch(url: str, limits: ImageLimits) -> bytes:
    """An http(s) URL's body: redirects followed by hand (a few, http(s) only), at most max_bytes
    read, all within fetch_timeout_s."""
    import httpx  # here, not at import: a text model's tokenizer stage never downloads

    timeout = limits.fetch_timeout_s
    timed_out = InvalidRequestError(
        f"fetching the image {_show(url)} timed out after {timeout:g} s: send a data: URL, use a faster host, "
        "or raise the server's --image-fetch-timeout", param=_PARAM)
    _check_host(url, limits)
    # No connection reuse: each hop's socket is the one the deadline closes.
    client = httpx.Client(follow_redirects=False, limits=httpx.Limits(max_keepalive_connections=0),
                          headers={"User-Agent": _USER_AGENT, "Accept": "image/*"})
    with client, _Deadline(timeout) as deadline:
        try:
            for _ in range(MAX_REDIRECTS + 1):
                with client.stream("GET", url, timeout=deadline.remaining(),
                                   extensions={"trace": deadline.trace}) as response:
                    if response.is_redirect:
                        location = response.headers.get("location", "")
                        target = urljoin(url, location)
                        if urlsplit(target).scheme.lower() not in ("http", "https"):
                            raise InvalidRequestError(
                                f"the image URL {_show(url)} redirects to {_show(location)}: only http(s) "
                                "redirects are followed; give the image's final http(s) URL", param=_PARAM)
                        _check_host(target, limits)
                        url = target
                        continue
                    if response.status_code >= 400:
                        raise InvalidRequestError(
                            f"fetching the image {_show(url)} failed: the host answered HTTP {response.status_code} "
                            f"{response.reason_phrase}: check the URL, or send the image as a data: URL", param=_PARAM)
                    return _read_body(response, url, limits, deadline, timed_out)
            raise InvalidRequestError(f"the image URL {_show(url)} redirects more than {MAX_REDIRECTS} times: give "
                                      "the image's final URL", param=_PARAM)
        except httpx.TimeoutException:
            raise timed_out from None
        except httpx.UnsupportedProtocol:
            raise InvalidRequestError(f"{_show(url)} is not an http(s) URL: use a data: URL or an http(s) URL",
                                      param=_PARAM) from None
        except httpx.InvalidURL as exc:
            raise InvalidRequestError(f"the image URL {_show(url)} is not a valid URL ({exc}): check it",
                                      param=_PARAM) from None
        except httpx.ConnectError as exc:
            if deadline.expired:
                raise timed_out from None
            raise InvalidRequestError(f"the image URL {_show(url)} is unreachable ({exc or 'connection failed'}): "
                                      "check the host and port, or send the image as a data: URL",
                                      param=_PARAM) from None
        except httpx.HTTPError as exc:  # the connection broke mid-answer (or the deadline closed it)
            if deadline.expired:
                raise timed_out from None
            raise InvalidRequestError(f"fetching the image {_show(url)} failed: {type(exc).__name__}: {exc}: "
                                      "try again, or send the image as a data: URL", param=_PARAM) from None


def _check_host(url: str, limits: ImageLimits) -> None:
    """A 400 when ``url`` names a host off ``limits.allowed_hosts``."""
    if not limits.host_allowed(url):
        raise InvalidRequestError(
            f"the image URL {_show(url)} is on a host this server does not fetch from (allowed: "
            f"{', '.join(limits.allowed_hosts)}): send the image as a data:image/...;base64 URL", param=_PARAM)


def _read_body(response: Any, url: str, limits: ImageLimits, deadline: _Deadline,
               timed_out: InvalidRequestError) -> bytes:
    """The body, refused by Content-Length before any byte is read and by the bytes really read."""
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > limits.max_bytes:
        raise _too_big(int(length), f"at {_show(url)}", limits)
    body = bytearray()
    for chunk in response.iter_bytes():  # after Content-Encoding: the cap bounds what a gzip bomb inflates to
        body += chunk
        if len(body) > limits.max_bytes:
            raise _too_big(f"more than {limits.max_bytes}", f"at {_show(url)}", limits)
        if deadline.expired:
            raise timed_out
    if deadline.expired:  # the socket closed at the deadline may read as a short, clean end
        raise timed_out
    return bytes(body)


def _decode(raw: bytes, limits: ImageLimits) -> Image.Image:
    """Encoded bytes as an image: the format and the header's size checked before the pixels are
    decoded, then every pixel decoded (a truncated file fails here, not in a processor later)."""
    try:
        image = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:  # more than twice Pillow's own MAX_IMAGE_PIXELS
        raise _too_many_pixels("far more than Pillow's limit", limits) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise InvalidRequestError(
            f"the image is not a file of a format this server reads ({', '.join(IMAGE_FORMATS)}): "
            f"{_reason(exc)}: send a PNG, JPEG, WebP or GIF file's bytes", param=_PARAM) from None
    return _finish(image, limits)


def _reason(exc: BaseException) -> str:
    # Pillow's message for an unknown format quotes the BytesIO object: not worth echoing.
    return "unknown format" if isinstance(exc, UnidentifiedImageError) else (str(exc) or type(exc).__name__)


def _too_many_pixels(size: str, limits: ImageLimits) -> InvalidRequestError:
    return InvalidRequestError(
        f"the image is {size} pixels, more than max_pixels ({limits.max_pixels}): scale it down, or raise the "
        "server's --max-image-pixels", param=_PARAM)


def _finish(image: Image.Image, limits: ImageLimits) -> Image.Image:
    """An opened image checked for size, loaded (its first frame) and converted to RGB."""
    width, height = image.size
    if width * height > limits.max_pixels:
        raise _too_many_pixels(f"{width} x {height} = {width * height}", limits)
    try:
        image.load()
    except Image.DecompressionBombError:  # a frame larger than the header said
        raise _too_many_pixels("far more than Pillow's limit", limits) from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error) as exc:
        # each is how one of Pillow's readers reports broken data (SyntaxError: a bad PNG chunk)
        raise InvalidRequestError(
            f"the image file is truncated or corrupt ({_reason(exc)}): send the complete file", param=_PARAM) from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """The image in RGB; transparent pixels composited onto white, as transformers' ``convert_to_rgb``
    (and vLLM) do. LMDeploy's ``convert("RGB")`` drops alpha, keeping whatever colour transparent
    pixels hold, often black; the families' reference processors see white."""
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB") if image.mode != "RGB" else image.copy()
