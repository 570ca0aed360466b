"""The chat machinery's errors told in another API's words: the Responses and Messages APIs are served by converting
their bodies to a chat request, whose checks name chat fields (response_format, tools[i].function.parameters) that
the client never sent. Each API says how its fields are named; the error's param and message are renamed on the way
out."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from shuttle.common.errors import InvalidRequestError


@contextmanager
def told_as(params: Mapping[str, str], paths: Sequence[tuple[str, str]]) -> Iterator[None]:
    """Rename an InvalidRequestError raised inside: its `param` by `params` (a chat field -> this API's), each
    (regular expression, replacement) of `paths` applied to its message in order (a chat field's path -> this API's,
    `re.sub` syntax)."""
    try:
        yield
    except InvalidRequestError as exc:
        if exc.param is not None:
            exc.param = params.get(exc.param, exc.param)
        message = str(exc)
        for pattern, replacement in paths:
            message = re.sub(pattern, replacement, message)
        exc.args = (message,)
        raise
