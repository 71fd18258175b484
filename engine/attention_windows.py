"""Which decoder layers attend through a sliding window, and how wide, read from ``config.json``.

A window W means the query at position p sees the keys p - W < k <= p (transformers'
``sliding_window_overlay``). Families say it three ways, and this module is the one place that
reads them, for the models (each layer's ``Attention``; the engine then reads the windows back from
the layers it built, and where every layer slides the block manager releases the blocks that have
left the window, through ``common_window``):

- ``layer_types`` (what transformers 5 saves for every family that alternates, and for Qwen2/3):
  ``"sliding_attention"`` layers use ``sliding_window``, the others attend over everything.
- Qwen2/Qwen3 configs without it: ``use_sliding_window`` switches the window on for layers
  ``max_window_layers`` and up (off by default, as in the published Qwen2.5 and Qwen3 configs).
- Gemma 2 / Gemma 3 configs without it: every other layer (Gemma 2: even layers), or all but
  every ``sliding_window_pattern``-th (Gemma 3, pattern 6), as transformers builds them.
- Any other family with ``sliding_window`` set (Mistral v0.1, Phi-3, StarCoder2): every layer.

A window that covers the whole context (``>= max_position_embeddings``) is dropped: it masks
nothing, and the kernels take the cheaper path without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"

# Families whose window is off unless the config switches it on (and then only for upper layers).
_OPT_IN_FAMILIES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# Families whose configs may omit layer_types: the pattern transformers fills in (every n-th is full).
_DEFAULT_PATTERNS = {"gemma2": 2, "gemma3_text": 6, "gemma3": 6, "cohere2": 4}


def layer_types(raw: Mapping[str, Any], num_layers: int) -> list[str]:
    """Each layer's attention type, ``SLIDING`` or ``FULL``, as the config describes it."""
    model_type = raw.get("model_type", "")
    types = raw.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"config.json has {len(types)} layer_types for {num_layers} layers")
        return [SLIDING if t == SLIDING else FULL for t in types]
    if not raw.get("sliding_window"):
        return [FULL] * num_layers
    if model_type in _OPT_IN_FAMILIES:
        if not raw.get("use_sliding_window", False):
            return [FULL] * num_layers
        first = int(raw.get("max_window_layers", 0))
        return [SLIDING if i >= first else FULL for i in range(num_layers)]
    pattern = raw.get("sliding_window_pattern") or _DEFAULT_PATTERNS.get(model_type)
    if pattern:
        return [SLIDING if (i + 1) % int(pattern) else FULL for i in range(num_layers)]
    return [SLIDING] * num_layers


def layer_windows(raw: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window in tokens, None where it attends over the whole context."""
    window = raw.get("sliding_window")
    if not window or int(window) >= int(raw.get("max_position_embeddings") or 0) > 0:
        return (None,) * num_layers
    return tuple(int(window) if t == SLIDING else None for t in layer_types(raw, num_layers))


def common_window(windows: tuple[int | None, ...]) -> int | None:
    """The window every layer slides with (the widest, if they differ), or None when some layer
    attends over everything: then no block may ever be freed for falling out of a window."""
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)
