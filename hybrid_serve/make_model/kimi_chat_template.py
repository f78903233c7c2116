"""Kimi's chat template, for `hybrid_serve.make_model.chat_templates` to register under
`KIMI_LINEAR` (`kimi-linear`, the name a Kimi family row gives as its `chat_template`): Jinja
written here that renders the strings of Moonshot's Kimi K2 Instruct template (as shipped with
`moonshotai/Kimi-K2-Instruct-0905`), whose turns, tool declaration and tool-call section the
Kimi-Linear Instruct release uses (`<|im_user|>`, `<|im_assistant|>`, `<|im_system|>`,
`<|im_middle|>`; SGLang's `kimi_k2` parser):

* the tools first, when given: `<|im_system|>tool_declare<|im_middle|>\\n  # Tools\\n  TOOLS
  <|im_end|>` (TOOLS the list as JSON);
* a default system turn (`You are Kimi, an AI assistant created by Moonshot AI.`) unless the
  first message is a system one;
* each message as `<|im_ROLE|>NAME<|im_middle|>TEXT<|im_end|>`, ROLE `user`, `assistant` or
  `system` (tool results and any other role), NAME the message's `name` or its role; the last
  message keeps its turn open unless a generation prompt follows;
* an assistant's calls after its content: `<|tool_calls_section_begin|>`, per call
  `<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>` (ID the call's `id`,
  `functions.NAME:N` as the server gives them; ARGS as JSON), `<|tool_calls_section_end|>`;
* a tool result as `## Return of ID\\n    TEXT`;
* the generation prompt `<|im_assistant|>assistant<|im_middle|>`; no thinking.

Content given as a list of parts renders its text parts (the release also writes an image
placeholder, which no model here reads).
"""

from __future__ import annotations

KIMI_LINEAR = "kimi-linear"
KIMI_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."


def kimi_linear() -> str:
    return (
        """
{%- if tools %}
    {{- '<|im_system|>tool_declare<|im_middle|>\\n  # Tools\\n  ' ~ tools | tojson ~ '<|im_end|>' }}
{%- endif %}
{%- for m in messages %}
    {%- if loop.first and m.role != 'system' %}
        {{- '<|im_system|>system<|im_middle|>"""
        + KIMI_DEFAULT_SYSTEM
        + """<|im_end|>' }}
    {%- endif %}
    {%- set who = m.get('name') or m.role %}
    {%- if m.role == 'user' %}{{- '<|im_user|>' ~ who ~ '<|im_middle|>' }}
    {%- elif m.role == 'assistant' %}{{- '<|im_assistant|>' ~ who ~ '<|im_middle|>' }}
    {%- else %}{{- '<|im_system|>' ~ who ~ '<|im_middle|>' }}
    {%- endif %}
    {%- if m.role == 'assistant' and m.tool_calls %}
        {%- if m.content %}{{- m.content }}{%- endif %}
        {{- '<|tool_calls_section_begin|>' }}
        {%- for call in m.tool_calls %}
            {%- set args = call.function.arguments %}
            {{- '<|tool_call_begin|>' ~ call.id ~ '<|tool_call_argument_begin|>' }}
            {{- args if args is string else args | tojson }}
            {{- '<|tool_call_end|>' }}
        {%- endfor %}
        {{- '<|tool_calls_section_end|>' }}
    {%- elif m.role == 'tool' %}
        {{- '## Return of ' ~ m.tool_call_id ~ '\\n    ' ~ m.content }}
    {%- elif m.content is string %}{{- m.content }}
    {%- elif m.content is not none %}
        {%- for part in m.content %}{%- if part.text is defined %}{{- part.text }}{%- endif %}
        {%- endfor %}
    {%- endif %}
    {%- if not loop.last or add_generation_prompt %}{{- '<|im_end|>' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"""
    )
