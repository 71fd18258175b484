"""The engine's side of images, without a model: span checks, chunks that never end inside an
image's span, prefix-cache keys that tell images apart, and the step's map of encoder rows."""

from __future__ import annotations

import numpy as np
import pytest

from conveyor.engine.block_manager import BlockManager
from conveyor.engine.multimodal import block_images, check_images, image_rows, shifted, whole_image_chunk
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.sequence import Sequence
from conveyor.protocol import InvalidRequestError, SamplingParams
from conveyor.protocol.multimodal import ImageInput

IMG = 99  # the image token


def _image(offset: int, length: int, digest: str = "d", shape=(3, 2, 2)) -> ImageInput:
    pixels = np.zeros(shape, dtype=np.float32)
    return ImageInput(offset, length, digest, pixels.tobytes(), list(shape))


def _ids(n: int, spans: list[tuple[int, int]]) -> list[int]:
    ids = [1 + i % 50 for i in range(n)]
    for offset, length in spans:
        ids[offset:offset + length] = [IMG] * length
    return ids


def test_check_images_accepts_good_spans_and_names_each_fault() -> None:
    ids = _ids(20, [(2, 5), (10, 4)])
    check_images([_image(2, 5), _image(10, 4)], 20, IMG, ids, max_span=8)
    faults = {
        "outside": [_image(18, 5)],
        "overlaps": [_image(2, 5), _image(4, 3)],
        "more than one step": [_image(2, 5)],  # max_span 4 below
        "other than the image token": [_image(1, 5)],
        "pixels": [ImageInput(2, 5, "d", b"\0" * 7, [3, 2, 2])],
        "takes no images": [_image(2, 5)],
    }
    for words, images in faults.items():
        with pytest.raises(InvalidRequestError, match=words):
            check_images(images, 20, None if words == "takes no images" else IMG, ids,
                         max_span=4 if words == "more than one step" else 8)


def test_a_chunk_never_ends_inside_a_span() -> None:
    images = [_image(10, 6)]
    assert whole_image_chunk(images, 0, 8) == 8  # ends before the span
    assert whole_image_chunk(images, 0, 12) == 10  # would cut it: stops before it
    assert whole_image_chunk(images, 0, 16) == 16  # covers it whole
    assert whole_image_chunk(images, 10, 2) == 6  # starts at it: carried to its end
    assert whole_image_chunk(images, 12, 1) == 4  # starts inside it (a prefix hit ended there)
    assert whole_image_chunk(images, 16, 3) == 3


def test_image_rows_map_inputs_to_encoder_rows() -> None:
    images = [_image(2, 4), _image(8, 3)]
    assert image_rows(images, 0, 12, first_row=5) == [(7, 0, 0, 4), (13, 1, 0, 3)]
    assert image_rows(images, 4, 6, first_row=0) == [(0, 0, 2, 2), (4, 1, 0, 2)]
    assert shifted(images, 3)[1].offset == 11


def test_block_keys_tell_images_apart() -> None:
    images = [_image(4, 4, "a")]
    assert block_images(images, 0, 4) == ()
    assert block_images(images, 4, 8) == ("a",)
    assert block_images(images, 6, 10) == ("a",)


def _engine_parts(prefix_caching: bool = True, max_tokens: int = 64):
    bm = BlockManager(64, 4, enable_prefix_caching=prefix_caching)
    return bm, Scheduler(bm, max_batch_size=8, max_num_tokens=max_tokens, session_len=1024)


def _seq(ids: list[int], images: list[ImageInput]) -> Sequence:
    seq = Sequence(ids, SamplingParams(max_new_tokens=2))
    seq.images = images
    return seq


def _prefill(bm: BlockManager, sched: Scheduler, seq: Sequence) -> list[int]:
    """Schedule until the prompt is computed; the chunk sizes."""
    sched.add(seq)
    sizes = []
    while seq.num_computed_tokens < len(seq.token_ids):
        out = sched.schedule()
        item = next(i for i in out.scheduled if i.seq is seq)
        sizes.append(item.num_new_tokens)
        sched.launched(out, [])
    return sizes


def test_the_same_ids_with_another_image_miss_the_prefix_cache() -> None:
    bm, sched = _engine_parts()
    ids = _ids(24, [(4, 8)])
    first = _seq(ids, [_image(4, 8, "cat")])
    _prefill(bm, sched, first)
    assert bm.find_prefix(ids, count=False, images=[_image(4, 8, "cat")]).num_tokens == 20
    assert bm.find_prefix(ids, count=False, images=[_image(4, 8, "dog")]).num_tokens == 4  # the block before it
    assert bm.find_prefix(ids, count=False).num_tokens == 4


def test_the_scheduler_keeps_each_span_in_one_chunk() -> None:
    bm, sched = _engine_parts(prefix_caching=False, max_tokens=10)
    ids = _ids(30, [(6, 8), (20, 6)])
    seq = _seq(ids, [_image(6, 8), _image(20, 6)])
    sizes = _prefill(bm, sched, seq)
    ends = np.cumsum(sizes).tolist()
    for end in ends:
        assert not any(o < end < o + n for o, n in ((6, 8), (20, 6))), (sizes, ends)
    assert ends[-1] == 30


def test_an_image_the_tower_cannot_take_is_refused_before_any_step() -> None:
    """A peer stage's image whose shape or grid does not fit the model's tower, or gives another
    row count than its span, is a 400 at admission (the model's ``image_rows_for``)."""
    def rows_for(shape: list[int], grid: list[int]) -> int:
        if shape != [4]:
            raise ValueError("takes [4] pixels")
        return grid[0]

    ids = [1, 2] + [IMG] * 5 + [3]
    good = ImageInput(2, 5, "a", np.zeros(4, dtype=np.float32).tobytes(), [4], grid=[5])
    check_images([good], len(ids), IMG, ids, max_span=8, rows_for=rows_for)
    wrong_shape = ImageInput(2, 5, "a", np.zeros(2, dtype=np.float32).tobytes(), [2], grid=[5])
    with pytest.raises(InvalidRequestError, match=r"does not fit this model's vision tower: takes \[4\] pixels"):
        check_images([wrong_shape], len(ids), IMG, ids, max_span=8, rows_for=rows_for)
    wrong_rows = ImageInput(2, 5, "a", np.zeros(4, dtype=np.float32).tobytes(), [4], grid=[3])
    with pytest.raises(InvalidRequestError, match="gives 3 encoder rows but its span is 5 tokens"):
        check_images([wrong_rows], len(ids), IMG, ids, max_span=8, rows_for=rows_for)
