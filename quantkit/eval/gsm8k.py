"""GSM8K: lm-eval's `gsm8k_cot` format (8 chain-of-thought exemplars, "Q: ...\\nA:") and its scoring.

The exemplars are the 8 from Wei et al. 2022 (chain-of-thought prompting) that lm-eval uses: the
packaged data has no train split to draw lm-eval's plain `gsm8k` shots from. Extraction and exact match
follow lm-eval: "strict" takes the number after an explicit answer marker, "flexible" the last number in
the output; both compare after removing commas, dollar signs, everything up to "#### " and a final
period, ignoring case.
"""

from __future__ import annotations

import re

COT_EXEMPLARS: tuple[tuple[str, str], ...] = (
    (
        "There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are "
        "done, there will be 21 trees. How many trees did the grove workers plant today?",
        "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must "
        "have been 21 - 15 = 6. The answer is 6.",
    ),
    (
        "If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking "
        "lot?",
        "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5.",
    ),
    (
        "Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in "
        "total?",
        "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After "
        "eating 35, they had 74 - 35 = 39. The answer is 39.",
    ),
    (
        "Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many "
        "lollipops did Jason give to Denny?",
        "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny "
        "20 - 12 = 8. The answer is 8.",
    ),
    (
        "Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does "
        "he have now?",
        "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. "
        "5 + 4 = 9. The answer is 9.",
    ),
    (
        "There were nine computers in the server room. Five more computers were installed each day, from "
        "monday to thursday. How many computers are now in the server room?",
        "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
        "computers were added. 9 + 20 is 29. The answer is 29.",
    ),
    (
        "Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How "
        "many golf balls did he have at the end of wednesday?",
        "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing "
        "2 more, he had 35 - 2 = 33 golf balls. The answer is 33.",
    ),
    (
        "Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
        "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 "
        "dollars left. 23 - 15 is 8. The answer is 8.",
    ),
)

# lm-eval stops gsm8k_cot at "Q:" and end-of-turn markers; the blank line stops a model that has
# finished its answer (the exemplars never contain one) instead of letting it ramble to the token limit.
STOP_SEQUENCES = ("Q:", "</s>", "<|im_end|>", "\n\n")
MAX_NEW_TOKENS = 256  # lm-eval's default max_gen_toks

_STRICT_PATTERNS = (
    re.compile(r"#### (-?[0-9.,]+)"),
    re.compile(r"[Tt]he answer is \$?(-?[0-9.,]+)"),
)
_NUMBER = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORED = (re.compile(r","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))


def question_text(question: str) -> str:
    return f"Q: {question}\nA:"


def exemplar_text(question: str, reasoning: str) -> str:
    return f"{question_text(question)} {reasoning}"


def target_answer(solution: str) -> str:
    """The reference number of a GSM8K solution ("... #### 72")."""
    return solution.split("####")[-1].strip()


def extract_strict(output: str) -> str | None:
    """The number after the first explicit answer marker ("#### 42", "The answer is 42."), else None."""
    for pattern in _STRICT_PATTERNS:
        match = pattern.search(output)
        if match:
            return match.group(1)
    return None


def extract_flexible(output: str) -> str | None:
    """The last number-like span of the output ("$5.50", "-3", "1,234"), else None."""
    matches = _NUMBER.findall(output)
    if not matches:
        return None
    return next(group for group in matches[-1] if group)


def normalize(answer: str) -> str:
    for pattern in _IGNORED:
        answer = pattern.sub("", answer)
    return answer.strip().lower()


def is_correct(extracted: str | None, target: str) -> bool:
    return extracted is not None and normalize(extracted) == normalize(target)
