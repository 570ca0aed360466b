"""Incremental detokenization: deltas concatenate to the full text, never half a UTF-8 character."""

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shuttle.frontend.tokenizer import IncrementalDetokenizer, TextTokenizer
from tests.byte_runs import cut_at_characters, streamed_text
from tests.server import MODEL_DIR


@functools.cache
def _tokenizer() -> TextTokenizer:
    return TextTokenizer(str(MODEL_DIR))


def _is_byte(tok: TextTokenizer, token_id: int) -> bool:
    piece = tok._tokenizer.id_to_token(token_id)
    return len(piece) == 6 and piece.startswith("<0x")


def _valid(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


# byte tokens of a few characters and of invalid sequences, ordinary tokens, and special tokens (</s>, <unk>)
_POOL = [3 + b for b in (0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0x41, 0xFF)] + [403, 407, 432, 410, 2, 0]


def test_deltas_concatenate_to_decoded_continuation():
    tok = TextTokenizer(str(MODEL_DIR))
    prompt = tok.encode("Once upon a time")
    output = tok.encode("there was a dog. It was happy!")[1:] + [2]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([t]) for t in output] + [detok.flush()]
    assert "".join(deltas) == tok.decode(prompt + output)[len(tok.decode(prompt)):]
    assert "".join(deltas).startswith(" there")


def test_byte_tokens_are_held_until_they_complete_a_character():
    tok = TextTokenizer(str(MODEL_DIR))
    euro = [tok._tokenizer.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    detok = IncrementalDetokenizer(tok, tok.encode("Price"))
    assert [detok.add([t]) for t in euro] + [detok.add([403]), detok.add(euro), detok.flush()] == [
        "", "", "€", " Once", "€", ""]


def test_invalid_bytes_at_the_end_are_flushed():
    tok = TextTokenizer(str(MODEL_DIR))
    detok = IncrementalDetokenizer(tok, tok.encode("A"))
    assert detok.add([tok._tokenizer.token_to_id("<0xE2>")]) == ""
    assert detok.flush() == "\ufffd"


def test_an_invalid_run_of_byte_tokens_is_one_replacement_per_byte_as_the_tokenizer_decodes():
    tok = TextTokenizer(str(MODEL_DIR))
    assert tok.decode([230, 142]) == "\ufffd\ufffd"  # <0xE3> <0x8B>: a character cut short
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"))
    assert "".join(detok.add([t]) for t in [230, 142]) + detok.flush() == "\ufffd\ufffd"


C3, A9 = (3 + b for b in "é".encode())
ONCE = 403  # "▁Once"


@pytest.mark.parametrize("output, text", [
    # The byte-fallback decoder judges a whole run of byte tokens, so one invalid byte would spoil the valid
    # characters before it in tokenizers' decode ("\ufffd" * 6 here); but a character a run completes goes out at
    # once and stays (the bytes that follow cannot take it back), and only the rest of the run is judged whole.
    ([C3, A9, C3, C3, A9, C3], "é" + "\ufffd" * 4),
    ([C3, C3, A9], "\ufffd" * 3),  # as tokenizers' decode: no prefix of the run is a character
    ([C3, A9, ONCE, C3], "é Once\ufffd"),
    ([C3, A9, 2, C3, ONCE], "é\ufffd Once"),  # a special token (</s>) shows nothing and does not end a run
    ([C3, A9, C3, 2, A9, ONCE], "éé Once"),
])
def test_a_run_of_byte_tokens_is_text_once_it_completes_a_character(output, text):
    tok = _tokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"))
    assert "".join(detok.add([t]) for t in output) + detok.flush() == text, output


def test_a_character_completed_by_a_byte_token_goes_out_with_that_token():
    """What a stop string is matched against: the text is out (and final) with the token that completes it,
    whatever follows (issue 24: a stop string "😀" stopped only when nothing followed its last byte)."""
    tok = _tokenizer()
    detok = IncrementalDetokenizer(tok, [1, 403, 243, 162, 155])  # "Once" and the first three bytes of U+1F600
    assert detok.add([131]) == "😀"
    assert detok.add([131]) == "" and detok.flush() == "\ufffd"  # a lone <0x80> after it is one U+FFFD


def test_a_character_split_between_prompt_and_output_is_reassembled():
    tok = TextTokenizer(str(MODEL_DIR))
    prompt = [1, 403, 243, 162, 155]  # "Once" and the first three bytes of U+1F600
    assert tok.decode(prompt + [131]) == "Once😀"
    for output, text in (([131], "😀"), ([131, 407], "😀 upon"), ([407], " upon"), ([131, 131], "😀\ufffd"),
                         ([68], "\ufffd")):  # the prompt's own bytes are U+FFFD in the prompt's text, not again
        detok = IncrementalDetokenizer(tok, prompt)
        assert "".join(detok.add([t]) for t in output) + detok.flush() == text, output


def _text(tok: TextTokenizer, ids: list[int]) -> str:
    return streamed_text(ids, tok.decode, tok._tokenizer.id_to_token, tok.special_ids)


def _open_tail(tok: TextTokenizer, ids: list[int]) -> int:
    """How many tokens end `ids` after its last ordinary token or completed character: byte tokens that are no
    character yet (and special tokens among them)."""
    *_, last = cut_at_characters(ids, tok._tokenizer.id_to_token, tok.special_ids)
    tail = 0
    while tail < len(last) and (_is_byte(tok, last[-1 - tail]) or not tok.token_bytes[last[-1 - tail]]):
        tail += 1
    return tail


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_POOL), max_size=6), st.lists(st.sampled_from(_POOL), min_size=1, max_size=12),
       st.data())
def test_streamed_text_equals_the_tokenizers_decode(prompt_tail, output, data):
    """Any split of the output into deltas gives the tokenizer's own decode of prompt + output after the prompt's
    text, a run of byte tokens decoded in pieces that end where it completes a character. Where the prompt ends in
    bytes that are no character yet, the character is the output's if the output completes it; otherwise they stay
    the prompt's and only the output's bytes are U+FFFD."""
    tok = _tokenizer()
    prompt = [1, 403] + prompt_tail
    tail = _open_tail(tok, prompt)
    closed, open_bytes = prompt[:len(prompt) - tail], b"".join(tok.token_bytes[t] for t in prompt[len(prompt) - tail:])
    rest = _text(tok, prompt + output)[len(_text(tok, closed)):]
    run, completed = open_bytes, False  # does the output's first run of byte tokens complete the prompt's bytes?
    for token_id in output:
        if _is_byte(tok, token_id):
            run += tok.token_bytes[token_id]
            completed = completed or _valid(run)
        elif tok.token_bytes[token_id]:
            break
    expected = rest if completed else rest[len(open_bytes):]
    detok = IncrementalDetokenizer(tok, prompt)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(output)), max_size=len(output))))
    pieces = [output[a:b] for a, b in zip([0] + cuts, cuts + [len(output)])]
    deltas = [detok.add(piece) for piece in pieces] + [detok.flush()]
    assert "".join(deltas) == expected, (open_bytes, rest)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_POOL), max_size=6), st.lists(st.sampled_from(_POOL), max_size=12),
       st.lists(st.sampled_from(_POOL), min_size=1, max_size=6))
def test_text_given_out_never_depends_on_the_tokens_that_follow(prompt_tail, output, more):
    """What `add` has returned is a prefix of the text of any longer output, and what it holds back is only bytes
    that are no character yet (U+FFFD if the output ends there): so a stop string is found, or not, with the token
    that completes it."""
    tok = _tokenizer()
    prompt = [1, 403] + prompt_tail
    detok = IncrementalDetokenizer(tok, prompt)
    given_out = "".join(detok.add([t]) for t in output)
    assert set(detok.flush()) <= {"\ufffd"}
    longer = IncrementalDetokenizer(tok, prompt)
    assert ("".join(longer.add([t]) for t in output + more) + longer.flush()).startswith(given_out)


@functools.cache
def _byte_level_tokenizer(directory: str) -> TextTokenizer:
    """A tiny GPT-2 style tokenizer (ByteLevel pre-tokenizer and decoder: one token per byte, plus merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(["Once upon a time there was a dog", "héllo wörld 😀 €"], trainer)
    tokenizer.save(f"{directory}/tokenizer.json")
    return TextTokenizer(directory)


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    tok = _byte_level_tokenizer(str(tmp_path_factory.mktemp("byte_level")))
    assert tok.byte_token_ids is None and tok.token_bytes is not None
    return tok


def _byte_level_pool(tok: TextTokenizer) -> list[int]:
    single = {table[0]: i for i, table in enumerate(tok.token_bytes) if len(table) == 1}
    return [single[b] for b in (0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0x41, 0xFF)] + \
        tok.encode("Once upon", False) + [tok._tokenizer.token_to_id("<|endoftext|>")]


def test_byte_level_prompt_split_character(byte_level):
    tok = byte_level
    emoji = "😀".encode()
    single = {table[0]: i for i, table in enumerate(tok.token_bytes) if len(table) == 1}
    prompt = tok.encode("Once", False) + [single[b] for b in emoji[:3]]
    assert tok.decode(prompt + [single[emoji[3]]]) == "Once😀"
    for output, text in (([single[emoji[3]]], "😀"), ([single[0x41]], "A"), ([single[emoji[3]], single[0x41]], "😀A")):
        detok = IncrementalDetokenizer(tok, prompt)
        assert "".join(detok.add([t]) for t in output) + detok.flush() == text, output


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_byte_level_streamed_text_equals_the_tokenizers_decode(byte_level, data):
    """As for byte fallback, with Rust's from_utf8_lossy (one U+FFFD per maximal invalid part) as the reference;
    a character split between prompt and output is the output's (the prompt's decode shows one U+FFFD for it)."""
    tok = byte_level
    pool = _byte_level_pool(tok)
    prompt = tok.encode("Once", False) + data.draw(st.lists(st.sampled_from(pool), max_size=6))
    output = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=12))
    whole, shown = tok.decode(prompt + output), tok.decode(prompt)
    expected = whole[len(shown):] if whole.startswith(shown) else whole[len(shown) - 1:]
    detok = IncrementalDetokenizer(tok, prompt)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(output)), max_size=len(output))))
    deltas = [detok.add(output[a:b]) for a, b in zip([0] + cuts, cuts + [len(output)])] + [detok.flush()]
    assert "".join(deltas) == expected
