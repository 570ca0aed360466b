"""Errors shared across processes, each mapped to the HTTP status a client should see."""


class ShuttleError(Exception):
    """Base of shuttle's own errors."""


class ModelDirError(ShuttleError):
    """The model directory is missing or its config files cannot be read."""


class GenerationError(ShuttleError):
    """An accepted request ended with an error output from the scheduler (status: HTTP-like code, e.g. 503 queue
    full, 408 timeout, 500 model failure), or was refused at once (503 while draining or restarting).

    Attributes:
        retry_after: with status 503, the predicted seconds until a retry is admitted (None: unknown).
        param: the request field the error is about, when it is one (a 400's).
    """

    def __init__(self, status: int, message: str, retry_after: float | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.param = param


class ModelNotFoundError(ShuttleError):
    """The request names a model this server does not serve: HTTP 404."""


class InvalidRequestError(ShuttleError):
    """A request that can never run as given: HTTP 400, OpenAI type ``invalid_request_error``.

    Attributes:
        param: the request field at fault (``None`` when no single field is).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
