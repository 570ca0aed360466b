"""Tool-call parsers: each format's whole-text parse, and its streamer adding up to that parse for every split."""

import json
import random
import time

import pytest

from shuttle.frontend.tools.parsers import (
    PARSERS,
    HermesToolParser,
    JsonArrayCallsParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedFunctionParser,
    parser_for,
)
from shuttle.frontend.tools.parsers.base import ParsedMessage, StreamPiece, ToolCall


def _splits(text: str):
    """The text whole, in two pieces at every boundary, one character at a time, and in random pieces."""
    yield [text]
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)
    rng = random.Random(text)
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] + [""]


def _assemble(pieces: list[StreamPiece]) -> ParsedMessage:
    """A stream's pieces as a message, checking the streaming rules on the way: indices 0, 1, ... in order, the
    name on each call's first piece only, no empty deltas."""
    content, calls = [], []
    for piece in pieces:
        content.append(piece.content)
        for delta in piece.tool_calls:
            assert delta.name is not None or delta.arguments, f"empty delta {delta}"
            if delta.index == len(calls):
                assert delta.name is not None, f"call {delta.index}'s first piece has no name"
                calls.append(ToolCall(delta.name, delta.arguments))
            else:
                assert delta.index == len(calls) - 1, f"index {delta.index} out of order ({len(calls)} calls so far)"
                assert delta.name is None, f"call {delta.index}'s name given twice"
                calls[-1].arguments += delta.arguments
    return ParsedMessage("".join(content), calls)


def check(parser, text: str, expected: ParsedMessage | None = None) -> ParsedMessage:
    """`parser.parse(text)` equals `expected` (when given), and the streamer fed any split of `text` adds up to
    exactly that: contents, names, and each call's arguments pieces."""
    parsed = parser.parse(text)
    if expected is not None:
        assert parsed == expected
    for pieces in _splits(text):
        streamer = parser.streamer()
        streamed = _assemble([streamer.feed(piece) for piece in pieces] + [streamer.finish()])
        assert streamed == parsed, f"split {pieces!r}"
    return parsed


def msg(content: str, *calls: tuple[str, str]) -> ParsedMessage:
    return ParsedMessage(content, [ToolCall(name, arguments) for name, arguments in calls])


TRICKY_ARGS = {
    "q": 'a}b]c"d\\e {x} [y]',
    "tags": "<tool_call></tool_call> [TOOL_CALLS] [ARGS] <|python_tag|> ; {",
    "nested": {"list": [1, [2, {"deep": [None, True, 1.5e3]}], {}], "empty": []},
    "unicode": "café ☕ 日本語 \U0001f600",
}
TRICKY_CANON = json.dumps(TRICKY_ARGS, ensure_ascii=False)


# hermes

HERMES_CASES = [
    ("Paris is the capital of France.", msg("Paris is the capital of France.")),
    ("  Indented, with a trailing newline\n", msg("  Indented, with a trailing newline\n")),
    ("", msg("")),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        msg("", ("get_weather", '{"city": "Paris"}')),
    ),
    (  # compact spelling: parse gives the canonical re-serialization
        '<tool_call>{"name":"f","arguments":{"a":1,"b":[1,2]}}</tool_call>',
        msg("", ("f", '{"a": 1, "b": [1, 2]}')),
    ),
    (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n  {"name": "b", "arguments":'
        ' {"x": 1}}  \n</tool_call>\n',
        msg("", ("a", "{}"), ("b", '{"x": 1}')),
    ),
    (
        'Let me check.\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        msg("Let me check.", ("f", "{}")),
    ),
    (  # content between and after calls; the whitespace next to a call is dropped
        'A <tool_call>{"name": "f", "arguments": {}}</tool_call> B\n<tool_call>{"name": "g", "arguments": {}}'
        "</tool_call>\n  C \n",
        msg("ABC \n", ("f", "{}"), ("g", "{}")),
    ),
    ('<tool_call>{"name": "noargs"}</tool_call>', msg("", ("noargs", "{}"))),
    # malformed blocks stay content
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', None),
    ('<tool_call>{"name": "f", "arguments": {"a": 1} x}</tool_call>', None),
    ('<tool_call>{"arguments": {}}</tool_call>', None),
    ('<tool_call>{"name": 7, "arguments": {}}</tool_call>', None),
    ('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', None),
    ('<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>', None),
    ('<tool_call>["f", {}]</tool_call>', None),
    ("Use the <tool_call> tag, or </tool_call>.", None),
    (
        'Hi <tool_call>{bad}</tool_call> <tool_call>{"name": "f", "arguments": {}}</tool_call>',
        msg("Hi <tool_call>{bad}</tool_call>", ("f", "{}")),
    ),
    (  # a broken block's text is read again: a well-formed block inside it counts
        '<tool_call>{"x": [<tool_call>{"name": "f", "arguments": {}}</tool_call>',
        msg('<tool_call>{"x": [', ("f", "{}")),
    ),
    # unterminated blocks
    ('Sure. <tool_call>\n{"name": "f", "arguments": {}}', None),
    ('Sure. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_c', None),
    ('<tool_call>\n{"name": "f", "arguments": {"a": "x', None),
    ("Text then <tool_", None),
    (
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g"',
        msg('<tool_call>{"name": "g"', ("f", "{}")),
    ),
    (  # unicode, escapes, nesting, brackets, quotes, backslashes and the tags inside strings
        f'<tool_call>\n{{"name": "tricky", "arguments": {json.dumps(TRICKY_ARGS)}}}\n</tool_call>',
        msg("", ("tricky", TRICKY_CANON)),
    ),
    (
        f'Voilà 😀 <tool_call>{{"name": "t", "arguments": {json.dumps(TRICKY_ARGS, ensure_ascii=False)}}}</tool_call>',
        msg("Voilà 😀", ("t", TRICKY_CANON)),
    ),
    (
        '<tool_call>{"name": "e", "arguments": {"s": "\\u00e9\\n\\"\\\\"}}</tool_call>',
        msg("", ("e", '{"s": "é\\n\\"\\\\"}')),
    ),
]


@pytest.mark.parametrize("text,expected", HERMES_CASES)
def test_hermes(text, expected):
    check(HermesToolParser(), text, expected or msg(text))


# llama3_json

LLAMA_CASES = [
    ("The weather is sunny.", msg("The weather is sunny.")),
    ("  Indented answer\n", msg("  Indented answer\n")),
    ("", msg("")),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', msg("", ("get_weather", '{"city": "Paris"}'))),
    (' \n<|python_tag|>{"name":"f","arguments":{"a":1}}', msg("", ("f", '{"a": 1}'))),
    ('<|python_tag|> {"name": "f", "parameters": {}}\n', msg("", ("f", "{}"))),
    (
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1]}}',
        msg("", ("a", "{}"), ("b", '{"x": [1]}')),
    ),
    ('{"name": "a", "parameters": {}} ;{"name": "b", "parameters": {}}', msg("", ("a", "{}"), ("b", "{}"))),
    ('{"name": "a", "parameters": {}}\n\nDone.', msg("Done.", ("a", "{}"))),
    ('{"name": "a", "parameters": {}};', msg(";", ("a", "{}"))),
    (
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": 5}',
        msg('; {"name": "b", "parameters": 5}', ("a", "{}")),
    ),
    ('{"name": "a", "parameters": {}}; {"name": "b", "param', msg('; {"name": "b", "param', ("a", "{}"))),
    # no call: all content, as written
    ('{"name": "Alice"}', None),
    ('{"name": "a", "parameters": {}', None),
    ('{"name": "a", "parameters": {} x}', None),
    ('{"name": "a", "parameters": []}', None),
    ('{"a": 1', None),
    ("<|python_tag|>print('hi')", None),
    ("<|python_tag", None),
    (' Here: {"name": "a", "parameters": {}}', None),
    (
        f'{{"name": "tricky", "parameters": {json.dumps(TRICKY_ARGS)}}}; {{"name": "u", "parameters": {{"s": "é"}}}}',
        msg("", ("tricky", TRICKY_CANON), ("u", '{"s": "é"}')),
    ),
    (f'{{"parameters": {json.dumps(TRICKY_ARGS, ensure_ascii=False)}, "name": "t"}}', msg("", ("t", TRICKY_CANON))),
]


@pytest.mark.parametrize("text,expected", LLAMA_CASES)
def test_llama3_json(text, expected):
    check(Llama3JsonToolParser(), text, expected or msg(text))


# mistral

MISTRAL_CASES = [
    ("Costs [5] dollars, see [TOOL_ or [ARGS].", msg("Costs [5] dollars, see [TOOL_ or [ARGS].")),
    ("", msg("")),
    (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        msg("", ("get_weather", '{"city": "Paris"}')),
    ),
    (
        'Checking.\n[TOOL_CALLS] [{"name": "a", "arguments": {}, "id": "abc123def"}, {"name":"b","arguments":{"x":1}}]',
        msg("Checking.", ("a", "{}"), ("b", '{"x": 1}')),
    ),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', msg("", ("get_weather", '{"city": "Paris"}'))),
    (
        'Checking.[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b.c-d[CALL_ID]x1Y2z3[ARGS] {"x": [1, 2]}',
        msg("Checking.", ("a", "{}"), ("b.c-d", '{"x": [1, 2]}')),
    ),
    ('[TOOL_CALLS]f[ARGS]{"a": 1}} extra', msg("} extra", ("f", '{"a": 1}'))),
    # malformed or cut off: content
    ('[TOOL_CALLS][{"name": "a", "arguments": {}]', None),
    ('[TOOL_CALLS][{"name": "a", "arguments": 3}]', None),
    ("[TOOL_CALLS][]", None),
    ('[TOOL_CALLS]get weather[ARGS]{"a": 1}', None),
    ('[TOOL_CALLS]f[ARGS]["a"]', None),
    ('[TOOL_CALLS]f[ARGS]{"a": 1', None),
    ("[TOOL_CALLS]f[AR", None),
    ("Text [TOOL_CA", None),
    ('[TOOL_CALLS]"f"[ARGS]{}', None),
    ("[TOOL_CALLS]bad name [TOOL_CALLS]f[ARGS]{}", msg("[TOOL_CALLS]bad name", ("f", "{}"))),
    (
        f'[TOOL_CALLS]tricky[ARGS]{json.dumps(TRICKY_ARGS)}[TOOL_CALLS]u[ARGS]{{"s": "ü"}}',
        msg("", ("tricky", TRICKY_CANON), ("u", '{"s": "ü"}')),
    ),
    (
        f'Ünïcode [TOOL_CALLS][{{"name": "t", "arguments": {json.dumps(TRICKY_ARGS, ensure_ascii=False)}}}]',
        msg("Ünïcode", ("t", TRICKY_CANON)),
    ),
]


@pytest.mark.parametrize("text,expected", MISTRAL_CASES)
def test_mistral(text, expected):
    check(MistralToolParser(), text, expected or msg(text))


# json_array (tool_choice "required")

TRICKY_RAW = json.dumps(TRICKY_ARGS, ensure_ascii=False)
JSON_ARRAY_CASES = [
    ('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', msg("", ("get_weather", '{"city": "Paris"}'))),
    ('[{"name":"f","parameters":{ "a" :1 ,"b":[ ] }}]', msg("", ("f", '{ "a" :1 ,"b":[ ] }'))),
    (
        '\n[ {"name": "a", "parameters": {}},\n  {"name": "b", "parameters": {"x": "y"}} ]\n',
        msg("", ("a", "{}"), ("b", '{"x": "y"}')),
    ),
    ('[{"parameters": {"a": [1, "}"]}, "name": "f"}]', msg("", ("f", '{"a": [1, "}"]}'))),
    ('[{"type": "function", "name": "f", "id": {"n": [1]}, "parameters": {}}]', msg("", ("f", "{}"))),
    ('[{"name": "n\\u00e9\\"q", "parameters": {}}]', msg("", ('né"q', "{}"))),
    ('[{"name": "f", "parameters": 42}, {"name": "g", "parameters": "s}"}]', msg("", ("f", "42"), ("g", '"s}"'))),
    ('[{"name": "f"}]', msg("", ("f", "{}"))),
    ('[{"parameters": {}}, {"name": "g", "parameters": {}}]', msg("", ("g", "{}"))),
    ("[]", msg("")),
    ("", msg("")),
    ("Hello", msg("Hello")),
    ("  Hello ", msg("  Hello ")),
    # cut off or off the shape
    ('[{"name": "f", "parameters": {"a": "x', msg("", ("f", '{"a": "x'))),
    ('[{"name": "f", "parameters": {"a": 1}', msg("", ("f", '{"a": 1}'))),
    ('[{"name": "f', msg("")),  # cut before any name was complete: the grammar's wrapper is not content
    ('[{"name": "f", ', msg("", ("f", ""))),  # cut before its parameters: no arguments made up
    ('[{"parameters": {"a": 1}', msg("")),
    ('[{"name": "f", "parameters": {}}, {"name": "g', msg("", ("f", "{}"))),  # a later call's name cut: dropped
    ('[{"name": "f", "parameters": {}}] trailing', msg("trailing", ("f", "{}"))),
    ('[{"name": "f", "parameters": {}} x]', msg("x]", ("f", "{}"))),
    ('[{"name": "f" "parameters": {}}]', msg('"parameters": {}}]', ("f", "{}"))),
    (
        f'[{{"name": "tricky", "parameters": {TRICKY_RAW}}}, '
        f'{{"parameters": {json.dumps(TRICKY_ARGS)}, "name": "t2"}}]',
        msg("", ("tricky", TRICKY_RAW), ("t2", json.dumps(TRICKY_ARGS))),
    ),
]


@pytest.mark.parametrize("text,expected", JSON_ARRAY_CASES)
def test_json_array(text, expected):
    check(JsonArrayCallsParser(), text, expected)


def test_json_array_streams_names_and_arguments_as_they_arrive():
    streamer = JsonArrayCallsParser().streamer()
    seen = []
    for char in '[{"name": "get_weather", "parameters": {"city": "Par':
        seen.extend(streamer.feed(char).tool_calls)
    assert seen[0].index == 0 and seen[0].name == "get_weather" and seen[0].arguments == ""
    assert "".join(d.arguments for d in seen) == '{"city": "Par'
    assert len(seen) > 5  # character by character, not held
    assert streamer.feed('is"}}, {"parameters": {"a"').tool_calls[0].arguments == 'is"}'
    piece = streamer.feed(': 1}, "name": "g"}]')
    assert [(d.index, d.name, d.arguments) for d in piece.tool_calls] == [(1, "g", '{"a": 1}')]


def _time_stream(parser, text: str, runs: int = 1, step: int = 3) -> float:
    """The best of `runs` runs' CPU seconds of this thread to stream `text` in `step`-character deltas (CPU time,
    not wall time: a run preempted by the machine's other work once took 70x the short text's wall time, and the
    test failed on a parser that had not changed)."""
    times = []
    for _ in range(runs):
        start = time.thread_time()
        streamer = parser.streamer()
        for i in range(0, len(text), step):
            streamer.feed(text[i : i + step])
        streamer.finish()
        times.append(time.thread_time() - start)
    return min(times)


def _long_outputs(rows: int):
    args = json.dumps({"rows": [{"k": i, "s": 'x}\\"' * 3} for i in range(rows)]})
    yield JsonArrayCallsParser(), f'[{{"name": "f", "parameters": {args}}}]'
    yield JsonArrayCallsParser(), f'[{{"parameters": {args}, "name": "f"}}]'
    yield HermesToolParser(), f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>'
    yield Llama3JsonToolParser(), f'{{"name": "f", "parameters": {args}}}'
    yield MistralToolParser(), f"[TOOL_CALLS]f[ARGS]{args}"
    yield NamedFunctionParser("f"), args


def test_long_outputs_stream_in_linear_time():
    """Sixteen times the text in 3-character deltas takes about sixteen times as long, not hundreds (as a copy or a
    rescan of the held text per delta would make it): 20k and 320k characters of one call's arguments."""
    for (parser, short), (_, long) in zip(_long_outputs(500), _long_outputs(8000)):
        assert len(parser.parse(short).tool_calls) == 1
        short_s, long_s = _time_stream(parser, short, runs=5), _time_stream(parser, long, runs=2)
        assert long_s < 40 * short_s + 0.1, (parser.name, short_s, long_s)


# named tool_choice


@pytest.mark.parametrize(
    "text,arguments",
    [
        ('{"city": "Paris"}', '{"city": "Paris"}'),
        (' \n{"a": [1, {"b": "}] \\" \\\\"}]}\n\t ', '{"a": [1, {"b": "}] \\" \\\\"}]}'),
        ('{"s": "日本 \u00e9"}  ', '{"s": "日本 \u00e9"}'),
        ('{"a":  1,\n "b": 2}', '{"a":  1,\n "b": 2}'),
        ("", ""),
        ("   ", ""),
    ],
)
def test_named(text, arguments):
    check(NamedFunctionParser("get_weather"), text, msg("", ("get_weather", arguments)))


# random texts from each format's pieces: whatever they parse to, every split streams to the same

FRAGMENTS = {
    HermesToolParser: [
        "<tool_call>",
        "</tool_call>",
        '{"name": "f", "arguments": {"a": 1}}',
        "{",
        "}",
        '"',
        "\\",
        " ",
        "\n",
        "x",
        "<tool",
        '"name"',
        ": ",
        '{"name": "g"}',
        "é",
        "[",
        "]",
        ",",
    ],
    Llama3JsonToolParser: [
        "<|python_tag|>",
        '{"name": "f", "parameters": {"a": [1]}}',
        "; ",
        ";",
        "{",
        "}",
        '"',
        " ",
        "\n",
        "x",
        '"name"',
        '"parameters"',
        ": ",
        "{}",
        "é",
        "<|py",
    ],
    MistralToolParser: [
        "[TOOL_CALLS]",
        "[ARGS]",
        "[CALL_ID]",
        "f",
        "ab1",
        '{"a": 1}',
        '[{"name": "f", "arguments": {}}]',
        "{",
        "}",
        "[",
        "]",
        '"',
        " ",
        "x",
        "[TOOL",
        "é",
        ",",
    ],
    JsonArrayCallsParser: [
        "[",
        "]",
        "{",
        "}",
        '"name"',
        '"parameters"',
        '"f"',
        ": ",
        ":",
        ", ",
        ",",
        '{"a": "}"}',
        '"',
        "\\",
        " ",
        "\n",
        "1",
        "x",
        '"n\\"',
    ],
}


@pytest.mark.parametrize("cls", list(FRAGMENTS), ids=lambda cls: cls.name)
def test_random_texts_stream_as_they_parse(cls):
    rng = random.Random(cls.name)
    for _ in range(150):
        check(cls(), "".join(rng.choice(FRAGMENTS[cls]) for _ in range(rng.randint(0, 12))))


# the registry


def test_parser_for():
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral"}
    for name, cls in PARSERS.items():
        parser = parser_for(name)
        assert isinstance(parser, cls) and parser.name == name
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral") as error:
        parser_for("json_array")
    assert "'json_array'" in str(error.value)
