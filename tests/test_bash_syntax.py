"""The approval rules read a command line as bash does: the strict reader against bash itself.

The oracle: bash runs each line in the sandbox with every builtin disabled and no PATH, so each command it
would run (builtins, external programs, the insides of substitutions) goes to ``command_not_found_handle``,
which records its words and runs nothing. A line the reader accepts must make bash run exactly commands the
reader found; with ``ls`` always allowed, a line that would run anything else is never allowed.
"""

import random
import re

import pytest

from localrl.agent.approvals import Approvals
from localrl.agent.bash_syntax import Unsure, simple_commands
from localrl.envs.sandbox import Sandbox

BYPASSES = ["ls x#; touch P", "ls #\ntouch P", "ls $'\\'' ; touch P ; echo #'"]  # shlex read each as one `ls`

# Pieces of bash syntax a fuzzer joins at random: quoting forms, comments, substitutions, new lines, here-docs.
PIECES = ["ls", "ls -la", "ls x#", " #", "#", ";", "\n", " touch P", "touch P", "$'\\''", "$'a b'", "'", '"', "\\",
          "\\\n", "$(touch P)", "`touch P`", "<(touch P)", ">(touch P)", "<<EOF\ntouch P\nEOF\n", "<<<x", "{ touch P; }",
          "(touch P)", "&&", "||", "|", "&", "2>&1", "> out", ">/tmp/out", "$HOME", "${x:-$(touch P)}", "*", "x=1",
          "echo", '"$(touch P)"', "'a;b'", '"a\\"b"', "$((1+1))", "|&", ";;", "!", "if", "then", "fi", "ls\\", "l\\s",
          "'l's", '"ls"', "\\;", "a\\#b", "$x", "\t", "<> io", "3<&-", "{a,b}", "~"]


def fuzz_lines(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    while len(lines) < count:
        line = "ls " + "".join(rng.choice(PIECES) + rng.choice(["", " "]) for _ in range(rng.randint(1, 5)))
        if line not in lines:
            lines.append(line)
    return lines


TRACER = """command_not_found_handle() {{ {root}/log "$@"; }}
enable -n $(compgen -b)
"""
# one write a command, so that the commands of a pipeline, which run at once, do not interleave their words
LOGGER = ("#!/bin/sh\nrs=$(printf '\\036'); out=\nfor a; do out=\"$out$a$rs\"; done\n"
          "printf '%s\\035' \"$out\" >> \"$TRACE\"\n")
DRIVER = ("i=0; while [ -e line.$i ]; do TRACE=$PWD/trace.$i BASH_ENV=$PWD/tracer PATH=/nonexistent "
          "/bin/bash -c \"$(cat line.$i)\" >/dev/null 2>&1 </dev/null; : > done.$i; i=$((i+1)); done")


def what_bash_runs(tmp_path, lines: list[str]) -> list[list[list[str]]]:
    """For each line, the words of each command bash would run, in the order it would run them."""
    work = tmp_path / "oracle"
    work.mkdir()
    sandbox = Sandbox(work, timeout=60)
    if sandbox.isolation == "process":
        pytest.skip("no isolation level that keeps a line's redirections off the host")
    (work / "tracer").write_text(TRACER.format(root=sandbox.workdir))
    (work / "log").write_text(LOGGER)
    (work / "log").chmod(0o755)
    for i, line in enumerate(lines):
        (work / f"line.{i}").write_text(line)
    result = sandbox.run(DRIVER)
    assert result.exit_code == 0 and all((work / f"done.{i}").exists() for i in range(len(lines))), result.output
    runs = []
    for i in range(len(lines)):
        trace = work / f"trace.{i}"
        text = trace.read_text() if trace.exists() else ""
        runs.append([c.split("\x1e")[:-1] for c in text.split("\x1d")[:-1]])
    return runs


def matches(words: list[str], command) -> bool:
    """Whether bash ran ``command``: the same words, or where bash expands some, the same command name (the
    reader refuses a name that expands)."""
    return words[0] == command.words[0] if any(command.expands) else words == command.words


def test_the_reader_agrees_with_bash_and_ls_allowed_allows_nothing_else(tmp_path):
    lines = BYPASSES + fuzz_lines(240)
    approvals = Approvals(tmp_path, store=tmp_path / "approvals.json")
    approvals.remember("ls", allow=True)
    runs = what_bash_runs(tmp_path, lines)
    accepted = allowed = 0
    for line, ran in zip(lines, runs):
        decision, why = approvals.decide(line)
        if decision == "allow":
            allowed += 1
            assert ran and all(words[0] == "ls" for words in ran), (line, ran, why)
        try:
            commands = simple_commands(line)
        except Unsure:
            continue
        accepted += 1
        for words in ran:  # everything bash would run, the reader saw
            assert any(matches(words, c) for c in commands), (line, words, [c.words for c in commands])
    for line in BYPASSES:
        assert approvals.decide(line)[0] == "ask", line
    assert accepted >= 40 and allowed >= 10  # the fuzzer reaches both sides (counts seen: see the assert message)
    assert any(["touch", "P"] in ran for ran in runs[:3])  # the oracle sees the bypasses' hidden commands


@pytest.mark.parametrize("line, why", [
    ("ls x#; touch P", None), ("ls #\ntouch P", "a comment"), ("ls $'\\'' ; touch P", "$'...' quoting"),
    ("ls `id`", "backticks"), ("ls $(id)", "substitution"), ("cat <<EOF\nx\nEOF", "here-document"),
    ("ls \\\n; touch P", "backslash before a new line"), ("ls > /etc/x", "outside the working directory"),
    ("ls > ../x", "outside the working directory"), ("(ls)", "subshell"), ("{ ls; }", "reserved word"),
    ("x=1 ls", "assignment"), ("$X", "expands"), ("ls |", "ends in"), ("ls ${x}", "${...}"),
])
def test_what_the_reader_refuses_it_names(line, why):
    if why is None:
        assert [c.words for c in simple_commands(line)] == [["ls", "x#"], ["touch", "P"]]
        return
    with pytest.raises(Unsure, match=re.escape(why)):
        simple_commands(line)


def test_words_and_redirections_as_bash_reads_them():
    commands = simple_commands("ls -la 'a b' \"c\\\"d\" e\\ f 2>&1 > out.txt | wc -l && git status;x\n echo 'a;b' &")
    assert [c.words for c in commands] == [["ls", "-la", "a b", 'c"d', "e f"], ["wc", "-l"], ["git", "status"],
                                           ["x"], ["echo", "a;b"]]
    assert commands[0].redirections == [("2>&", "1"), (">", "out.txt")]
    assert simple_commands("ls 2>/dev/null")[0].redirections == [("2>", "/dev/null")]
