"""Per-request sampling parameters (SGLang's names) and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field

# What torch.Generator.manual_seed accepts (a negative seed wraps modulo 2**64).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Stop strings: OpenAI allows 4; 16 leaves room for lm-eval's `until` lists and SGLang clients,
# and 1,000 characters for any real delimiter. Each string costs the detokenizer's matcher
# build time and memory in proportion to its length (16,000 characters at most per request).
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 1000


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0  # EOS and stop tokens are masked until this many outputs
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # structured output (SGLang's names; at most one): see hybrid_serve/scheduler/grammar.py
    regex: str | None = None
    json_schema: str | None = None  # a JSON schema, as a string
    ebnf: str | None = None
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    # with return_logprob: prompt logprobs from this position on (-1: the last prompt token
    # only); the request recomputes from there, so its prefix-cache hit is cut to it
    logprob_start_len: int = -1

    def __post_init__(self) -> None:
        self.validate()

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, spec) of the output constraint, or None."""
        if self.json_object:
            return ("json", "")
        for kind in ("json_schema", "regex", "ebnf"):
            spec = getattr(self, kind)
            if spec is not None:
                return (kind, spec)
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (the API answers it with HTTP 400)."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if not 0 <= self.min_new_tokens <= max(self.max_new_tokens, 0):
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got "
                f"{self.min_new_tokens}"
            )
        for token, bias in (self.logit_bias or {}).items():
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(
                    f"logit_bias needs token ids >= 0 and biases in [-100, 100], got "
                    f"{token}: {bias}"
                )
        constraints = [self.regex, self.json_schema, self.ebnf, self.json_object or None]
        if sum(c is not None for c in constraints) > 1:
            raise ValueError("give at most one of regex, json_schema, ebnf and json_object")
        if self.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be >= -1, got {self.logprob_start_len}")
        if self.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {self.top_logprobs_num}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"each stop string must be at most {MAX_STOP_CHARS} characters")
