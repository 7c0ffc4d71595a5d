"""The `math` task's own parts: its instruction to chat models, its check of gold answers, its reward.

Math problems come from the built-in generator (`pipeline.tasks.make_math`, whose output the
shipped files are) or from a user's file (`pipeline.data`, which reads files of any task).
A chat run asks for the final answer in `\\boxed{}` by default (`INSTRUCTION`, the user turn made
from a question: pipeline.data.chat), which is where the reward looks first; `reward` scores a
response with math-verify against the gold answer, which must be one math-verify can read
(`unreadable_answer`: a data row whose answer is not is a bad row).
"""

from __future__ import annotations

from pipeline.tasks.rewards import MathVerifyReward, parse_gold

BOXED_INSTRUCTION = "Put your final answer within \\boxed{}."
INSTRUCTION = "{prompt}\n" + BOXED_INSTRUCTION  # a chat run's user turn; "{prompt}" stands for the question


def unreadable_answer(answer: str) -> str | None:
    """Why math-verify cannot score responses against the gold `answer`; None when it can."""
    return None if parse_gold(answer) else f"math-verify cannot parse the answer {answer!r}"


_REWARD = MathVerifyReward()


def reward(text: str, answer: str) -> float:
    """1.0 if math-verify finds the response's final answer equal to `answer`, else 0.0."""
    return _REWARD(text, answer)[0]
