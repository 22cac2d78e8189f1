"""Requests and their sampling parameters; plain Python, no device code."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import numpy as np

_ids = itertools.count()
MAX_TOP_LOGPROBS = 20   # OpenAI's limit for top_logprobs


class InvalidRequest(ValueError):
    """Bad sampling parameters or a prompt that cannot be served; the message says why."""


class EngineBusy(RuntimeError):
    """What needs an idle engine (a cache rebuild) was asked while requests are queued or running."""


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt. temperature 0 is greedy; top_k <= 0 and top_p >= 1 disable."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: str | None = None      # Lark text (freetoken/grammar.py): the output is constrained to it
    presence_penalty: float = 0.0   # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output (HF rule)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    logprobs: int | None = None     # report each sampled token's logprob and this many top ones
    prompt_logprobs: int | None = None  # the same for every prompt token (no prefix-cache reuse)
    skip_special_tokens: bool = True    # False: special tokens' text stays in the output (harmony's markers)

    def __post_init__(self):
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0 or self.top_k == -1,
             "top_k must be an integer >= 0 (0 or -1: disabled)"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (self.grammar is None or isinstance(self.grammar, str) and self.grammar.strip(),
             "grammar must be non-empty Lark text"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (all(-100.0 <= b <= 100.0 for _, b in self.logit_bias), "logit_bias values must be in [-100, 100]"),
            (len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias lists a token twice"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))

    @property
    def adjusts_logits(self) -> bool:
        """Whether the penalties op has anything to do for this request."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's raw distribution, and the top ones there."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), most probable first


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence: prompt, generated tokens, its KV slots and its random stream."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)    # KV slot of each computed position
    num_computed: int = 0        # positions whose KV is written
    num_cached: int = 0          # prompt tokens reused from the prefix cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stopped_by: str | None = None   # the stop string that ended generation, if one did
    rng: np.random.Generator | None = None
    text: str = ""               # detokenized output so far (stop strings excluded)
    lock_node: object = None     # radix node of the reused prefix, locked while running
    metrics: dict = field(default_factory=dict)
    matcher: object = None       # grammar.Matcher when params.grammar is set
    output_counts: dict = field(default_factory=dict)   # token id -> occurrences in output_ids
    prompt_logprobs: list = field(default_factory=list)  # one TokenLogprob (None first) per prompt token
    output_logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when asked
    state_row: int | None = None  # state row (GDN, sliding windows), held while running
    anchor_candidates: list = field(default_factory=list)  # every anchor of the prompt (state models)
    anchors: list = field(default_factory=list)   # the ones this prefill checkpoints at, and the end
    pending: list = field(default_factory=list)   # checkpoints taken, linked once their KV is in the tree
    ends_a_query: bool = False    # the prompt's last message is the user's, not a tool result (GDN models)
    resume: object = None         # the checkpoint this request's prefill resumes from
    prompt_unique: object = None  # sorted distinct prompt ids (the repetition penalty's), made once
    slot_row: object = None       # int32 copy of slots[:slot_row_len] (the runner's slot table row)
    slot_row_len: int = 0         # 0 whenever slots is rewritten in place
    slot_row_of: object = None    # the slots list slot_row mirrors (a new list invalidates it)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_at(self, start: int, n: int) -> list[int]:
        """all_ids[start:start + n] without building all_ids (a decode step at 16k context would
        copy 16k ids for one)."""
        P = len(self.prompt_ids)
        if start >= P:
            return self.output_ids[start - P:start - P + n]
        return self.prompt_ids[start:start + n] + self.output_ids[:max(0, start + n - P)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)
