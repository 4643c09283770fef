"""Answering a JSONL data set: one answer line per request, in the order prompts end; a job cut
short (a torn last line included) resumes and ends with the same answers, each once."""

import json
import re

import jax
import pytest

import jaxkv
from jaxkv.front import cli, jsonl
from tests.conftest import char_tokenizer

REQUESTS = [{"prompt": "Hello there"}, {"prompt": "A", "max_new_tokens": 3},
            {"id": "q7", "prompt": "The quick brown fox jumps over the lazy dog"},
            {"prompt": "xyz", "max_new_tokens": 9}, {"prompt": "Once upon a time, far away"},
            {"id": 42, "prompt": "12345"}]


def write_lines(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(llama, tmp_path, output, requests=REQUESTS, tokenizer=None, **options):
    encode = char_tokenizer(llama.config.vocab_size).encode
    source = write_lines(tmp_path / "in.jsonl", requests)
    options = dict(batch_size=2, temperature=0.8, top_k=30, seed=5) | options
    return jsonl.answer_file(llama, tokenizer or char_tokenizer(llama.config.vocab_size),
                             lambda text: encode(text).ids, str(source), str(output), 6,
                             **options)


def answers(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == len({json.dumps(r["id"]) for r in rows})  # each id once
    return {json.dumps(r["id"]): r for r in rows}


def test_every_request_answered_once(llama, tmp_path):
    out = tmp_path / "out.jsonl"
    assert run(llama, tmp_path, out) == 6
    got = answers(out)
    assert set(got) == {"1", "2", '"q7"', "4", "5", "42"}
    assert [got[k]["tokens"] for k in ("1", "2", "4")] == [6, 3, 9]
    assert all(isinstance(r["completion"], str) for r in got.values())
    assert run(llama, tmp_path, out) == 0  # all done: nothing to redo


def test_completions_cut_before_a_stop_string(llama, tmp_path):
    plain, cut = tmp_path / "plain.jsonl", tmp_path / "cut.jsonl"
    run(llama, tmp_path, plain)
    text = answers(plain)["1"]["completion"]
    run(llama, tmp_path, cut, stop=[text[2:4]])
    assert answers(cut)["1"]["completion"] == text[:2]


def test_logprobs_are_written_per_token(llama, tmp_path):
    """logprobs=2: each line's tokens with their log-probabilities and the two likeliest; the
    answers are those of a job without them."""
    plain, scored = tmp_path / "plain.jsonl", tmp_path / "scored.jsonl"
    run(llama, tmp_path, plain)
    run(llama, tmp_path, scored, logprobs=2)
    for key, line in answers(scored).items():
        assert line["completion"] == answers(plain)[key]["completion"]
        assert len(line["logprobs"]) == line["tokens"]
        for entry in line["logprobs"]:
            assert set(entry) == {"token", "id", "logprob", "top"} and len(entry["top"]) == 2
            assert entry["logprob"] <= entry["top"][0]["logprob"] + 1e-6
            assert isinstance(entry["token"], str)


def test_resume_after_a_kill_gives_the_same_answers(llama, tmp_path):
    """Three answers and half of a fourth line written, as after kill -9: the rerun drops the
    torn line and answers the rest, as the uninterrupted (sampled) run did."""
    whole = tmp_path / "whole.jsonl"
    run(llama, tmp_path, whole)
    lines = whole.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    assert run(llama, tmp_path, cut) == 3
    assert answers(cut) == answers(whole)


@pytest.mark.parametrize("line, message", [
    ("not json", "in.jsonl:2: not a JSON object"),
    ('{"text": "x"}', 'expected an object with a "prompt" string'),
    ('{"prompt": "x", "id": 1}', "id 1 already used on line 1"),
    ('{"prompt": "x", "max_new_tokens": 0}', '"max_new_tokens" must be a positive int'),
    ('{"prompt": "x", "max_new_tokens": true}', 'in.jsonl:2: "max_new_tokens" must be a '
                                                 'positive int, got True'),
    ('{"prompt": "x", "id": [1]}', 'in.jsonl:2: "id" must be an int or a string'),
    (b'{"prompt": "caf\xe9"}', r"in.jsonl:2: not UTF-8 text \(invalid continuation byte"),
    ('{"prompt": "x", "regex": "a", "choices": ["a"]}', "in.jsonl:2: at most one of"),
])
def test_bad_requests(tmp_path, line, message):
    """Each bad line is named by file and line, before anything is generated."""
    line = line if isinstance(line, bytes) else line.encode()
    (tmp_path / "in.jsonl").write_bytes(b'{"prompt": "a"}\n' + line + b"\n")
    with pytest.raises(ValueError, match=message):
        jsonl.read_requests(str(tmp_path / "in.jsonl"))


def test_a_prompt_that_cannot_be_encoded_names_its_line(llama, tmp_path):
    def encode(text):
        if not text:
            raise ValueError("the prompt is empty")
        return [1]

    write_lines(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": ""}])
    with pytest.raises(ValueError, match="in.jsonl:2: the prompt is empty"):
        jsonl.answer_file(llama, char_tokenizer(97), encode, str(tmp_path / "in.jsonl"),
                          str(tmp_path / "out.jsonl"), 3)


def test_the_output_is_guarded(llama, tmp_path):
    """The requests' own file is refused as the output; so is an output another job holds (a
    lock the system drops with the job, however it ends)."""
    import fcntl

    source = write_lines(tmp_path / "in.jsonl", REQUESTS)
    with pytest.raises(ValueError, match="is the input file"):
        jsonl.answer_file(llama, char_tokenizer(97), lambda t: [1], str(source), str(source), 3)
    assert source.read_text().count("\n") == len(REQUESTS)
    out = tmp_path / "out.jsonl"
    with open(out, "a") as other_job:
        fcntl.flock(other_job, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="out.jsonl is being written by another job"):
            run(llama, tmp_path, out)
    assert run(llama, tmp_path, out) == 6  # once the other job has ended


def test_output_of_another_kind_is_refused(tmp_path):
    (tmp_path / "out.jsonl").write_text('{"answer": 1}\n')
    with pytest.raises(ValueError, match="out.jsonl:1: not an answer line"):
        jsonl.answered_ids(str(tmp_path / "out.jsonl"))


def test_generator_prompts_keep_their_indices(llama):
    """iter_many's indices: a prompt draws the same answer whatever its place in this call."""
    prompts = [[1, 2, 3], [4, 5], [6]]
    key = jax.random.key(2)
    whole = dict(jaxkv.iter_many(llama, prompts, 5, temperature=1.0, key=key, batch_size=2))
    tail = dict(jaxkv.iter_many(llama, prompts[1:], 5, temperature=1.0, key=key, batch_size=2,
                                indices=[1, 2]))
    assert tail == {0: whole[1], 1: whole[2]}


def test_an_interrupted_job_says_how_far_it_got(llama, tmp_path, monkeypatch):
    """Ctrl-C once two answers are out: they are in the file, the error says how many of how
    many and how to go on, and the rerun ends with the uninterrupted run's answers."""
    whole, out = tmp_path / "whole.jsonl", tmp_path / "out.jsonl"
    run(llama, tmp_path, whole)
    real = jsonl.iter_many

    def interrupted(*args, **kwargs):
        answers = real(*args, **kwargs)
        yield next(answers)
        yield next(answers)
        raise KeyboardInterrupt

    monkeypatch.setattr(jsonl, "iter_many", interrupted)
    for done in (2, 4):
        with pytest.raises(KeyboardInterrupt, match=rf"^{done} of 6 prompts answered in "
                           r"\S*out.jsonl; run the same command again to resume$"):
            run(llama, tmp_path, out)
        assert len(answers(out)) == done
    monkeypatch.undo()
    assert run(llama, tmp_path, out) == 2 and answers(out) == answers(whole)


@pytest.fixture(scope="module")
def answered(llama, tmp_path_factory):
    """A complete answers file of run's job (and its folder, holding the requests)."""
    folder = tmp_path_factory.mktemp("answered")
    run(llama, folder, folder / "out.jsonl")
    return folder


@pytest.mark.parametrize("change, words", [
    (dict(logprobs=3), "answered with logprobs unset, but this job has logprobs 3"),
    (dict(temperature=0.5), "answered with temperature 0.8, but this job has temperature 0.5"),
    (dict(stop=["\n"]), r'answered with stop \[\], but this job has stop \["\\n"\]'),
    (dict(seed=6), "answered with seed 5, but this job has seed 6"),
    (dict(about={"model": "/m"}), 'answered with model unset, but this job has model "/m"'),
])
def test_a_resume_with_other_options_is_refused(llama, answered, tmp_path, change, words):
    """A complete file, rerun with --logprobs 3, did nothing: each answer records what it was
    drawn with, and a job with other options is refused, naming the first that differs."""
    text = (answered / "out.jsonl").read_text()
    (tmp_path / "out.jsonl").write_text(text)
    with pytest.raises(ValueError, match="out.jsonl:1: " + words):
        run(llama, tmp_path, tmp_path / "out.jsonl", **change)
    assert (tmp_path / "out.jsonl").read_text() == text
    assert json.loads(text.splitlines()[0])["options"] == {
        "max_new_tokens": 6, "stop": [], "seed": 5, "temperature": 0.8, "top_k": 30}


def test_answers_of_older_versions_are_taken_as_they_are(llama, answered, tmp_path):
    """Lines without "options" (written before they were recorded) are resumed, not refused."""
    lines = [json.loads(line) for line in (answered / "out.jsonl").read_text().splitlines()]
    old = write_lines(tmp_path / "out.jsonl", [{k: v for k, v in line.items()
                                                if k != "options"} for line in lines[:4]])
    assert run(llama, tmp_path, old, logprobs=2) == 2


def test_a_prompt_too_long_names_its_file_and_line(llama, tmp_path):
    """(was `prompts[6]`, generate_many's argument)."""
    out = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match=r"in.jsonl:7: 200 tokens \+ max_new_tokens 6"):
        run(llama, tmp_path, out, requests=REQUESTS + [{"prompt": "x" * 200}])
    assert out.read_text() == ""


def test_logprob_tokens_are_their_text(llama, tmp_path):
    """A token's "token" is its text, not its string in the vocabulary (was "\u0120capital")."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"#" + chr(32 + i): i for i in range(96)} | {"<unk>": 96}
    hashed = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))  # "#a" is the text "a"
    hashed.decoder = decoders.Sequence([decoders.Strip("#", 1, 0), decoders.Fuse()])
    run(llama, tmp_path, tmp_path / "out.jsonl", tokenizer=hashed, logprobs=2)
    for line in answers(tmp_path / "out.jsonl").values():
        for drawn in line["logprobs"]:
            for entry in [drawn, *drawn["top"]]:
                i = entry["id"]
                assert entry["token"] == (chr(32 + i) if i < 96 else "<unk>")


def test_the_command_checks_its_job_before_loading(llama, tmp_path, monkeypatch, capsys):
    """Before the model loads (which took seconds): a rerun says how many answers it skips,
    other options than the file's are refused, and a bad request is named."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(tmp_path), "--input", str(source), "--output", str(out),
            "--max-new-tokens", "6", "--temperature", "0.8", "--compile-cache", "off"]
    args = cli.parser().parse_args(argv)
    encode = char_tokenizer(97).encode
    write_lines(source, REQUESTS[:2])
    jsonl.answer_file(llama, char_tokenizer(97), lambda text: encode(text).ids, str(source),
                      str(out), 6, **jsonl.flag_options(args, cli.model_path(args.model, None)))
    write_lines(source, REQUESTS)

    def load_model(path, mesh=None):
        raise ValueError("not loaded in this test")

    monkeypatch.setattr(cli, "load_model", load_model)
    for flags, words in [([], "not loaded in this test"),
                         (["--logprobs", "3"], "out.jsonl:1: answered with logprobs unset"),
                         (["--no-chat"], "out.jsonl:1: answered with chat true, but this job "
                                         "has chat false")]:
        with pytest.raises(SystemExit, match=words):
            cli.main(argv + flags)
    assert f"[2 of 6 already in {out}; answering 4]" in capsys.readouterr().err
    source.write_text(source.read_text() + "not json\n")
    with pytest.raises(SystemExit, match="in.jsonl:7: not a JSON object"):
        cli.main(argv)


def test_each_request_keeps_its_form(llama, tmp_path):
    """Requests with "regex", "choices" or "json_schema" (and one without) in one job: each
    completion has its form; the same form twice is compiled once."""
    requests = [{"prompt": "Hello", "regex": "[0-9]{3}"},
                {"prompt": "Pick", "choices": ["red", "green", "blue"]},
                {"prompt": "Data", "json_schema": {"type": "object", "properties": {
                    "x": {"type": "integer"}}, "required": ["x"]}, "max_new_tokens": 12},
                {"prompt": "Free"}, {"prompt": "Again", "regex": "[0-9]{3}"}]
    out = tmp_path / "out.jsonl"
    assert run(llama, tmp_path, out, requests) == 5
    got = answers(out)
    assert re.fullmatch("[0-9]{3}", got["1"]["completion"])
    assert re.fullmatch("[0-9]{3}", got["5"]["completion"])
    assert got["2"]["completion"] in ("red", "green", "blue")
    assert isinstance(json.loads(got["3"]["completion"])["x"], int)


@pytest.mark.parametrize("request_, message", [
    ({"prompt": "x", "regex": "(a"}, "in.jsonl:1: regex: .*not a regular expression"),
    ({"prompt": "x", "choices": []}, "in.jsonl:1: choices: .*non-empty list"),
    ({"prompt": "x", "regex": "[a-z]{40}"}, "in.jsonl:1 .*shortest answer is 40 tokens"),
])
def test_a_bad_form_names_its_line(llama, tmp_path, request_, message):
    with pytest.raises(ValueError, match=message):
        run(llama, tmp_path, tmp_path / "out.jsonl", [request_])
