"""The warm start (`localrl sft`): expert episodes encoded exactly as this model's rollouts hold them, a
gradient that does not depend on the micro-batch size, a run that resumes exactly and raises held-out
success, and GRPO started from its adapter (`--init-adapter`), with one-line errors for what cannot work."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from localrl.envs.shell import expert_call
from localrl.errors import UserError
from localrl.evaluation.plot import Curve, plot_run
from localrl.generation.agent_rollout import TurnFormat
from localrl.modeling import load_policy, pick_device
from localrl.policy.sft import Demo, demo_rollout, end_of_turn, episode_tokens, nll_step
from localrl.training.loop import resume_config, train
from localrl.training.settings import build_config
from tests.helpers import QUIET, one_line, randomise_lora, rel_err, train_records

TURNS = [(expert_call("wc -l < a.txt"), "3\n[exit code 0]"), (expert_call("ls"), "a.txt\n[exit code 0]"),
         ("<answer>3</answer>", "")]


def test_an_expert_episode_is_encoded_as_the_chat_template_renders_it(tiny_models):
    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    fmt = TurnFormat(tok, "You are an agent.")
    end = end_of_turn(fmt, [tok.eos_token_id])
    assert tok.convert_ids_to_tokens(end) == "<|im_end|>"
    prompt, ids, mask = episode_tokens(fmt, "How many lines are in a.txt?", TURNS, end)
    messages = [{"role": "system", "content": "You are an agent."},
                {"role": "user", "content": "How many lines are in a.txt?"}]
    for action, observation in TURNS:
        messages.append({"role": "assistant", "content": action})
        if observation:
            messages.append({"role": "user", "content": f"<tool_response>\n{observation}\n</tool_response>"})
    want = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(prompt + ids) + "\n" == want  # the template's newline after the last <|im_end|> is not sampled
    # the loss covers the agent's own tokens: each turn as written, the answer with its end-of-turn token
    own = tok.decode([t for t, m in zip(ids, mask) if m])
    assert own == "".join(a for a, _ in TURNS) + "<|im_end|>"
    assert tok.decode(prompt) == tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)


@pytest.fixture
def policy(tiny_models):
    cfg = build_config(None, {"model": str(tiny_models["llama"]), "quantize": "none", "objective": "sft"})
    torch.manual_seed(0)
    model, tok = load_policy(cfg, pick_device("cpu"))
    randomise_lora(model)
    return model, tok, cfg


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_the_update_does_not_depend_on_the_micro_batch_size(policy, micro_batch):
    model, tok, cfg = policy
    fmt = TurnFormat(tok, None)
    demos = [Demo("How many lines are in a.txt?", TURNS, 1.0), Demo("List the files.", TURNS[1:], 1.0),
             Demo("Answer.", TURNS[2:], 1.0)]
    rollout = demo_rollout(fmt, demos, end_of_turn(fmt, [tok.eos_token_id]))
    assert rollout.loss_mask.sum() < rollout.completion_mask.sum()  # tool outputs are attended to, not trained on
    start = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}

    def update(size):
        with torch.no_grad():
            for k, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(start[k])
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        loss = nll_step(model, optimizer, rollout, cfg, micro_batch=size)
        return loss, {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}

    loss_all, all_rows = update(0)
    loss_mb, micro = update(micro_batch)
    assert abs(loss_all - loss_mb) < 1e-5 * abs(loss_all)
    assert any((all_rows[k] != start[k]).any() for k in start)
    assert max(rel_err(micro[k] - start[k], all_rows[k] - start[k]) for k in start) < 1e-4


def sft_config(run_dir, **kw):
    base = {"objective": "sft", "steps": 2, "prompts_per_step": 4, "eval_size": 0, "save_every": 1,
            "run_dir": str(run_dir), "seed": 3, "env_workers": 4}
    return build_config(None, {**base, **kw})


def adapter(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "adapter_model.safetensors"))


@pytest.mark.slow
def test_a_warm_start_resumes_exactly_and_grpo_starts_from_its_adapter(tmp_path):
    cfg = sft_config(tmp_path / "full", steps=3)
    assert (cfg.env, cfg.model, cfg.lr) == ("shell", "tiny-shell", 2e-3)  # the presets (lr: what the README measured)
    full = train(cfg, **QUIET)
    part = train(sft_config(tmp_path / "part", steps=1), **QUIET)
    train(resume_config(part.run_dir, {"steps": 3}), resume=True, **QUIET)
    records = train_records(full.run_dir)
    assert records == train_records(part.run_dir)
    assert [r["objective"] for r in records] == ["sft"] * 3 and all(r["demos"] == 4 for r in records)
    a, b = adapter(full.run_dir, 3), adapter(part.run_dir, 3)
    assert all((a[k] == b[k]).all() for k in a) and any((a[k] != 0).any() for k in a if "lora_B" in k)
    curve = Curve("success", rollouts=False)  # as `localrl plot` and the trackers are told by the objective
    assert plot_run(full.run_dir, tmp_path / "curve.png", curve=curve).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # GRPO from the warm start: its masked-out step changes nothing, so the adapter is the warm start's
    grpo = build_config(None, {"env": "shell", "steps": 1, "prompts_per_step": 2, "group_size": 4, "max_turns": 1,
                               "mask_truncated_completions": True, "eval_size": 0, "run_dir": str(tmp_path / "grpo"),
                               "init_adapter": str(full.run_dir)})
    train(grpo, **QUIET)
    c = adapter(tmp_path / "grpo", 1)
    assert all((a[k] == c[k]).all() for k in a)


def test_init_adapter_errors_are_one_line_before_anything_is_written(tmp_path, capsys):
    run = train(sft_config(tmp_path / "sft", steps=1, lora_rank=8, lora_alpha=16), **QUIET).run_dir
    cases = [
        (["--init-adapter", tmp_path / "nowhere"], "init_adapter: .*nowhere: no such directory"),
        (["--init-adapter", tmp_path], "neither a run directory nor a PEFT adapter directory"),
        (["--init-adapter", run], r"its adapter has LoRA rank 8 and alpha 16, this run 16 and 32 \(set --lora-rank 8"),
        (["--init-adapter", run, "--model", "tiny-arith", "--env", ""],
         "init_adapter .*sft: model tiny-arith is not the base this run was trained on"),
    ]
    for flags, message in cases:
        out = tmp_path / "out"
        line = one_line(capsys, "train", "--env", "shell", "--steps", "1", "--eval-size", "0", "--run-dir", out, *flags)
        assert re.search(message, line), line
        assert not out.exists()


def test_sft_needs_an_environment_and_tasks_with_solutions(tmp_path, capsys):
    with pytest.raises(UserError, match=r"sft learns from an environment's expert episodes \(env, e.g. 'shell'\) or "
                                        r"from prompt-completion rows \(data\)"):
        build_config(None, {"objective": "sft", "env": ""})
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"instruction": "Make b.txt.", "files": {}, "check": {"files": {"b.txt": ""}}}) + "\n")
    assert "no training task has a \"solution\"" in one_line(capsys, "sft", "--env-tasks", tasks, "--run-dir",
                                                            tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_warm_start_on_expert_episodes_raises_held_out_success(tmp_path):
    """tiny-shell learned careless habits as often as expert ones; the expert's episodes alone fix many."""
    result = train(sft_config(tmp_path / "run", steps=12, prompts_per_step=8, eval_size=40, lr=2e-3, seed=0),
                   **QUIET)
    before, after = result.eval_before, result.eval_after
    assert after["accuracy"] >= before["accuracy"] + 0.15, (before, after)
    records = train_records(result.run_dir)
    assert records[-1]["loss"] < records[0]["loss"]
    shutil.rmtree(tmp_path / "run")
