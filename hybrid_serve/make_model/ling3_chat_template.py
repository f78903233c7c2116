"""Ling-3's chat template, for `hybrid_serve.make_model.chat_templates` to register under
`LING_3` (`ling-3`, the bailing_hybrid row's `chat_template`): Jinja written here that renders
the strings of inclusionAI's Ling-3.0 `chat_template.jinja`. The release file itself was not in
the sources searched; the rules below are those of a published byte-exact port of it (a Kotlin
prompt builder checked against goldens generated with the release template), and the tests
compare this template with strings of those goldens.

* one system turn first, always: `<role>SYSTEM</role>`, then the first message's text when it is
  a system one, then, with tools, the tool block (`# Tools` .. `<tools>`, one JSON line per tool,
  `</tools>` and the XML call instructions), then `detailed thinking on` / `off` (from
  `enable_thinking`, default on) unless the system text already says one of them; a `\\n`
  separates the system text from what follows it; `<|role_end|>` ends every turn;
* user turns `<role>HUMAN</role>TEXT`, later system turns `<role>SYSTEM</role>TEXT`;
* assistant turns `<role>ASSISTANT</role>\\n<think>REASONING</think>TEXT` (the reasoning from
  `reasoning_content`, or split off the text at `</think>`; empty when there is none), then each
  call as `<tool_call>NAME\\n` + per argument `<arg_key>KEY</arg_key>\\n<arg_value>VALUE
  </arg_value>` (strings as written, other values as JSON) + `\\n</tool_call>`, a `\\n` before a
  call that follows text or another call;
* consecutive tool results in one `<role>OBSERVATION</role>` turn, each as
  `\\n<tool_response>\\nTEXT\\n</tool_response>`;
* the generation prompt `<role>ASSISTANT</role>\\n<think>` (thinking on: the output starts inside
  the reasoning) or `<role>ASSISTANT</role>\\n<think></think>` (off).

Content given as a list of parts renders its text parts.
"""

from __future__ import annotations

LING_3 = "ling-3"

_TOOLS_HEAD = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_TAIL = (
    "\\n</tools>\\n\\nIf none of the functions can be used, point it out. If the given question "
    "lacks the parameters required by the function, also point it out.\\nIf you need to use a "
    "function, for each function call, output the function name and arguments within the "
    "following XML format:\\n<tool_call>{function-name}\\n<arg_key>{arg-key-1}</arg_key>\\n"
    "<arg_value>{arg-value-1}</arg_value>\\n<arg_key>{arg-key-2}</arg_key>\\n"
    "<arg_value>{arg-value-2}</arg_value>\\n...\\n</tool_call>\\n"
)


def ling_3() -> str:
    return (
        """
{%- macro text(c) %}
    {%- if c is string %}{{- c }}
    {%- elif c is not none %}
        {%- for part in c %}{%- if part.text is defined %}{{- part.text }}{%- endif %}{%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- set thinking = 'on' if enable_thinking is not defined or enable_thinking else 'off' %}
{%- set first_system = messages and messages[0].role == 'system' %}
{%- set sys = text(messages[0].content) if first_system else '' %}
{%- set flagged = first_system
    and ('detailed thinking on' in sys or 'detailed thinking off' in sys) %}
{{- '<role>SYSTEM</role>' }}
{%- if tools %}
    {%- if first_system %}{{- sys ~ '\\n' }}{%- endif %}
    {{- '"""
        + _TOOLS_HEAD
        + """' }}
    {%- for tool in tools %}{{- '\\n' ~ tool | tojson }}{%- endfor %}
    {{- '"""
        + _TOOLS_TAIL
        + """' }}
    {%- if not flagged %}{{- 'detailed thinking ' ~ thinking }}{%- endif %}
{%- elif first_system %}
    {{- sys }}
    {%- if not flagged %}{{- '\\ndetailed thinking ' ~ thinking }}{%- endif %}
{%- else %}
    {{- 'detailed thinking ' ~ thinking }}
{%- endif %}
{{- '<|role_end|>' }}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {{- '<role>HUMAN</role>' ~ text(m.content) ~ '<|role_end|>' }}
    {%- elif m.role == 'system' %}
        {%- if not loop.first %}
            {{- '<role>SYSTEM</role>' ~ text(m.content) ~ '<|role_end|>' }}
        {%- endif %}
    {%- elif m.role == 'assistant' %}
        {%- set content = text(m.content) %}
        {%- set reasoning = '' %}
        {%- if m.reasoning_content is defined and m.reasoning_content %}
            {%- set reasoning = m.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n') %}
            {%- set reasoning = reasoning.split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if reasoning %}
            {{- '<role>ASSISTANT</role>\\n<think>' ~ reasoning.strip('\\n') ~ '</think>' }}
            {{- content.lstrip('\\n') }}
        {%- else %}
            {{- '<role>ASSISTANT</role>\\n<think></think>' ~ content }}
        {%- endif %}
        {%- if m.tool_calls %}
            {%- for call in m.tool_calls %}
                {%- set fn = call.function if call.function is defined else call %}
                {%- if not loop.first or content %}{{- '\\n' }}{%- endif %}
                {{- '<tool_call>' ~ fn.name ~ '\\n' }}
                {%- for key, value in (fn.arguments or {}) | items %}
                    {{- '<arg_key>' ~ key ~ '</arg_key>\\n<arg_value>' }}
                    {{- value if value is string else value | tojson }}
                    {{- '</arg_value>' }}
                {%- endfor %}
                {{- '\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|role_end|>' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<role>OBSERVATION</role>' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' ~ text(m.content) ~ '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|role_end|>' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<role>ASSISTANT</role>\\n<think>' ~ ('' if thinking == 'on' else '</think>') }}
{%- endif %}"""
    )
