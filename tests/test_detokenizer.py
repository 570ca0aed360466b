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


def test_invalid_bytes_between_valid_characters_become_one_replacement_each():
    tok = TextTokenizer(str(MODEL_DIR))
    c3, a9 = (tok._tokenizer.token_to_id(f"<0x{b:02X}>") for b in "é".encode())
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"))
    text = "".join(detok.add([t]) for t in [c3, a9, c3, c3, a9, c3]) + detok.flush()
    assert text == bytes([0xC3, 0xA9, 0xC3, 0xC3, 0xA9, 0xC3]).decode("utf-8", errors="replace") == "é\ufffdé\ufffd"


def test_first_output_after_an_empty_prompt_has_no_leading_space():
    tok = TextTokenizer(str(MODEL_DIR))
    bos_only = tok.encode("")
    output = tok.encode("Once upon a time")[1:]
    detok = IncrementalDetokenizer(tok, bos_only)
    assert "".join(detok.add([t]) for t in output) + detok.flush() == "Once upon a time" == tok.decode(bos_only + output)
