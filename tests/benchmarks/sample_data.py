"""GSM8K rows for the benchmark tests, and where the shared full copy lives."""

from __future__ import annotations

from pathlib import Path

SHARED_GSM8K = Path("/work/shared/data/gsm8k")

# A synthetic GSM8K directory: two shots, four questions (commas, a negative gold).
TRAIN = [
    {
        "question": "Ann has 2 pens and buys 3 more. How many pens?",
        "answer": "Ann has 2+3=<<2+3=5>>5 pens.\n#### 5",
    },
    {
        "question": "A box holds 4 cups. How many cups do 2 boxes hold?",
        "answer": "2*4=<<2*4=8>>8 cups.\n#### 8",
    },
]
TEST = [
    {
        "question": "Tom has 3 apples and gets 4 more. How many apples?",
        "answer": "3+4=<<3+4=7>>7\n#### 7",
    },
    {
        "question": "A car costs $600 and repairs $400. Total cost?",
        "answer": "600+400=<<600+400=1000>>1000\n#### 1,000",
    },
    {
        "question": "It is 2 degrees and drops 5. What is the temperature?",
        "answer": "2-5=<<2-5=-3>>-3\n#### -3",
    },
    {"question": "This question makes the server fail. How many errors?", "answer": "#### 1"},
]
