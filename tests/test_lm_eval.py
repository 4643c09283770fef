"""jaxkv.lm_eval.JaxkvLM in lm-evaluation-harness: on a tiny random Llama saved with a
character tokenizer, and tiny tasks defined here from local files (multiple choice, rolling
log-likelihood, generation until stop strings), the harness's metrics and per-document results
from JaxkvLM equal those from the harness's own Hugging Face backend on the same directory."""

import json
import re

import lm_eval  # the test extra installs it
import numpy as np
import pytest

from tests.conftest import save_tiny_llama

QUESTIONS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "label": 0},
    {"question": "Two and two make", "choices": [" four", " five"], "label": 0},
    {"question": "Cats say", "choices": [" meow", " woof", " moo", " meow!"], "label": 3},
    {"question": "", "choices": ["Start", "End"], "label": 1},
]
DOCUMENTS = [{"text": "A short document. " * 3}, {"text": "x" * 300},
             {"text": "Rolling windows predict every token once, " * 8}]
PROMPTS = [{"prompt": "Q: 2+2? A:", "answer": " 4"}, {"prompt": "Say hi:", "answer": " hi"}]
TASKS = {
    "jaxkv_tiny_choice": ("choice.jsonl", QUESTIONS, """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list: [{metric: acc}, {metric: acc_norm}]"""),
    "jaxkv_tiny_rolling": ("rolling.jsonl", DOCUMENTS, """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, {metric: bits_per_byte}]"""),
    "jaxkv_tiny_generate": ("generate.jsonl", PROMPTS, """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: [".", "?"], max_gen_toks: 12, do_sample: false}
metric_list: [{metric: exact_match}]"""),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, task directory): a random Llama with a character tokenizer (end of
    text: <unk>, id 96) and the tasks' YAML and JSONL files."""
    model_dir, task_dir = (tmp_path_factory.mktemp(n) for n in ("model", "tasks"))
    save_tiny_llama(model_dir)
    for task, (data, rows, spec) in TASKS.items():
        (task_dir / data).write_text("".join(json.dumps(r) + "\n" for r in rows))
        (task_dir / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {task_dir / data}\ntest_split: test\n{spec}\n")
    return model_dir, task_dir


def evaluate(model, model_args, task_dir, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=sorted(TASKS),
                                   task_manager=TaskManager(include_path=str(task_dir)),
                                   log_samples=True, batch_size=1, random_seed=0,
                                   numpy_random_seed=0, torch_random_seed=0)


def test_jaxkv_equals_the_harness_hugging_face_backend(tiny, monkeypatch):
    import jaxkv

    model_dir, task_dir = tiny
    ours = evaluate(jaxkv.lm_eval.JaxkvLM(str(model_dir), batch_size=3), None, task_dir,
                    monkeypatch)
    theirs = evaluate("hf", f"pretrained={model_dir},dtype=float32,device=cpu", task_dir,
                      monkeypatch)
    for task in TASKS:
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                assert ours["results"][task][metric] == pytest.approx(value, rel=1e-4), metric
        for mine, hf in zip(ours["samples"][task], theirs["samples"][task]):
            if task == "jaxkv_tiny_generate":
                assert mine["resps"] == hf["resps"]
                continue
            (mine_ll, hf_ll) = ([r[0][0] if isinstance(r[0], (list, tuple)) else r[0]
                                 for r in s["resps"]] for s in (mine, hf))
            # float32 sums of per-token log-probabilities, to a few ulps: 1e-6 relative is
            # about 8 (one ulp of a rolling document's -1392.8 is 1.2e-4, jax 0.12's difference
            # from the harness; an absolute 1e-4 was less than that), and 1e-5 absolute covers
            # log-likelihoods near 0, where the terms' own rounding (ulp(ln 97) = 4.8e-7) rules
            np.testing.assert_allclose(mine_ll, hf_ll, rtol=1e-6, atol=1e-5)


def test_the_eval_command_prints_the_harness_table(tiny, monkeypatch, tmp_path, capsys):
    """(On a mesh, as across processes: tests/test_processes.py checks the jobs it runs.)"""
    from jaxkv.front import cli

    model_dir, task_dir = tiny
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "results.json"
    cli.main(["eval", "--model", str(model_dir), "--tasks", "jaxkv_tiny_choice",
              "--include-path", str(task_dir), "--limit", "2", "--output", str(out),
              "--mesh", "1x1"])
    printed = capsys.readouterr().out
    assert "jaxkv_tiny_choice" in printed and "acc" in printed
    results = json.loads(out.read_text())["results"]["jaxkv_tiny_choice"]
    assert 0 <= results["acc,none"] <= 1


def test_an_unknown_task_is_named(tiny, monkeypatch):
    from jaxkv.front import cli

    model_dir, task_dir = tiny
    with pytest.raises(SystemExit, match="jaxkv: tasks: no_such_task is not a task"):
        cli.main(["eval", "--model", str(model_dir), "--tasks", "no_such_task",
                  "--include-path", str(task_dir)])


@pytest.mark.parametrize("options, error, words", [
    ({"max_length": 0}, ValueError, "JaxkvLM: max_length must be a positive int, got 0"),
    ({"max_length": "0"}, ValueError, "JaxkvLM: max_length must be a positive int, got 0"),
    ({"batch_size": "many"}, ValueError, "JaxkvLM: batch_size must be an int, got 'many'"),
    ({"int8": "no"}, TypeError, "JaxkvLM: int8 must be True or False, got 'no'"),
])
def test_bad_model_options_are_errors(tiny, options, error, words):
    """Options (as Python values or the harness's model_args text) are checked, never taken for
    a default: max_length=0 is not the model's max_seq_len."""
    from jaxkv.lm_eval import JaxkvLM

    model_dir, _ = tiny
    with pytest.raises(error, match=re.escape(words)):
        JaxkvLM(str(model_dir), **options)


def test_model_options_given_as_text_are_read():
    """The harness passes model_args as text: "2048", "true" are an int and a bool."""
    from jaxkv.lm_eval import _bool_option, _int_option

    assert _int_option("2048", "max_length") == 2048 and _bool_option("True", "int8") is True
    assert _bool_option("0", "int8") is False and _bool_option(False, "int8") is False
