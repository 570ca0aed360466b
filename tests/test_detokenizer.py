"""Incremental detokenization: deltas concatenate to the full text, never half a UTF-8 character."""

from frontend.tokenizer import IncrementalDetokenizer, TextTokenizer
from tests.server import MODEL_DIR


def test_deltas_concatenate_to_decoded_continuation():
    tok = TextTokenizer(str(MODEL_DIR))
    prompt = tok.encode("Once upon a time")
    output = tok.encode("there was a dog. It was happy!")[1:] + [2]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([t]) for t in output] + [detok.flush()]
    assert "".join(deltas) == tok.decode(prompt + output)[len(tok.decode(prompt)):]
    assert "".join(deltas).startswith(" there")


def test_multibyte_characters_are_held_until_complete():
    tok = TextTokenizer(str(MODEL_DIR))
    euro = [tok._tokenizer.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    detok = IncrementalDetokenizer(tok, tok.encode("Price"))
    assert [detok.add([t]) for t in euro] == ["", "", "€"]


def test_invalid_bytes_at_the_end_are_flushed():
    tok = TextTokenizer(str(MODEL_DIR))
    detok = IncrementalDetokenizer(tok, tok.encode("A"))
    assert detok.add([tok._tokenizer.token_to_id("<0xE2>")]) == ""
    assert detok.flush() == "\ufffd"
