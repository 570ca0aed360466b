"""The frontend's per-request metrics: what one prompt and its n sequences count."""

from shuttle.common.messages import SchedulerStats
from shuttle.frontend.observability.metrics import Metrics


def test_a_prompt_refused_at_arrival_is_counted_once_not_its_sequences_again_as_aborted():
    """A fresh-clone trial: a displaced n=3 request counted once in request_rejected{queue_full} and its two siblings,
    which the frontend ended with it, again in request_success{abort}."""
    metrics = Metrics(lambda: SchedulerStats())
    rejected, aborted = metrics.rejected.labels("queue_full"), metrics.finished.labels("abort")
    prompt = metrics.prompt(3)
    first, *others = [prompt.sequence(5) for _ in range(3)]
    first.on_rejected(503)
    for sequence in others:
        sequence.on_finish("abort")
    assert (rejected._value.get(), aborted._value.get(), prompt.pending) == (1, 0, 0)
    both = metrics.prompt(2)
    for sequence in [both.sequence(5) for _ in range(2)]:  # each sequence refused on its own: still one prompt
        sequence.on_rejected(503)
    assert rejected._value.get() == 2
