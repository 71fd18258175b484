"""The engine as a library: requests in, one batch of new tokens out per step.

Not thread-safe: one thread (the pipeline's engine loop, later the engine process) owns it.

Overlap. ``step()`` first schedules and queues step N+1 on the GPU, then reads back step N's
sampled ids and turns them into outputs, so the host's work (scheduling, building inputs,
reading back, and whatever the caller does with the outputs, such as handing them to the
detokenizer) runs while the GPU computes; the GPU always has the next step queued. Step N+1
can be built before step N's ids are known because its shape depends only on counts: each
sequence that samples in step N counts one pending token (``engine/sequence.py``), which step
N+1 reads on the device. A sequence that stops on a token of step N has also been given step
N+1; that extra token is discarded and its KV slot is never counted. Steps are not overlapped
(step N is read back before N+1 is scheduled) when a sequence of step N needs its token ids
to sample (repetition penalty, ``bad_sequences``), or when ``EngineConfig.overlap_schedule``
is off (the default turns it on for CUDA only: on the CPU a launch computes the step before
returning, so there is nothing to overlap with).
"""

from __future__ import annotations

import itertools
import logging
import random
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..kernels import set_kernel_mode
from ..protocol.addresses import free_port
from ..protocol.checks import check_int64, check_token_ids
from ..protocol.errors import (
    EngineConfigError,
    InvalidRequestError,
    PromptTooLongError,
    SessionBusyError,
    UnknownAdapterError,
)
from ..protocol.messages import EngineStats, Finish
from ..protocol.multimodal import ImageInput
from ..protocol.sampling import SamplingParams, validate
from .attention_windows import common_window
from .block_manager import BlockManager
from .config import EngineConfig
from .distributed import close_tp, forget_tp, init_tp
from .engine_inputs import resolve_engine_inputs
from .grammar import GuideCompiler, GuideState, fill_token_bitmask
from .model_runner import LaunchedStep, ModelRunner
from .multimodal import check_images, shifted
from .peer_all_reduce import check_all_reduce
from .rank_timing import RankTiming, StepHook
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceStatus
from .tp_workers import TPWorkers

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one step did to one request: a new token, its end, or both."""

    request_id: str
    token: int | None = None  # None: no new token (e.g. ended by an abort)
    finish_reason: Finish | None = None  # None while the request runs
    logprob: float | None = None  # the token's, where asked
    top_logprobs: list[tuple[int, float]] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        """True when this output ends the request."""
        return self.finish_reason is not None


class LLMEngine:
    """Continuous-batching engine over a paged KV cache (implements ``engine.interface.Engine``).

    With ``tp > 1`` it is tensor-parallel rank 0: it starts ranks 1..tp-1 (``TPWorkers``) and
    leads them step by step; ``close()`` stops them."""

    def __init__(self, model_path: str | Path, config: EngineConfig | None = None, *, process_group: bool = False):
        """``process_group`` (tests and benchmarks): join a process group even at tp=1, so that
        tensor parallel's collectives run (and are captured in the decode graphs) on one GPU."""
        self.config = config = config or EngineConfig()
        set_kernel_mode(config.kernels)  # process-wide, once: the kernels' dispatch reads it
        self.model_path, self.model_config, self.device, self.dtype = resolve_engine_inputs(model_path, config)
        self.tp_workers = None
        self._tp_group = None  # the process group this engine joined, which close() leaves
        self._rank_timing: StepHook | None = None  # rank 0's step times (config.rank_timing_dir)
        try:
            tensor_parallel = config.tp > 1 or process_group
            # A wrong all-reduce path is refused here, before any rank starts.
            check_all_reduce(config.tp_all_reduce, self.device, tensor_parallel, self.dtype, config.tp)
            if tensor_parallel:
                self._start_tensor_parallel()
            self.runner = ModelRunner(self.model_path, self.model_config, config, self.device, self.dtype)
            if config.rank_timing_dir is not None:
                self._rank_timing = StepHook(RankTiming(0, Path(config.rank_timing_dir), self.device))
                self.runner.step_hooks.append(self._rank_timing)
            if self.tp_workers is not None:
                self.tp_workers.wait_ready()
                self.runner.workers = self.tp_workers
        except BaseException:
            self.close()
            raise
        self.session_len = config.session_len or self.model_config.max_position_embeddings
        # The windows the built layers attend through (from config.json, engine/attention_windows.py):
        # a model that ignored its config's window must keep every block.
        window = common_window(tuple(a.sliding_window for a in self.runner.model.attention_layers()))
        if window is not None:
            logger.info("every layer attends through a %d-token sliding window: KV blocks wholly before "
                        "it are released as sequences move on", window)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          num_head_blocks=self.runner.num_head_blocks, window=window)
        self.scheduler = Scheduler(self.block_manager, config.max_batch_size,
                                   config.max_prefill_token_num, self.session_len,
                                   min_first_chunk_tokens=self.runner.kv_layout.min_first_chunk_tokens,
                                   max_adapters=self.runner.lora.num_slots if self.runner.lora else 0)
        self._seqs: dict[str, Sequence] = {}  # unfinished turns, by request id
        self._sessions: dict[int, Sequence] = {}
        self._pending: list[StepOutput] = []  # finishes decided outside step(), reported by it
        self._inflight: LaunchedStep | None = None  # queued on the device, not read back yet
        self.overlap = config.overlap_schedule if config.overlap_schedule is not None else self.device.type == "cuda"
        self._seed_source = random.Random()
        self._request_ids = itertools.count()
        self.generated_tokens = 0
        # Output constraints: compiled off the step loop (engine/grammar.py); ``_compiling`` holds
        # the turns queued before their grammar was ready, ``_read_early`` the outputs of a step
        # read back inside the next launch (its tokens decide the next step's masks).
        self.guides = GuideCompiler(self.model_path, self.model_config.vocab_size)
        self._compiling: list[Sequence] = []
        self._read_early: list[StepOutput] = []

    def _start_tensor_parallel(self) -> None:
        if self.config.tp > 1:
            self.tp_workers = TPWorkers(self.model_path, self.config)
            self.tp_workers.wait_joining()
        init_method = self.tp_workers.init_method if self.tp_workers else f"tcp://127.0.0.1:{free_port()}"
        self._tp_group = init_tp(0, self.config.tp, init_method, self.device, self.config.tp_all_reduce)

    def close(self) -> None:
        """Stop the tensor-parallel ranks and leave the process group (nothing to do at tp=1).

        The ranks are told to stop (each then leaves the group), rank 0 leaves it at the same
        time, and only then are the ranks' processes waited for: no rank is left inside a
        collective whose peer has gone (``close_tp`` says how each backend leaves)."""
        if getattr(self, "guides", None) is not None:
            self.guides.close()
        if self._rank_timing is not None:  # the other ranks write theirs as they stop
            self.runner.step_hooks.remove(self._rank_timing)
            self._rank_timing.timing.write()
            self._rank_timing = None
        if self.tp_workers is not None:
            self.tp_workers.stop()
        failed = self.tp_workers is not None and self.tp_workers.failure is not None
        if self._tp_group is not None:
            if getattr(self, "runner", None) is not None:
                # Before NCCL's teardown (ModelRunner.release_graphs). After a rank's failure a
                # step may still wait on the dead one: its replay is not waited for.
                self.runner.release_graphs(wait=not failed)
            if failed and not self.tp_workers.wait_aborted():
                logger.warning("NCCL's abort after the tensor-parallel failure has not returned; "
                               "leaving its communicators as they are")
                forget_tp()
            else:
                close_tp()
            self._tp_group = None
        if self.tp_workers is not None:
            self.tp_workers.close()
            self.tp_workers = None

    @property
    def has_work(self) -> bool:
        """True while a step would do something or report something."""
        return self.scheduler.has_work or bool(self._pending) or self._inflight is not None

    def add_request(self, token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    session_id: int | None = None, first_turn_ids: list[int] | None = None,
                    priority: int = 0, images: list[ImageInput] | None = None) -> Sequence:
        """Queue a request (or a session's next turn); raises InvalidRequestError on bad input.

        ``first_turn_ids``, when given, replace ``token_ids`` if the session has no history yet
        (the prompt rendered as a conversation's first turn). ``request_id`` must be unique among
        running requests; by default one is made up. Waiting requests of a lower ``priority``
        are admitted first (QoS user groups); running ones are never withdrawn for them.
        ``images``: a vision model's images, each with its span of ``token_ids``
        (``protocol/multimodal.py``; with ``first_turn_ids`` taken, the spans move by the two
        prompts' length difference).
        """
        vocab = self.model_config.vocab_size
        # Every field is checked before anything is touched: a peer stage can send any value
        # the wire types allow, and one that raised later, in a step, would stop the engine.
        validate(params, vocab)
        check_token_ids(token_ids, vocab, "input_ids")
        if first_turn_ids is not None:
            check_token_ids(first_turn_ids, vocab, "first_turn_ids")
        check_int64(session_id, "session_id")
        check_int64(priority, "priority")
        adapter_id = self._adapter_id(params.adapter_name)
        request_id = f"req-{next(self._request_ids)}" if request_id is None else request_id
        if request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        seq = self._sessions.get(session_id) if session_id is not None else None
        if seq is not None and seq.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING):
            raise SessionBusyError(session_id)
        images = list(images or ())
        if first_turn_ids is not None and (seq is None or not seq.token_ids):
            images = shifted(images, len(first_turn_ids) - len(token_ids))
            token_ids = first_turn_ids
        model = self.runner.model
        check_images(images, len(token_ids), getattr(model, "image_token_id", None), token_ids,
                     self.scheduler.max_num_tokens, getattr(model, "image_rows_for", None))
        if not token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
        total = len(token_ids) + (seq.num_tokens if seq is not None else 0)
        if total >= self.session_len:
            raise PromptTooLongError(total, self.session_len)
        if self.block_manager.blocks_needed(total + 1) > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"the prompt needs {self.block_manager.blocks_needed(total + 1)} KV blocks but the cache "
                f"has {self.block_manager.num_blocks}: raise cache_max_entry_count", param="messages")
        if seq is None:
            seq = Sequence(token_ids, params, request_id=request_id, session_id=session_id)
            seq.adapter_id = adapter_id
            if session_id is not None:
                self._sessions[session_id] = seq
        else:
            images = shifted(images, len(seq.token_ids))
            seq.start_turn(token_ids, params, request_id)
            if adapter_id != seq.adapter_id:
                self.block_manager.switch_adapter(seq, adapter_id)
        seq.images.extend(images)
        # The sampler's noise is a function of (seed, tokens generated): see engine/sampler.py.
        seed = params.random_seed
        seq.sampling_seed = (seed if seed is not None else self._seed_source.getrandbits(63)) % (1 << 63)
        if params.guide is not None:
            seq.guide_state = GuideState(self.guides.submit(params.guide), params.stop_token_ids)
            if not seq.admissible:
                self._compiling.append(seq)
        self._seqs[request_id] = seq
        seq.priority = priority
        self.scheduler.add(seq)
        return seq

    def _adapter_id(self, name: str | None) -> int:
        """The id of the LoRA adapter a request names (0: none); UnknownAdapterError if none has it."""
        if name is None:
            return 0
        lora = self.runner.lora
        adapter_id = lora.by_name.get(name) if lora is not None else None
        if adapter_id is None:
            raise UnknownAdapterError(name, self.adapter_names())
        return adapter_id

    def adapter_names(self) -> list[str]:
        """Registered LoRA adapters, in load order."""
        return self.runner.lora.names if self.runner.lora is not None else []

    def load_adapter(self, name: str, path: str) -> None:
        """Read a PEFT LoRA checkpoint and register it under ``name`` (on every rank). Raises
        EngineConfigError when the engine has no LoRA pool, AdapterError when the name is taken or
        the checkpoint does not fit the base model or the pool."""
        lora = self.runner.lora
        if lora is None:
            raise EngineConfigError(
                f"cannot load LoRA adapter {name!r}: this engine was started without a LoRA pool; start it "
                "with adapters={...} or max_loras=N (--adapters / --max-loras) to load adapters at run time")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"adapter name {name!r}: give a non-empty string", param="lora_name")
        self._collect_adapters()
        self.runner.register_adapter(lora.new_id(), name, str(path))
        logger.info("loaded LoRA adapter %r from %s", name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget adapter ``name``: new requests can no longer name it; running ones finish with
        it (its weights go when the last ends). UnknownAdapterError when no adapter has that name."""
        lora = self.runner.lora
        if lora is None or lora.unregister(name) is None:
            raise UnknownAdapterError(name, self.adapter_names(), param="lora_name")
        self._collect_adapters()
        logger.info("unloaded LoRA adapter %r", name)

    def _collect_adapters(self) -> None:
        """Drop the weights of unloaded adapters no unfinished turn runs with (on every rank)."""
        self.runner.forget_adapters(self.runner.lora.unused({seq.adapter_id for seq in self._seqs.values()}))

    def abort(self, request_id: str) -> None:
        """Stop a request now (client gone); it is reported finished with reason ABORT."""
        self._finish_outside(request_id, Finish.ABORT)

    def stop(self, request_id: str) -> None:
        """Stop a request because a stop string appeared in its text."""
        self._finish_outside(request_id, Finish.STOP)

    def _finish_outside(self, request_id: str, reason: Finish) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.finish(seq, reason)
        self._pending.append(StepOutput(request_id, finish_reason=reason, num_cached_tokens=seq.num_cached_tokens))

    def abort_session(self, session_id: int) -> None:
        """Abort a session's running turn, if any; the session and its history stay."""
        seq = self._sessions.get(session_id)
        if seq is not None and self._seqs.get(seq.request_id) is seq:
            self.abort(seq.request_id)

    def end_session(self, session_id: int) -> None:
        """Abort a session's running turn, release its KV blocks and forget its history."""
        self.abort_session(session_id)
        if self._sessions.pop(session_id, None) is not None:
            self.scheduler.end_session(session_id)

    def release_idle_sessions(self, now: float | None = None) -> int:
        """Free the KV blocks of sessions parked longer than ``EngineConfig.session_idle_timeout``
        (``now``: a ``time.monotonic()`` reading, by default the present). A released session
        keeps its history as token ids: its next turn recomputes it, ``end_session`` forgets it.
        Returns how many were released (0 when the timeout is None or 0)."""
        timeout = self.config.session_idle_timeout
        if not timeout:
            return 0
        released = self.scheduler.release_idle(self.scheduler.clock() if now is None else now, timeout)
        if released:
            logger.info("released the KV blocks of %d session(s) idle for %ss or more", released, timeout)
        return released

    def step(self) -> list[StepOutput]:
        """Queue the next step on the device, read back the one before, and report every
        request that moved (see the module docstring for the overlap)."""
        self._check_compiled()
        outputs, self._pending = self._pending, []
        if self._inflight is not None and (not self.overlap or self._needs_token_ids(self._inflight)):
            outputs += self._read_back()
            self._forget_finished()  # reported just now; the sweep below must not see them
        sched = self.scheduler.schedule()
        # A sequence the scheduler dropped because it can never fit in the cache.
        outputs += [StepOutput(s.request_id, finish_reason=s.finish_reason)
                    for s in self._seqs.values() if s.is_finished]
        launched = None
        if sched:
            launched = self.runner.launch(sched, self._inflight, partial(self._after_forward, sched))
            outputs, self._read_early = outputs + self._read_early, []
        elif self._compiling and self._inflight is None:
            self._wait_compiling()  # nothing to run until a grammar is ready: wait, do not spin
        if self._inflight is not None:
            outputs += self._read_back()
        if launched is not None and launched.sampling:
            self._inflight = launched
            if not self.overlap:
                outputs += self._read_back()
        self._forget_finished()
        return outputs

    def _check_compiled(self) -> None:
        """Forget the turns whose grammar is ready; end those whose grammar failed to compile
        (the tokenizer stage parsed it, so this is rare: the model's tokenizer, say)."""
        if not self._compiling:
            return
        still = []
        for seq in self._compiling:
            if not seq.guide_state.ready:
                still.append(seq)
            elif seq.guide_state.error is None:
                continue
            elif seq.guide_state.error is not None and self._seqs.get(seq.request_id) is seq:
                logger.error("request %s: its response format did not compile: %s", seq.request_id,
                             seq.guide_state.error)
                self._finish_outside(seq.request_id, Finish.ERROR)
        self._compiling = still

    def _wait_compiling(self, timeout: float = 0.01) -> None:
        wait([s.guide_state.compiled for s in self._compiling], timeout=timeout, return_when=FIRST_COMPLETED)

    def _after_forward(self, sched: SchedulerOutput, rows: list[Sequence]):
        """Account for the step just queued (``ModelRunner.launch`` calls this once its forward is
        on the device) and, when some row is constrained, return the rows' token mask. A mask must
        follow the step before's tokens, so that step is read back here, while the device runs
        this one's forward; the scheduler has counted this step first, so a turn that the read
        back ends drops this step's token as it would without the overlap."""
        self.scheduler.launched(sched, rows)
        if not any(s.guide_state is not None for s in rows):
            return None
        if self._inflight is not None:
            self._read_early += self._read_back()
        # A row whose turn ended (its token this step is discarded) allows everything.
        states = [None if s.is_finished else s.guide_state for s in rows]
        return fill_token_bitmask(states, self.model_config.vocab_size)

    @staticmethod
    def _needs_token_ids(step: LaunchedStep) -> bool:
        """Whether a sequence of ``step`` reads its own token ids when it samples next."""
        return any(s.params.repetition_penalty != 1.0 or s.params.bad_sequences for s in step.sampling)

    def _read_back(self) -> list[StepOutput]:
        """Wait for the in-flight step's sampled ids, hand them to the scheduler, and report
        them (with the finishes they caused)."""
        step, self._inflight = self._inflight, None
        if self.tp_workers is not None:  # a step waiting on a dead rank never ends: TPWorkers.wait_for
            self.tp_workers.wait_for(step.samples.ready)
        result = step.samples.fetch()
        outputs = []
        for row, (seq, request_id) in enumerate(zip(step.sampling, step.request_ids)):
            if not self.scheduler.awaits(seq, request_id):
                continue  # its turn ended since launch: the token is discarded, not reported
            token = result.token_ids[row]
            guide = seq.guide_state
            if guide is not None and not guide.accept(token):
                # Only a row whose every allowed token was also banned (bad_words) gets here.
                logger.error("request %s: token %d breaks its response format; ending it", request_id, token)
                self.scheduler.resolve(seq, token)
                if not seq.is_finished and seq.status != SequenceStatus.PARKED:
                    self.scheduler.finish(seq, Finish.ERROR)
                outputs.append(StepOutput(request_id, token, seq.finish_reason or Finish.ERROR,
                                          num_cached_tokens=seq.num_cached_tokens))
                continue
            out = StepOutput(request_id, token, self.scheduler.resolve(seq, token),
                             num_cached_tokens=seq.num_cached_tokens)
            if result.logprobs is not None:
                out.logprob, out.top_logprobs = result.logprobs[row], result.top_logprobs[row]
            outputs.append(out)
        self.generated_tokens += len(outputs)  # discarded tokens (after a stop) are not counted
        return outputs

    def _forget_finished(self) -> None:
        for rid in [k for k, s in self._seqs.items() if s.status in (SequenceStatus.FINISHED, SequenceStatus.PARKED)]:
            del self._seqs[rid]

    def get_ppl(self, input_ids: list[list[int]]) -> list[float]:
        """Mean negative log-likelihood of each token sequence (LMDeploy's get_ppl: exp() it for perplexity)."""
        losses = []
        for ids in input_ids:
            if len(ids) < 2:
                raise InvalidRequestError("get_ppl needs at least 2 tokens per sequence", param="input_ids")
            seq = Sequence(ids, SamplingParams(max_new_tokens=1))
            total = 0.0
            try:
                while seq.num_computed_tokens < len(ids) - 1:
                    n = min(len(ids) - 1 - seq.num_computed_tokens, self.config.max_prefill_token_num)
                    if not self.block_manager.allocate(seq, n):
                        raise InvalidRequestError(
                            f"not enough free KV blocks to score {len(ids)} tokens: raise "
                            "cache_max_entry_count or score while the engine is idle", param="input_ids")
                    total += float(self.runner.score_chunk(seq, n))
                    seq.num_computed_tokens += n
            finally:
                self.block_manager.free(seq)
            losses.append(total / (len(ids) - 1))
        return losses

    def stats(self) -> EngineStats:
        """Queue lengths, cache usage and prefix-cache hits, for logs and /metrics."""
        bm = self.block_manager
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), kv_usage=bm.usage,
            num_blocks=bm.num_blocks, free_blocks=bm.num_free_blocks, prefix_hit_tokens=bm.prefix_hit_tokens,
            prefix_query_tokens=bm.prefix_query_tokens, generated_tokens=self.generated_tokens,
            adapters=self.adapter_names())
