"""Chat output formats, one class per format: tool calls (`server/formats/tool_call.py`) and
reasoning (`hybrid_serve/server/formats/reasoning.py`).

Each registry maps a `--tool-call-parser` / `--reasoning-parser` name to its class, in the order
`auto` tries them on the chat template: the first whose `matches` holds (tool calls end with
`qwen25`, which matches any template; a template with no reasoning format gets none). A new
format is one class and one entry here. The aliases are SGLang's other names for a format we
have: `nemotron_3` (Nemotron 3's `<think>` switched by `enable_thinking`, which is `qwen3`),
`qwen` (SGLang's second name for `qwen25`) and `lfm2` (SGLang's LFM2 detector: `pythonic` in
LFM2's tags, JSON calls in the list included); `auto` gives the format's own name.
"""

from __future__ import annotations

from hybrid_serve.server.formats.kimi_k2 import KimiK2
from hybrid_serve.server.formats.ling3 import Ling3
from hybrid_serve.server.formats.pythonic import Pythonic
from hybrid_serve.server.formats.qwen3_coder import Qwen3Coder
from hybrid_serve.server.formats.qwen25 import Qwen25
from hybrid_serve.server.formats.reasoning import (
    KimiK2Reasoning,
    Ling3Reasoning,
    Qwen3Reasoning,
    Qwen3ThinkingReasoning,
    ReasoningFormat,
)
from hybrid_serve.server.formats.tool_call import ToolCallFormat

TOOL_CALL_FORMATS: dict[str, type[ToolCallFormat]] = {
    f.name: f for f in (Qwen3Coder, KimiK2, Ling3, Pythonic, Qwen25)
}
REASONING_FORMATS: dict[str, type[ReasoningFormat]] = {
    f.name: f for f in (Ling3Reasoning, Qwen3Reasoning, KimiK2Reasoning, Qwen3ThinkingReasoning)
}
TOOL_CALL_ALIASES: dict[str, str] = {"qwen": Qwen25.name, "lfm2": Pythonic.name}
REASONING_ALIASES: dict[str, str] = {"nemotron_3": Qwen3Reasoning.name}
