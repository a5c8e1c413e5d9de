"""Open questions: prompts whose answers do not repeat themselves.

Speculation's prompt-lookup drafts guess the next tokens from text already in the
context, so a workload whose answers copy or loop gives it free wins. The `chat` prompts
of `parity_prompts` are short questions; decoded greedily past their short answers (a
benchmark ignores EOS to get equal lengths), a 135M model falls into loops that the
drafts then predict. These ask for new prose on a different subject each, and the
benchmark samples them, so the text after the prompt is fresh all the way.
"""

from __future__ import annotations

OPEN_QUESTIONS = (
    "Describe a walk through a busy fish market early in the morning.",
    "Write a letter to a friend about learning to play the cello as an adult.",
    "Explain how a bicycle stays upright while it is moving.",
    "Tell a short story about a lighthouse keeper who finds a lost dog.",
    "What would you pack for a week of hiking in the mountains, and why?",
    "Compare living in a small village with living in a large city.",
    "Describe how bread is made, from the flour to the finished loaf.",
    "Write a review of an imaginary restaurant that serves only soup.",
)
