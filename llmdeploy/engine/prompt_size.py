"""How many tokens a prompt of so many bytes and messages makes with this engine's tokenizer and chat template.

The router decides before anything is tokenized: it estimates a request's prompt tokens from its text's UTF-8
bytes and its message count with these coefficients, which each engine measures once at start and publishes in
/load. Guessing bytes / 4 without the template was off by 8x for a short chat prompt (issue 12: 4 guessed, 31
real, most of it SmolLM2's default system prompt); tokenizing every request in the router would cost it more
than its whole latency budget.
"""

from __future__ import annotations

from typing import Any

from llmdeploy.policies.prompt_size import PromptSize

# ordinary English prose with some code, numbers and punctuation: what a chat or completion prompt looks like
SAMPLE = (
    "The capital of France is Paris, a city of about 2.1 million people on the river Seine. Summarise the "
    "following report in three sentences, then list the key figures as a table. Revenue grew 12% in 2025 to "
    "$4.3bn; operating margin was 18.5%. def area(r: float) -> float:\n    return 3.14159 * r ** 2\n"
    "Please answer concisely and cite the paragraph numbers you used (e.g. [3], [7])."
)


def measure_prompt_size(tokenizer: Any) -> PromptSize:
    per_byte = len(tokenizer.encode(SAMPLE, add_special_tokens=False)) / len(SAMPLE.encode())
    text_fixed = float(len(tokenizer.encode("", add_special_tokens=True)))
    if not getattr(tokenizer, "chat_template", None):
        return PromptSize(per_byte, 0.0, 0.0, text_fixed)
    try:
        one = _chat_tokens(tokenizer, ["user"])
        three = _chat_tokens(tokenizer, ["user", "assistant", "user"])
    except Exception:  # a template that wants something else (e.g. a system turn first): no chat figures
        return PromptSize(per_byte, 4.0, 0.0, text_fixed)
    per_message = max(0.0, (three - one) / 2)
    return PromptSize(per_byte, per_message, max(0.0, one - per_message), text_fixed)


def _chat_tokens(tokenizer: Any, roles: list[str]) -> int:
    messages = [{"role": r, "content": ""} for r in roles]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))
