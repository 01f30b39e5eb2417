"""A seeded, mixed chat workload with exact prompt and output lengths.

Each prompt is a real chat: the model's template (with its default system prompt) around a user message
cut from a pool of filler text so the whole prompt has exactly the drawn number of tokens."""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass

FILLER = (
    "Summarize the following notes and answer the question at the end. "
    "The library opens at nine and closes at six on weekdays, with shorter hours on Saturday. "
    "Members may borrow up to twelve books at a time and renew them twice online. "
    "A reading group meets every second Thursday to discuss a novel chosen by vote. "
    "The city council approved a budget for new bicycle lanes along the river and near the station. "
    "Construction should begin in spring and finish before the autumn festival. "
    "Engineers measured traffic for three weeks and found that most trips are shorter than five kilometres. "
    "In the kitchen, bread dough rises faster in a warm room, and salt slows the yeast slightly. "
    "A loaf baked at a high temperature develops a darker crust and a softer crumb. "
    "Astronomers count the moons of Jupiter by comparing photographs taken on several nights. "
    "Small moons are hard to see because they reflect little light and move quickly. "
    "The museum's new exhibition shows maps drawn by sailors over four centuries. "
    "Old maps often placed sea monsters in waters the mapmakers had never visited. "
)
QUESTIONS = ["What are the three most useful facts here?", "Write a short poem about these notes.",
             "Which detail surprised you, and why?", "Explain this to a ten-year-old.",
             "List the numbers mentioned and what they refer to."]


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class WorkloadSpec:
    num_requests: int = 64
    min_prompt: int = 32
    max_prompt: int = 512
    min_output: int = 16
    max_output: int = 256
    seed: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def chat_prompt_of_length(tokenizer, n: int, rng: random.Random) -> list[int]:
    """Chat-templated prompt of exactly n tokens (n >= the template's fixed part)."""
    q = rng.choice(QUESTIONS)
    # split the rendered template around the placeholder: everything before is the prefix, after is the suffix
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}])
    before, after = rendered.split("\x00")
    prefix = tokenizer.encode(before, add_special_tokens=False)
    suffix = tokenizer.encode(q + after, add_special_tokens=False)
    room = n - len(prefix) - len(suffix)
    if room < 0:
        return (prefix + suffix)[-n:]
    filler = tokenizer.encode(FILLER, add_special_tokens=False)
    start = rng.randrange(len(filler))
    body = [filler[(start + i) % len(filler)] for i in range(room)]
    return prefix + body + suffix


def make_workload(tokenizer, spec: WorkloadSpec | None = None) -> list[Request]:
    spec = spec or WorkloadSpec()
    rng = random.Random(spec.seed)
    out = []
    for _ in range(spec.num_requests):
        n = rng.randint(spec.min_prompt, spec.max_prompt)
        m = rng.randint(spec.min_output, spec.max_output)
        out.append(Request(chat_prompt_of_length(tokenizer, n, rng), m))
    return out


def random_workload(vocab_size: int, spec: WorkloadSpec) -> list[Request]:
    """Same length distribution with random token ids (for tiny test models without a chat template)."""
    rng = random.Random(spec.seed)
    return [Request([rng.randrange(3, vocab_size) for _ in range(rng.randint(spec.min_prompt, spec.max_prompt))],
                    rng.randint(spec.min_output, spec.max_output)) for _ in range(spec.num_requests)]
