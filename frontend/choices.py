"""Running the choices of one request together: collected (non-streaming) or, when there are several, merged into
one stream."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncGenerator

from shuttle.common.messages import TokenLogprobs
from shuttle.frontend.generation import TextDelta, TextGeneration


@dataclass
class CollectedChoice:
    generation: TextGeneration
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text_starts: list[int] = field(default_factory=list)  # each token's, in `text` (TextDelta.text_starts)


async def collect(generations: list[TextGeneration]) -> list[CollectedChoice]:
    """Run every generation to its end: one choice in this task, several in a task each. The first error cancels
    the others (aborting them) and is raised."""
    if len(generations) == 1:
        return [await _collect_one(CollectedChoice(generations[0]))]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_collect_one(CollectedChoice(g))) for g in generations]
    except BaseExceptionGroup as group_error:
        raise group_error.exceptions[0] from None
    return [t.result() for t in tasks]


async def _collect_one(choice: CollectedChoice) -> CollectedChoice:
    texts = []
    async with aclosing(choice.generation.deltas()) as deltas:
        async for delta in deltas:
            texts.append(delta.text)
            choice.token_ids.extend(delta.token_ids)
            choice.logprobs.extend(delta.logprobs)
            choice.text_starts.extend(delta.text_starts)
    choice.text = "".join(texts)
    return choice


async def merge(generations: list[TextGeneration]) -> AsyncGenerator[TextDelta, None]:
    """Several choices' deltas in one stream as they arrive (a task per choice feeding one queue; one choice
    needs none of this: stream its own deltas). An error in any is raised here; leaving early cancels (and so
    aborts) the rest."""
    queue: asyncio.Queue[TextDelta | Exception | None] = asyncio.Queue()
    remaining = len(generations)

    async def pump(generation: TextGeneration) -> None:
        try:
            async with aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    queue.put_nowait(delta)
        except Exception as exc:  # handed to the consumer, who decides
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(g)) for g in generations]
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(generations: list[TextGeneration], prompt_tokens_details: bool = True) -> dict:
    """OpenAI `usage`: each distinct prompt counted once (n choices share it), every choice's output counted;
    `prompt_tokens_details` (cached_tokens: prompt tokens found in the prefix cache) unless told not to
    (--no-enable-prompt-tokens-details)."""
    prompts: dict[int, TextGeneration] = {}
    for g in generations:
        prompts.setdefault(id(g.prompt_token_ids), g)
    prompt_tokens = sum(len(g.prompt_token_ids) for g in prompts.values())
    completion_tokens = sum(g.num_output_tokens for g in generations)
    cached = sum(max(h.num_cached_tokens for h in generations if h.prompt_token_ids is g.prompt_token_ids)
                 for g in prompts.values())
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
              "total_tokens": prompt_tokens + completion_tokens}
    return {**counts, "prompt_tokens_details": {"cached_tokens": cached}} if prompt_tokens_details else counts
