"""Incremental detokenization: deltas concatenate to the full text, never half a UTF-8 character."""

import functools

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.tokenizer import IncrementalDetokenizer, TextTokenizer
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


def test_byte_tokens_are_held_until_their_run_ends():
    tok = TextTokenizer(str(MODEL_DIR))
    euro = [tok._tokenizer.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    detok = IncrementalDetokenizer(tok, tok.encode("Price"))
    assert [detok.add([t]) for t in euro] + [detok.add([403]), detok.add(euro), detok.flush()] == [
        "", "", "", "€ Once", "", "€"]


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
    # The byte-fallback decoder judges a whole run of byte tokens: one invalid byte spoils the run's valid
    # characters too; a run that ends before the invalid byte keeps them.
    c3, a9 = (tok._tokenizer.token_to_id(f"<0x{b:02X}>") for b in "é".encode())
    dog = tok._tokenizer.token_to_id("▁Once")
    for output in ([c3, a9, c3, c3, a9, c3], [c3, a9, dog, c3], [c3, a9, 2, c3, dog], [c3, a9, c3, 2, a9, dog]):
        prompt = tok.encode("Hi")
        detok = IncrementalDetokenizer(tok, prompt)
        text = "".join(detok.add([t]) for t in output) + detok.flush()
        assert text == tok.decode(prompt + output)[len("Hi"):], output


def test_a_character_split_between_prompt_and_output_is_reassembled():
    tok = TextTokenizer(str(MODEL_DIR))
    prompt = [1, 403, 243, 162, 155]  # "Once" and the first three bytes of U+1F600
    assert tok.decode(prompt + [131]) == "Once😀"
    for output, text in (([131], "😀"), ([131, 407], "😀 upon"), ([407], " upon"), ([131, 131], "\ufffd" * 2),
                         ([68], "\ufffd")):  # the prompt's own bytes are U+FFFD in the prompt's text, not again
        detok = IncrementalDetokenizer(tok, prompt)
        assert "".join(detok.add([t]) for t in output) + detok.flush() == text, output


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_POOL), max_size=6), st.lists(st.sampled_from(_POOL), min_size=1, max_size=12),
       st.data())
def test_streamed_text_equals_the_tokenizers_decode(prompt_tail, output, data):
    """Any split of the output into deltas gives the tokenizer's own decode of prompt + output after the prompt's
    text. Where the prompt ends in a run of byte tokens that the output continues, the run's text belongs to the
    output when the output makes an invalid run valid (a character split between them); otherwise the prompt keeps
    its own text and the output's bytes are U+FFFD."""
    tok = _tokenizer()
    prompt = [1, 403] + prompt_tail
    head = len(prompt)  # the prompt up to its trailing run of byte tokens (special tokens skipped)
    while not tok.token_bytes[prompt[head - 1]] or _is_byte(tok, prompt[head - 1]):
        head -= 1
    run = b"".join(tok.token_bytes[t] for t in prompt[head:])
    whole = tok.decode(prompt + output)
    run_and_output = whole[len(tok.decode(prompt[:head])):]
    if whole.startswith(tok.decode(prompt)):
        expected = whole[len(tok.decode(prompt)):]
    elif _valid(run):  # the output's bytes spoil the prompt's valid run: the prompt keeps its text
        expected = run_and_output[len(run):]
    else:  # the output completed the prompt's run: its text is the output's
        expected = run_and_output
    detok = IncrementalDetokenizer(tok, prompt)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(output)), max_size=len(output))))
    pieces = [output[a:b] for a, b in zip([0] + cuts, cuts + [len(output)])]
    deltas = [detok.add(piece) for piece in pieces] + [detok.flush()]
    assert "".join(deltas) == expected, (run, run_and_output)


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
