"""RL tasks: where the prompts come from and how completions are scored.

`arith` (the default, for the instruct target): seeded one-step word problems ("Ann has 12 pens and
buys 7 more. How many ...?") with exact integer answers, rendered with the tokenizer's chat template.
The reward is verifiable and has a format part an instruct model of 135M parameters can learn within
tens of steps (end with ``Answer: <integer>``) and a correctness part it gets right only sometimes, so
the policy really moves and its reply style narrows, which is what a drafter must keep up with.

`upper`, `ast`, `short_lines`: code prompts (`dvi.data.prompt_stream`) for the self-trained pairs,
whose "policy" has no chat ability.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Problem", "arithmetic_problems", "arith_reward", "arith_messages", "arith_dataset", "trl_reward", "upper_reward", "ast_reward", "short_lines_reward",
    "REWARDS", "TASKS", "task_prompts",
]

ARITH_SYSTEM = "Solve the problem in one or two sentences. End with 'Answer: <number>'."
_ANSWER = re.compile(r"Answer:\s*\**\s*(-?\d+)")
_INT = re.compile(r"-?\d+")
_NAMES = ("Tom", "Ann", "Sam", "Mia", "Leo", "Eva", "Max", "Zoe")
_ITEMS = ("apples", "pens", "books", "coins", "cards", "stamps", "shells", "marbles")


@dataclass(frozen=True)
class Problem:
    """One prompt of a task: the user's text and what the reward checks against (None: nothing)."""

    text: str
    answer: int | None = None


def arithmetic_problems(seed: int) -> Iterator[Problem]:
    """An endless seeded stream of one-step add/subtract word problems with small integer answers."""
    rng = random.Random(seed)
    while True:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        if rng.random() < 0.5:
            yield Problem(f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", a + b)
        else:
            yield Problem(f"{name} has {a + b} {item} and gives away {b}. How many {item} does {name} have left?", a)


def arith_reward(problem: Problem, completion: str) -> float:
    """Verifiable and graded: 0.5 when the stated answer is right, 0.25 for the asked format
    (``Answer: <int>``), 0.25 when the right integer appears anywhere (a shaping term with a base rate
    a 135M model at temperature 1 hits often enough for group advantages to be non-zero).

    The stated answer is the one after the last ``Answer:``, else the last integer of the reply.
    """
    tagged = _ANSWER.findall(completion)
    numbers = _INT.findall(completion)
    stated = (tagged or numbers)[-1:]
    truth = problem.answer
    correct = truth is not None and bool(stated) and int(stated[0]) == truth
    mentioned = truth is not None and any(int(x) == truth for x in numbers)
    return 0.5 * correct + 0.25 * bool(tagged) + 0.25 * mentioned


def upper_reward(prompt: str, completion: str) -> float:
    """Share of letters in the completion that are upper case (SHOUTING code)."""
    letters = [c for c in completion if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def ast_reward(prompt: str, completion: str) -> float:
    """1 if prompt + the completion's complete lines parse as Python, else 0.

    The text may end by opening a block (`if x:`), so a `pass` indented one level under the
    last line is tried too. A completion without one complete non-blank line scores 0.
    """
    body = completion[: completion.rfind("\n") + 1] if "\n" in completion else ""
    if not body.strip():
        return 0.0
    text = prompt + body
    last = next((ln for ln in reversed(text.splitlines()) if ln.strip()), "")
    indent = last[: len(last) - len(last.lstrip())]
    for candidate in (text, f"{text}{indent}    pass\n"):
        try:
            ast.parse(candidate)
            return 1.0
        except (SyntaxError, ValueError):
            continue
    return 0.0


def short_lines_reward(prompt: str, completion: str) -> float:
    """Rewards many line breaks: 1 at one newline per 8 characters or more."""
    return min(1.0, 8.0 * completion.count("\n") / max(1, len(completion)))


# Code-prompt rewards: (prompt_text, completion_text) -> float in [0, 1].
REWARDS: dict[str, Callable[[str, str], float]] = {
    "upper": upper_reward,
    "ast": ast_reward,
    "short_lines": short_lines_reward,
}
TASKS = ("arith", *REWARDS)


def arith_messages(problem: Problem) -> list[dict[str, str]]:
    """The chat a word problem is asked in (system instruction + the problem)."""
    return [{"role": "system", "content": ARITH_SYSTEM}, {"role": "user", "content": problem.text}]


def arith_dataset(num: int, seed: int) -> dict[str, list]:
    """Columns of a TRL dataset: conversational ``prompt`` and the integer ``answer`` (passed to rewards)."""
    problems = [p for p, _ in zip(arithmetic_problems(seed), range(num), strict=False)]
    return {"prompt": [arith_messages(p) for p in problems], "answer": [p.answer for p in problems]}


def trl_reward(task: str) -> Callable[..., list[float]]:
    """A task's reward as a TRL reward function (completions as text or as assistant messages).

    `arith` reads the dataset's ``answer`` column (TRL passes extra columns as keyword arguments).
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")

    def reward(prompts: list, completions: list, answer: list[int] | None = None, **kwargs: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        if task == "arith":
            return [score(task, Problem("", int(a)), t) for t, a in zip(texts, answer or [], strict=True)]
        return [score(task, Problem(str(p)), t) for p, t in zip(prompts, texts, strict=True)]

    reward.__name__ = f"{task}_reward"
    return reward


def task_prompts(task: str, tokenizer: Any, seed: int,
                 prompt_tokens: tuple[int, int] = (16, 48)) -> Iterator[tuple[list[int], Problem]]:
    """(prompt ids, problem) pairs of `task`: chat-rendered word problems, or held-out code prompts."""
    from dvi.data import prompt_stream, render_chat

    if task == "arith":
        for p in arithmetic_problems(seed):
            yield render_chat(tokenizer, arith_messages(p)), p
        return
    if task not in REWARDS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
    for ids in prompt_stream("code", tokenizer, split="heldout", prompt_tokens=prompt_tokens, seed=seed):
        yield ids, Problem(tokenizer.decode(ids))


def score(task: str, problem: Problem, completion: str) -> float:
    """The reward of `completion` for `problem` under `task`."""
    if task == "arith":
        return arith_reward(problem, completion)
    return REWARDS[task](problem.text, completion)
