"""A griffe extension for the docs build: the reST in docstrings read as Markdown.

popmesh's docstrings cross-reference with Sphinx roles (``:class:`~popmesh.torch.sync.GradientSync```,
``:func:`init```) and introduce literal blocks with ``::``. Markdown has neither, so mkdocstrings would
print the role's name before the code and a double colon before each example. This turns a role into
its code alone (the last part of the path where the target starts with ``~``, as Sphinx shows it) and
``Use::`` into ``Use:`` (the indented block after it is a code block in Markdown too). Loaded by
mkdocs.yml; the docstrings themselves are unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")
_LITERAL = re.compile(r"::\n(?=\s*\n)")


def _plain(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class RestAsMarkdown(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _LITERAL.sub(":\n", _ROLE.sub(_plain, obj.docstring.value))
