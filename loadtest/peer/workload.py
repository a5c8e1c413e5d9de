"""The peer benchmark's requests: chat-shaped prompts of a fixed length, the same text
for both servers.

Lifecycle: `peer_requests(synth, n, prompt_tokens, output_tokens, stream)` draws `n`
prompts once per point and round (seeded by `stream`, so a round's two servers get
identical text, and no two points share a prompt: neither server's prefix cache finds
more than the template's few tokens). Each prompt is a system and a user turn in the
model's ChatML template, written out as text and ending with the assistant's header,
so `/v1/completions` on either server sees the same tokens a chat request would
(both tokenizers read the template's special-token strings as those tokens).
"""

from __future__ import annotations

import random

from loadtest.harness.request_spec import BenchRequest
from loadtest.workloads.prompt_text import TextSynth

#: The template's own tokens: three headers, two ends, the newlines between them.
TEMPLATE_TOKENS = 14
SYSTEM_SHARE = 0.25  # of the words; the rest is the user's turn


def chat_prompt(system: str, user: str) -> str:
    """One system and one user turn, then the assistant's header (SmolLM2's ChatML)."""
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def peer_requests(
    synth: TextSynth, n: int, prompt_tokens: int, output_tokens: int, stream: int
) -> list[BenchRequest]:
    """`n` requests of about `prompt_tokens` tokens (the exact counts come back in each
    response's usage), each generating `output_tokens`."""
    if prompt_tokens <= TEMPLATE_TOKENS + 2:
        raise ValueError(f"prompt_tokens must be > {TEMPLATE_TOKENS + 2}, got {prompt_tokens}")
    rng = random.Random(f"peer/{stream}")
    words = prompt_tokens - TEMPLATE_TOKENS
    system_words = max(1, round(words * SYSTEM_SHARE))
    out = []
    for i in range(n):
        system = synth.text(rng, system_words)
        user = synth.text(rng, words - system_words)
        prompt = chat_prompt(system, user)
        rid = f"p{stream}-{i}"
        out.append(
            BenchRequest(request_id=rid, kind="chat", max_tokens=output_tokens, prompt=prompt)
        )
    return out
