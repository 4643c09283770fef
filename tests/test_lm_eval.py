"""jaxkv.lm_eval.JaxkvLM in lm-evaluation-harness: on a tiny random Llama saved with a
character tokenizer, and tiny tasks defined here from local files (multiple choice, rolling
log-likelihood, generation until stop strings), the harness's metrics and per-document results
from JaxkvLM equal those from the harness's own Hugging Face backend on the same directory.
`jaxkv eval` runs docs/guide.md's "Tasks of your own" as the guide shows it, saying each stage,
and runs offline at once when the Hub does not answer."""

import json
import os
import re
import shlex

import lm_eval  # the test extra installs it
import numpy as np
import pytest

from tests.conftest import save_tiny_llama

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                     "guide.md")

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


@pytest.fixture
def offline(monkeypatch):
    """Data sets read offline (the libraries' flags, which they read from the environment at
    import, set for this test alone)."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def evaluate(model, model_args, task_dir):
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=sorted(TASKS),
                                   task_manager=manager, log_samples=True, batch_size=1,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def test_jaxkv_equals_the_harness_hugging_face_backend(tiny, offline):
    import jaxkv

    model_dir, task_dir = tiny
    ours = evaluate(jaxkv.lm_eval.JaxkvLM(str(model_dir), batch_size=3), None, task_dir)
    theirs = evaluate("hf", f"pretrained={model_dir},dtype=float32,device=cpu", task_dir)
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


def guide_example() -> tuple[dict, list]:
    """({path: text} of the files docs/guide.md's "Tasks of your own" shows, each under a line
    `path`:, and the arguments of its jaxkv eval command)."""
    with open(GUIDE) as f:
        section = f.read().split("\n### Tasks of your own\n")[1].split("\n#")[0]
    files = dict(re.findall(r"^`(my_tasks/[^`]+)`:\n\n```\w*\n(.*?)```", section, re.M | re.S))
    command = re.search(r"^```bash\njaxkv (eval .*?)\n```", section, re.M | re.S).group(1)
    return files, shlex.split(command)


def test_the_guides_own_tasks_run_as_shown_saying_each_stage(tiny, offline, tmp_path,
                                                             monkeypatch, capsys):
    """The guide's files and command, run in a folder holding them (the tiny model as --model,
    on a 1x1 mesh as across processes: tests/test_processes.py checks the jobs it runs): the
    harness's table and results file, and each stage said on stderr in order, reading only
    the --include-path folder's tasks."""
    from jaxkv.front import cli

    files, args = guide_example()
    assert sorted(files) == ["my_tasks/capitals.jsonl", "my_tasks/capitals_choice.yaml",
                             "my_tasks/capitals_generate.yaml"]
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    cli.main(args + ["--model", str(tiny[0]), "--mesh", "1x1"])
    printed, said = capsys.readouterr()
    assert "capitals_choice" in printed and "exact_match" in printed
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert 0 <= results["capitals_choice"]["acc,none"] <= 1
    assert 0 <= results["capitals_generate"]["exact_match,none"] <= 1
    stages = ["reading the tasks in my_tasks", "reading the data sets of capitals_choice",
              "2 tasks ready", f"loading {tiny[0]}", "12 loglikelihood requests: compiling",
              "12 loglikelihood requests answered", "4 generate_until requests: compiling",
              "4 generate_until requests answered", "writing results.json"]
    at = [said.index(f"[{stage}") for stage in stages]
    assert at == sorted(at), said
    assert "index of lm-evaluation-harness" not in said


def test_an_unreachable_hub_means_offline_at_once(tiny, tmp_path, monkeypatch, capsys):
    """With the Hub not answering (and no offline flag set), evaluate says so and reads data
    sets offline at once, instead of the hub client's retries; a data set neither cached nor
    local is refused before the model loads, saying what to do."""
    import datasets
    import huggingface_hub

    from jaxkv.front import cli

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "0")  # restored after the test, whatever evaluate sets
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # closed
    (tmp_path / "remote.yaml").write_text(
        "task: jaxkv_remote\ndataset_path: jaxkv-tests/no-such-dataset\ntest_split: test\n"
        "output_type: loglikelihood\ndoc_to_text: x\ndoc_to_target: y\n")
    with pytest.raises(SystemExit) as refused:
        cli.main(["eval", "--model", str(tiny[0]), "--tasks", "jaxkv_remote",
                  "--include-path", str(tmp_path)])
    said = capsys.readouterr().err
    assert "[http://127.0.0.1:9 does not answer" in said and "running offline" in said
    assert "Retry" not in said and "[loading" not in said
    for words in ("no-such-dataset", "HF_DATASETS_OFFLINE=1", "dataset_path: json",
                  "--include-path DIR"):
        assert words in str(refused.value)
    assert datasets.config.HF_HUB_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE


def test_an_unknown_task_is_named_with_where_tasks_of_your_own_go(tiny, offline):
    from jaxkv.front import cli

    model_dir, task_dir = tiny
    with pytest.raises(SystemExit, match="jaxkv: tasks: no_such_task is not a task") as refused:
        cli.main(["eval", "--model", str(model_dir), "--tasks", "no_such_task",
                  "--include-path", str(task_dir)])
    assert f"nor in {task_dir}" in str(refused.value)
    assert "--include-path DIR (jaxkv eval) or include_path= (jaxkv.lm_eval.evaluate)" in str(
        refused.value)


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
