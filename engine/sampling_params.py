"""Per-request sampling parameters as the engine sees them (token ids, not strings)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """What the sampler and the stop checks need for one sequence.

    Built by the front door from a ``GenerationConfig``: strings (stop/bad words) are already
    tokenized here; text-level stop strings are matched by the detokenizer, not the engine.
    ``top_k <= 0`` means no top-k limit; ``top_k == 1`` or ``temperature == 0`` is greedy.
    """

    max_new_tokens: int = 512
    min_new_tokens: int = 0
    temperature: float = 0.8
    top_k: int = 1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    random_seed: int | None = None
    # Token ids that end generation (the model's eos ids plus single-token stop words).
    stop_token_ids: list[int] = field(default_factory=list)
    # Token ids never sampled (bad words that are a single token; longer ones are banned when
    # their prefix has been generated, see Sampler).
    bad_token_ids: list[int] = field(default_factory=list)
    # Multi-token bad words: banned last token, given the preceding ones were just generated.
    bad_sequences: list[list[int]] = field(default_factory=list)
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1
