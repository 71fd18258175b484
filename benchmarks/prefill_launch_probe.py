"""Where a lone 2048-token prefill's first-token time goes: host launches vs GPU execution.

Runs the Llama-2-7B shape (dummy weights) through ``LLMEngine.step`` 8 times and prints, per
run: total time to the first token, how long the first ``step()`` took to return (the host
launching the forward), when the GPU started the step and how long its span lasted (CUDA
events). With ``sleep`` the stream is held ~60 ms before each run, so the whole forward is
queued before the GPU starts it: the span is then the GPU's own time, and the difference from a
live run is the time the GPU waited for the host's launches. Then one more prefill is launched
under cProfile (the GPU held busy) to show where the host's launch time goes.

    python -m benchmarks.prefill_launch_probe [sleep]
"""

import cProfile
import io
import pstats
import random
import statistics
import sys
import time

import torch

from benchmarks.common import StepTimer, dummy_engine, random_prompt
from conveyor.protocol.sampling import SamplingParams


def main() -> None:
    hold = len(sys.argv) > 1 and sys.argv[1] == "sleep"
    engine = dummy_engine("llama2-7b", "float16")
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_new_tokens=1, temperature=0.0, top_k=1, ignore_eos=True)
    rng = random.Random(0)
    rows = []
    for _ in range(8):
        prompt = random_prompt(rng, 2048, vocab)
        torch.cuda.synchronize()
        timer = StepTimer().attach(engine)
        e0 = torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        if hold:
            torch.cuda._sleep(int(60e-3 * 1.98e9))  # ~60 ms at the H100's max clock
        engine.add_request(prompt, params)
        first_return = t_token = None
        while engine.has_work:
            outs = engine.step()
            first_return = first_return or time.perf_counter()
            if outs:
                t_token = time.perf_counter()
        torch.cuda.synchronize()
        timer.detach(engine)
        start, end = timer.spans[0]
        rows.append({"total_ms": (t_token - t0) * 1e3, "launch_ms": (first_return - t0) * 1e3,
                     "gpu_start_ms": e0.elapsed_time(start), "gpu_span_ms": start.elapsed_time(end)})
        print({k: round(v, 2) for k, v in rows[-1].items()}, flush=True)
    print("median of runs 3-8:", {k: round(statistics.median(r[k] for r in rows[2:]), 2) for k in rows[0]})

    torch.cuda.synchronize()
    torch.cuda._sleep(int(200e-3 * 1.98e9))  # keep the GPU busy: the host is measured alone
    engine.add_request(random_prompt(rng, 2048, vocab), params)
    prof = cProfile.Profile()
    prof.enable()
    t = time.perf_counter()
    engine.step()
    print(f"launch under cProfile: {(time.perf_counter() - t) * 1e3:.1f} ms")
    prof.disable()
    while engine.has_work:
        engine.step()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())


if __name__ == "__main__":
    main()
