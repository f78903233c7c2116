"""Chat templates of the preset checkpoints: Jinja written here that renders the same strings as
the real Qwen3-Next Instruct / Thinking and Qwen3.5 templates, so the tests see what real
checkpoints are sent and answer.

* ``qwen3-next-instruct`` (Qwen3-Next-80B-A3B-Instruct, Qwen3 2507 style): tools as JSON lines
  in a system turn, calls as ``<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>``,
  tool results as ``<tool_response>`` blocks in one user turn; no thinking.
* ``qwen3-next-thinking`` (Qwen3-Next-80B-A3B-Thinking): the same tools; the generation prompt
  always opens ``<think>\\n``, and assistant turns after the last user query carry their
  reasoning as ``<think>\\n..\\n</think>\\n\\n``.
* ``qwen3.5`` / ``qwen3.5-small`` (Qwen3.5 4B and larger / 2B and smaller): tools as JSON lines
  with the XML call format (``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n
  </parameter>\\n</function>\\n</tool_call>``); ``enable_thinking`` picks ``<think>\\n`` or an
  empty ``<think>\\n\\n</think>\\n\\n`` in the generation prompt (default on, resp. off).
* ``nemotron-3-nano``, ``granite-4.0`` (Nemotron-3-Nano, Granite 4.0): in
  ``hybrid_serve/make_model/mamba2_chat_templates.py``.
* ``lfm2`` (LFM2): in ``hybrid_serve/make_model/lfm2_chat_template.py``.
* ``kimi-linear`` (Kimi-Linear, Kimi K2 Instruct): in
  ``hybrid_serve/make_model/kimi_chat_template.py``.
* ``ling-3`` (Ling-3): in ``hybrid_serve/make_model/ling3_chat_template.py``.

`TEMPLATE_TOKENS` names, per template, the tokens its tokenizer keeps whole and its end-of-turn
token (the Qwen templates: ChatML's, which every preset tokenizer has; their think and tool tags
stay plain text, as the presets always had them; the LFM2 and Kimi tool tags are single tokens
but not special, so they stay in the output text the parsers read).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_serve.make_model.kimi_chat_template import KIMI_LINEAR, kimi_linear
from hybrid_serve.make_model.lfm2_chat_template import lfm2
from hybrid_serve.make_model.ling3_chat_template import LING_3, ling_3
from hybrid_serve.make_model.mamba2_chat_templates import granite_4, nemotron_3
from hybrid_serve.models.families import family_of_type

_JSON_TOOLS_INTRO = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_JSON_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
    "<|im_end|>\\n"
)
_XML_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with "
    "NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n"
    "<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n"
    "<parameter=example_parameter_2>\\nThis is the value for the second parameter\\n"
    "that can span\\nmultiple lines\\n</parameter>\\n</function>\\n</tool_call>\\n\\n"
    "<IMPORTANT>\\nReminder:\\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\\n"
    "- Required parameters MUST be specified\\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\\n- If there is "
    "no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\\n</IMPORTANT>"
)


# The index of the last real user query (a user turn that is not only a tool response): the
# thinking templates keep reasoning only on assistant turns after it. Qwen3.5 trims the content
# before the test, Qwen3-Next does not.
def _last_query(trim: bool) -> str:
    body = "(m.content if m.content is string else '')" + ("|trim" if trim else "")
    return (
        """
{%- set q = namespace(open=true, at=messages|length - 1) %}
{%- for m in messages|reverse %}
    {%- set body = """
        + body
        + """ %}
    {%- if q.open and m.role == 'user'
        and not (body.startswith('<tool_response>') and body.endswith('</tool_response>')) %}
        {%- set q.open = false %}
        {%- set q.at = messages|length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}"""
    )


# Reasoning of an assistant turn: its reasoning_content, or what its content holds in <think>.
_SPLIT_REASONING = """
        {%- set thought = '' %}
        {%- if m.reasoning_content is string %}
            {%- set thought = m.reasoning_content %}
        {%- elif '</think>' in text %}
            {%- set thought = text.split('</think>')[0].rstrip('\\n').split('<think>')[-1]
                .lstrip('\\n') %}
            {%- set text = text.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}"""

_TOOL_RESULTS = """
    {%- elif m.role == 'tool' %}
        {%- if OPEN_TOOL_TURN %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + text + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"""


def _qwen3_next(thinking: bool) -> str:
    head = (
        "{%- if tools %}{{- '<|im_start|>system\\n' }}"
        "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
        "{{- '" + _JSON_TOOLS_INTRO + "' }}"
        "{%- for t in tools %}{{- '\\n' }}{{- t | tojson }}{%- endfor %}"
        "{{- '" + _JSON_TOOLS_OUTRO + "' }}"
        "{%- elif messages[0].role == 'system' %}"
        "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
        "{%- endif %}"
    )
    if thinking:
        opening = """
        {%- if loop.index0 > q.at and (loop.last or thought) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n'
                + text.lstrip('\\n') }}
        {%- else %}{{- '<|im_start|>assistant\\n' + text }}{%- endif %}"""
        assistant = _SPLIT_REASONING + opening
    else:
        assistant = "{{- '<|im_start|>assistant\\n' + text }}"
    body = (
        _last_query(trim=False)
        + """
{%- for m in messages %}
    {%- set text = m.content if m.content is string else '' %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\\n' + text + '<|im_end|>\\n' }}
    {%- elif m.role == 'assistant' %}"""
        + assistant
        + """
        {%- for call in m.tool_calls or [] %}
            {%- if text or not loop.first %}{{- '\\n' }}{%- endif %}
            {%- set fn = call.function if call.function else call %}
            {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}"""
        + _TOOL_RESULTS.replace(
            "OPEN_TOOL_TURN", "loop.first or messages[loop.index0 - 1].role != 'tool'"
        )
        + """
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n"""
        + ("<think>\\n" if thinking else "")
        + "' }}{%- endif %}"
    )
    return head + body


def _qwen3_5(thinking_default: bool) -> str:
    head = (
        "{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}"
        "{%- set sys = (messages[0].content if messages[0].content is string else '')|trim %}"
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:"
        "\\n\\n<tools>' }}"
        "{%- for t in tools %}{{- '\\n' }}{{- t | tojson }}{%- endfor %}"
        "{{- '" + _XML_TOOLS_OUTRO + "' }}"
        "{%- if messages[0].role == 'system' and sys %}{{- '\\n\\n' + sys }}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- elif messages[0].role == 'system' %}"
        "{{- '<|im_start|>system\\n' + sys + '<|im_end|>\\n' }}"
        "{%- endif %}"
    )
    if thinking_default:
        prompt_end = (
            "{%- if enable_thinking is defined and enable_thinking is false %}"
            "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
        )
    else:
        prompt_end = (
            "{%- if enable_thinking is defined and enable_thinking is true %}"
            "{{- '<think>\\n' }}{%- else %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
        )
    body = (
        _last_query(trim=True)
        + """
{%- if q.open %}{{- raise_exception('No user query found in messages.') }}{%- endif %}
{%- for m in messages %}
    {%- set text = (m.content if m.content is string else '')|trim %}
    {%- if m.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif m.role == 'user' %}
        {{- '<|im_start|>user\\n' + text + '<|im_end|>\\n' }}
    {%- elif m.role == 'assistant' %}"""
        + _SPLIT_REASONING
        + """
        {%- if loop.index0 > q.at %}
            {{- '<|im_start|>assistant\\n<think>\\n' + thought|trim + '\\n</think>\\n\\n' + text }}
        {%- else %}{{- '<|im_start|>assistant\\n' + text }}{%- endif %}
        {%- for call in m.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if not loop.first %}{{- '\\n' }}
            {%- elif text|trim %}{{- '\\n\\n' }}{%- endif %}
            {{- '<tool_call>\\n<function=' + fn.name + '>\\n' }}
            {%- if fn.arguments is defined %}
                {%- for key, value in fn.arguments|items %}
                    {{- '<parameter=' + key + '>\\n' }}
                    {%- if value is mapping or (value is sequence and value is not string) %}
                        {{- value | tojson | safe }}
                    {%- else %}{{- value | string }}{%- endif %}
                    {{- '\\n</parameter>\\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}"""
        + _TOOL_RESULTS.replace("OPEN_TOOL_TURN", "loop.previtem and loop.previtem.role != 'tool'")
        + """
    {%- else %}{{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"""
        + prompt_end
        + "{%- endif %}"
    )
    return head + body


@dataclass(frozen=True)
class TemplateTokens:
    """The tokens a template writes that its tokenizer keeps whole, besides ChatML's three
    (`make_model/tokenizer_builder.py`): `special` ones (roles, end of text: dropped from output
    text with `skip_special_tokens`) and `tags` (think and tool tags: kept in the text the
    output parsers read). `eos` ends an assistant turn: the checkpoint's stop token."""

    special: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    eos: str = "<|im_end|>"


_TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TEMPLATE_TOKENS: dict[str, TemplateTokens] = {
    "nemotron-3-nano": TemplateTokens(tags=("<think>", "</think>", *_TOOL_TAGS)),
    "granite-4.0": TemplateTokens(
        special=("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"),
        tags=_TOOL_TAGS,
        eos="<|end_of_text|>",
    ),
    "lfm2": TemplateTokens(
        special=(
            "<|tool_list_start|>",
            "<|tool_list_end|>",
            "<|tool_response_start|>",
            "<|tool_response_end|>",
        ),
        tags=("<|tool_call_start|>", "<|tool_call_end|>"),
    ),
    KIMI_LINEAR: TemplateTokens(
        special=("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"),
        tags=(
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
    ),
    LING_3: TemplateTokens(
        special=("<role>", "</role>", "<|role_end|>"),
        tags=("<think>", "</think>", *_TOOL_TAGS, "<arg_key>", "</arg_key>")
        + ("<arg_value>", "</arg_value>"),
        eos="<|role_end|>",
    ),
}


TEMPLATES: dict[str, str] = {
    "qwen3-next-instruct": _qwen3_next(thinking=False),
    "qwen3-next-thinking": _qwen3_next(thinking=True),
    "qwen3.5": _qwen3_5(thinking_default=True),
    "qwen3.5-small": _qwen3_5(thinking_default=False),
    "nemotron-3-nano": nemotron_3(),
    "granite-4.0": granite_4(),
    "lfm2": lfm2(),
    KIMI_LINEAR: kimi_linear(),
    LING_3: ling_3(),
}
# The families' own templates (the others: Qwen3-Next Instruct, ChatML; Bamba ships none)


def template_name(model_type: str, name: str | None = None) -> str:
    """`name` (one of TEMPLATES), or the default of `model_type`'s family (its row's
    `chat_template` in `models.families`)."""
    if name is None:
        name = family_of_type(model_type).chat_template
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(TEMPLATES)}")
    return name


def tokens_for(name: str) -> TemplateTokens:
    """The tokens template `name` needs whole (none beyond ChatML's for the Qwen templates)."""
    return TEMPLATE_TOKENS.get(name, TemplateTokens())
