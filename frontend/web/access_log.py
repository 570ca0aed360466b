"""The HTTP access log: one line per request, `REMOTE - "METHOD PATH HTTP/x.y" STATUS BYTES SECONDS`, as aiohttp's
default logger writes it with the format '%a - "%r" %s %b %Tf', plus the response's x-request-id as the record's
`request_id`, which --log-format json writes as a field of the line (common/log_format.py)."""

from __future__ import annotations

import logging

from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse


class RequestAccessLogger(AbstractAccessLogger):
    """aiohttp's access logger class for shuttle's handler (RequestHandler's `access_log_class`)."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        """Write one INFO line for a request answered in `time` seconds."""
        version = request.version
        self.logger.info('%s - "%s %s HTTP/%d.%d" %d %d %.6f', request.remote or "-", request.method, request.path_qs,
                         version.major, version.minor, response.status, response.body_length, time,
                         extra={"request_id": response.headers.get("X-Request-Id")})

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)  # a hidden line formats nothing
