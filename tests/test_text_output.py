"""The one text-output rule (generation/text_output.py) that ``generate`` and the engine share."""

from __future__ import annotations

from mlx_infer.generation.text_output import TextOutput


class HoldingDetokenizer:
    """Holds every token's text until ``flush`` when the token is odd (like an incomplete UTF-8 sequence)."""

    def __init__(self) -> None:
        self.held = ""

    def add(self, token: int) -> str:
        self.held += f"<{token}>"
        if token % 2:
            return ""
        out, self.held = self.held, ""
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def test_held_text_is_released_at_every_ending_but_not_at_eos_token_text():
    out = TextOutput(HoldingDetokenizer())
    assert out.feed(2, None, eos=False) == ("<2>", None)
    assert out.feed(3, None, eos=False) == ("", None)  # held
    # A grammar that completes ends the sequence with "stop" on a normal token: its held text is released.
    assert out.feed(5, "stop", eos=False) == ("<3><5>", "stop")
    out = TextOutput(HoldingDetokenizer())
    out.feed(3, None, eos=False)
    assert out.feed(99, "stop", eos=True) == ("<3>", "stop")  # the end-of-sequence token's own text is dropped
    out = TextOutput(HoldingDetokenizer())
    assert out.feed(7, "length", eos=False) == ("<7>", "length")


def test_stop_strings_end_the_text_and_held_prefixes_come_out_at_the_end():
    out = TextOutput(HoldingDetokenizer(), stop=["<4>"])
    assert out.feed(2, None, eos=False) == ("<2>", None)
    assert out.feed(4, None, eos=False) == ("", "stop")  # the stop string is not shown
    out = TextOutput(HoldingDetokenizer(), stop=["<6><8>"])
    text, reason = out.feed(6, None, eos=False)
    assert (text, reason) == ("", None)  # "<6>" could start the stop string: held back
    assert out.feed(2, "length", eos=False) == ("<6><2>", "length")


def test_a_primed_output_continues_where_it_was():
    a, b = TextOutput(HoldingDetokenizer(), stop=["<2><4>"]), TextOutput(HoldingDetokenizer(), stop=["<2><4>"])
    a.feed(1, None, eos=False)
    a.feed(2, None, eos=False)
    b.prime([1, 2])
    assert a.feed(4, None, eos=False) == b.feed(4, None, eos=False) == ("", "stop")


def test_the_finish_rule_orders_stop_length_cancelled():
    from mlx_infer.generation.text_output import token_finish, token_limit

    assert token_finish(eos=True, complete=False, count=4, limit=4, cancelled=True) == "stop"
    assert token_finish(eos=False, complete=True, count=1, limit=4) == "stop"  # a completed grammar
    assert token_finish(eos=False, complete=False, count=4, limit=4, cancelled=True) == "length"
    assert token_finish(eos=False, complete=False, count=3, limit=4, cancelled=True) == "cancelled"
    assert token_finish(eos=False, complete=False, count=3, limit=4) is None
    assert token_limit(10, 5, None) == 10
    assert token_limit(10, 5, 8) == 4  # the window holds 8: prompt 5 + 3 fed tokens, the 4th is only sampled
    assert token_limit(10, 8, 8) == 1  # a full window still yields the token of the last prompt position
