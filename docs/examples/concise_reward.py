"""A reward for your checkpoint: the right answer, less 0.01 per word past 50 (a cost on long responses).
python train.py --model PATH --data prompts.jsonl --reward=docs.examples.concise_reward:concise"""
from tasks.hf_task import math_answer_reward


def concise(prompt: str, response: str, answer: str) -> float:
    # prompt: the text the tokenizer saw (a chat prompt as its template rendered it); response: the decoded response
    # (up to its EOS, special tokens dropped); answer: the row's --answer_key field as a string.
    right = math_answer_reward(response, answer)  # 1.0 or 0.0: the built-in rule (tasks/hf_task.py)
    return right - 0.01 * max(0, len(response.split()) - 50)  # any finite number: GRPO's R_i
