"""The docs site's one hook: a code fence's marker for the docs tests (```python torchrun=2, ```bash norun) is
dropped before Markdown sees it, which accepts a language alone."""

import re

FENCE_MARKER = re.compile(r"^(\s*```[\w+-]+)[ \t]+[^\n`]*$", re.M)


def on_page_markdown(markdown: str, **_kwargs) -> str:
    return FENCE_MARKER.sub(r"\1", markdown)
