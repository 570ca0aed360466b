"""A synchronous ZeroMQ client for batch jobs against a shuttle frontend (text in, text out).

    from common.batch_client import BatchClient
    with BatchClient("tcp://127.0.0.1:8001") as client:
        for result in client.run([{"prompt": "Once upon a time", "max_tokens": 32}]):
            print(result.job_id, result.text)
"""

from __future__ import annotations

import itertools
import os
from typing import Iterable, Iterator

import msgspec
import zmq

from common.ipc import Channel
from common.messages import BatchJob, BatchResult


class BatchClient:
    """Keeps at most `window` jobs in flight and yields each job's BatchResult as it finishes.

    Args:
        endpoint: the frontend's batch endpoint (the launcher prints it).
        window: jobs in flight at once; the server's queue bound still applies (a full queue answers 503).
        timeout: seconds to wait for any result before giving up (TimeoutError).
        api_key: the server's API key, put into every job (default: $SHUTTLE_API_KEY).
    """

    def __init__(self, endpoint: str, window: int = 64, timeout: float = 600.0, api_key: str | None = None):
        self._ctx = zmq.Context()
        self._channel: Channel[BatchResult] = Channel(self._ctx, zmq.DEALER, endpoint, bind=False,
                                                      recv_type=BatchResult)
        self.window = window
        self.timeout_ms = int(timeout * 1000)
        self.api_key = api_key if api_key is not None else os.environ.get("SHUTTLE_API_KEY", "")

    def run(self, jobs: Iterable[dict | BatchJob]) -> Iterator[BatchResult]:
        """Submit jobs (dicts take BatchJob's fields; a missing job_id becomes the job's index) and yield results.

        Raises:
            TypeError: a job dict has an unknown field.
            msgspec.ValidationError: a job dict has a field of the wrong type.
            TimeoutError: no result arrived for `timeout` seconds.
        """
        pending = 0
        counter = itertools.count()
        source = iter(jobs)
        exhausted = False
        while True:
            while not exhausted and pending < self.window:
                job = next(source, None)
                if job is None:
                    exhausted = True
                    break
                if isinstance(job, dict):
                    job = _checked(BatchJob(**{"job_id": str(next(counter)), "api_key": self.api_key, **job}))
                elif self.api_key and not job.api_key:
                    job = msgspec.structs.replace(job, api_key=self.api_key)
                self._channel.send(job)
                pending += 1
            if pending == 0:
                return
            if not self._channel.poll(self.timeout_ms):
                raise TimeoutError(f"no batch result within {self.timeout_ms / 1000:g} s ({pending} pending)")
            yield self._channel.recv()
            pending -= 1

    def close(self) -> None:
        self._channel.close()
        self._ctx.term()

    def __enter__(self) -> "BatchClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _checked(job: BatchJob) -> BatchJob:
    """Round-trip through the wire format so a wrong type fails here, not silently at the server."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(job), type=BatchJob)
