"""GGUF export: every file is loaded in llama.cpp and compared with the torch model it came from."""

import json

import gguf
import pytest
import torch

from localrl.errors import UserError
from localrl.quant import gguf_writer
from localrl.quant.export import export
from tests.helpers import make_tiny_model


@pytest.fixture(scope="module")
def bpe_models(tmp_path_factory):
    """Tiny random models of each family with a trained BPE tokenizer; one with tied embeddings;
    Llama 2 and Mistral style ones with a SentencePiece tokenizer (one with ChatML tokens added)."""
    root = tmp_path_factory.mktemp("bpe-models")
    models = {arch: make_tiny_model(root / arch, arch, tokenizer="bpe")
              for arch in ("llama", "mistral", "qwen2", "qwen3")}
    models["qwen2-tied"] = make_tiny_model(root / "qwen2-tied", "qwen2", tie=True, tokenizer="bpe")
    models["llama3-bpe"] = make_tiny_model(root / "llama3-bpe", "llama", tokenizer="bpe-llama3")
    models["llama-spm"] = make_tiny_model(root / "llama-spm", "llama", tokenizer="spm")
    models["mistral-spm-chatml"] = make_tiny_model(root / "mistral-spm-chatml", "mistral", tokenizer="spm-chatml")
    return models


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "qwen2-tied", "llama3-bpe", "llama-spm",
                                  "mistral-spm-chatml"])
def test_export_passes_llama_cpp_validation(bpe_models, tmp_path, name, quant):
    out = tmp_path / f"{name}.gguf"
    result = export(bpe_models[name], out, quant, log=lambda *_: None)
    report = result.report
    assert report.passed, report.describe()
    assert report.tokens_identical
    if quant in ("f16", "q8_0"):
        assert report.top1_agreement >= (0.99 if quant == "f16" else 0.90)
        assert report.decisive_agreement >= (0.99 if report.decisive_positions >= 20 else 1.0)
    if quant == "q8_0":  # random weights have few decisive positions; the report says when the gate had too few
        assert bool(report.notes) == (report.decisive_positions < 20), report.describe()
    if quant == "f16":
        assert report.greedy_identical
    assert not list(tmp_path.glob(".tmp-*"))


def test_metadata_reads_back(bpe_models, tmp_path):
    out = tmp_path / "q3.gguf"
    export(bpe_models["qwen3"], out, "f16", check=False, log=lambda *_: None)
    fields = gguf.GGUFReader(out).fields
    value = lambda key: fields[key].contents()
    config = json.loads((bpe_models["qwen3"] / "config.json").read_text())
    assert value("general.architecture") == "qwen3"
    assert value("qwen3.block_count") == config["num_hidden_layers"]
    assert value("qwen3.attention.head_count_kv") == config["num_key_value_heads"]
    assert value("qwen3.attention.key_length") == config["head_dim"]
    assert value("tokenizer.ggml.model") == "gpt2"
    assert value("tokenizer.ggml.pre") == "gpt-2"
    assert len(value("tokenizer.ggml.tokens")) == config["vocab_size"]
    assert len(value("tokenizer.ggml.merges")) > 100
    tokenizer_config = json.loads((bpe_models["qwen3"] / "tokenizer_config.json").read_text())
    assert value("tokenizer.chat_template") == (bpe_models["qwen3"] / "chat_template.jinja").read_text() \
        or value("tokenizer.chat_template") == tokenizer_config.get("chat_template")
    eos = value("tokenizer.ggml.eos_token_id")
    assert value("tokenizer.ggml.tokens")[eos] == "<|im_end|>" == value("tokenizer.ggml.tokens")[
        value("tokenizer.ggml.eot_token_id")]
    types = value("tokenizer.ggml.token_type")
    assert types[eos] == gguf.TokenType.CONTROL
    assert types[value("tokenizer.ggml.tokens").index("<think>")] == gguf.TokenType.USER_DEFINED
    names = {t.name for t in gguf.GGUFReader(out).tensors}
    assert "blk.0.attn_q_norm.weight" in names and "output.weight" in names


def test_modelfile_beside_the_gguf(bpe_models, tmp_path):
    out = tmp_path / "m.gguf"
    export(bpe_models["qwen2"], out, "f16", check=False, log=lambda *_: None)
    text = (tmp_path / "m.Modelfile").read_text()
    assert text.startswith("FROM ./m.gguf\n")
    assert 'TEMPLATE """' in text and "{{ .Role }}" in text and text.count("<|im_start|>assistant") == 1
    assert 'PARAMETER stop "<|im_end|>"' in text and "PARAMETER num_ctx 256" in text


def test_every_metadata_key_written_reads_back(bpe_models, tmp_path, monkeypatch):
    written = {}
    original = gguf.GGUFWriter.write_kv_data_to_file

    def record(self):
        written.update({k: v.value for k, v in self.kv_data[0].items()})
        return original(self)

    monkeypatch.setattr(gguf.GGUFWriter, "write_kv_data_to_file", record)
    out = tmp_path / "all.gguf"
    export(bpe_models["llama"], out, "f16", check=False, log=lambda *_: None)  # quantised types: llama.cpp's keys
    fields = gguf.GGUFReader(out).fields
    assert len(written) > 20
    for key, value in written.items():
        got = fields[key].contents()
        if isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-6), key
        else:
            assert got == (list(value) if isinstance(value, (list, tuple)) else value), key


def test_tied_embeddings_write_no_output_tensor(bpe_models, tmp_path):
    out = tmp_path / "tied.gguf"
    export(bpe_models["qwen2-tied"], out, "f16", check=False, log=lambda *_: None)
    names = {t.name for t in gguf.GGUFReader(out).tensors}
    assert "token_embd.weight" in names and "output.weight" not in names


def test_missing_rotary_permutation_is_caught(bpe_models, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_writer, "_permute_rotary", lambda w, n_head: w)
    result = export(bpe_models["llama"], tmp_path / "bad.gguf", "f32", log=lambda *_: None)
    assert not result.report.passed and result.path is None
    assert list(tmp_path.iterdir()) == []  # a file that failed validation is not kept, nor its Modelfile


def test_a_failed_write_leaves_no_file(bpe_models, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)  # fails before any Modelfile
    with pytest.raises(RuntimeError, match="disk full"):
        export(bpe_models["qwen2"], tmp_path / "x.gguf", "f16", check=False, log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_export_errors_are_one_line(tmp_path, builtin_model):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UserError, match="supported: llama, mistral, qwen2, qwen3"):
        export(tmp_path / "gpt2", tmp_path / "x.gguf", log=lambda *_: None)
    with pytest.raises(UserError, match="unknown quant type 'q3_x'"):
        export(builtin_model, tmp_path / "x.gguf", "q3_x", log=lambda *_: None)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('[train]\nmodel = "tiny-arith"\n')
    with pytest.raises(UserError, match="has no checkpoint yet"):
        export(run, tmp_path / "x.gguf", log=lambda *_: None)
    ckpt = run / "checkpoints" / "step-000001"
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_config.json").write_text("{}")
    (ckpt / "adapter_model.safetensors").write_bytes(b"broken")
    with pytest.raises(UserError, match="adapter step-000001 cannot be loaded"):
        export(run, tmp_path / "x.gguf", log=lambda *_: None)


@pytest.mark.slow
def test_fine_tuned_builtin_model_exports_merged_and_validates(builtin_model, tmp_path):
    from localrl.config import TrainConfig
    from localrl.training.loop import train

    cfg = TrainConfig(steps=2, prompts_per_step=4, group_size=4, eval_size=0, run_dir=str(tmp_path / "run"))
    run = train(cfg, log=lambda *_: None).run_dir
    for quant in ("f16", "q8_0", "q4_0"):
        lines = []
        result = export(run, tmp_path / f"tiny-{quant}.gguf", quant, log=lines.append)
        assert "merged onto the full-precision (float32) base" in result.source
        assert lines[0].endswith(f"loading {run} and merging its adapter")
        assert result.report.passed, result.report.describe()


@pytest.mark.slow
def test_k_quant_through_llama_cpps_quantizer(builtin_model, tmp_path, capfd):
    out, lines = tmp_path / "k.gguf", []
    result = export(builtin_model, out, "q4_k_m", log=lines.append)
    # llama.cpp's warning for each tensor whose rows do not divide into 256-wide blocks (29 of them, printed to
    # stderr), said once instead
    assert "falling back" not in capfd.readouterr().err
    [note] = [line for line in lines if line.startswith("note: ")]
    assert note.startswith("note: 29 tensors' rows do not divide into q4_k_m's blocks, so llama.cpp gave them another "
                           "type: q4_K -> q5_0 for 25 (token_embd.weight, blk.*.attn_k.weight"), note
    stages = [line.split("] ", 1)[1] for line in lines if line.startswith("[")]  # each stage says when it starts
    assert [s.split(" (")[0] for s in stages] == [f"loading {builtin_model}", "writing an f16 GGUF",
                                                  "validating the f16 file in llama.cpp", "quantising to q4_k_m",
                                                  "validating the q4_k_m file in llama.cpp"], lines
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert result.report.passed and result.report.tokens_identical and result.report.top1_agreement >= 0.9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.Modelfile", "k.gguf"]  # no f16 or temp file left


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "yarn-8x": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
}


def _rope_model(tmp_path, params):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.helpers import train_bpe_tokenizer

    tok = train_bpe_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters=params, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


@pytest.mark.parametrize("kind", sorted(ROPE_SCALINGS))
def test_rope_scaling_is_written_and_needed(tmp_path, monkeypatch, kind):
    model = _rope_model(tmp_path, ROPE_SCALINGS[kind])
    assert export(model, tmp_path / "ok.gguf", "f32", log=lambda *_: None).report.passed
    monkeypatch.setattr(gguf_writer, "_rope", lambda config: {})  # the same export without the scaling
    assert not export(model, tmp_path / "bad.gguf", "f32", log=lambda *_: None).report.passed


@pytest.mark.parametrize("params, message", [
    ({"rope_type": "dynamic", "factor": 4.0}, "rope scaling 'dynamic' is not supported yet"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0},
     "YaRN with {'beta_fast': 16.0} is not supported"),
])
def test_unsupported_rope_scaling_is_refused(tmp_path, params, message):
    model = _rope_model(tmp_path, {**params, "rope_theta": 10000.0})
    with pytest.raises(UserError, match=message):
        export(model, tmp_path / "x.gguf", log=lambda *_: None)


def _read_fields(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}


@pytest.mark.parametrize("name, pre", [("llama", "gpt-2"), ("qwen2", "qwen2"), ("llama3-bpe", "llama-bpe")])
def test_pre_tokenizer_name(bpe_models, tmp_path, name, pre):
    fields = _read_fields(export(bpe_models[name], tmp_path / "x.gguf", check=False, log=lambda *_: None).path)
    assert fields["tokenizer.ggml.pre"] == pre


def test_sentencepiece_vocabulary_metadata(bpe_models, tmp_path):
    from transformers import AutoTokenizer

    fields = _read_fields(export(bpe_models["llama-spm"], tmp_path / "spm.gguf", check=False, log=lambda *_: None).path)
    tok = AutoTokenizer.from_pretrained(bpe_models["llama-spm"])
    tokens, types, scores = (fields[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores"))
    assert fields["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.merges" not in fields
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and types[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL,
                                                                      gguf.TokenType.CONTROL]
    assert tokens[3:259] == [f"<0x{i:02X}>" for i in range(256)] and set(types[3:259]) == {gguf.TokenType.BYTE}
    # merged pieces score in merge order, as in the SentencePiece model they came from
    import sentencepiece

    spm = sentencepiece.SentencePieceProcessor(model_file=str(bpe_models["llama-spm"].with_name("llama-spm-spm")
                                                              / "tokenizer.model"))
    merged = [i for i in range(259, spm.get_piece_size()) if len(tokens[i]) > 1]
    assert [tokens[i] for i in merged] == [spm.id_to_piece(i) for i in merged]
    assert sorted(merged, key=lambda i: -scores[i]) == sorted(merged, key=lambda i: -spm.get_score(i))
    assert fields["tokenizer.ggml.add_space_prefix"] is True
    assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.add_eos_token"] is False
    assert fields["tokenizer.ggml.bos_token_id"] == tok.bos_token_id == 1
    assert fields["tokenizer.ggml.unknown_token_id"] == 0


def test_sentencepiece_scores_decide_tokenisation(bpe_models, tmp_path, monkeypatch):
    """Equal scores (what a converter writes when it has none) make llama.cpp merge in the wrong order."""
    monkeypatch.setattr(gguf_writer, "_spm_scores", lambda tokens, _: [-1000.0] * len(tokens))
    report = export(bpe_models["llama-spm"], tmp_path / "flat.gguf", log=lambda *_: None).report
    assert not report.tokens_identical and "tokenisation differs" in report.failures


def test_unsupported_vocabulary_is_refused_before_weights_load(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    vocab = [("<unk>", 0.0), ("▁a", -1.0), ("a", -2.0)]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.Unigram(vocab, unk_id=0)), unk_token="<unk>")
    LlamaConfig(vocab_size=3, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not weights")  # never read
    with pytest.raises(UserError, match="Unigram tokenizers are not supported"):
        export(tmp_path / "m", tmp_path / "x.gguf", log=lambda *_: None)
    assert not (tmp_path / "x.gguf").exists()


def test_a_near_tie_does_not_decide_the_q8_0_gate_and_a_clear_flip_does():
    import numpy as np

    from localrl.quant.gguf_check import DECISIVE_MARGIN, top1_counts

    ours = np.array([[5.0, 4.9, 0.0], [3.0, 0.0, 1.0], [0.0, 2.0, 2.0 - DECISIVE_MARGIN]])  # [T=3, V=3]
    near_tie_flipped = np.array([[4.9, 5.0, 0.0], [3.0, 0.0, 1.0], [0.0, 2.0, 1.0]])
    clear_flipped = np.array([[5.0, 4.9, 0.0], [0.0, 3.0, 1.0], [0.0, 2.0, 1.0]])
    assert top1_counts(ours, ours) == (3, 2, 2)  # position 0 is a near-tie: not decisive
    assert top1_counts(ours, near_tie_flipped) == (2, 2, 2)
    assert top1_counts(ours, clear_flipped) == (2, 2, 1)


def _report(quant: str, top1: float, decisive: int, decisive_agreement: float, median: float = 0.0):
    from localrl.quant.gguf_check import CheckReport, judge

    return judge(CheckReport(quant, True, top1, 0.0, median, True, decisive_agreement=decisive_agreement,
                             decisive_positions=decisive, positions=200, median_rel_logit_error=median))


def test_the_decisive_gate_is_never_skipped_silently():
    """With enough decisive positions f16 and q8_0 are judged on them; with fewer (a random model's near-uniform
    logits) every one of them must still agree, a floor over all positions holds, and the report says so."""
    assert _report("q8_0", 0.90, 40, 1.0).passed  # near-ties flipped elsewhere: not judged
    failed = _report("q8_0", 0.99, 40, 0.975)
    assert not failed.passed and "decisive positions 97.5% < 99%" in failed.describe() and not failed.notes
    # too few: announced, and still judged on the ones there are
    few = _report("q8_0", 0.80, 5, 1.0, median=0.035)  # a random 1.5B-shape q8_0 file's figures
    assert few.passed and few.notes == ["only 5 decisive positions (fewer than 20): q8_0 needs all of them to agree "
                                        "and its logits within 10% of their range at the median position"]
    assert "note: only 5 decisive positions" in few.describe()
    flipped = _report("q8_0", 0.99, 5, 0.8)
    assert not flipped.passed and "decisive positions 80.0% of 5 < 100%" in flipped.describe()
    far = _report("q8_0", 0.99, 0, 1.0, median=0.2)
    assert not far.passed and "20.0% of their range at the median position" in far.describe()
    # f16 has the same gate, at 99% over all positions where decisive ones are too few; lower-bit types none
    assert _report("f16", 0.995, 0, 1.0).passed and "99% top-1 agreement" in _report("f16", 0.995, 0, 1.0).notes[0]
    assert not _report("f16", 0.985, 0, 1.0).passed and _report("f16", 0.985, 40, 1.0).passed
    assert not _report("q4_0", 0.5, 3, 0.0).notes and _report("q4_0", 0.5, 3, 0.0).passed


def test_shared_context_is_judged_once_and_greedy_stops_at_a_near_tie():
    from localrl.quant.gguf_check import before_near_tie, decisive_margin, shared_prefix

    system = [1, 2, 3, 4]
    assert shared_prefix(system + [9, 9], []) == 0
    assert shared_prefix(system + [7, 8], [system + [5], system + [7, 1]]) == 5  # the longest common prefix
    assert before_near_tie([3.0, 2.5, 0.1, 4.0], tie=0.5) == 2 and before_near_tie([3.0], tie=0.5) == 1
    assert decisive_margin("f16") < decisive_margin("q8_0")  # quantisation moves logits further than f16


def _closeness(quant: str, median: float, worst: float):
    from localrl.quant.gguf_check import CheckReport, judge

    return judge(CheckReport(quant, True, 1.0, 0.0, worst, True, decisive_agreement=1.0, decisive_positions=40,
                             positions=200, median_rel_logit_error=median))


def test_closeness_is_judged_at_the_median_position_and_loosely_at_the_worst():
    # measured: a merged SmolLM2 f16 file 0.10% / 0.42%; a random Llama without its rope scaling 0.26% / 0.48%
    assert _closeness("f16", 0.0010, 0.0042).passed
    assert "at the median position" in _closeness("f16", 0.0026, 0.0048).failures[0]
    assert "at the worst position" in _closeness("f16", 0.001, 0.02).failures[0]
    assert _closeness("bf16", 0.01, 0.05).passed and _closeness("q8_0", 0.03, 0.08).passed  # q8_0: reported


def test_llama_cpp_loads_without_extra_buffers_on_amx_cpus(monkeypatch):
    """A native llama.cpp build on an AMX CPU faulted in its AMX kernels on a VM that advertised AMX (every
    quantised GGUF killed the process); localrl's loads leave the extra buffer types off there."""
    from localrl.quant.runtime import EXTRA_BUFFERS_ENV, cpu_has_amx, require_llama_cpp

    monkeypatch.delenv(EXTRA_BUFFERS_ENV, raising=False)
    llama_cpp = require_llama_cpp("this test")
    assert llama_cpp.llama_model_default_params().use_extra_bufts is (not cpu_has_amx())
    assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts is (not cpu_has_amx())


def test_an_export_the_free_memory_cannot_hold_stops_before_loading(builtin_model, tmp_path, monkeypatch):
    from localrl.memory import FREE_MEMORY_ENV, export_bytes, read_shape

    assert export_bytes(read_shape(str(builtin_model))) > 0.45 * 2**30  # the libraries, weights and copies
    monkeypatch.setenv(FREE_MEMORY_ENV, "300MB")  # less than the libraries alone
    with pytest.raises(UserError, match=r"export: needs about .* GiB of memory .* 0.29 GiB is free"):
        export(builtin_model, tmp_path / "x.gguf", "q8_0", log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_export_records_each_phase_and_its_resident_peak(builtin_model, tmp_path):
    result = export(builtin_model, tmp_path / "x.gguf", "q8_0", log=lambda *_: None)
    assert list(result.seconds) == ["load", "write", "validate f16", "quantise", "validate"] == list(result.peaks)
    assert all(2**27 < peak < 2**33 for peak in result.peaks.values())  # the whole process, libraries included


def _header_as_gguf_py_reads_it(path):
    """Every key-value pair, array length and tensor of ``path`` as gguf-py's own reader gives them."""
    reader = gguf.GGUFReader(str(path))
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arrays = {k: len(f.data) for k, f in fields.items() if f.types[0] == gguf.GGUFValueType.ARRAY}
    scalars = {k: f.contents() for k, f in fields.items() if k not in arrays}
    tensors = {t.name: (tuple(t.shape.tolist()), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
               for t in reader.tensors}
    return scalars, arrays, tensors


def _agrees_with_gguf_py(path):
    from localrl.quant.gguf_info import read_header

    header = read_header(path)
    assert (header.fields, header.array_lengths, header.tensors) == _header_as_gguf_py_reads_it(path)


@pytest.mark.parametrize("name, quant", [("qwen2-tied", "f16"), ("llama-spm", "q8_0"), ("mistral-spm-chatml", "q4_0")])
def test_the_header_reader_agrees_with_gguf_py(bpe_models, tmp_path, name, quant):
    _agrees_with_gguf_py(export(bpe_models[name], tmp_path / "x.gguf", quant, check=False, log=lambda *_: None).path)


@pytest.mark.real
def test_the_header_reader_agrees_with_gguf_py_on_the_real_model(real_gguf):
    _agrees_with_gguf_py(real_gguf)


def test_a_gguf_cut_anywhere_is_one_error_naming_it(bpe_models, tmp_path):
    from localrl.quant.gguf_info import read_gguf_info, read_header

    data = export(bpe_models["llama-spm"], tmp_path / "x.gguf", check=False, log=lambda *_: None).path.read_bytes()
    header_end = min(first for _, _, first, _ in read_header(tmp_path / "x.gguf").tensors.values())
    cut = tmp_path / "cut.gguf"
    for size in sorted({5, 12, 30, 100, *range(200, header_end, max(header_end // 40, 1)), header_end + 1,
                        len(data) - 1}):
        cut.write_bytes(data[:size])
        with pytest.raises(UserError, match=f"model {cut}: (damaged or )?truncated GGUF"):
            read_gguf_info(cut)
