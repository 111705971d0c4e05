"""A step's completions, as reward functions see them: consecutive runs of one prompt's completions (its group)."""

from __future__ import annotations


def prompt_groups(prompts: list) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive completions of one prompt."""
    out, start = [], 0
    while start < len(prompts):
        end = start + 1
        while end < len(prompts) and prompts[end] == prompts[start]:
            end += 1
        out.append((start, end))
        start = end
    return out
