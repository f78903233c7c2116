"""The LFM2 presets' chat template, for `hybrid_serve.make_model.chat_templates` to register as
`lfm2`: the strings of Liquid AI's LFM2 template (`LiquidAI/LFM2-*`), plus the history calls as
Liquid's LFM2.5 template writes them (LFM2's own ignores `tool_calls`):

* ChatML turns (`<|im_start|>ROLE\\n..<|im_end|>\\n`); a system turn only when there is a
  system message or tools: the system message, then (on a new line) the tools as
  `List of tools: <|tool_list_start|>[TOOL, TOOL]<|tool_list_end|>`, each tool as JSON; no
  instruction sentence (the model calls in its own format unasked).
* an assistant turn: its content, then its `tool_calls` as one pythonic block,
  `<|tool_call_start|>[NAME(KEY=VALUE, ...), ...]<|tool_call_end|>`, a string value in single
  quotes as written, a mapping as JSON, any other value as Python prints it (`True`, `None`,
  `[1, 'a']`): LFM2.5's `render_tool_calls`.
* a tool result in its own `tool` turn as `<|tool_response_start|>..<|tool_response_end|>`; no
  thinking; no `bos_token` (the presets' tokenizers have none).

The calls are the `pythonic` format of `server.formats`, which the family row names.
"""

from __future__ import annotations

# One argument value as LFM2.5's template writes it.
_ARG_VALUE = """
{%- macro arg_value(v) -%}
    {%- if v is string -%}{{- "'" + v + "'" -}}
    {%- elif v is mapping -%}{{- v | tojson -}}
    {%- else -%}{{- v | string -}}{%- endif -%}
{%- endmacro -%}"""

_PYTHONIC_CALLS = """
        {%- if m.tool_calls %}
            {%- set calls = namespace(text=[]) %}
            {%- for call in m.tool_calls %}
                {%- set fn = call.function if call.function is defined else call %}
                {%- set args = namespace(text=[]) %}
                {%- for key, value in (fn.arguments if fn.arguments is mapping else {})|items %}
                    {%- set args.text = args.text + [key + '=' + arg_value(value)] %}
                {%- endfor %}
                {%- set calls.text = calls.text + [fn.name + '(' + args.text|join(', ') + ')'] %}
            {%- endfor %}
            {{- '<|tool_call_start|>[' + calls.text|join(', ') + ']<|tool_call_end|>' }}
        {%- endif %}"""


def lfm2() -> str:
    head = (
        "{%- set first_system = messages and messages[0].role == 'system' %}"
        "{%- set ns = namespace(sys=messages[0].content if first_system and "
        "messages[0].content is string else '') %}"
        "{%- if tools %}"
        "{%- set ns.sys = ns.sys + ('\\n' if ns.sys else '') + 'List of tools: "
        "<|tool_list_start|>[' %}"
        "{%- for t in tools %}"
        "{%- set ns.sys = ns.sys + (t if t is string else t | tojson) %}"
        "{%- if not loop.last %}{%- set ns.sys = ns.sys + ', ' %}{%- endif %}"
        "{%- endfor %}"
        "{%- set ns.sys = ns.sys + ']<|tool_list_end|>' %}"
        "{%- endif %}"
        "{%- if ns.sys %}{{- '<|im_start|>system\\n' + ns.sys + '<|im_end|>\\n' }}{%- endif %}"
    )
    body = (
        """
{%- for m in messages %}
    {%- set text = m.content if m.content is string else '' %}
    {%- if m.role == 'system' and loop.first %}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + text }}"""
        + _PYTHONIC_CALLS
        + """
        {{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {{- '<|im_start|>tool\\n<|tool_response_start|>' + text }}
        {{- '<|tool_response_end|><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\\n' + text + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
    )
    return _ARG_VALUE + head + body
