"""Training-free GRPO: the experience library's edits against hand-worked cases (add, modify, delete, keep,
invalid edits, the size bound), reading a judge's reply, the groups a judge is shown, the library in the
system message and on disk; a run changes no weight and resumes with the library it had."""

from __future__ import annotations

import json

import pytest

from localrl.errors import UserError
from localrl.experience import (FILE, HEADER, MAX_LESSON_CHARS, Edit, ExperienceLibrary, contrasting_pairs,
                                judge_request, load_library, parse_edits)


def test_edits_apply_in_order_with_stable_numbers():
    lib = ExperienceLibrary(capacity=3)
    assert lib.apply([Edit("add", text="Carry the one."), Edit("add", text="Check the last digit.")]) == (2, 0)
    assert lib.lessons == {1: "Carry the one.", 2: "Check the last digit."}
    # modify 1, delete 2, keep (neither), then add: the new lesson is number 3, never a reused 2
    assert lib.apply([Edit("modify", 1, "Carry the one into the next column."), Edit("delete", 2), Edit("keep"),
                      Edit("add", text="Add from the right.")]) == (3, 0)
    assert lib.lessons == {1: "Carry the one into the next column.", 3: "Add from the right."}
    assert lib.next_number == 4
    # invalid: a number no lesson has (2 was deleted), modify without text, add without text, a duplicate
    assert lib.apply([Edit("delete", 2), Edit("modify", 1, ""), Edit("add"), Edit("add", text="Add from the right."),
                      Edit("modify", None, "x")]) == (0, 5)
    assert lib.lessons == {1: "Carry the one into the next column.", 3: "Add from the right."}


def test_a_full_library_drops_its_oldest_lesson():
    lib = ExperienceLibrary(capacity=2)
    lib.apply([Edit("add", text=t) for t in ("a", "b", "c")])
    assert lib.lessons == {2: "b", 3: "c"}
    lib.apply([Edit("modify", 2, "b2"), Edit("add", text="d")])  # modify keeps 2's age: 2 is still the oldest
    assert lib.lessons == {3: "c", 4: "d"}


def test_parse_edits_reads_one_edit_a_line_and_ignores_prose():
    reply = ("Sure! Here are the edits:\n"
             "ADD: Always carry the 1 when a column sums to 10 or more.\n"
             "- modify 3: Start from the rightmost digit.\n"
             "2. DELETE 4\n"
             "Delete [5]\n"
             "KEEP\n"
             "MODIFY: no number here\n"
             "add:\n"
             "That is all.")
    assert parse_edits(reply) == [Edit("add", None, "Always carry the 1 when a column sums to 10 or more."),
                                  Edit("modify", 3, "Start from the rightmost digit."), Edit("delete", 4),
                                  Edit("delete", 5), Edit("keep"), Edit("modify", None, "no number here"),
                                  Edit("add", None, "")]
    long = parse_edits("ADD: " + "word " * 100)[0].text
    assert len(long) <= MAX_LESSON_CHARS and long.endswith("word")  # cut at a word
    assert parse_edits("additional thoughts: none") == []  # "ADD" must be a word of its own


def test_the_judge_sees_groups_that_part_into_right_and_wrong():
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "What is 2 + 2?", "answer": "4"},
            {"prompt": "What is 3 + 3?", "answer": "6"}]
    completions = ["r0", "w0", "r0b", "w1", "w1b", "w1c", "r2", "r2b", "r2c"]
    correct = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert contrasting_pairs(rows, completions, correct, 3) == [(rows[0], "r0", "w0")]
    lib = ExperienceLibrary()
    lib.apply([Edit("add", text="Carry the one.")])
    messages = judge_request("What is 1 + 1?", "2", "r0", "w0", lib)
    assert [m["role"] for m in messages] == ["system", "user"]
    user = messages[1]["content"]
    for part in ("What is 1 + 1?", "Reference answer: 2", "r0", "w0", "[1] Carry the one."):
        assert part in user


def test_the_library_follows_the_system_message_and_round_trips(tmp_path):
    lib = ExperienceLibrary(capacity=5)
    assert lib.system("Be brief.") == "Be brief." and lib.system(None) is None  # empty: nothing changes
    lib.apply([Edit("add", text="Carry the one."), Edit("add", text="Check the sum.")])
    assert lib.system("Be brief.") == f"Be brief.\n\n{HEADER}\n[1] Carry the one.\n[2] Check the sum."
    assert lib.system(None) == f"{HEADER}\n[1] Carry the one.\n[2] Check the sum."
    path = lib.save(tmp_path)
    assert path == tmp_path / FILE and json.loads(path.read_text())["lessons"][1] == {"number": 2, "text": "Check the sum."}
    back = load_library(tmp_path)
    assert back == lib and load_library(path) == lib


def test_a_missing_or_broken_library_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="no experience.json there"):
        load_library(tmp_path)
    (tmp_path / FILE).write_text('{"lessons": 3}')
    with pytest.raises(UserError, match="not an experience library"):
        load_library(tmp_path)
