"""`shuttle serve --step-log FILE`: every step's shape and how long it took as served, one JSON line per step.

A step's served seconds run from when the worker could start it (its plan sent, or the previous step's result
back, whichever is later: with two plans in flight the worker queues the second) to when its result is back in
the scheduler: the worker's own time plus what serving adds (the plan's and the result's way through the
sockets, the frontend and clients taking their turns on the cores). Set against the step-cost model's prediction
(scheduler/step_cost.py), these lines show what serving adds to the worker's steps on a given machine; nothing fits
the model to them.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from shuttle.scheduler.step_cost import StepShape, shape_of


class ServedStep(msgspec.Struct, array_like=True):
    """One line of the log: the step's shape, its served duration in seconds and when it ended (time.monotonic()
    seconds when its result was back; 0 in logs written before the field existed)."""

    seconds: float
    num_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    prefill_attention: int
    decode_attention: int
    num_sampled: int
    ended_at: float = 0.0  # last: older lines, without it, still decode

    @property
    def shape(self) -> StepShape:
        return StepShape(self.num_tokens, self.num_prefill_seqs, self.num_decode_seqs, self.prefill_attention,
                         self.decode_attention, self.num_sampled)


class StepLog:
    """Appends ServedSteps to a file, line-buffered (a step's line is on disk when the step is settled).

    Raises:
        OSError: the file cannot be opened for appending.
    """

    def __init__(self, path: str | Path):
        self._file = open(path, "a", buffering=1)
        self._encoder = msgspec.json.Encoder()
        self._last_result_at = 0.0

    def record(self, scheduled, sent_at: float, result_at: float) -> None:
        """Log one settled step. scheduled: its ScheduledStep.scheduled entries; times: time.monotonic()."""
        began, self._last_result_at = max(sent_at, self._last_result_at), result_at
        shape = shape_of((e.start, e.num_new, e.samples) for e in scheduled.values())
        line = ServedStep(result_at - began, shape.num_tokens, shape.num_prefill_seqs, shape.num_decode_seqs,
                          shape.prefill_attention, shape.decode_attention, shape.num_sampled, result_at)
        self._file.write(self._encoder.encode(line).decode() + "\n")

    def close(self) -> None:
        self._file.close()


def read_step_log(path: str | Path) -> list[ServedStep]:
    """All steps of a log. Raises OSError, msgspec.ValidationError (not a step log)."""
    decoder = msgspec.json.Decoder(ServedStep)
    return [decoder.decode(line) for line in Path(path).read_bytes().splitlines() if line.strip()]
