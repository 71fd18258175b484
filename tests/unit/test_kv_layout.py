"""KVCacheLayout's answers to the engine's neutral questions, for each quant_policy, and the
bookkeeping modules that take them staying free of torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conveyor.kernels.kv_layout import CENTRE_TOKENS, KVCacheLayout


def test_an_unquantized_layout_asks_nothing_of_the_scheduler_or_block_manager():
    layout = KVCacheLayout(0, 64)
    assert not layout.centred
    assert layout.min_first_chunk_tokens == 0
    assert layout.reserved_head_blocks(max_batch_size=8) == 0
    assert layout.reserved_head_blocks(max_batch_size=8, num_blocks=100) == 0
    assert layout.centre_table_bytes(layers=30, num_kv_heads=3, max_batch_size=8) == 0
    assert layout.allocate_centres(30, 0, 3, "cpu") is None


@pytest.mark.parametrize("policy", [8, 4])
def test_a_quantized_layout_asks_for_whole_first_chunks_and_head_blocks(policy: int):
    """int8 and int4 both centre keys: a first chunk brings the centre's tokens, and two head
    blocks a sequence of the batch (capped by the cache) have a centre row."""
    layout = KVCacheLayout(policy, 64)
    assert layout.centred
    assert layout.min_first_chunk_tokens == CENTRE_TOKENS == 64
    assert layout.reserved_head_blocks(max_batch_size=8) == 16
    assert layout.reserved_head_blocks(max_batch_size=8, num_blocks=100) == 16
    assert layout.reserved_head_blocks(max_batch_size=8, num_blocks=5) == 5
    # Rows for the 16 head blocks and the zero row, per layer and kv head, each two fp16 vectors.
    assert layout.centre_table_bytes(layers=30, num_kv_heads=3, max_batch_size=8) == 30 * 17 * 3 * 2 * 64 * 2
    table = layout.allocate_centres(30, 5, 3, "cpu")
    assert table.shape == (30, 6, 2, 3, 64) and not table.any()


def test_bookkeeping_modules_import_no_torch():
    """The scheduler and block manager take the layout's answers as ints: importing them pulls
    in neither torch nor Triton (they run in the engine, but their tests need neither)."""
    code = ("import sys, conveyor.engine.scheduler, conveyor.engine.block_manager, conveyor.engine.sequence; "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
