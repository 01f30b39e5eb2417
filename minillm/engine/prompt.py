"""Prompt text -> token ids, with or without the model's chat template."""
from __future__ import annotations


def build_prompt_ids(tokenizer, prompt: str | list[dict], chat: bool | None = None,
                     system: str | None = None) -> list[int]:
    """`chat=None` means: use the chat template when the model has one. A list of messages always uses it."""
    use_chat = isinstance(prompt, list) or (chat if chat is not None else tokenizer.chat_template is not None)
    if not use_chat:
        return tokenizer.encode(prompt)
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template: pass --no-chat (or chat=False) to send raw text")
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if system is not None and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system}] + messages
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    # The template already spells out BOS/special tokens as text; don't add them twice.
    return tokenizer.encode(text, add_special_tokens=False)
