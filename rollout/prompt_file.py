"""The prompt file of `rollout sample`: JSONL, one prompt per line; every error names the file and line."""

from __future__ import annotations

import json
import re
from pathlib import Path


def read_prompts(path: Path) -> tuple[list[str | list[int]], list[int]]:
    """Prompts of a JSONL file (per line a string, a token-id list, or an object with a "prompt" field),
    and the line each came from; blank lines are skipped. Lines end at "\n" only: a JSON string may hold U+2028,
    U+0085 and the like, at which `str.splitlines` would cut it."""
    prompts, lines = [], []
    for number, line in enumerate(_text(path).split("\n"), 1):
        if line.strip():
            prompts.append(_prompt(line, f"{path}:{number}"))
            lines.append(number)
    if not prompts:
        raise ValueError(f"prompt file {str(path)!r} holds no prompts")
    return prompts, lines


def at_line(err: ValueError, path: Path, lines: list[int]) -> ValueError:
    """An error about `prompt N` (its place in the call, as the engines name it) naming the file's line."""
    match = re.match(r"prompt (\d+)\b", str(err))
    if match is None or int(match[1]) >= len(lines):
        return err
    return ValueError(f"{path}:{lines[int(match[1])]}: the prompt{str(err)[match.end():]}")


def _text(path: Path) -> str:
    if not path.exists():
        raise ValueError(f"prompt file {str(path)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r} is not a file")
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors write one) is skipped
    except UnicodeDecodeError as err:
        raise ValueError(f"prompt file {str(path)!r} is not UTF-8 text ({err})") from None


def _prompt(line: str, where: str) -> str | list[int]:
    """The prompt of one line, checked as far as the file alone allows (the engines check the rest)."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err})") from None
    if isinstance(item, dict) and "prompt" not in item:
        raise ValueError(f"{where}: an object needs a \"prompt\" field, got keys {sorted(item)!r:.60}")
    prompt = item["prompt"] if isinstance(item, dict) else item
    if not isinstance(prompt, (str, list)):
        raise ValueError(f"{where}: expected a string, a token-id list or {{\"prompt\": ...}}, got {prompt!r:.60}")
    if not prompt:
        raise ValueError(f"{where}: the prompt is empty")
    bad = [t for t in prompt if type(t) is not int or t < 0] if isinstance(prompt, list) else []
    if bad:
        raise ValueError(f"{where}: {bad[0]!r} is not a token id (an integer >= 0)")
    return prompt
