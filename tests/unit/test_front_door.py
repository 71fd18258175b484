"""What a new user meets first in Python: a readable Response, a light client import."""

from __future__ import annotations

from conveyor import Response


def test_print_of_a_response_shows_the_text_and_counts_not_every_id() -> None:
    r = Response("Paris is the capital.", 120, 30, 0, "stop", list(range(120)), [{1: -0.5}] * 120)
    text = repr([r])
    assert "text='Paris is the capital.'" in text and "generate_token_len=120" in text
    assert "finish_reason='stop'" in text and "token_ids=<120 ids>" in text and "logprobs=<120 tokens>" in text
    assert len(text) < 300  # the dataclass repr listed all 120 ids and 120 dicts
    assert str(r) == repr(r)
