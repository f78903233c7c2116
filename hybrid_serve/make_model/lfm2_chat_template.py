"""The LFM2 presets' chat template, written here in the shape of Liquid AI's LFM2 template (same
roles, tags and tool list; the instruction sentence is our own words), for
`hybrid_serve.make_model.chat_templates` to register as `lfm2`:

ChatML turns (`<|im_start|>ROLE\\n..<|im_end|>\\n`); a system turn only when there is a system
message or tools: the system message, then (on a new line) the tools as
`List of tools: <|tool_list_start|>[TOOL, TOOL]<|tool_list_end|>`; tool results each in their
own `tool` turn as `<|tool_response_start|>..<|tool_response_end|>`; no thinking. The release's
calls are pythonic (`<|tool_call_start|>[f(n=2)]<|tool_call_end|>`), a format `server.formats`
does not parse yet: this template asks for, and writes history calls as, the JSON calls of the
`qwen25` format (`<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>`), which the family
row names.
"""

from __future__ import annotations

from hybrid_serve.make_model.mamba2_chat_templates import JSON_TOOL_CALLS

_JSON_CALL_RULES = (
    "\\nTo call a tool, reply with a JSON object of its name and arguments inside "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n"
    '{\\"name\\": <tool-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
)


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
        "{%- set ns.sys = ns.sys + ']<|tool_list_end|>" + _JSON_CALL_RULES + "' %}"
        "{%- endif %}"
        "{%- if ns.sys %}{{- '<|im_start|>system\\n' + ns.sys + '<|im_end|>\\n' }}{%- endif %}"
    )
    body = (
        """
{%- for m in messages %}
    {%- set text = m.content if m.content is string else '' %}
    {%- if m.role == 'system' and loop.first %}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + text }}
"""
        + JSON_TOOL_CALLS
        + """        {{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {{- '<|im_start|>tool\\n<|tool_response_start|>' + text }}
        {{- '<|tool_response_end|><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\\n' + text + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
    )
    return head + body
