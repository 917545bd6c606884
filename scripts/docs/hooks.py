"""MkDocs hooks: the CLI and API reference pages, generated from the code at build time.

``cli.md`` renders ``jaxpar --help`` and each subcommand's help from ``jaxpar.cli``'s
argparse parser; ``api/*.md`` list the public names of ``jaxpar``, ``jaxpar.spec``,
``jaxpar.plan`` and ``jaxpar.inspect`` (their ``__all__``) for mkdocstrings to render from
the docstrings. Nothing generated is committed, so neither page can drift from the code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
# The API pages document the modules of this checkout, whatever is installed.
sys.path.insert(0, str(ROOT))

# Subpackages whose public names `jaxpar` re-exports, and where each is documented.
API_PAGES = {
    "jaxpar.spec": "api/spec.md",
    "jaxpar.plan": "api/plan.md",
    "jaxpar.inspect": "api/inspect.md",
}
REEXPORTED_FROM = ("jaxpar.errors", "jaxpar.models", "jaxpar.engine")
# A fence with a tag after its language: ```bash serve.
TAGGED_FENCE = re.compile(r"^(```\w+) \w+$", flags=re.M)


def _help(parser: argparse.ArgumentParser) -> str:
    """A parser's help at a fixed width, whatever the terminal building the site."""
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        return parser.format_help().rstrip()
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def cli_page() -> str:
    import jaxpar.cli

    parser = jaxpar.cli._parser()
    lines = [
        "# CLI reference",
        "",
        "Generated from `jaxpar.cli`'s parsers when the site is built: what `jaxpar --help` and",
        "`jaxpar COMMAND --help` print. Options before the command (`--cpu-devices`,",
        "`--compile-cache`, the distributed ones) apply to every command.",
        "",
        "## jaxpar",
        "",
        "```text",
        _help(parser),
        "```",
    ]
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        lines += ["", f"## jaxpar {name}", "", "```text", _help(sub), "```"]
    return "\n".join(lines) + "\n"


def _public(module: str) -> list[str]:
    """A module's public names: its ``__all__``, else the classes it defines."""
    mod = importlib.import_module(module)
    if hasattr(mod, "__all__"):
        return list(mod.__all__)
    return [n for n, v in vars(mod).items() if isinstance(v, type) and v.__module__ == module]


def _objects(module: str, names: list[str]) -> list[str]:
    return [f"::: {module}.{name}\n" for name in names]


def api_page(module: str) -> str:
    public = sorted(_public(module), key=str.lower)
    lines = [f"# {module}", "", f"::: {module}", "    options:", "      members: false", ""]
    return "\n".join(lines + _objects(module, public))


def jaxpar_page() -> str:
    """``jaxpar``'s own names: its errors, and the models' and engine's classes and
    functions it re-exports; names of ``jaxpar.spec`` and ``jaxpar.inspect`` link there."""
    import jaxpar

    elsewhere = {
        name: package
        for package in API_PAGES
        for name in _public(package)
        if name in jaxpar.__all__
    }
    lines = ["# jaxpar", "", "::: jaxpar", "    options:", "      members: false", ""]
    linked = sorted(elsewhere, key=str.lower)
    lines += [
        "## Also here",
        "",
        "Re-exported at the top level, documented with their package:",
        "",
    ]
    lines += [f"- [`{name}`][{elsewhere[name]}.{name}] ({elsewhere[name]})" for name in linked]
    lines.append("")
    for package in REEXPORTED_FROM:
        exported = set(_public(package))
        names = sorted(
            (n for n in jaxpar.__all__ if n in exported and n not in elsewhere), key=str.lower
        )
        if names:
            lines += [f"## From `{package}`", ""] + _objects(package, names)
    missing = (
        set(jaxpar.__all__) - set(elsewhere) - {n for p in REEXPORTED_FROM for n in _public(p)}
    )
    if missing:
        raise RuntimeError(f"jaxpar exports {sorted(missing)}, which no API page documents")
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):
    """Drops the tag after a fence's language (```bash serve, ```python structured): the
    tests pick their blocks by it, Markdown would not see the fence."""
    return TAGGED_FENCE.sub(r"\1", markdown)


def on_files(files, config):
    generated = {"cli.md": cli_page(), "api/jaxpar.md": jaxpar_page()}
    generated |= {page: api_page(module) for module, page in API_PAGES.items()}
    for path, content in generated.items():
        files.append(File.generated(config, path, content=content))
    return files
