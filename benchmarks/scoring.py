"""GSM8K answer extraction and scoring under three published rules.

- `sglang`: SGLang's few-shot GSM8K rule. Commas are removed, the LAST run of digits is the
  answer (so signs and decimal points are dropped: "-3" reads 3, "2.5" reads 5), and text with no
  digit is `INVALID`. The gold answer goes through the same function, which is why negative
  golds still compare equal.
- `strict-match`: lm-eval's gsm8k (v3) strict filter, the FIRST `#### <number>` in the output.
- `flexible-extract`: lm-eval's flexible filter, the LAST match of
  `(-?[$0-9.,]{2,})|(-?[0-9]+)` anywhere in the output.

For both lm-eval rules a missing match becomes the string `"[invalid]"`, and the extracted string
is compared for exact equality with the gold answer after lm-eval's `exact_match` clean-up of both
sides: remove ",", "$", everything up to the last "#### ", a final ".", then lower-case. So
"1,000." equals "1000", but "18.00" does not equal "18".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

INVALID = -9999999
LM_EVAL_INVALID = "[invalid]"
RULES = ("sglang", "strict-match", "flexible-extract")

_DIGITS = re.compile(r"\d+")
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
# lm-eval's regexes_to_ignore for gsm8k, applied in this order.
_IGNORE = (re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))


def sglang_answer(text: str) -> int:
    """The last run of digits in `text` with commas removed, or `INVALID` when there is none."""
    numbers = _DIGITS.findall(text.replace(",", ""))
    return int(numbers[-1]) if numbers else INVALID


def strict_match(text: str) -> str:
    """The number after the first `#### ` in `text`, or `"[invalid]"`."""
    found = _STRICT.findall(text)
    return found[0].strip() if found else LM_EVAL_INVALID


def flexible_extract(text: str) -> str:
    """The last number-like span of `text` (its first non-empty group), or `"[invalid]"`."""
    found = _FLEXIBLE.findall(text)
    if not found:
        return LM_EVAL_INVALID
    return next(group for group in found[-1] if group).strip()


def exact_match_normalize(text: str) -> str:
    """lm-eval's gsm8k exact_match clean-up, applied to both prediction and gold answer."""
    for pattern in _IGNORE:
        text = pattern.sub("", text)
    return text.lower()


@dataclass(frozen=True)
class Verdict:
    """One output scored under every rule; `*_pred` are the extracted answers."""

    sglang_pred: int
    strict_pred: str
    flexible_pred: str
    sglang: bool
    strict: bool
    flexible: bool

    @property
    def invalid(self) -> bool:
        """No answer could be extracted under the SGLang rule (what SGLang reports as Invalid)."""
        return self.sglang_pred == INVALID


def score(output: str, gold_answer: str) -> Verdict:
    """Score model `output` against a GSM8K gold `answer` field (solution text ending `#### N`).

    The gold's label is `sglang_answer(gold)` for the SGLang rule (never INVALID for GSM8K) and
    the whole gold text through `exact_match_normalize` for the lm-eval rules.
    """
    label = sglang_answer(gold_answer)
    gold = exact_match_normalize(gold_answer)
    s_pred, st_pred, fx_pred = sglang_answer(output), strict_match(output), flexible_extract(output)
    return Verdict(
        sglang_pred=s_pred,
        strict_pred=st_pred,
        flexible_pred=fx_pred,
        sglang=s_pred != INVALID and s_pred == label,
        strict=exact_match_normalize(st_pred) == gold,
        flexible=exact_match_normalize(fx_pred) == gold,
    )


def summarize(verdicts: list[Verdict]) -> dict[str, float]:
    """Mean accuracy under each rule and the SGLang invalid rate (all 0.0 for no verdicts)."""
    n = max(len(verdicts), 1)
    return {
        "accuracy": sum(v.sglang for v in verdicts) / n,
        "strict_match": sum(v.strict for v in verdicts) / n,
        "flexible_extract": sum(v.flexible for v in verdicts) / n,
        "invalid": sum(v.invalid for v in verdicts) / n,
    }
