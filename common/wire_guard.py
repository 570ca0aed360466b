"""Reading frames from peers that may send anything: a decoder that turns every way a payload can be bad into one
exception, a nesting-depth scan that runs before msgspec, and a count of malformed messages whose warnings are
rate-limited per peer.

Why the scan: msgspec decodes nested containers by recursing on the C stack, guarded only by the interpreter's
recursion limit. Under the default limit (1,000) a deep message raises RecursionError; with the limit raised, or
in a thread with a small stack, a deep message overflows the stack and kills the process (measured with msgspec
0.23 on Python 3.11: 1,000,000 one-element arrays with `sys.setrecursionlimit(10**7)` -> SIGSEGV; in a 64 KiB
thread stack 200 levels decode and 400 crash). A socket that any peer can reach therefore checks the depth before
decoding (the batch endpoint allows 128 levels).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")

log = logging.getLogger("shuttle.ipc")

WARN_INTERVAL_S = 60.0  # one warning per peer per this many seconds
MAX_WARNINGS_PER_INTERVAL = 10  # and at most this many per socket, however many peers (identities are free)
MAX_REASON_CHARS = 200


class Malformed(Exception):
    """A payload that is not one well-formed message. `kind`: "frames" (not the expected frame count), "depth"
    (nested deeper than the socket allows), "decode" (bad msgpack, wrong type, or any other decoding failure)."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


# ---- the nesting-depth scan -------------------------------------------------------------------------------------

_CONTAINER_HEADS = bytes([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])  # fixmap, fixarray, array16/32, map16/32
_NOT_CONTAINER_HEADS = bytes(b for b in range(256) if b not in _CONTAINER_HEADS)
_MAP_HEADS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])

_INVALID, _SIZED, _CONTAINER = 0, -1, -2
# Per head byte: _STEP is the whole length of a scalar (head included), or one of the three codes above; _WIDTH the
# width of a sized or container head's length field (0: the count is in the head); _EXTRA the bytes after a sized
# head's length field that are not in the length (an ext's type byte).
_STEP = [_INVALID] * 256
_WIDTH = [0] * 256
_EXTRA = [0] * 256
for _b in [*range(0x00, 0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3]:  # fixints, nil, booleans
    _STEP[_b] = 1
for _b in range(0xA0, 0xC0):  # fixstr
    _STEP[_b] = 1 + (_b & 0x1F)
for _b, _after in {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
                   0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}.items():  # floats, ints, fixext (type + data)
    _STEP[_b] = 1 + _after
for _b, _width, _extra in ((0xC4, 1, 0), (0xC5, 2, 0), (0xC6, 4, 0), (0xC7, 1, 1), (0xC8, 2, 1), (0xC9, 4, 1),
                           (0xD9, 1, 0), (0xDA, 2, 0), (0xDB, 4, 0)):  # bin, ext, str
    _STEP[_b], _WIDTH[_b], _EXTRA[_b] = _SIZED, _width, _extra
for _b in range(0x80, 0xA0):  # fixmap, fixarray
    _STEP[_b] = _CONTAINER
for _b, _width in ((0xDC, 2), (0xDD, 4), (0xDE, 2), (0xDF, 4)):  # array16/32, map16/32
    _STEP[_b], _WIDTH[_b] = _CONTAINER, _width


# The heads a run of scalars may continue with: the same head (token ids are mostly runs of 0xcd and two bytes),
# or any fixint of the same sign.
_RUN_HEADS = [bytes([_b]) for _b in range(256)]
for _b in range(0x00, 0x80):
    _RUN_HEADS[_b] = bytes(range(0x00, 0x80))
for _b in range(0xE0, 0x100):
    _RUN_HEADS[_b] = bytes(range(0xE0, 0x100))


def nesting_exceeds(data: bytes, limit: int) -> bool:
    """True when the msgpack in `data` nests containers (arrays, maps) more than `limit` deep; the outermost
    container is level 1.

    A fast path counts the bytes that could be container heads (one pass in C): with no more than `limit` of
    them no nesting can exceed it. Otherwise it walks the heads without recursion, one step per item (about
    0.5 us) or per run of scalars of one kind. Data that is truncated or invalid is not judged here (False): the
    decoder refuses it.
    """
    if len(data.translate(None, _NOT_CONTAINER_HEADS)) <= limit:
        return False
    step_of, width_of, extra_of, from_bytes = _STEP, _WIDTH, _EXTRA, int.from_bytes
    size, pos = len(data), 0
    open_counts: list[int] = []  # items still to read in each enclosing container, innermost last
    left = -1  # items left at the current level (the top level is unbounded)
    while pos < size:
        head = data[pos]
        step = step_of[head]
        if step > 0:
            like = _RUN_HEADS[head]
            if left > 1 and pos + step < size and data[pos + step] in like:
                # a run: skip as many scalars like this one as follow, up to the container's end, in C
                heads = data[pos:min(size, pos + left * step):step]
                count = len(heads) - len(heads.lstrip(like))
                pos += count * step
                left -= count - 1
            else:
                pos += step
        elif step == _SIZED:
            width = width_of[head]
            pos += 1 + width + from_bytes(data[pos + 1:pos + 1 + width], "big") + extra_of[head]
        elif step == _CONTAINER:
            width = width_of[head]
            items = (head & 0x0F) if width == 0 else from_bytes(data[pos + 1:pos + 1 + width], "big")
            pos += 1 + width
            if head in _MAP_HEADS:
                items *= 2  # keys and values
            if len(open_counts) >= limit:  # this container's level is one more than the open ones
                return True
            if items:
                open_counts.append(left - 1)  # the container itself is one item of the enclosing level
                left = items
                continue
        else:
            return False
        left -= 1
        while left == 0 and open_counts:
            left = open_counts.pop()
    return False


class GuardedDecoder(Generic[T]):
    """A msgspec msgpack Decoder for `type` that raises only Malformed, whatever the bytes.

    Args:
        max_depth: refuse payloads nested deeper than this before decoding them (0: no scan; the decoder's own
            recursion guard still turns a deep payload into Malformed under the default recursion limit).
    """

    def __init__(self, type: Any, max_depth: int = 0):
        self._decoder = msgspec.msgpack.Decoder(type)
        self.max_depth = max_depth

    def decode(self, payload: bytes | memoryview) -> T:
        """Raises Malformed("depth" or "decode")."""
        if self.max_depth and nesting_exceeds(payload if isinstance(payload, bytes) else bytes(payload),
                                              self.max_depth):
            raise Malformed("depth", f"nested deeper than {self.max_depth} levels")
        try:
            return self._decoder.decode(payload)
        except Exception as exc:  # DecodeError, ValidationError, RecursionError, MemoryError...: all the bytes' fault
            reason = str(exc) if isinstance(exc, msgspec.DecodeError) else f"{type(exc).__name__}: {exc}"
            raise Malformed("decode", reason[:MAX_REASON_CHARS]) from None


# ---- counting and rate-limited warnings -------------------------------------------------------------------------

class FaultLog:
    """Counts one socket's malformed messages by kind and warns about them at most once per peer per
    WARN_INTERVAL_S, and at most MAX_WARNINGS_PER_INTERVAL times per interval in all (a peer can take a new
    identity with every connection); what is not warned about is still counted, and the next warning says how many.

    Args:
        name: the socket, as warnings name it (its endpoint).
        clock: time.monotonic; tests pass their own.
    """

    def __init__(self, name: str, clock=time.monotonic):
        self.name = name
        self.counts: Counter[str] = Counter()
        self._clock = clock
        self._warned: dict[bytes, float] = {}  # peer -> when it was last warned about
        self._window_start = -WARN_INTERVAL_S
        self._window_warnings = 0
        self._unlogged = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def record(self, peer: bytes, fault: Malformed) -> None:
        """Count `fault` from `peer` (b"" where the socket cannot tell peers apart) and maybe warn."""
        self.counts[fault.kind] += 1
        now = self._clock()
        if now - self._window_start >= WARN_INTERVAL_S:
            self._window_start, self._window_warnings = now, 0
            self._warned = {p: t for p, t in self._warned.items() if now - t < WARN_INTERVAL_S}
        last = self._warned.get(peer)
        if (last is not None and now - last < WARN_INTERVAL_S) or self._window_warnings >= MAX_WARNINGS_PER_INTERVAL:
            self._unlogged += 1
            return
        self._warned[peer] = now
        self._window_warnings += 1
        unlogged, self._unlogged = self._unlogged, 0
        log.warning("malformed message on %s%s: %s (%d malformed so far; %d not logged since the last warning; "
                    "at most one warning per peer per %g s)", self.name, f" from peer {peer[:32]!r}" if peer else "",
                    fault, self.total, unlogged, WARN_INTERVAL_S)
