"""Offline, deterministic byte-level BPE tokenizer for random-weight test checkpoints.

The tokenizer is trained with the ``tokenizers`` library on a synthetic English / arithmetic corpus
that is generated in code from a fixed seed, so nothing is read from disk or the network and the
same ``vocab_size`` always yields the same ``tokenizer.json`` bytes (also across processes).

Contracts:

* byte-level BPE (``pre_tokenizers.ByteLevel`` without prefix space, ``decoders.ByteLevel``, no
  normalizer), so ``decode(encode(s)) == s`` for any unicode string that contains no special-token
  text;
* the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` are single tokens with ids
  0, 1, 2 (always below any legal ``vocab_size``); a chat template's own tokens
  (``make_model.chat_templates.TemplateTokens``: Granite's role tokens, the think and tool tags)
  follow them, ids 3, 4, ...: its ``special`` ones, then its ``tags``, which are not special
  (decoding keeps them in the text, where the output parsers read them);
* ``len(tokenizer) <= vocab_size``; it is equal whenever the corpus can supply enough merges, which
  holds for every vocab size up to at least 8192 (the presets use 2048 and 8192).
"""

from __future__ import annotations

import functools
import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from hybrid_serve.make_model.chat_templates import TEMPLATES, TemplateTokens

logger = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
CHATML = TemplateTokens()  # the Qwen templates: ChatML's tokens alone
CORPUS_SEED = 20240917
CORPUS_LINES = 24000

# ChatML, as used by Qwen: every message is "<|im_start|>{role}\n{content}<|im_end|>\n"; with
# add_generation_prompt the prompt ends in "<|im_start|>assistant\n". The default is the Qwen3-Next
# Instruct template; hybrid_serve/make_model/chat_templates.py holds it and the others.
CHAT_TEMPLATE = TEMPLATES["qwen3-next-instruct"]

_NAMES = (
    "Alice Bob Carol David Emma Farid Grace Hiro Ines Jamal Kira Liam Maya Noah Olga Pedro Quinn "
    "Rosa Sam Tara Umar Vera Wen Xavier Yuki Zane Amir Bella Chen Dana Elif Felix Gita Hugo Ivan "
    "Jana Kofi Lena Marco Nina Omar Priya Ravi Sofia Tomas Uma Viktor Wanda Yara Zoe"
).split()
_ITEMS = (
    "apple banana book pencil marble coin stamp card sticker cookie orange pear ticket shell "
    "feather button ribbon candle bottle flower seed egg muffin cupcake sandwich notebook eraser "
    "crayon brick block toy car kite balloon lemon cherry grape melon peach plum potato carrot "
    "tomato onion basket box bag jar cup plate spoon fork chair table lamp"
).split()
_PLACES = (
    "market school library garden park station museum bakery farm harbour village city forest "
    "river mountain island beach office kitchen classroom shop factory hospital stadium zoo"
).split()
_ADJECTIVES = (
    "small large quick slow bright dark quiet loud happy curious careful busy old young green "
    "red blue yellow purple golden silver heavy light warm cold ancient modern gentle brave "
    "clever tired hungry strange simple complex narrow wide tall short early late"
).split()
_ANIMALS = (
    "cat dog fox owl horse rabbit turtle eagle whale dolphin tiger lion bear wolf deer mouse "
    "squirrel frog duck goose sheep goat cow pig hen penguin otter badger falcon"
).split()
_VERBS_PAST = (
    "walked jumped looked waited listened travelled painted counted measured carried opened "
    "closed watched followed discovered noticed explained remembered visited finished started "
    "borrowed returned collected shared divided multiplied added subtracted wrote read"
).split()
_TOPICS = (
    "history science music art geography biology chemistry physics algebra geometry statistics "
    "language poetry astronomy economics engineering medicine philosophy weather cooking"
).split()
_UNITS = (
    ("metres", "m"),
    ("kilograms", "kg"),
    ("litres", "L"),
    ("minutes", "min"),
    ("hours", "h"),
    ("seconds", "s"),
    ("kilometres", "km"),
    ("grams", "g"),
    ("dollars", "$"),
    ("euros", "€"),
)
_ONSETS = (
    "b br c ch cl d dr f fl g gl gr h j k kr l m n p pl pr qu r s sh sl st t th tr v w z".split()
)
_VOWELS = "a e i o u ai ea ou oo ie au".split()
_CODAS = ["", "", "n", "r", "l", "s", "th", "nd", "rk", "x", "m", "st"]
_UNICODE_SNIPPETS = (
    "café",
    "naïve",
    "Zürich",
    "São Paulo",
    "π ≈ 3.14159",
    "2 × 3 = 6",
    "12 ÷ 4 = 3",
    "x ≤ y",
    "a ≠ b",
    "√16 = 4",
    "température 20 °C",
    "日本語",
    "Ελληνικά",
    "русский",
    "emoji 🙂",
)


def _pseudo_word(rng: random.Random) -> str:
    """A pronounceable made-up word of 2-3 syllables (used as a place or creature name)."""
    syllables = [
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.randint(2, 3))
    ]
    return "".join(syllables)


def _word_problem(rng: random.Random) -> str:
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    kind = rng.randrange(5)
    if kind == 0:
        return (
            f"{name} has {a} {item}s. {other} gives {name} {b} more. How many {item}s does {name} "
            f"have now? Answer: {a} + {b} = {a + b}."
        )
    if kind == 1:
        big, small = max(a, b), min(a, b)
        return (
            f"There were {big} {item}s at the {rng.choice(_PLACES)}. {name} took {small} of them. "
            f"{big} - {small} = {big - small} {item}s are left."
        )
    if kind == 2:
        n = rng.randint(2, 30)
        return (
            f"Each box holds {n} {item}s. {name} fills {a} boxes, so {name} packs {a} * {n} = "
            f"{a * n} {item}s in total."
        )
    if kind == 3:
        n = rng.randint(2, 12)
        total = a * n
        return (
            f"{name} shares {total} {item}s equally among {n} friends. Each friend gets "
            f"{total} / {n} = {a} {item}s."
        )
    unit, symbol = rng.choice(_UNITS)
    x, y = rng.randint(1, 500) / 10, rng.randint(1, 500) / 10
    return (
        f"{name} measured {x} {unit} and then {y} {unit}; together that is "
        f"{round(x + y, 1)} {symbol}, a {rng.randint(1, 99)}% change from last week."
    )


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(7)
    if kind == 6:
        word = _pseudo_word(rng)
        return (
            f"In the old {rng.choice(_TOPICS)} books, {word} means a {rng.choice(_ADJECTIVES)} "
            f"{rng.choice(_ANIMALS)}; the plural is {word}s and {word}ing is the verb."
        )
    if kind == 0:
        return (
            f"The {rng.choice(_ADJECTIVES)} {rng.choice(_ANIMALS)} {rng.choice(_VERBS_PAST)} "
            f"near the {rng.choice(_ADJECTIVES)} {rng.choice(_PLACES)}."
        )
    if kind == 1:
        place = _pseudo_word(rng).capitalize()
        return (
            f"In {rng.randint(1500, 2030)}, travellers from {place} {rng.choice(_VERBS_PAST)} "
            f"to the {rng.choice(_PLACES)} of {_pseudo_word(rng).capitalize()}."
        )
    if kind == 2:
        return (
            f"{rng.choice(_NAMES)} studied {rng.choice(_TOPICS)} and {rng.choice(_TOPICS)} "
            f"for {rng.randint(2, 40)} hours, then {rng.choice(_VERBS_PAST)} home."
        )
    if kind == 3:
        p, q = rng.randint(1, 20), rng.randint(-30, 30)
        v = rng.randint(-9, 9)
        return f"Let f(x) = {p}x + {q}. Then f({v}) = {p * v + q}, and f(0) = {q}."
    if kind == 4:
        r1, r2 = rng.randint(-12, 12), rng.randint(-12, 12)
        return f"The equation x^2 - ({r1 + r2})x + ({r1 * r2}) = 0 has roots x = {r1} and x = {r2}."
    return f"Note: {rng.choice(_UNICODE_SNIPPETS)} — {rng.choice(_ADJECTIVES)} {_pseudo_word(rng)}."


def corpus_lines(num_lines: int = CORPUS_LINES, seed: int = CORPUS_SEED) -> Iterator[str]:
    """Yield the synthetic training corpus: a fixed function of ``(num_lines, seed)``."""
    rng = random.Random(seed)
    for i in range(num_lines):
        if i % 97 == 0:
            yield f"{IM_START}user\nWhat is {i} + {i + 1}?{IM_END}\n{IM_START}assistant\n"
        yield _word_problem(rng) if rng.random() < 0.5 else _sentence(rng)


def added_tokens(tokens: TemplateTokens = CHATML) -> tuple[str, ...]:
    """The tokens every tokenizer built for `tokens` holds whole, in id order (0, 1, ...)."""
    return (*SPECIAL_TOKENS, *tokens.special, *tokens.tags)


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int, tokens: TemplateTokens) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, normalized=False) for t in added_tokens(tokens)],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer, length=CORPUS_LINES)
    if tokens.tags:  # the trainer makes every token it is given special: not so the tags
        spec = json.loads(tok.to_str())
        for entry in spec["added_tokens"]:
            entry["special"] = entry["content"] not in tokens.tags
        tok = Tokenizer.from_str(json.dumps(spec))
    size = tok.get_vocab_size(with_added_tokens=True)
    if size < vocab_size:
        logger.warning(
            "BPE corpus supplied only %d of %d tokens; the rest of the embedding rows are unused",
            size,
            vocab_size,
        )
    return tok.to_str(pretty=False)


def build_tokenizer(vocab_size: int, tokens: TemplateTokens = CHATML) -> Tokenizer:
    """Train (or fetch from the in-process cache) the byte-level BPE for ``vocab_size``, holding
    the chat template's ``tokens`` whole (ChatML's alone: the same tokenizer as ever).

    Raises ValueError when ``vocab_size`` cannot hold the 256 byte symbols plus those tokens.
    """
    low = 256 + len(added_tokens(tokens))
    if vocab_size < low:
        raise ValueError(f"vocab_size must be >= {low}, got {vocab_size}")
    tok = Tokenizer.from_str(_trained_tokenizer_json(vocab_size, tokens))
    for i, text in enumerate(added_tokens(tokens)):
        if tok.token_to_id(text) != i:  # pragma: no cover - would be a tokenizers behaviour change
            raise RuntimeError(f"special token {text!r} got id {tok.token_to_id(text)}, not {i}")
    return tok


def special_token_ids(tokens: TemplateTokens = CHATML) -> dict[str, int]:
    """Ids of the tokens held whole (ChatML's and the template's) in every tokenizer built here
    for ``tokens`` (independent of vocab size)."""
    return {text: i for i, text in enumerate(added_tokens(tokens))}


def write_tokenizer_files(
    out_dir: str | Path,
    vocab_size: int,
    *,
    model_max_length: int,
    chat_template: str = CHAT_TEMPLATE,
    tokens: TemplateTokens = CHATML,
) -> int:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``.

    The files load offline with ``AutoTokenizer.from_pretrained(out_dir)`` (class
    ``PreTrainedTokenizerFast``, i.e. the ``tokenizer.json`` pipeline is used as is). eos is the
    template's end of turn (``tokens.eos``: ``<|im_end|>`` for ChatML), pad ``<|endoftext|>``, no
    bos (as in Qwen chat checkpoints); the template's tokens are held whole (``build_tokenizer``).
    Returns ``len(tokenizer)`` (``<= vocab_size``).
    """
    out = Path(out_dir)
    tok = build_tokenizer(vocab_size, tokens)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    added = {
        str(i): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": text not in tokens.tags,
        }
        for text, i in special_token_ids(tokens).items()
    }
    specials = [IM_START, IM_END, *tokens.special]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": specials,
        "bos_token": None,
        "eos_token": tokens.eos,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "chat_template": chat_template,
    }
    special_map = {
        "additional_special_tokens": specials,
        "eos_token": tokens.eos,
        "pad_token": ENDOFTEXT,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", special_map)
    return tok.get_vocab_size(with_added_tokens=True)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(
        json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )
