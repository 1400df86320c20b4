"""Chat templates render as transformers renders them."""

import pytest

from mlx_infer.artifacts.gguf_tokenizer import GEMMA_CHAT_TEMPLATE
from mlx_infer.input.chat_template import ChatTemplateError, render_chat

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name three colours."},
    {"role": "assistant", "content": "Red.  "},
    {"role": "user", "content": "More?"},
]


def test_gemma_fallback_template_renders_gemmas_turn_format():
    text = render_chat(GEMMA_CHAT_TEMPLATE, CONVERSATION, bos_token="<bos>")
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nName three colours.<end_of_turn>\n"
                    "<start_of_turn>model\nRed.<end_of_turn>\n<start_of_turn>user\nMore?<end_of_turn>\n"
                    "<start_of_turn>model\n")


def test_gemma_fallback_template_equals_transformers_rendering():
    """The same conversation through transformers' own renderer and our template string."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[CONVERSATION], chat_template=GEMMA_CHAT_TEMPLATE,
                                        add_generation_prompt=True, bos_token="<bos>")
    assert rendered[0] == render_chat(GEMMA_CHAT_TEMPLATE, CONVERSATION, bos_token="<bos>")


def test_template_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="must alternate"):
        render_chat(GEMMA_CHAT_TEMPLATE, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        render_chat("{% if %}", CONVERSATION)
    with pytest.raises(ChatTemplateError, match="'role'"):
        render_chat(GEMMA_CHAT_TEMPLATE, ["hello"])
