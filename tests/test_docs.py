"""Every `localrl ...` command written in the README and docs/ parses as written: the command and its flags
exist, config-field values have their field's type, choices are among the choices (argparse and
config_io.split_overrides, as `localrl` itself reads a command line, without running it)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from localrl.cli import FIELD_COMMANDS, _parse
from localrl.config_io import split_overrides

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_SEPARATORS = re.compile(r"\s(?:&&|\|\||\||;)\s")


def fenced_lines(text: str) -> list[str]:
    """The lines of the page's fenced blocks, backslash continuations joined."""
    lines, fence, joined = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence:
            joined += line.rstrip()
            if joined.endswith("\\"):
                joined = joined[:-1] + " "
                continue
            lines.append(joined.strip())
            joined = ""
    return lines


def commands(page: Path) -> list[str]:
    """The `localrl` invocations in a page's fenced blocks: one per shell segment, a prompt's `$ ` and a
    leading `/usr/bin/time -v` or environment assignment dropped. Synopses (`[--flag X]`, `A|B`, `...`)
    are not commands."""
    found = []
    for line in fenced_lines(page.read_text()):
        line = line.removeprefix("$ ")
        for segment in SHELL_SEPARATORS.split(line):
            segment = segment.split(" #", 1)[0].strip().removesuffix("&").strip()
            segment = re.sub(r"^(?:/usr/bin/time(?: -v)? |[A-Z_]+=\S+ )+", "", segment)
            if not segment.startswith("localrl ") or re.search(r"\[|\]|\.\.\.|\w\|\w", segment):
                continue
            if re.match(r"localrl \S+ \(", segment):  # a benchmark's output row ("localrl steps (s): ..."), not a command
                continue
            found.append(segment)
    return found


ALL = [(page.relative_to(ROOT).as_posix(), command) for page in PAGES for command in commands(page)]


def test_the_pages_have_commands_to_check():
    pages = {page for page, _ in ALL}
    assert "README.md" in pages and len(pages) >= 8 and len(ALL) >= 30, (pages, len(ALL))


@pytest.mark.parametrize("page, command", ALL, ids=[f"{p}:{c[:60]}" for p, c in ALL])
def test_a_documented_command_parses(page, command):
    argv = shlex.split(command)[1:]
    if argv and argv[0] in FIELD_COMMANDS:
        _, rest = split_overrides(argv[1:], FIELD_COMMANDS[argv[0]])
        _parse([argv[0], *rest])
    else:
        _parse(argv)


def test_every_relative_link_resolves():
    missing = [(page.name, m.group(1)) for page in PAGES
               for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
               if not m.group(1).startswith(("http://", "https://")) and not (page.parent / m.group(1)).exists()]
    assert not missing, missing


def test_the_readme_is_one_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300  # each topic's details live in docs/


def test_the_docs_site_builds_with_every_page(tmp_path):
    """mkdocs (what TRL's users meet) builds docs/ as a static site; --strict fails on a page missing from the
    nav, a nav entry without its page, or a broken link between pages."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    pages = sorted(p.relative_to(ROOT / "docs").with_suffix("").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    built = [p for p in pages if (tmp_path / "site" / ("" if p == "index" else p) / "index.html").is_file()]
    assert built == pages and len(pages) >= 14


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end != -1 else len(text)]


def test_the_trl_page_maps_names_both_configs_have():
    """docs/coming-from-trl.md's tables against TRL's GRPOConfig and localrl's TrainConfig: a field renamed or
    dropped on either side fails here, not on the page."""
    import dataclasses

    trl = pytest.importorskip("trl")
    from localrl.config import FIELDS

    grpo = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    text = (ROOT / "docs" / "coming-from-trl.md").read_text()
    same = re.findall(r"^\| `(\w+)` \|$", _section(text, "## Same name"), re.M)
    assert len(same) >= 20 and all(n in grpo and n in FIELDS for n in same), \
        [n for n in same if n not in grpo or n not in FIELDS]
    renamed = re.findall(r"^\| `(\w+)` \| ((?:`\w+`(?:, )?)+) \|", _section(text, "## Different name"), re.M)
    ours = [(theirs, re.findall(r"`(\w+)`", mine)) for theirs, mine in renamed]
    assert len(ours) >= 10
    assert all(theirs in grpo and theirs not in FIELDS and all(m in FIELDS for m in mine) for theirs, mine in ours), ours
    shared = {n for n in grpo & set(FIELDS)}
    assert shared <= set(same), f"same in both, missing from the page: {sorted(shared - set(same))}"
