"""Prompt text -> token ids, with or without the model's chat template."""
from __future__ import annotations


def build_prompt_ids(tokenizer, prompt: str | list[dict], chat: bool | None = None,
                     system: str | None = None) -> list[int]:
    """`chat=None` means: use the chat template when the model has one. A list of messages always uses it."""
    use_chat = isinstance(prompt, list) or (chat if chat is not None else tokenizer.chat_template is not None)
    if not use_chat:
        if system is not None:
            raise ValueError("a system prompt needs chat mode: drop --no-chat (chat=False), or put the instructions "
                             "into the raw prompt text")
        return tokenizer.encode(prompt)
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template: pass --no-chat (or chat=False) to send raw text")
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    check_messages(messages)
    if system is not None and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system}] + messages
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    # The template already spells out BOS/special tokens as text; don't add them twice.
    return tokenizer.encode(text, add_special_tokens=False)


ROLES = ("system", "user", "assistant")


def check_messages(messages: list) -> None:
    """Messages as the chat template expects them, or a ValueError naming the first that is not (before the
    template would fail inside jinja2, or silently render an unknown role)."""
    if not messages:
        raise ValueError("a chat needs at least one message, e.g. [{'role': 'user', 'content': 'Hi'}]")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content' (got {m!r:.80})")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has role {m['role']!r}: use one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {i}'s content must be text (str), got {type(m['content']).__name__}")
