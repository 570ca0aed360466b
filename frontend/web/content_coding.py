"""Content-Encoding of request bodies, decoded by the frontend itself, after authentication and under the body limit.

aiohttp's parser would decompress a body as its bytes arrive, before any middleware has run, and a body that is not
validly compressed then fails inside the parser (a 500 and two tracebacks, even for a client refused with 401). So
the listener turns that off (frontend/web/server.py) and a body is decoded here, only once its request has passed
the API key and Content-Type checks: one coding (gzip or deflate, the ones the standard library reads) or none.
"""

from __future__ import annotations

import zlib

SUPPORTED = ("gzip", "deflate")  # x-gzip is gzip's old name (RFC 9110, section 8.4.1.3)
ALIASES = {"x-gzip": "gzip"}
SHOWN_CHARS = 64  # of a refused header value, in a message


class BodyRefused(Exception):
    """A request body that cannot be used: `status` 400 (not validly encoded), 413 (over the limit once decoded)
    or 415 (a coding not supported)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def content_coding(header: str) -> str | None:
    """The one coding a Content-Encoding header value names ("gzip" or "deflate"), or None for no coding
    (no header, or only "identity").

    Raises:
        BodyRefused: 415 for a coding not in SUPPORTED, or for more than one coding.
    """
    codings = [c.strip().lower() for c in header.split(",")]
    codings = [ALIASES.get(c, c) for c in codings if c and c != "identity"]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in SUPPORTED:
        shown = header if len(header) <= SHOWN_CHARS else header[:SHOWN_CHARS] + "..."
        raise BodyRefused(415, f"Content-Encoding {shown!r} is not supported: send one of {', '.join(SUPPORTED)} "
                               f"or identity")
    return codings[0]


def decode(raw: bytes, coding: str | None, limit: int) -> bytes:
    """`raw` decoded from `coding`, at most `limit` bytes of it (never more is inflated, so a small body that
    would inflate to gigabytes costs no more than the limit). "deflate" is the zlib format (RFC 9110); a raw
    deflate stream without the zlib header is read too, as aiohttp and browsers do.

    Raises:
        BodyRefused: 400 when `raw` is not one complete stream of that coding, 413 when it decodes to more than
            `limit` bytes.
    """
    if coding is None or not raw:
        return raw
    if coding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    else:  # the zlib header: compression method 8, window at most 32 KiB, a check sum of the two bytes
        zlib_header = len(raw) >= 2 and raw[0] & 0x0F == 8 and raw[0] >> 4 <= 7 and (raw[0] << 8 | raw[1]) % 31 == 0
        wbits = zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    try:
        body = inflater.decompress(raw, limit + 1)
    except zlib.error as exc:
        raise BodyRefused(400, f"request body is not valid {coding} data ({exc})") from None
    if len(body) > limit:
        raise BodyRefused(413, f"request body is over the limit of {limit} bytes once decoded from {coding}")
    if not inflater.eof:
        raise BodyRefused(400, f"request body is not valid {coding} data (the stream is cut short)")
    if inflater.unused_data:
        raise BodyRefused(400, f"request body is not valid {coding} data ({len(inflater.unused_data)} bytes after "
                               f"the end of the stream)")
    return body
