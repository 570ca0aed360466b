"""Errors shared across processes, each mapped to the HTTP status a client should see."""


class ShuttleError(Exception):
    """Base of shuttle's own errors."""


class ModelDirError(ShuttleError):
    """The model directory is missing or its config files cannot be read."""


class InvalidRequestError(ShuttleError):
    """A request that can never run as given: HTTP 400, OpenAI type ``invalid_request_error``.

    Attributes:
        param: the request field at fault (``None`` when no single field is).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
