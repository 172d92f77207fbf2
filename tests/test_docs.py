"""The README and the pages of ``docs/`` (and ``bench/README.md``) against the code, so what they say of a
flag, a default or a signature can't drift from what agentenv.py does:

* every synopsis of a command (``python agentenv.py CMD ...``) names only flags that command has, with
  its choices and, where it shows one, its default; the reference page's synopsis of each command names
  every flag it has;
* ``build_app``'s signature, as the README and the reference page print it, is the function's;
* the reference page's settings table has a row for every setting, with its flag, its default and the
  commands that take it;
* every link to a page, a file or a heading leads somewhere, every page of ``docs/`` is linked from the
  README, and the README stays a map (at most 600 lines).

Fast: it reads files and builds the argument parser, nothing more.
"""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

import agentenv
from tests.harness import REPO

README = REPO / "README.md"
REFERENCE = REPO / "docs" / "reference.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
COMMANDS = ("check", "serve", "write-gym", "eval")


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's own parser, as ``command_line()`` builds it."""
    parser = agentenv.command_line()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def options(command: str) -> dict[str, argparse.Action]:
    """A command's flags (its long option strings, --help aside) and their actions."""
    return {flag: action for action in parsers()[command]._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"}


def synopses(page: Path) -> list[tuple[str, str]]:
    """Each ``python agentenv.py CMD ...`` of a page, joined into one line: (CMD, the text after it).
    In a code span it runs to the span's end; in a code block, to the end of its line, and on over
    lines that a backslash continues or that are indented under it."""
    text, found = page.read_text(), []
    for match in re.finditer(r"python agentenv\.py (check|serve|write-gym|eval)\b", text):
        before, rest = text[:match.start()], text[match.end():]
        in_block = before.count("```") % 2 == 1
        if not in_block:
            taken = rest[:rest.find("`")]
        else:
            lines = rest.split("\n")
            kept = [lines[0]]
            for line in lines[1:]:
                if not (kept[-1].rstrip().endswith("\\") or line.startswith((" ", "\t"))):
                    break
                kept.append(line)
            taken = "\n".join(kept)
        found.append((match.group(1), " ".join(taken.replace("\\", " ").split())))
    return found


PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_:=.\[\],]*")


def shown_default(action: argparse.Action) -> object:
    """What a synopsis shows as the flag's default: the parser's, else the setting's."""
    if action.default is not None:
        return action.default
    return getattr(agentenv.Settings, action.dest, None) if action.dest in agentenv.Settings.names() \
        else None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_synopsis_names_the_commands_own_flags_choices_and_defaults(page):
    for command, text in synopses(page):
        flags = options(command)
        for flag in re.findall(r"--[a-z][a-z-]*", text):       # an example's flags too
            assert flag in flags, f"{page.name}: {command} has no flag {flag} ({text[:120]}...)"
        # a synopsis's [--flag VALUE]: its choices, or its default (a placeholder says neither)
        for flag, value in re.findall(r"\[(--[a-z][a-z-]*)(?: ([^\]]+))?\]", text):
            action = flags[flag]
            if not value or PLACEHOLDER.fullmatch(value):
                continue
            if "|" in value:
                assert tuple(value.split("|")) == tuple(action.choices or ()), \
                    f"{page.name}: {command} {flag} offers {action.choices}, not {value}"
                continue
            default = shown_default(action)
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                assert float(value) == float(default), \
                    f"{page.name}: {command} {flag}'s default is {default:g}, not {value}"
            else:
                assert value == str(default), f"{page.name}: {command} {flag}'s default is {default!r}"


def test_the_reference_pages_synopsis_of_each_command_names_every_flag_it_has():
    said = {command: set() for command in COMMANDS}
    for command, text in synopses(REFERENCE):
        said[command] |= set(re.findall(r"--[a-z][a-z-]*", text))
    for command in COMMANDS:
        assert said[command] == set(options(command)), \
            (command, "missing:", set(options(command)) - said[command],
             "not a flag:", said[command] - set(options(command)))


def signature_of(function) -> str:
    """A function's signature as the pages print it: names and defaults, no annotations."""
    parts, starred = [], False
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind is parameter.KEYWORD_ONLY and not starred:
            parts.append("*")
            starred = True
        if parameter.kind is parameter.VAR_KEYWORD:
            parts.append(f"**{name}")
        elif parameter.default is parameter.empty:
            parts.append(name)
        else:
            default = parameter.default
            parts.append(f'{name}="{default}"' if isinstance(default, str) else f"{name}={default!r}")
    return f"{function.__name__}({', '.join(parts)})"


@pytest.mark.parametrize("page", [README, REFERENCE], ids=["README.md", "docs/reference.md"])
def test_build_apps_signature_in_the_pages_is_the_functions(page):
    printed = re.findall(r"^build_app\(.*\)$", page.read_text(), re.M)
    assert printed == [signature_of(agentenv.build_app)], printed
    text = REFERENCE.read_text()
    for function in (agentenv.trl_environment, agentenv.trl_dataset, agentenv.trl_reward):
        assert signature_of(function) in text, signature_of(function)


def settings_rows() -> dict[str, list[str]]:
    rows = {}
    for line in REFERENCE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 5:
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_the_settings_table_has_every_setting_with_its_flag_default_and_commands():
    rows = settings_rows()
    named = [name for name in agentenv.Settings.names()
             if not getattr(agentenv.Settings.DECLARED.get(name), "gym_global", False)]
    assert sorted(rows) == sorted(named), set(rows) ^ set(named)
    for name in named:
        flag, default, taken, _ = rows[name]
        assert flag == f"`{agentenv.flag(name)}`", (name, flag)
        value = agentenv.Settings.DECLARED[name].default if name in agentenv.Settings.DECLARED \
            else getattr(agentenv.Settings, name)
        shown = "none" if value in (None, ()) else f"`{value}`" if isinstance(value, str) \
            else str(agentenv._plain(value))
        assert default == shown, (name, default, shown)
        takers = [c for c in COMMANDS if any(a.dest == name for a in options(c).values())]
        assert sorted(t.strip() for t in taken.split(",")) == sorted(takers), (name, taken, takers)


def anchors(page: Path) -> set[str]:
    """The anchors a page's headings make, as GitHub makes them."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_leads_somewhere(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name} links to {target}, which is not there"
        if anchor:
            assert anchor in anchors(linked), f"{page.name} links to {target}: no such heading"


def test_the_readme_is_a_map_that_links_every_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 600, "the README is a map: move the reference into docs/"
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"](docs/{page.name}" in text, f"the README does not link docs/{page.name}"
    assert "](bench/README.md)" in text
