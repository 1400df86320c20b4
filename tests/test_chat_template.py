"""Chat templates render as transformers renders them."""

import pytest

from mlx_infer.input.chat_template import ChatTemplateError, render_chat


# A Gemma-format template to check the renderer against transformers' (a system message is folded
# into the first user turn, as Gemma's own template does). mlx-infer never invents one for a model.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{{ (prefix if loop.first else '') + (m['content'] | trim) + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name three colours."},
    {"role": "assistant", "content": "Red.  "},
    {"role": "user", "content": "More?"},
]


def test_gemma_format_template_renders_gemmas_turn_format():
    text = render_chat(GEMMA_CHAT_TEMPLATE, CONVERSATION, bos_token="<bos>")
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nName three colours.<end_of_turn>\n"
                    "<start_of_turn>model\nRed.<end_of_turn>\n<start_of_turn>user\nMore?<end_of_turn>\n"
                    "<start_of_turn>model\n")


def test_gemma_format_template_equals_transformers_rendering():
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
