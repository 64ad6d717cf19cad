"""MkDocs hook (``hooks:`` in mkdocs.yml): generates the reference page of ``hpcnn train``'s
options, ``reference/options.md``, from :class:`hpcnn.config.TrainConfig` at every build, and
puts the run log's schema from :mod:`hpcnn.log.runlog`'s docstring into ``reference/run-log.md``.

Each option's default is the field's, its help the comment beside the field (what
``hpcnn train --help`` prints, :func:`hpcnn.config.describe`), its allowed values
:data:`hpcnn.config.CHOICES`, :data:`~hpcnn.config.RANGES` or :data:`~hpcnn.config.FREE`;
the groups are the ``# -- ... --`` headings of the class body. Nothing is written to disk, so
the page cannot fall behind the code. ``python docs/hooks.py`` prints the page.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = "reference/options.md"


def _config():
    if ROOT not in sys.path:        # the checkout's package, installed or not
        sys.path.insert(0, ROOT)
    from hpcnn import config
    return config


def _escaped(text: str) -> str:
    """Help text as Markdown shows it literally."""
    text = text.replace("\\", "\\\\").replace("<", "&lt;")
    return re.sub(r"([*_`\[\]])", r"\\\1", text)


def _allowed(config, name: str, typ: str) -> str:
    if name in config.CHOICES:
        return "one of " + ", ".join(f"`{v}`" if v else '`""`' for v in config.CHOICES[name])
    if name in config.RANGES:
        each = "each " if typ.startswith("tuple") else ""
        return f"{typ}, {each}{config.RANGES[name]}"
    if name in config.FREE:
        return "true or false" if typ == "bool" else f"any {typ}"
    return typ


def options_page() -> str:
    """The Markdown of the options page."""
    config = _config()
    cls = config.TrainConfig
    fields = {f.name: f for f in dataclasses.fields(cls)}
    lines = [
        "# `hpcnn train` options",
        "",
        "Generated from `hpcnn/config.py` (`TrainConfig`) when the site is built: every option of",
        "`hpcnn train --key=value ...`, its default, the values it accepts and its meaning, grouped",
        "as `hpcnn train --help` prints them. A value outside its range, an unknown key or a",
        "combination the engine cannot run is refused before anything runs, in one line, with exit",
        "code 2 (see [Getting started](../getting-started.md#options-are-checked-first)).",
    ]
    for line in inspect.getsource(cls).splitlines():
        s = line.strip()
        m = re.fullmatch(r"(\w+): ([^=]+?)\s*= .+?\s+# (.*)", s)
        if s.startswith("# --"):
            lines += ["", f"## {s.strip('# -').strip().capitalize()}", ""]
        elif m and m.group(1) in fields:
            name, typ, help_ = m.groups()
            typ = typ.replace("tuple[int, ...]", "tuple of int")
            default = config.shown(fields[name].default)
            lines.append(f"- **`--{name}`** (default `{default or chr(34) * 2}`; "
                         f"{_allowed(config, name, typ)}): {_escaped(help_)}")
    return "\n".join(lines) + "\n"


SCHEMA_MARK = "<!-- runlog-schema -->"


def runlog_schema() -> str:
    """The schema block and the paragraphs after it of :mod:`hpcnn.log.runlog`'s docstring, up
    to its crash-safety notes, as Markdown."""
    _config()
    from hpcnn.log import runlog
    doc = runlog.__doc__
    start = doc.index("Schema (")
    end = doc.index("Crash safety:")
    text = doc[start:end].rstrip()
    text = text.replace("::\n", ":\n\n```text", 1)
    head, rest = text.split("```text", 1)
    block, _, after = rest.partition("\n\n")
    while after.startswith("    "):                    # the literal block may hold blank lines
        more, _, after = after.partition("\n\n")
        block += "\n\n" + more
    block = "\n".join(ln[4:] for ln in block.strip("\n").splitlines())
    after = re.sub(r"``([^`]+)``", r"`\1`", after)
    after = re.sub(r":(?:func|class|meth|mod):`~?([^`]+)`", r"`\1`", after)
    after = after.replace("::\n\n", ":\n\n```python\n", 1)
    if "```python" in after:                            # close the example block
        pre, _, code = after.partition("```python\n")
        lines = code.splitlines()
        n = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("    "))
        after = (pre + "```python\n" + "\n".join(ln[4:] for ln in lines[:n]).strip("\n")
                 + "\n```\n\n" + "\n".join(lines[n:]))
    head = re.sub(r"``([^`]+)``", r"`\1`", head)
    return head.rstrip() + "\n\n```text\n" + block + "\n```\n\n" + after.strip() + "\n"


def on_page_markdown(markdown, page, config, files):
    """The run log's schema, from the code, into its reference page."""
    if SCHEMA_MARK in markdown:
        markdown = markdown.replace(SCHEMA_MARK, runlog_schema())
    return markdown


def on_files(files, config):
    """Adds the generated options page to the site's files (MkDocs >= 1.6)."""
    from mkdocs.structure.files import File
    files.append(File.generated(config, PAGE, content=options_page()))
    return files


if __name__ == "__main__":
    print(options_page(), end="")
