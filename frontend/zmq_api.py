"""The frontend's ZeroMQ endpoint for batch jobs: a ROUTER in the same event loop as the HTTP server.

A batch client (common/batch_client.py) sends BatchJob messages and receives one BatchResult per job. Jobs go
through the same validation and the same engine path as /v1/completions. With an API key set, a job must
carry it (`BatchJob.api_key`) or it gets error_status 401 and no work is done. A message that is not one
well-formed BatchJob (extra frames, bad msgpack, wrong fields) is answered with a BatchResult whose job_id is
empty and error_status 400, and the endpoint goes on serving.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

import zmq
import zmq.asyncio

from common.ipc import AsyncChannel, MalformedMessage
from common.messages import BatchClientMessage, BatchJob, BatchResult
from frontend.choices import collect
from frontend.openai_api import build_generations
from frontend.protocol import CompletionRequest, client_error, completion_prompts
from frontend.state import FrontendState

log = logging.getLogger("shuttle.frontend")


class BatchEndpoint:
    """Binds `endpoint` (tcp://host:port, tcp://host:* for any port, or ipc://path).

    Args:
        api_key: when set, every job must carry it.
    """

    def __init__(self, state: FrontendState, endpoint: str, api_key: str | None = None):
        self.state = state
        self.channel: AsyncChannel[BatchClientMessage] = AsyncChannel(
            zmq.asyncio.Context.instance(), zmq.ROUTER, endpoint, bind=True, recv_type=BatchClientMessage)
        self.endpoint = self.channel.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._api_key = api_key.encode() if api_key else None
        self._tasks: set[asyncio.Task] = set()

    async def serve(self) -> None:
        while True:
            try:
                client, job = await self.channel.recv_from()
            except MalformedMessage as exc:
                log.warning("malformed batch message: %s", exc)
                self._spawn(self._answer(exc.identity, BatchResult("", error_status=400,
                                                                   error_message=f"malformed message: {exc}")))
                continue
            self._spawn(self._run(client, job))

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, client: bytes, result: BatchResult) -> None:
        try:
            await self.channel.send(result, identity=client)
        except zmq.ZMQError as exc:  # the endpoint closed under us (shutdown)
            log.debug("batch result for %r not sent: %s", result.job_id, exc)

    def _authorized(self, job: BatchJob) -> bool:
        return self._api_key is None or hmac.compare_digest(job.api_key.encode(), self._api_key)

    async def _run(self, client: bytes, job: BatchJob) -> None:
        if not self._authorized(job):
            return await self._answer(client, BatchResult(job.job_id, error_status=401,
                                                          error_message="invalid or missing API key"))
        try:
            result = await self._complete(job)
        except Exception as exc:
            known = client_error(exc)
            if known is None:
                log.exception("batch job %s failed", job.job_id)
            retry_after = getattr(exc, "retry_after", None) or 0.0
            result = BatchResult(job.job_id, error_status=known[0] if known else 500,
                                 error_message=str(exc) if known else "internal server error", retry_after=retry_after)
        await self._answer(client, result)

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
