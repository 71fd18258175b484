"""Model files against Hugging Face: tiny random checkpoints, paged-cache forward, same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from conveyor.engine.attention_metadata import AttentionMetadata, set_attention_metadata
from conveyor.protocol.errors import UnsupportedModelError
from conveyor.engine.model_config import ModelConfig
from conveyor.engine.model_registry import SUPPORTED_ARCHITECTURES, model_class
from conveyor.engine.model_runner import kv_cache_spec
from conveyor.engine.models import build_model
from conveyor.engine.weight_loader import iter_checkpoint, load_model

TOL = 1e-4
BLOCK_SIZE = 4
TINY = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
)


pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny models: see tests/conftest.py


def _tiny_configs() -> dict[str, object]:
    return {
        "llama": LlamaConfig(**TINY),
        "llama_tied": LlamaConfig(**TINY, tie_word_embeddings=True),
        "llama_llama3_rope": LlamaConfig(**TINY, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        }),
        # Rewritten on disk to the old top-level rope_theta + rope_scaling spelling.
        "llama_old_rope_spelling": LlamaConfig(**TINY, rope_parameters={
            "rope_type": "linear", "rope_theta": 20000.0, "factor": 2.0,
        }),
        "llama_bias_gqa1": LlamaConfig(**{**TINY, "num_key_value_heads": 1}, attention_bias=True, mlp_bias=True),
        "mistral": MistralConfig(**TINY, sliding_window=None),
        "qwen2": Qwen2Config(**TINY),
        # Sliding windows of 6 tokens, which the test prompts cross: Mistral v0.1's on every layer,
        # Qwen2's switched on from layer 1 (use_sliding_window, max_window_layers).
        "mistral_window": MistralConfig(**TINY, sliding_window=6),
        "qwen2_window_upper_layers": Qwen2Config(**TINY, use_sliding_window=True, sliding_window=6,
                                                 max_window_layers=1),
    }


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace HF's tiny init (zero biases, unit norms) with weights that make every term matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)


def save_tiny(config, path: Path, seed: int = 0, **save_kwargs) -> torch.nn.Module:
    """Build a random HF model from ``config``, save it to ``path``, return it (float32, eval)."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomize(hf, seed)
    if config.tie_word_embeddings:
        hf.tie_weights()
    hf.save_pretrained(path, **save_kwargs)
    return hf


class PagedCache:
    """A small paged KV cache plus the bookkeeping a model runner would do, for driving a model."""

    def __init__(self, model: torch.nn.Module, num_blocks: int = 64, seed: int = 0) -> None:
        spec = kv_cache_spec(model.config)  # the runner's geometry (MLA: one latent row, values a view of it)
        lead = (num_blocks, BLOCK_SIZE, spec.num_kv_heads)
        self.device = next(model.parameters()).device
        for attn in model.attention_layers():
            attn.k_cache = torch.zeros((*lead, spec.k_dim), device=self.device)
            attn.v_cache = (attn.k_cache[..., : spec.v_dim] if spec.shares_v
                            else torch.zeros((*lead, spec.v_dim), device=self.device))
        # Hand out blocks in a shuffled order so sequences get non-contiguous blocks.
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.model = model

    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one forward over each sequence's new tokens; return each sequence's logits for them."""
        ids, positions, slots, tables, cu, lens_k = [], [], [], [], [0], []
        for sid, toks in new_tokens.items():
            start = self.lengths.get(sid, 0)
            end = start + len(toks)
            blocks = self.blocks.setdefault(sid, [])
            while len(blocks) * BLOCK_SIZE < end:
                blocks.append(self.free.pop())
            ids += toks
            positions += range(start, end)
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            self.lengths[sid] = end
            tables.append(blocks)
            cu.append(cu[-1] + len(toks))
            lens_k.append(end)
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seqlens_k=torch.tensor(lens_k, dtype=torch.int32, device=dev),
            max_seqlen_q=max(len(t) for t in new_tokens.values()),
            max_seqlen_k=max(lens_k),
        )
        set_attention_metadata(meta)
        try:
            with torch.no_grad():
                hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev))
                logits = self.model.compute_logits(hidden).cpu()
        finally:
            set_attention_metadata(None)
        return {sid: logits[cu[i] : cu[i + 1]] for i, sid in enumerate(new_tokens)}


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """HF's logits for every position of one sequence."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def load_ours(path: Path) -> torch.nn.Module:
    """ModelConfig + build_model + load_weights, float32."""
    model = build_model(ModelConfig.from_pretrained(path), dtype=torch.float32)
    return load_model(model, path)


def random_tokens(n: int, seed: int, vocab: int = TINY["vocab_size"]) -> list[int]:
    """``n`` reproducible random token ids."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Max abs diff below TOL."""
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < TOL, f"max abs diff {diff:.3g}"


@pytest.fixture(scope="module", params=sorted(_tiny_configs()))
def tiny(request, tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(HF reference model loaded back from disk, our model loaded from the same files)."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    save_tiny(_tiny_configs()[name], path)
    if name == "llama_old_rope_spelling":
        cfg = json.loads((path / "config.json").read_text())
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params["rope_theta"]
        cfg["rope_scaling"] = {"type": params["rope_type"], "factor": params["factor"]}
        (path / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, load_ours(path)


# The HF parity checks every family's tests run on (hf, ours): one definition, each family's file
# calls them from its own tests.
def check_prefills(hf, ours, lengths=(5, 13, 30)) -> None:
    """Single-sequence prefills of several lengths, each into fresh non-contiguous blocks."""
    cache = PagedCache(ours)
    for sid, n in enumerate(lengths):
        tokens = random_tokens(n, seed=sid)
        assert_close(cache.step({sid: tokens})[sid], hf_logits(hf, tokens))


def check_two_sequence_batch(hf, ours) -> None:
    """Two sequences flattened into one prefill batch."""
    a, b = random_tokens(11, seed=10), random_tokens(6, seed=11)
    out = PagedCache(ours, seed=1).step({0: a, 1: b})
    assert_close(out[0], hf_logits(hf, a))
    assert_close(out[1], hf_logits(hf, b))


def check_prefill_then_decode(hf, ours) -> None:
    """Prefill, then a batched and a single decode step reading the cached keys."""
    a, b = random_tokens(9, seed=20), random_tokens(4, seed=21)
    cache = PagedCache(ours, seed=2)
    cache.step({0: a[:-2], 1: b[:-1]})
    out_b = cache.step({0: [a[-2]], 1: [b[-1]]})  # batched decode
    out_a = cache.step({0: [a[-1]]})
    assert_close(out_a[0][-1], hf_logits(hf, a)[-1])
    assert_close(out_b[1][-1], hf_logits(hf, b)[-1])


def check_triton_kernels(hf, ours) -> None:
    """The whole model through the Triton kernels: on CPU under Triton's interpreter, or, where
    this process cannot interpret, compiled on a GPU (a float32 copy of the model on CUDA);
    skipped with neither."""
    import copy

    from conveyor.kernels._triton import HAS_TRITON, TRITON_INTERPRETED, set_kernel_mode

    if HAS_TRITON and not TRITON_INTERPRETED and torch.cuda.is_available():
        ours = copy.deepcopy(ours).cuda()
    elif not HAS_TRITON or not TRITON_INTERPRETED:
        pytest.skip("needs Triton's interpreter in this process (CPU tensors) or a GPU")
    set_kernel_mode("triton")
    a = random_tokens(9, seed=40)
    cache = PagedCache(ours, seed=5)
    prefill = cache.step({0: a[:-1]})[0]
    decode = cache.step({0: [a[-1]]})[0]
    ref = hf_logits(hf, a)
    assert_close(prefill, ref[:-1])
    assert_close(decode[-1], ref[-1])


def check_chunked_prefill(hf, ours) -> None:
    """A prefill split in two chunks (the second attends to the cached first)."""
    tokens = random_tokens(14, seed=30)
    cache = PagedCache(ours, seed=4)
    first = cache.step({0: tokens[:6]})[0]
    second = cache.step({0: tokens[6:]})[0]
    assert_close(torch.cat([first, second]), hf_logits(hf, tokens))


def until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def check_greedy_matches_generate(hf, path, eos: int, seeds=(50, 51, 52)) -> None:
    """Greedy decoding through one engine (scheduler, runner, sampler) equals ``generate`` for
    7-token prompts of these seeds, 12 new tokens, compared up to the end token."""
    from tiny_llama import engine, greedy

    eng = engine(path)
    try:
        for seed in seeds:
            prompt = random_tokens(7, seed=seed)
            with torch.no_grad():
                ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
            assert until_eos(greedy(eng, prompt, n=12), eos) == until_eos(ref.tolist(), eos)
    finally:
        eng.close()


def hf_mean_nll(hf, tokens: list[int]) -> float:
    """transformers' mean negative log-likelihood of ``tokens[1:]`` (what ``get_ppl`` returns)."""
    logits = hf_logits(hf, tokens)
    return float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(tokens[1:])))


def check_engine_batch_and_ppl(hf, path, eos: int, new_tokens: int = 8) -> None:
    """One engine with prefix caching and 16-token prefill chunks, as ``pipeline`` runs it, given
    a batch at once: a 20-token prompt (past any test window), a 40-token one (prefilled in three
    chunks) and, once a 16-token prompt has finished, one sharing its first 12 tokens (served from
    the prefix cache). Every greedy token is transformers' argmax after the tokens before it;
    ``get_ppl`` of a 30-token text (two chunks) equals transformers' mean NLL within 1e-4; every
    KV block is free again at the end."""
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.protocol.sampling import SamplingParams

    def assert_greedy(rid: str, prompt: list[int], tokens: list[int]) -> None:
        # Each token must be transformers' argmax after the prompt and the tokens before it (one
        # full forward over them all, so transformers' own cache path is not what is checked);
        # where its best two are within 1e-3 either counts, as float32 sums may order them apart.
        logits = hf_logits(hf, prompt + tokens)[len(prompt) - 1:]
        for i, token in enumerate(tokens):
            best = logits[i].max()
            assert logits[i, token] >= best - 1e-3, f"{rid}: token {i} is {token}, not {int(logits[i].argmax())}"
        assert len(tokens) == new_tokens or tokens[-1] == eos, f"{rid}: ended early"

    def run(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
        for rid, prompt in prompts.items():
            eng.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, temperature=0.0), request_id=rid)
        out: dict[str, list[int]] = {rid: [] for rid in prompts}
        while eng.has_work:
            for o in eng.step():
                if o.token is not None:
                    out[o.request_id].append(o.token)
        return {rid: until_eos(tokens, eos) for rid, tokens in out.items()}

    eng = LLMEngine(path, EngineConfig(device="cpu", dtype="float32", cache_max_entry_count=64, block_size=4,
                                       max_batch_size=4, max_prefill_token_num=16, enable_prefix_caching=True))
    try:
        shared = random_tokens(16, seed=90)
        batch = {"long": random_tokens(20, seed=91), "chunked": random_tokens(40, seed=92), "first": shared}
        got = run(batch)
        hits_before = eng.block_manager.prefix_hit_tokens
        batch["cached"] = shared[:12] + random_tokens(5, seed=93)
        got.update(run({"cached": batch["cached"]}))
        assert eng.block_manager.prefix_hit_tokens - hits_before >= 12, "the shared prefix was not reused"
        for rid, prompt in batch.items():
            assert_greedy(rid, prompt, got[rid])
        text = random_tokens(30, seed=94)
        assert abs(eng.get_ppl([text])[0] - hf_mean_nll(hf, text)) < TOL
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.close()


def test_prefill_matches_hf(tiny) -> None:
    check_prefills(*tiny)


def test_two_sequence_batch_matches_hf(tiny) -> None:
    check_two_sequence_batch(*tiny)


def test_prefill_then_decode_matches_hf(tiny) -> None:
    """Prefill, then batched and single decode steps reading the cached keys."""
    hf, ours = tiny
    a, b = random_tokens(9, seed=20), random_tokens(4, seed=21)
    cache = PagedCache(ours, seed=2)
    cache.step({0: a[:-2], 1: b[:-1]})
    cache.step({0: [a[-2]], 1: [b[-1]]})  # batched decode
    out = cache.step({0: [a[-1]]})
    assert_close(out[0][-1], hf_logits(hf, a)[-1])
    ref_b = hf_logits(hf, b)[-1]
    cache2 = PagedCache(ours, seed=3)
    cache2.step({0: b[:-1]})
    assert_close(cache2.step({0: [b[-1]]})[0][-1], ref_b)


def test_triton_kernels_match_hf(tiny) -> None:
    check_triton_kernels(*tiny)


def test_chunked_prefill_matches_hf(tiny) -> None:
    check_chunked_prefill(*tiny)


@pytest.mark.parametrize("name", ["llama", "mistral_window", "qwen2_window_upper_layers"])
def test_engine_batch_and_ppl_match_hf(name: str, tmp_path: Path) -> None:
    """A batch as pipeline() runs it (prefix cache, chunked prefill, past the window) and get_ppl."""
    hf = save_tiny(_tiny_configs()[name], tmp_path)
    check_engine_batch_and_ppl(hf, tmp_path, eos=-1)


def test_forward_without_kv_cache(tiny) -> None:
    """Before the runner assigns caches (memory profiling), a prefill attends over its own k/v."""
    hf, ours = tiny
    a, b = random_tokens(7, seed=40), random_tokens(5, seed=41)
    layers = ours.attention_layers()
    saved = [(attn.k_cache, attn.v_cache) for attn in layers]
    for attn in layers:
        attn.k_cache = attn.v_cache = None
    meta = AttentionMetadata(
        slot_mapping=torch.arange(12), block_tables=torch.zeros(2, 0, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 7, 12], dtype=torch.int32),
        seqlens_k=torch.tensor([7, 5], dtype=torch.int32), max_seqlen_q=7, max_seqlen_k=7,
    )
    set_attention_metadata(meta)
    try:
        with torch.no_grad():
            logits = ours.compute_logits(ours(torch.tensor(a + b), torch.tensor(list(range(7)) + list(range(5)))))
    finally:
        set_attention_metadata(None)
        for attn, (k, v) in zip(layers, saved, strict=True):
            attn.k_cache, attn.v_cache = k, v
    assert_close(logits[:7], hf_logits(hf, a))
    assert_close(logits[7:], hf_logits(hf, b))


# ---- InternLM2: HF Llama weights repacked into InternLM2's names and packed wqkv ----------------


def pack_internlm2(state: dict[str, torch.Tensor], heads: int, kv_heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Rename a HF Llama state dict to InternLM2's and interleave q/k/v per kv head into wqkv."""
    renames = {
        "model.embed_tokens.": "model.tok_embeddings.", ".self_attn.o_proj.": ".attention.wo.",
        ".mlp.gate_proj.": ".feed_forward.w1.", ".mlp.up_proj.": ".feed_forward.w3.",
        ".mlp.down_proj.": ".feed_forward.w2.", ".input_layernorm.": ".attention_norm.",
        ".post_attention_layernorm.": ".ffn_norm.", "lm_head.": "output.",
    }
    group = heads // kv_heads
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".self_attn.q_proj." in name:
            k = state[name.replace("q_proj", "k_proj")]
            v = state[name.replace("q_proj", "v_proj")]
            rest = tensor.shape[1:]
            q_blocks = tensor.reshape(kv_heads, group, head_dim, *rest)
            packed = torch.cat(
                [q_blocks, k.reshape(kv_heads, 1, head_dim, *rest), v.reshape(kv_heads, 1, head_dim, *rest)], dim=1
            )
            out[name.replace(".self_attn.q_proj.", ".attention.wqkv.")] = packed.reshape(-1, *rest).contiguous()
            continue
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        for old, new in renames.items():
            name = name.replace(old, new)
        out[name] = tensor.contiguous()
    return out


@pytest.mark.parametrize("kv_heads,bias", [(2, False), (1, True)])
def test_internlm2_matches_hf_llama(tmp_path: Path, kv_heads: int, bias: bool) -> None:
    """A Llama repacked as InternLM2 (names, packed wqkv, bias flag) gives Llama's logits."""
    config = LlamaConfig(**{**TINY, "num_key_value_heads": kv_heads}, attention_bias=bias,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    hf = save_tiny(config, tmp_path / "llama", seed=5)
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    state = pack_internlm2(hf.state_dict(), TINY["num_attention_heads"], kv_heads, head_dim)
    target = tmp_path / "internlm2"
    target.mkdir()
    save_file(state, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({
        "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "bias": bias,
        "hidden_size": TINY["hidden_size"], "intermediate_size": TINY["intermediate_size"],
        "num_hidden_layers": TINY["num_hidden_layers"], "num_attention_heads": TINY["num_attention_heads"],
        "num_key_value_heads": kv_heads, "vocab_size": TINY["vocab_size"], "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": TINY["max_position_embeddings"],
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }))
    ours = load_ours(target)
    tokens = random_tokens(17, seed=50)
    cache = PagedCache(ours)
    prefill = cache.step({0: tokens[:-1]})[0]
    decode = cache.step({0: tokens[-1:]})[0]
    assert_close(torch.cat([prefill, decode]), hf_logits(hf, tokens))


# ---- checkpoint formats and errors ------------------------------------------------------------


@pytest.mark.parametrize("save_kwargs", [
    {"max_shard_size": "40KB"},
    {"safe_serialization": False},
    {"safe_serialization": False, "max_shard_size": "40KB"},
], ids=["sharded_safetensors", "bin", "sharded_bin"])
def test_checkpoint_formats_load(tmp_path: Path, save_kwargs: dict) -> None:
    """Sharded safetensors and (sharded) pytorch_model.bin checkpoints load."""
    hf = save_tiny(LlamaConfig(**TINY), tmp_path, seed=6, **save_kwargs)
    files = sorted(p.name for p in tmp_path.iterdir())
    if "max_shard_size" in save_kwargs:
        assert any(name.endswith(".index.json") for name in files), files
    ours = load_ours(tmp_path)
    tokens = random_tokens(10, seed=60)
    assert_close(PagedCache(ours).step({0: tokens})[0], hf_logits(hf, tokens))


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    """An unknown architecture raises UnsupportedModelError naming the supported ones."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_pretrained(tmp_path)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


def test_every_registered_architecture_names_its_class() -> None:
    """The registry's lazy entries resolve to the class of the same name."""
    for arch in SUPPORTED_ARCHITECTURES:
        assert model_class(arch).__name__ == arch
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        model_class("GPT2LMHeadModel")


def test_reading_a_config_imports_no_model_code(tmp_path: Path) -> None:
    """ModelConfig needs only the registry's names: no model file, layer or kernel is imported
    (the dependency runs one way, models -> model_config)."""
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps({**TINY, "architectures": ["LlamaForCausalLM"]}))
    code = ("import sys; from conveyor.engine.model_config import ModelConfig; "
            f"assert ModelConfig.from_pretrained({str(tmp_path)!r}).architecture == 'LlamaForCausalLM'; "
            "print(sorted(m for m in sys.modules if m.startswith(('conveyor.engine.models', "
            "'conveyor.engine.layers', 'conveyor.kernels', 'triton'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_missing_parameter_is_named(tmp_path: Path) -> None:
    """A missing fused shard is reported by parameter name and shard id."""
    save_tiny(LlamaConfig(**TINY), tmp_path)
    model = build_model(ModelConfig.from_pretrained(tmp_path), dtype=torch.float32)
    weights = ((n, t) for n, t in iter_checkpoint(tmp_path) if n != "model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        model.load_weights(weights)


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    """A checkpoint tensor the model has no parameter for is reported."""
    save_tiny(LlamaConfig(**TINY), tmp_path)
    model = build_model(ModelConfig.from_pretrained(tmp_path), dtype=torch.float32)
    weights = [*iter_checkpoint(tmp_path), ("model.layers.0.self_attn.o_proj.bias", torch.zeros(64))]
    with pytest.raises(UnsupportedModelError, match=r"unexpected.*o_proj\.bias"):
        model.load_weights(weights)


def test_absent_lm_head_falls_back_to_embedding(tmp_path: Path) -> None:
    """An untied config whose checkpoint lacks lm_head uses the embedding."""
    hf = save_tiny(LlamaConfig(**TINY), tmp_path, seed=7)
    model = build_model(ModelConfig.from_pretrained(tmp_path), dtype=torch.float32)
    model.load_weights((n, t) for n, t in iter_checkpoint(tmp_path) if n != "lm_head.weight")
    assert torch.equal(model.lm_head.weight, hf.model.embed_tokens.weight)


def test_tied_model_shares_embedding(tmp_path: Path) -> None:
    """tie_word_embeddings makes lm_head the embedding's Parameter."""
    save_tiny(LlamaConfig(**TINY, tie_word_embeddings=True), tmp_path)
    model = load_ours(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_build_model_dtype_and_interface(tmp_path: Path) -> None:
    """build_model honours dtype, restores the default dtype, exposes the runner interface."""
    save_tiny(LlamaConfig(**TINY), tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    model = build_model(config, dtype=torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32  # restored
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())
    layers = model.attention_layers()
    assert len(layers) == TINY["num_hidden_layers"] and layers[0] is model.model.layers[0].self_attn.attn
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope.cos_sin_cache.dtype == torch.float32
    dynamic = build_model(config, dtype=torch.float32, rope_scaling_factor=2.0)
    assert dynamic.model.layers[0].self_attn.rotary_emb.rope_scaling == {"rope_type": "dynamic", "factor": 2.0}


@pytest.mark.parametrize("overlap", [True, False])
def test_min_new_tokens_counts_the_tokens_generated_before_the_one_sampled(tmp_path: Path, overlap: bool) -> None:
    """min_new_tokens=1 bans a stop token as the first token: the engine passes the sampler the
    count before the step's own pending token (it passed one more, so the ban never applied)."""
    from conveyor.protocol.sampling import SamplingParams
    from tiny_llama import engine, greedy, random_tensors, write_checkpoint

    common, linears = random_tensors(torch.Generator().manual_seed(3))
    eng = engine(write_checkpoint(tmp_path / "m", {**common, **{f"{k}.weight": v for k, v in linears.items()}}))
    try:
        eng.overlap = overlap
        first = greedy(eng, [1, 5, 9], 3)[0]
        eng.add_request([1, 5, 9], SamplingParams(max_new_tokens=3, temperature=0.0, min_new_tokens=1,
                                                  stop_token_ids=[first]))
        out = []
        while eng.has_work:
            out += [o.token for o in eng.step() if o.token is not None]
        assert out and out[0] != first
    finally:
        eng.close()
