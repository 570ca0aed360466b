"""The frontend's ZeroMQ endpoint for batch jobs: a ROUTER in the same event loop as the HTTP server.

A batch client (common/batch_client.py) sends BatchJob messages and receives one BatchResult per job. Jobs go
through the same validation and the same engine path as /v1/completions.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq
import zmq.asyncio

from common.ipc import AsyncChannel
from common.messages import BatchClientMessage, BatchJob, BatchResult
from frontend.choices import collect
from frontend.openai_api import build_generations
from frontend.protocol import CompletionRequest, client_error, completion_prompts
from frontend.state import FrontendState

log = logging.getLogger("shuttle.frontend")


class BatchEndpoint:
    """Binds `endpoint` (tcp://host:port, tcp://host:* for any port, or ipc://path)."""

    def __init__(self, state: FrontendState, endpoint: str):
        self.state = state
        self.channel: AsyncChannel[BatchClientMessage] = AsyncChannel(
            zmq.asyncio.Context.instance(), zmq.ROUTER, endpoint, bind=True, recv_type=BatchClientMessage)
        self.endpoint = self.channel.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks: set[asyncio.Task] = set()

    async def serve(self) -> None:
        while True:
            try:
                client, job = await self.channel.recv_from()
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("dropping a malformed batch message: %s", exc)
                continue
            task = asyncio.create_task(self._run(client, job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, client: bytes, job: BatchJob) -> None:
        try:
            result = await self._complete(job)
        except Exception as exc:
            known = client_error(exc)
            if known is None:
                log.exception("batch job %s failed", job.job_id)
            result = BatchResult(job.job_id, error_status=known[0] if known else 500,
                                 error_message=str(exc) if known else "internal server error")
        await self.channel.send(result, identity=client)

    async def _complete(self, job: BatchJob) -> BatchResult:
        state = self.state
        body = CompletionRequest(prompt=job.prompt, max_tokens=job.max_tokens, temperature=job.temperature,
                                 top_p=job.top_p, top_k=job.top_k, seed=job.seed, stop=job.stop or None,
                                 priority=job.priority, ignore_eos=job.ignore_eos)
        prompts = completion_prompts(body.prompt, state.tokenizer, state.config.model.max_model_len)
        generations = build_generations(state, body, prompts, state.engine.new_request_id("batch"), body.max_tokens,
                                        None)
        [done] = await collect(generations)
        generation = done.generation
        return BatchResult(job.job_id, done.text, done.token_ids, generation.finish_reason or "",
                           len(generation.prompt_token_ids), generation.num_output_tokens)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.channel.close()
