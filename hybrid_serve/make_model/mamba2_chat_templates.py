"""Chat templates of the Mamba2 hybrid presets, written here in the shape of the releases' own
(same roles, tags and switches; the instruction sentences are our own words), for
`hybrid_serve.make_model.chat_templates` to register:

* `nemotron_3()` (NVIDIA-Nemotron-3-Nano-30B-A3B): ChatML turns with a system turn always
  written; the tools listed in it as `<function><name>..<parameters>..</function>` blocks, then
  the instructions for the XML call format `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\n
  VALUE\\n</parameter>\\n</function>\\n</tool_call>`; `enable_thinking` (default on) ends the
  prompt in `<think>\\n` or in an empty `<think></think>`; every assistant turn opens a think
  block (`<think>\\nREASONING\\n</think>\\n`, or `<think></think>` without reasoning), and with
  `truncate_history_thinking` (default on) turns before the last user message keep only the
  empty one; tool results as `<tool_response>` blocks in one user turn.
* `granite_4()` (Granite 4.0 / 4.0-H): `<|start_of_role|>ROLE<|end_of_role|>TEXT<|end_of_text|>`
  turns, always a system turn (the system message, the tools as JSON lines with the
  instructions for `<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>` calls, or a
  default); tool results as `<tool_response>` blocks in one user turn; no thinking.
"""

from __future__ import annotations

_XML_CALL_RULES = (
    "\\n</tools>\\n\\nTo call a function, reply ONLY in this format, with nothing after it:"
    "\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>"
    "\\nvalue_1\\n</parameter>\\n<parameter=example_parameter_2>\\nA value may run over\\n"
    "several lines\\n</parameter>\\n</function>\\n</tool_call>\\n\\n<IMPORTANT>\\nRemember:\\n"
    "- Each <function=...></function> block sits inside <tool_call></tool_call> tags\\n"
    "- Give every required parameter\\n- Any reasoning about the call goes BEFORE it, never "
    "after\\n- When no function fits, answer normally and do not mention the functions\\n"
    "</IMPORTANT>"
)

# Nemotron-3-Nano: a tool as <function> with its name, description and one <parameter> block per
# property (name, type, description, enum), then the required list.
_NEMOTRON_TOOL = """
        {%- set fn = t.function if t.function is defined else t %}
        {%- set params = fn.parameters if fn.parameters is mapping else {} %}
        {{- '\\n<function>\\n<name>' + fn.name + '</name>' }}
        {%- if fn.description is defined %}
            {{- '\\n<description>' + fn.description|trim + '</description>' }}
        {%- endif %}
        {{- '\\n<parameters>' }}
        {%- for key, p in (params.properties if params.properties is mapping else {})|items %}
            {{- '\\n<parameter>\\n<name>' + key + '</name>' }}
            {%- if p.type is defined %}{{- '\\n<type>' + p.type|string + '</type>' }}{%- endif %}
            {%- if p.description is defined %}
                {{- '\\n<description>' + p.description|trim + '</description>' }}
            {%- endif %}
            {%- if p.enum is defined %}{{- '\\n<enum>' + p.enum|tojson + '</enum>' }}{%- endif %}
            {{- '\\n</parameter>' }}
        {%- endfor %}
        {%- if params.required is defined %}
            {{- '\\n<required>' + params.required|tojson + '</required>' }}
        {%- endif %}
        {{- '\\n</parameters>\\n</function>' }}"""

# Nemotron-3-Nano's assistant turn: a think block always (the reasoning, or empty), emptied
# before the last user message when truncate_history_thinking; then the XML calls.
_NEMOTRON_ASSISTANT = """
        {%- if m.reasoning_content is string and m.reasoning_content|trim %}
            {%- set text = '<think>\\n' + m.reasoning_content + '\\n</think>\\n' + text %}
        {%- elif '<think>' not in text and '</think>' not in text %}
            {%- set text = '<think></think>' + text %}
        {%- endif %}
        {%- if truncate_history_thinking and loop.index0 < q.last and '</think>' in text %}
            {%- set text = '<think></think>' + text.split('</think>')[-1] %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + text|trim }}
        {%- if m.tool_calls %}{{- '\\n' }}{%- endif %}
        {%- for call in m.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '<tool_call>\\n<function=' + fn.name + '>\\n' }}
            {%- for key, value in (fn.arguments if fn.arguments is mapping else {})|items %}
                {{- '<parameter=' + key + '>\\n' }}
                {%- if value is mapping or (value is sequence and value is not string) %}
                    {{- value | tojson }}
                {%- else %}{{- value | string }}{%- endif %}
                {{- '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>\\n' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}"""


# An assistant turn's tool calls as JSON objects in <tool_call> tags (Granite 4.0's format);
# `text` is the turn's content
JSON_TOOL_CALLS = """        {%- for call in m.tool_calls or [] %}
            {%- if text or not loop.first %}{{- '\\n' }}{%- endif %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
"""


def nemotron_3() -> str:
    head = (
        """
{%- set enable_thinking = enable_thinking if enable_thinking is defined else true %}
{%- set truncate_history_thinking = truncate_history_thinking
    if truncate_history_thinking is defined else true %}
{%- set first_system = messages and messages[0].role == 'system' %}
{%- set sys = messages[0].content if first_system and messages[0].content is string else '' %}
{%- set rest = messages[1:] if first_system else messages %}
{%- set q = namespace(last=-1) %}
{%- for m in rest %}
    {%- if m.role == 'user' %}{%- set q.last = loop.index0 %}{%- endif %}
{%- endfor %}
{{- '<|im_start|>system\\n' + sys }}
{%- if tools %}
    {%- if sys %}{{- '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
    {%- for t in tools %}"""
        + _NEMOTRON_TOOL
        + """
    {%- endfor %}
    {{- '"""
        + _XML_CALL_RULES
        + """' }}
{%- endif %}
{{- '<|im_end|>\\n' }}"""
    )
    body = (
        """
{%- for m in rest %}
    {%- set text = m.content if m.content is string else '' %}
    {%- if m.role == 'assistant' %}"""
        + _NEMOTRON_ASSISTANT
        + """
    {%- elif m.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user\\n' }}{%- endif %}
        {{- '<tool_response>\\n' + text + '\\n</tool_response>\\n' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}{{- '<|im_start|>' + m.role + '\\n' + text + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' + ('<think>\\n' if enable_thinking else '<think></think>') }}
{%- endif %}"""
    )
    return head + body


_GRANITE_TOOLS_INTRO = (
    "You are a helpful assistant with access to the tools below; call one or more of them when "
    "they help with the user\\'s query.\\n\\nTheir function signatures are given within "
    "<tools></tools> XML tags:\\n<tools>"
)
_GRANITE_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nFor each tool call, return a JSON object with the function name and "
    "its arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>. '
    "If no listed tool can do what the user asks, say that you cannot fulfil the request."
)
_GRANITE_DEFAULT_SYSTEM = "You are a helpful assistant. Keep your answers accurate, safe and kind."


def granite_4() -> str:
    head = (
        "{%- set first_system = messages and messages[0].role == 'system' %}"
        "{%- set ns = namespace(sys=messages[0].content if first_system and "
        "messages[0].content is string else '', tools='') %}"
        "{%- if tools %}"
        "{%- set ns.tools = '" + _GRANITE_TOOLS_INTRO + "' %}"
        "{%- for t in tools %}{%- set ns.tools = ns.tools + '\\n' + t | tojson %}{%- endfor %}"
        "{%- set ns.tools = ns.tools + '" + _GRANITE_TOOLS_OUTRO + "' %}"
        "{%- set ns.sys = ns.sys + '\\n\\n' + ns.tools if ns.sys else ns.tools %}"
        "{%- elif not first_system %}{%- set ns.sys = '" + _GRANITE_DEFAULT_SYSTEM + "' %}"
        "{%- endif %}"
        "{{- '<|start_of_role|>system<|end_of_role|>' + ns.sys + '<|end_of_text|>\\n' }}"
    )
    body = (
        """
{%- for m in messages %}
    {%- set text = m.content if m.content is string else '' %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|start_of_role|>' + m.role + '<|end_of_role|>' + text + '<|end_of_text|>\\n' }}
    {%- elif m.role == 'assistant' %}
        {{- '<|start_of_role|>assistant<|end_of_role|>' + text }}
"""
        + JSON_TOOL_CALLS
        + """        {{- '<|end_of_text|>\\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|start_of_role|>user<|end_of_role|>' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + text + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|end_of_text|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"""
    )
    return head + body
