"""The parity prompts, for the tests (they live in loadtest, which the accuracy gate's
benchmark shares)."""

from loadtest.workloads.parity_prompts import CHAT, PARAGRAPH, SHORT, long_prompt

__all__ = ["CHAT", "PARAGRAPH", "SHORT", "long_prompt"]
