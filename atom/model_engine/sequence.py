"""A request's token state as the scheduler, block manager and model runner see it."""

from __future__ import annotations

import enum
import itertools

from atom.sampling_params import SamplingParams

_ids = itertools.count()

# A sampled token the host has not read yet (asynchronous scheduling): the scheduler appends one
# per sampling step at schedule time and `resolve_placeholder` replaces it when the step's output
# is read. The model runner takes its value from the previous step's sampled ids on the device.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    # Constrained: waiting until every rank has bound its grammar (compiled in the background).
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its KV blocks were taken back (recompute)
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefix_source: str | None = None,
    ):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.params = params
        # A parallel sample (`n` > 1) names the request whose prompt blocks it reuses: it waits
        # until that one has computed them (`Scheduler._waits_for_prefix`).
        self.prefix_source = prefix_source
        self.prompt_token_ids = list(prompt_token_ids)
        # Prompt, then output tokens: an entry before the placeholders never changes again, so
        # each step's output refers to them instead of copying (`output.TokenIdsPrefix`).
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Prompt + output length at which it finishes with "length": max_tokens, capped at the
        # model's length by the scheduler (`Scheduler.add`).
        self.max_len = self.num_prompt_tokens + params.max_tokens
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        self.block_hashes: list[int] = []
        # Structured output: how many output tokens the ranks have been sent to commit (kept
        # across preemption: recomputed tokens are not re-sent, so no rank re-commits them).
        self.num_grammar_acked = 0
        # Trailing entries of `token_ids` that are PLACEHOLDERs (at most two: the step whose
        # output is being read and the one just scheduled).
        self.num_placeholders = 0
        # Speculative decoding: draft tokens proposed after its last step, verified by its next
        # one (never part of `token_ids`: only the accepted ones are appended).
        self.draft_token_ids: list[int] = []
        # Asynchronous speculative decoding: the drafts of each scheduled verification step
        # whose output is not read yet, oldest first. Until it is read, its accepted drafts
        # are unknown: the next step's positions are later by up to that many on the device.
        self.unread_drafts: list[int] = []
        # ... and whether the last verification read rejected one of its drafts: the drafts of
        # the step in flight were proposed as if it had not, so they are likely wrong too.
        self.drafts_missed = False
        self.num_preemptions = 0  # a draft model's K/V of it is lost with its blocks
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Output tokens read so far (placeholders excluded)."""
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - self.num_placeholders]

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens read so far (placeholders excluded)."""
        return len(self.token_ids) - self.num_placeholders

    @property
    def num_output_tokens(self) -> int:
        """Output tokens read so far (placeholders excluded)."""
        return len(self.token_ids) - self.num_placeholders - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def insert_known(self, token_id: int) -> None:
        """Another token of the step being read (an accepted draft, or the token after it),
        before the placeholders of later steps. The grammar committed a verification step's
        tokens together, so one that follows a token already sent to it counts as sent."""
        i = len(self.token_ids) - self.num_placeholders
        if i - 1 < self.num_prompt_tokens + self.num_grammar_acked:
            self.num_grammar_acked += 1
        self.token_ids.insert(i, token_id)

    def append_placeholder(self) -> None:
        self.token_ids.append(PLACEHOLDER)
        self.num_placeholders += 1

    def resolve_placeholder(self, token_id: int | None) -> None:
        """The oldest placeholder becomes `token_id`; None drops it (its row failed)."""
        i = len(self.token_ids) - self.num_placeholders
        if token_id is None:
            del self.token_ids[i]
        else:
            self.token_ids[i] = token_id
        self.num_placeholders -= 1

    def drop_placeholders(self) -> None:
        """Forget tokens still being computed (the sequence finished: they are never emitted)."""
        if self.num_placeholders:
            del self.token_ids[-self.num_placeholders :]
            self.num_placeholders = 0
        self.unread_drafts = []
