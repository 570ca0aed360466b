"""A request's output constraint (response_format, vLLM's structured_outputs and guided_* fields) as one
StructuredOutput for the worker's grammar engine."""

from __future__ import annotations

from common.sampling import StructuredOutput


def structured_output_of(body) -> StructuredOutput | None:
    """The constraint `body` (a SamplingFields) asks for, or None.

    Raises:
        InvalidRequestError: a malformed constraint, or more than one (param names the field).
    """
    return None
