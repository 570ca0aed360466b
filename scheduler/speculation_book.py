"""The scheduler's side of speculative decoding: which decoding sequences draft and how many tokens, and vLLM's
spec_decode counters once the worker has verified them.

N-gram drafts are proposed here (scheduler/ngram.py): the scheduler holds every token id. A draft model runs in
the worker, so for it the scheduler books only the number of drafts, as DRAFT_SLOT placeholders that the worker
fills before it verifies (worker/draft_model.py). Either way the booking, the budget accounting and the settling
(scheduler/scheduler.py) are the same.
"""

from __future__ import annotations

from shuttle.common.speculative import DRAFT_MODEL, SpeculativeConfig
from shuttle.scheduler.ngram import propose_ngram
from shuttle.scheduler.request import Request

DRAFT_SLOT = -1  # a draft token the worker's draft model proposes in the step itself
MAX_PAUSE = 16  # most decode steps a request whose drafts keep failing goes without drafting before it tries again


class SpeculationBook:
    """Proposes drafts (or draft slots) for decoding requests and counts what verification accepted.

    Args:
        config: the parsed --speculative-config.
    Attributes:
        num_drafts, num_draft_tokens, num_accepted_tokens: cumulative, as vLLM's spec_decode_num_drafts (sequence
            steps that verified drafts), _num_draft_tokens and _num_accepted_tokens.
        accepted_per_pos: [k], accepted drafts by their position in the run of drafts.
    """

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    @staticmethod
    def may_speculate(request: Request) -> bool:
        """True for a decoding request whose only token left to compute is its last known one, and which has no
        grammar, penalties or prompt logprobs (verifying those would need the grammar or the counts advanced along
        the drafts)."""
        sampling = request.sampling
        return (not request.num_output_placeholders and bool(request.output_token_ids)
                and request.num_computed_tokens == request.num_tokens - 1 and sampling.structured is None
                and not sampling.has_penalties and sampling.prompt_logprobs is None)

    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to min(k, limit) drafts for `request` (may_speculate holds): n-gram token ids, or DRAFT_SLOT
        placeholders for the draft model. [] when `limit` < 1, no n-gram matched, or the request pauses (record())."""
        limit = min(limit, self.config.num_speculative_tokens)
        if request.spec_pause > 0:
            request.spec_pause -= 1
            return []
        if limit < 1:
            return []
        if self.config.method == DRAFT_MODEL:
            return [DRAFT_SLOT] * limit
        low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        assert low is not None and high is not None  # parse_speculative_config fills both for ngram
        return propose_ngram(request.all_token_ids, limit, low, high)

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """Count one verified run of `num_drafted` drafts of which the first `num_accepted` were accepted.

        A request whose drafts are all rejected twice in a row pauses drafting for 2, then 4, 8 up to MAX_PAUSE
        decode steps, and tries again after each pause; an accepted draft ends the backoff. Where drafts fail (a
        draft model that disagrees, text that copies nothing) their verification rows then cost almost nothing,
        while a request whose drafts start to land again drafts within MAX_PAUSE steps."""
        if num_accepted:
            request.spec_misses = 0
        else:
            request.spec_misses += 1
            if request.spec_misses >= 2:
                request.spec_pause = min(2 ** (request.spec_misses - 1), MAX_PAUSE)
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1
