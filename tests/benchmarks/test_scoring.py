from __future__ import annotations

import pytest

from benchmarks import gsm8k_data, scoring
from tests.benchmarks.sample_data import SHARED_GSM8K


@pytest.mark.skipif(not (SHARED_GSM8K / "test.jsonl").is_file(), reason="no shared GSM8K copy")
def test_gold_answers_score_perfectly_under_every_rule() -> None:
    test = gsm8k_data.load_split(SHARED_GSM8K, "test")
    assert len(test) == 1319
    verdicts = [scoring.score(row["answer"], row["answer"]) for row in test]
    assert sum(v.sglang for v in verdicts) == 1319
    assert sum(v.strict for v in verdicts) == 1319
    assert sum(v.flexible for v in verdicts) == 1319
    assert not any(v.invalid for v in verdicts)
    assert scoring.summarize(verdicts) == {
        "accuracy": 1.0,
        "strict_match": 1.0,
        "flexible_extract": 1.0,
        "invalid": 0.0,
    }


GOLD_18 = "She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
GOLD_1000 = "80,000+50,000 ... so 1,000\n#### 1,000"
GOLD_NEG = "2-5=<<2-5=-3>>-3\n#### -3"
GOLD_5 = "10/2=<<10/2=5>>5\n#### 5"


@pytest.mark.parametrize(
    ("output", "gold", "expected"),
    [
        # (sglang, strict-match, flexible-extract)
        (" 9 * 2 = 18 dollars.\n#### 18", GOLD_18, (True, True, True)),
        (" The answer is 18.", GOLD_18, (True, False, True)),  # final "." is ignored
        (" She makes $18", GOLD_18, (True, False, True)),  # "$" is ignored
        (" #### $18", GOLD_18, (True, False, True)),  # strict wants a digit right after "#### "
        (" #### 18.00", GOLD_18, (False, False, False)),  # 18.00 is not 18 for anyone
        (" #### 18\nThen 3 more apples.", GOLD_18, (False, True, False)),  # last number is 3
        (" It costs 1,000 dollars.", GOLD_1000, (True, False, True)),  # commas
        (" #### 1,000", GOLD_1000, (True, True, True)),
        (" #### 1000", GOLD_1000, (True, True, True)),
        (" #### 10,00", GOLD_1000, (True, True, True)),  # commas are simply removed
        (" #### -3", GOLD_NEG, (True, True, True)),  # negatives
        (" it is 3 degrees", GOLD_NEG, (True, False, False)),  # SGLang drops the sign
        (" it is -3 degrees", GOLD_5, (False, False, False)),
        (" half of it, 2.5", GOLD_5, (True, False, False)),  # SGLang reads the last digits, 5
        (" #### 5.", GOLD_5, (True, True, True)),  # decimals: a final "." is dropped
        (" #### 5.5", GOLD_5, (True, False, False)),  # last digit run of 5.5 is 5
        (" I do not know.", GOLD_5, (False, False, False)),  # no number
        ("", GOLD_5, (False, False, False)),
    ],
)
def test_tricky_answers(output: str, gold: str, expected: tuple[bool, bool, bool]) -> None:
    v = scoring.score(output, gold)
    assert (v.sglang, v.strict, v.flexible) == expected


def test_extractors() -> None:
    assert scoring.sglang_answer("a 1,234 b 56") == 56
    assert scoring.sglang_answer("no digits") == scoring.INVALID
    assert scoring.sglang_answer("-7") == 7
    assert scoring.strict_match("x #### -1,234.5 y #### 9") == "-1,234.5"
    assert scoring.strict_match("#### abc") == scoring.LM_EVAL_INVALID
    assert scoring.flexible_extract("got $1,000. then 7") == "7"
    assert scoring.flexible_extract("got 7 then $1,000.") == "$1,000."
    assert scoring.flexible_extract("x") == scoring.LM_EVAL_INVALID
    assert scoring.exact_match_normalize("$1,000.") == "1000"
    assert scoring.exact_match_normalize("steps\n#### 1,000") == "1000"


def test_invalid_and_summary() -> None:
    verdicts = [scoring.score("no idea", GOLD_5), scoring.score("#### 5", GOLD_5)]
    assert [v.invalid for v in verdicts] == [True, False]
    assert scoring.summarize(verdicts) == {
        "accuracy": 0.5,
        "strict_match": 0.5,
        "flexible_extract": 0.5,
        "invalid": 0.5,
    }
    assert scoring.summarize([])["accuracy"] == 0.0
