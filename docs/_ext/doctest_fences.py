"""A griffe extension for the API reference: `>>>` examples as code blocks.

tfdls' docstrings put their doctest examples after a plain "Example:" line
(tests/tooling/test_docstrings.py runs them), not in a Google "Examples:"
section, so Markdown would read `>>>` as nested block quotes and a printed
list as a link. This wraps each run of doctest lines (a `>>>` line and what
follows it up to the next blank line, the extent doctest gives an example)
in a ```pycon fence, for the rendered page only: the source is unchanged.
mkdocs.yml loads it (plugins > mkdocstrings > python > options > extensions).
"""

from __future__ import annotations

from typing import Any

import griffe

_FENCE = "```"


def fence_doctests(text: str) -> str:
    """Returns `text` with every run of doctest lines inside a ```pycon fence."""
    lines = text.splitlines()
    out: list[str] = []
    in_fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith(_FENCE):
            in_fence = not in_fence
        if in_fence or not stripped.startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(stripped)]
        if out and out[-1].strip():
            out.append("")
        out.append(f"{indent}{_FENCE}pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{indent}{_FENCE}")
        if i < len(lines):
            out.append("")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fences the doctest examples of every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
