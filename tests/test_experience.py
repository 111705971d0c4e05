"""Training-free GRPO: the experience library's edits against hand-worked cases (add, modify, delete, keep,
invalid edits, the size bound), reading a judge's reply, the groups a judge is shown, the library in the
system message and on disk; a run changes no weight and resumes with the library it had."""

from __future__ import annotations

import json

import pytest

from localrl.errors import UserError
from localrl.policy.experience import (HEADER, MAX_LESSON_CHARS, Edit, ExperienceLibrary, contrasting_pairs,
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
    # invalid: a number no lesson has (2 was deleted), modify without text, add without text, a duplicate,
    # modify without a number, and texts that are not lessons (fewer than three words of letters)
    assert lib.apply([Edit("delete", 2), Edit("modify", 1, ""), Edit("add"), Edit("add", text="Add from the right."),
                      Edit("modify", None, "Carry the one."), Edit("add", text="7634 + 588 = 1349"),
                      Edit("add", text="68"), Edit("modify", 1, "carry 1 always")]) == (0, 8)
    assert lib.lessons == {1: "Carry the one into the next column.", 3: "Add from the right."}


def test_a_full_library_drops_its_oldest_lesson():
    lib = ExperienceLibrary(capacity=2)
    a, b, c, d = (f"Lesson {x} is here." for x in "abcd")
    lib.apply([Edit("add", text=t) for t in (a, b, c)])
    assert lib.lessons == {2: b, 3: c}
    lib.apply([Edit("modify", 2, "Lesson b changed."), Edit("add", text=d)])  # modify keeps 2's age: still the oldest
    assert lib.lessons == {3: c, 4: d}


def test_the_library_keeps_to_the_room_the_prompt_has_for_it():
    """``within`` (here: at most 100 characters of the block, header and numbers included) bounds the lessons: an
    addition drops the oldest to fit, a lesson too long alone and a modification that would not fit are invalid."""
    lib = ExperienceLibrary(capacity=12, within=lambda block: len(block) <= 100)
    a, b = "Carry the one into the next column.", "Add from the right, digit by digit."
    assert lib.apply([Edit("add", text=a), Edit("add", text=b)]) == (2, 0)
    assert lib.lessons == {2: b}  # header 48 + two numbered lessons of 40 would be 130
    assert lib.apply([Edit("add", text="A lesson far too long " * 4), Edit("modify", 2, "Add " * 20)]) == (0, 2)
    assert lib.lessons == {2: b} and lib.next_number == 3
    roomy = ExperienceLibrary(capacity=12, lessons={1: a, 2: b}, next_number=3)
    roomy.within = lib.within
    assert roomy.trim() == 1 and roomy.lessons == {2: b}
    assert roomy == ExperienceLibrary(12, {2: b}, 3)  # (the room is not part of what a library is)


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
    path = lib.save(tmp_path / "experience.json")
    assert path.is_file() and json.loads(path.read_text())["lessons"][1] == {"number": 2, "text": "Check the sum."}
    back = load_library(tmp_path)
    assert back == lib and load_library(path) == lib


def test_lessons_written_by_hand_read_from_a_text_file(tmp_path):
    (tmp_path / "lessons.txt").write_text("Carry the one into the next column.\n\n  Check the last digit twice.\n")
    assert load_library(tmp_path / "lessons.txt").lessons == {1: "Carry the one into the next column.",
                                                              2: "Check the last digit twice."}


def test_a_missing_or_broken_library_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="no experience.json there"):
        load_library(tmp_path)
    (tmp_path / "experience.json").write_text('{"lessons": 3}')
    with pytest.raises(UserError, match="not an experience library"):
        load_library(tmp_path)
    with pytest.raises(UserError, match="no such file"):
        load_library(tmp_path / "lessons.txt")


def _seeded_library(path) -> str:
    lib = ExperienceLibrary()
    lib.apply([Edit("add", text="Carry the one into the next column.")])
    return str(lib.save(path / "experience.json"))


def _lora(run_dir, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "adapter_model.safetensors"))


def test_a_run_changes_no_weight_and_resumes_with_its_library(builtin_model, tmp_path):
    """The built-in policy with a random-weight judge (a real model, whose replies are rarely edits): the
    judge sees the groups that part, the adapter stays its initial no-op, the library is saved with each
    checkpoint, and a resumed run equals the uninterrupted one."""
    import torch

    from localrl.training.loop import resume_config, train
    from tests.helpers import QUIET, make_tiny_model, small, train_records

    judge = make_tiny_model(tmp_path / "judge", "llama", context=2048)
    kw = dict(objective="experience", experience_judge=str(judge), experience_judge_tokens=16, save_every=1,
              keep_checkpoints=3)
    full = train(small(tmp_path / "full", steps=3, **kw), **QUIET)
    records = train_records(full.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3] and sum(r["judged_groups"] for r in records) > 0
    assert all(r["loss"] == 0.0 and r["judge_reply"].startswith("ADD:") for r in records if r["judged_groups"])
    first, last = _lora(full.run_dir, 1), _lora(full.run_dir, 3)
    assert all(torch.equal(first[k], last[k]) for k in first)
    assert all(not v.any() for k, v in first.items() if "lora_B" in k)  # LoRA's zero init: the base model itself
    library = load_library(full.run_dir)
    state = torch.load(full.run_dir / "checkpoints" / "step-000003" / "trainer_state.pt", weights_only=False)
    assert state["run_state"]["experience"] == library.state()
    part = train(small(tmp_path / "part", steps=1, **kw), **QUIET)
    train(resume_config(part.run_dir, {"steps": 3}), resume=True, **QUIET)
    assert train_records(part.run_dir) == records and load_library(part.run_dir) == library


@pytest.mark.slow
def test_the_lessons_reach_the_model_in_training_eval_and_chat(builtin_model, tmp_path):
    """A run started from a library gives its lessons to the model: tiny-arith, which never saw a system
    message, stops answering right with one (the lessons are in its prompt), in the run's evaluations, in
    `localrl eval` of the run or of the model with --experience, and in chat."""
    from localrl.commands.eval import evaluate_policy
    from localrl.config import TrainConfig
    from localrl.training.loop import resume_config, train
    from tests.helpers import QUIET, localrl, make_tiny_model, small

    judge = make_tiny_model(tmp_path / "judge", "llama", context=2048)
    (tmp_path / "lib").mkdir()
    seed = _seeded_library(tmp_path / "lib")
    run = train(small(tmp_path / "run", steps=1, eval_size=32, objective="experience", experience_judge=str(judge),
                      experience_init=seed, experience_judge_tokens=16), **QUIET)
    plain = evaluate_policy(TrainConfig(eval_size=32), samples=0)
    assert plain["accuracy"] > 0.2 and run.eval_before["accuracy"] < plain["accuracy"] - 0.2
    assert run.eval_after["accuracy"] == run.eval_before["accuracy"]  # the model did not change, nor the library
    of_run = evaluate_policy(resume_config(run.run_dir, {}), run.run_dir, samples=0)
    with_seed = evaluate_policy(TrainConfig(eval_size=32), samples=0, experience=seed)
    assert of_run["accuracy"] == with_seed["accuracy"] == run.eval_after["accuracy"]
    assert "with the 1 lessons of its experience library" in of_run["model"]
    chats = [localrl("chat", "tiny-arith", *extra, "--temperature", "0", "--max-tokens", "40",
                     input="What is 457 + 68?\n") for extra in ([], ["--experience", run.run_dir])]
    assert all(c.returncode == 0 for c in chats) and "<answer>" in chats[0].stdout
    assert chats[0].stdout != chats[1].stdout  # greedy: only the lessons differ
    bad = localrl("chat", "--experience", tmp_path)
    assert bad.returncode == 2 and "no experience.json there" in bad.stderr


def test_bad_experience_settings_fail_before_loading(builtin_model, tmp_path):
    from localrl.config import TrainConfig
    from localrl.training.loop import preflight
    from localrl.training.settings import check_config

    with pytest.raises(UserError, match="experience_init: experience .*: no experience.json there"):
        preflight(TrainConfig(objective="experience", experience_init=str(tmp_path), run_dir=str(tmp_path / "r")))
    # the built-in model's 256-token context cannot hold a judge request: name a judge
    with pytest.raises(UserError, match="experience_judge: the policy model tiny-arith .* context of 256 tokens"):
        preflight(TrainConfig(objective="experience", run_dir=str(tmp_path / "r")))
    with pytest.raises(UserError, match="experience_judge: needs objective experience"):
        check_config(TrainConfig(experience_judge="tiny-arith"))
