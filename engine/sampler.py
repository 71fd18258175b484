"""Batched next-token selection: penalties, bans, greedy/temperature/top-k/top-p/min-p, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..protocol.sampling import SamplingParams
from ..kernels.sampling import seeded_race
from .grammar import apply_token_bitmask

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    """What the sampler chose for each row of the batch.

    ``logprobs`` holds the chosen token's logprob for every row as soon as any row asked for
    logprobs (computing it for all rows costs nothing extra), else ``None``. ``top_logprobs``
    holds, per row, the ``params.logprobs`` most likely ``(token, logprob)`` pairs sorted by
    descending logprob (an empty list for rows with ``logprobs`` of ``None`` or ``0``), or
    ``None`` when no row asked.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclass
class DeviceSamples:
    """The sampler's choices while they are still on the device.

    ``token_ids`` (``[B]`` int64) can feed the next step's inputs on the device before the host
    has seen them. ``start_copy`` queues non-blocking copies into pinned host memory behind the
    sampling kernels; ``fetch`` waits for those copies only (not for later work queued on the
    stream) and returns the host-side ``SamplerOutput``.
    """

    token_ids: torch.Tensor
    chosen_logprobs: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    wanted: list[int | None] | None = None  # params.logprobs per row, when some row asked
    _host: list[torch.Tensor | None] = field(default_factory=list)
    _ready: torch.cuda.Event | None = None

    def _device_tensors(self) -> list[torch.Tensor | None]:
        return [self.token_ids, self.chosen_logprobs, self.top_values, self.top_ids]

    def start_copy(self) -> None:
        """Queue the device-to-host copies (CUDA only; on the CPU ``fetch`` reads directly)."""
        if self.token_ids.device.type != "cuda":
            return
        self._host = [None if t is None
                      else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                      for t in self._device_tensors()]
        self._ready = torch.cuda.Event()
        self._ready.record()

    def ready(self) -> bool:
        """Whether ``fetch`` would return without waiting for the device."""
        return self._ready is None or self._ready.query()

    def fetch(self) -> SamplerOutput:
        """The chosen ids (and logprobs when asked) on the host; waits for the copies."""
        if self._ready is not None:
            self._ready.synchronize()
            ids, chosen, top_values, top_ids = self._host
        else:
            ids, chosen, top_values, top_ids = self._device_tensors()
        token_ids = ids.tolist()
        if self.wanted is None:
            return SamplerOutput(token_ids, None, None)
        values, tids = top_values.tolist(), top_ids.tolist()
        top = [list(zip(tids[i][: n or 0], values[i][: n or 0])) for i, n in enumerate(self.wanted)]
        return SamplerOutput(token_ids, chosen.tolist(), top)


def _to_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list on ``device`` without a host sync: on CUDA it goes through pinned memory with a
    non-blocking copy (a plain ``torch.tensor(..., device="cuda")`` waits for the stream)."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def _pair_mask(
    rows: list[int], cols: list[int], shape: tuple[int, int], device: torch.device
) -> torch.Tensor:
    """Boolean ``[B, V]`` mask that is True at each ``(rows[i], cols[i])``."""
    mask = torch.zeros(shape, dtype=torch.bool, device=device)
    if rows:
        mask[_to_device(rows, device, torch.int64), _to_device(cols, device, torch.int64)] = True
    return mask


def plain_greedy(params: list[SamplingParams], num_generated: list[int]) -> bool:
    """Every row takes the plain argmax of its logits (after the output constraint's mask, when
    the step has one): greedy, no logprobs, no repetition penalty, no ban that can apply.

    Reads nothing that can change between planning a step and sampling it, so that the
    tensor-parallel runner may decide from it before the forward (``vocab_parallel_greedy``):
    any ``bad_sequences`` or repetition penalty counts (``_ban`` / ``_penalize`` would look at
    the history; such rows make the engine read every step back anyway, so the shortcut buys
    them little), and ``num_generated`` is the count before the step's own token, the same when
    the step is planned and when it samples (``ModelRunner.launch``)."""
    for p, n in zip(params, num_generated):
        if not p.greedy or p.logprobs is not None or p.bad_token_ids or p.bad_sequences:
            return False
        if p.repetition_penalty != 1.0 or (p.stop_token_ids and n < p.min_new_tokens):
            return False
    return True


def vocab_parallel_greedy(params: list[SamplingParams], num_generated: list[int]) -> bool:
    """Whether a tensor-parallel step's tokens may be the vocab-parallel argmax of its logits
    (``layers/vocab_argmax.py``: no gathered row, no sampler, the same ids): ``plain_greedy``,
    and no row under an output constraint, whose mask needs the whole row."""
    return plain_greedy(params, num_generated) and all(p.guide is None for p in params)


class Sampler:
    """Picks the next token of every row of a batch in one call, each row with its own params.

    Order of processing (Hugging Face / vLLM conventions):

    0. the output constraints' token mask (``token_bitmask``, ``engine/grammar.py``): tokens a
       row's grammar does not allow are ``-inf`` before anything else sees the logits, so
       penalties, logprobs and sampling all work within what the grammar allows;
    1. repetition penalty (HF style) on every token that appears in the row's ``token_history``;
    2. bans (``-inf``): ``bad_token_ids``; the last token of each ``bad_sequences`` entry whose
       prefix equals the last generated tokens (only generated tokens count, not the prompt);
       ``stop_token_ids`` while fewer than ``min_new_tokens`` tokens were generated. A row whose
       every token ends up banned ignores its bans for this step (the least surprising choice
       that never yields NaN); a row whose raw logits are all ``-inf`` samples uniformly;
    3. logprobs: ``log_softmax`` of the logits at this point, i.e. after penalties and bans but
       before temperature / top-k / top-p / min-p (vLLM's "raw" logprobs);
    4. greedy rows (``params.greedy``) take the argmax; the others divide by temperature, keep
       the top-k (``<= 0`` means off), then the smallest nucleus of mass ``>= top_p`` (the top
       token is always kept), then drop tokens with ``prob < min_p * max_prob``, and sample.

    Sampling uses the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``, equivalent to
    drawing from ``probs``. The noise ``q`` is a pure function of (the row's seed, the number of
    tokens it has generated, the token id), computed inside the race kernel
    (``kernels/sampling.py``): a row's random stream depends on nothing else in the batch, needs
    no generator state, is the same on the CPU and the GPU, and a request replayed after
    preemption draws the same tokens. The engine gives an unseeded request a random seed.

    ``sample`` never synchronizes with the device: per-row parameters are read on the host and
    moved without blocking, and no decision depends on tensor values; the caller reads the ids
    back when it needs them (``DeviceSamples.fetch``). Calling the sampler does both at once. A
    batch that is all plain greedy (``plain_greedy``: no penalty, no ban that can apply, no
    logprobs) skips everything but the argmax, with identical results.
    """

    def __call__(self, *args, **kwargs) -> SamplerOutput:
        """``sample`` (same arguments), with the choices read back."""
        return self.sample(*args, **kwargs).fetch()

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        token_history: list[list[int]],
        num_generated: list[int],
        seeds: list[int],
        token_bitmask: torch.Tensor | None = None,
    ) -> DeviceSamples:
        """Choose one token per row of ``logits`` (``[B, V]``), leaving the choices on the device.

        ``token_history`` is each row's known tokens (read only by repetition penalties and
        ``bad_sequences``), ``num_generated`` its generated-token count (``min_new_tokens``, and
        the noise's step), ``seeds`` its noise seed (see the class docstring), ``token_bitmask``
        the rows' allowed tokens (int32 ``[B, ceil(V / 32)]`` on ``logits``' device, or None)."""
        device = logits.device
        if token_bitmask is not None:
            logits = apply_token_bitmask(logits.to(torch.float32, copy=True), token_bitmask)
        if plain_greedy(params, num_generated):
            # argmax over the raw logits equals the full path's: no penalty or ban applies, an
            # all -inf row gives token 0 either way, and float32 conversion keeps the order.
            return DeviceSamples(logits.argmax(dim=-1))
        # A private float32 copy: the bans below write in place and the caller's tensor is theirs.
        logits = logits.to(torch.float32, copy=True)
        logits = self._penalize(logits, params, token_history)
        logits = self._ban(logits, params, token_history, num_generated)

        token_ids = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = _to_device(sampled, device, torch.int64)
            probs = self._truncated_probs(logits[rows], [params[i] for i in sampled])
            row_seeds = _to_device([seeds[i] for i in sampled], device, torch.int64)
            steps = _to_device([num_generated[i] for i in sampled], device, torch.int64)
            token_ids[rows] = seeded_race(probs, row_seeds, steps)
        return self._with_logprobs(token_ids, logits, params)

    @staticmethod
    def _penalize(
        logits: torch.Tensor, params: list[SamplingParams], history: list[list[int]]
    ) -> torch.Tensor:
        """HF repetition penalty: seen tokens with a positive logit are divided by p, others multiplied."""
        rows, cols = [], []
        for i, p in enumerate(params):
            if p.repetition_penalty != 1.0 and history[i]:
                seen = set(history[i])  # each token is penalized once, however often it appeared
                rows.extend([i] * len(seen))
                cols.extend(seen)
        if not rows:
            return logits
        seen_mask = _pair_mask(rows, cols, tuple(logits.shape), logits.device)
        penalty = _to_device([p.repetition_penalty for p in params], logits.device)[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        return torch.where(seen_mask, penalized, logits)

    @staticmethod
    def _ban(
        logits: torch.Tensor, params: list[SamplingParams], history: list[list[int]], num_generated: list[int]
    ) -> torch.Tensor:
        """Set banned tokens to ``-inf``; rows left with nothing allowed fall back (class docstring)."""
        rows, cols = [], []
        for i, p in enumerate(params):
            banned = list(p.bad_token_ids)
            for seq in p.bad_sequences:
                n = len(seq) - 1
                # The prefix must lie wholly in the generated tokens: a prompt never triggers a ban.
                if n >= 1 and num_generated[i] >= n and history[i][-n:] == seq[:-1]:
                    banned.append(seq[-1])
            if num_generated[i] < p.min_new_tokens:
                banned.extend(p.stop_token_ids)
            rows.extend([i] * len(banned))
            cols.extend(banned)
        if rows:
            allowed = logits
            logits = logits.masked_fill(_pair_mask(rows, cols, tuple(logits.shape), logits.device), _NEG_INF)
            dead = torch.isneginf(logits).all(dim=-1, keepdim=True)
            logits = torch.where(dead, allowed, logits)
        # Raw logits that are all -inf would turn softmax into NaN; uniform is the only sane reading.
        dead = torch.isneginf(logits).all(dim=-1, keepdim=True)
        return logits.masked_fill(dead, 0.0)

    @staticmethod
    def _truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, then top-k, top-p, min-p; returns the renormalized probabilities ``[n, V]``."""
        device, vocab = logits.device, logits.shape[-1]
        temperature = _to_device([p.temperature for p in params], device)[:, None]
        logits = logits / temperature
        # "Off" maps to values that mask nothing, so one batched pass serves every row.
        top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
        top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
        if any(k < vocab for k in top_k) or any(q < 1.0 for q in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            position = torch.arange(vocab, device=device)
            k = _to_device(top_k, device)[:, None]
            sorted_logits = sorted_logits.masked_fill(position >= k, _NEG_INF)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Drop a token when the mass strictly above it already reaches top_p; keep the top one.
            mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
            outside = mass_above >= _to_device(top_p, device)[:, None]
            outside[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(outside, _NEG_INF)
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_p = _to_device([p.min_p for p in params], device)[:, None]
        # Relative threshold: unaffected by the renormalization after top-k/top-p.
        return probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)

    @staticmethod
    def _with_logprobs(token_ids: torch.Tensor, logits: torch.Tensor, params: list[SamplingParams]) -> DeviceSamples:
        """Add the logprobs (of the processed logits, see step 3) when some row asked for them."""
        wanted = [p.logprobs for p in params]
        if all(n is None for n in wanted):
            return DeviceSamples(token_ids)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        top_n = min(max(n or 0 for n in wanted), logprobs.shape[-1])
        top_values, top_ids = logprobs.topk(top_n, dim=-1)
        return DeviceSamples(token_ids, chosen, top_values, top_ids, wanted)
