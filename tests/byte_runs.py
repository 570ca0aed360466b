"""The reference for streamed text with byte-fallback tokens (<0xE2> ...): the tokenizer's own decode, except that a
run of byte tokens is decoded in pieces, each ending with the byte token that completes a character.

That is where frontend/tokenizer.py's IncrementalDetokenizer gives a run's text out (and where stop strings are
matched against it), so bytes that follow cannot spoil a character already shown; tokenizers' ByteFallback decoder,
which sees the whole run, would make every byte of an invalid run U+FFFD, its complete characters included.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

ANCHOR = 403  # "▁Once" in stories260K's vocabulary: an ordinary token that ends any run of byte tokens


def byte_value(piece: str) -> int | None:
    """The byte of a byte-fallback piece ("<0xE2>" -> 0xE2), None for any other piece."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return int(piece[3:5], 16)
    return None


def cut_at_characters(ids: list[int], piece: Callable[[int], str], special: Collection[int]) -> list[list[int]]:
    """`ids` split after every byte token that completes a character: the bytes of its run since the run's start
    (or the previous split) are valid UTF-8. Special tokens show no text and do not end a run. The last piece holds
    what follows the last split (possibly nothing)."""
    pieces, current, pending = [], [], b""
    for token_id in ids:
        current.append(token_id)
        value = byte_value(piece(token_id))
        if value is not None:
            pending += bytes([value])
            try:
                pending.decode()
            except UnicodeDecodeError:
                continue
            pieces.append(current)
            current, pending = [], b""
        elif token_id not in special:
            pending = b""
    return pieces + [current]


def streamed_text(ids: list[int], decode: Callable[[list[int]], str], piece: Callable[[int], str],
                  special: Collection[int]) -> str:
    """The text of `ids` as a stream shows it: each piece of cut_at_characters decoded by `decode` (special tokens
    skipped) after ANCHOR, so that only the very start of the text loses a leading space, as in one decode."""
    first, *rest = cut_at_characters(ids, piece, special)
    anchor = decode([ANCHOR])
    return decode(first) + "".join(decode([ANCHOR] + p)[len(anchor):] for p in rest)
