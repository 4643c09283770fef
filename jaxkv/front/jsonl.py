"""Answering a data set file: one JSON request per line in, one JSON answer per line out,
appended as each prompt ends, so a job killed at any moment resumes where it stopped.

A job of several processes (a mesh that spans them) runs the same call on every process, each
reading its own copy of the requests: process 0 alone writes the answers, and tells the others
which ids its file holds.

Input lines: {"prompt": text, "id": optional (default: the line number, from 1),
"max_new_tokens": optional, and at most one of "regex": a pattern, "choices": a list of strings,
"json_schema": a schema (an object, or {} for any JSON): the answer's form (jaxkv.constraints)}.
Output lines: {"id", "completion", "tokens", "options"} (tokens:
how many the answer drew, a stop token included; options: what the answer was drawn with beyond
its request, which a resumed job must repeat); with logprobs=k also "logprobs": per token drawn,
its {"token" (its text), "id", "logprob"} and "top": the k likeliest as {"token", "id",
"logprob"}.
"""

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator

import jax
import numpy as np

from jaxkv.core.sharding import from_first_process, same_on_every_process
from jaxkv.decoding import constraints, stops
from jaxkv.decoding.batching import iter_many

FORMS = ("regex", "choices", "json_schema")  # a request's constraint, at most one


def read_requests(path: str) -> list[dict]:
    """The requests of a JSONL file, each with its "id" and "line" (1-based); blank lines are
    skipped. The whole file is read before anything is generated, and a line that is not
    UTF-8, not a JSON object with a "prompt" string, or has a bad "id" or "max_new_tokens", or
    repeats an id, is an error naming the file and the line."""
    requests, lines_of = [], {}
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") \
                    from None
            if line.strip():
                request = _request(line, where)
                request.setdefault("id", line_no)
                key = json.dumps(request["id"])
                if key in lines_of:
                    raise ValueError(f"{where}: id {request['id']!r} already used on line "
                                     f"{lines_of[key]}")
                lines_of[key] = line_no
                requests.append(dict(request, line=line_no))
    return requests


def _request(line: str, where: str) -> dict:
    """One request line, checked: a JSON object with a "prompt" string, an optional "id" (an int
    or a string) and an optional "max_new_tokens" (a positive int)."""
    try:
        request = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON object ({e.msg})") from None
    if not isinstance(request, dict) or not isinstance(request.get("prompt"), str):
        raise ValueError(f'{where}: expected an object with a "prompt" string, got '
                         f"{line.strip()[:60]}")
    if "id" in request and (not isinstance(request["id"], (int, str)) or
                            isinstance(request["id"], bool)):
        raise ValueError(f'{where}: "id" must be an int or a string, got {request["id"]!r}')
    budget = request.get("max_new_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                               or budget < 1):
        raise ValueError(f'{where}: "max_new_tokens" must be a positive int, got {budget!r}')
    forms = [k for k in FORMS if k in request]
    if len(forms) > 1:
        raise ValueError(f"{where}: at most one of {', '.join(map(repr, FORMS))} may be given, "
                         f"got {', '.join(map(repr, forms))}")
    return request


def constraint_of(request: dict, tokenizer, where: str, built: dict | None = None):
    """The constraint of a request's (or a job's) form (None without one), built once per
    distinct form (built: those so far); a bad one is an error naming where it came from."""
    form = next((k for k in FORMS if k in request), None)
    if form is None:
        return None
    built = {} if built is None else built
    key = json.dumps([form, request[form]], sort_keys=True)
    if key not in built:
        make = {"regex": constraints.Regex, "choices": constraints.Choice,
                "json_schema": constraints.JsonSchema}[form]
        try:
            built[key] = make(request[form], tokenizer)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {form}: {e}") from None
    return built[key]


# What an answer depends on beyond its request and the job's budget, stops and seed (with its
# value where not given): each answer records them, and a resumed job must have the same.
RECORDED = dict(temperature=0.0, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
                logprobs=None)


def record_of(max_new_tokens: int, stop, seed: int, about: dict | None, options: dict,
              form: dict | None = None) -> dict:
    """The "options" of each answer: about (the caller's: the model, its dtype ...), the budget,
    the stops, the seed, the job's form (if any), then the sampling options and logprobs;
    those not set left out."""
    record = dict(about or {}, max_new_tokens=max_new_tokens, stop=stops.texts_of(stop),
                  seed=seed, form=form or None)
    record.update((k, options.get(k, default)) for k, default in RECORDED.items())
    return json.loads(json.dumps({k: v for k, v in record.items() if v is not None}))


def answered_ids(path: str, record: dict | None = None, cut: bool = True) -> set[str]:
    """The ids (as JSON text) already answered in an output file. A last line cut short by a
    kill (no newline) is no answer: cut=True removes it from the file (its writer holds it). A
    bad line before it is an error, and so is an answer drawn with other options than record
    (where given; the answers of older versions record none)."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    whole = data[: data.rfind(b"\n") + 1]
    if cut and len(whole) < len(data):  # a torn last line: the answer is drawn again
        with open(path, "r+b") as f:
            f.truncate(len(whole))
    done = set()
    for line_no, line in enumerate(whole.splitlines(), 1):
        try:
            answer = json.loads(line)
            done.add(json.dumps(answer["id"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line_no}: not an answer line of jaxkv ({e}); is it "
                             "the output file of another job?") from e
        if record is not None and "options" in answer:
            _same_options(answer["options"], record, f"{path}:{line_no}")
    return done


def _same_options(found: dict, record: dict, where: str):
    """An answer's recorded options are this job's; else the first that differs is named."""
    shown = lambda v: "unset" if v is None else json.dumps(v)  # noqa: E731
    for key in dict.fromkeys([*record, *found]):
        if found.get(key) != record.get(key):
            raise ValueError(f"{where}: answered with {key} {shown(found.get(key))}, but this "
                             f"job has {key} {shown(record.get(key))}; resume with the options "
                             "its answers were drawn with, or write to another output file")


def check_job(input_path: str, output_path: str, max_new_tokens: int, *, stop=(),
              seed: int = 0, about: dict | None = None, form: dict | None = None,
              **options) -> tuple[int, int]:
    """What answer_file (given the same arguments) checks before it needs a model: the paths,
    every request, and the options of the answers output_path holds (the file left as it is).
    Returns (how many requests, how many of them output_path answers)."""
    check_paths(input_path, output_path)
    requests = read_requests(input_path)
    record = record_of(max_new_tokens, stop, seed, about, options, form)
    done = answered_ids(output_path, record, cut=False)
    return len(requests), sum(json.dumps(r["id"]) in done for r in requests)


def answer_file(params, tokenizer, encode, input_path: str, output_path: str,
                max_new_tokens: int, *, stop_ids=(), stop=(), seed: int = 0,
                about: dict | None = None, form: dict | None = None, **options) -> int:
    """Answers every request of input_path not yet in output_path, appending each answer as
    its prompt ends (one whole line, flushed). encode(text) -> ids makes a prompt; options go
    to iter_many (batch_size, sampling, progress). An answer ends at a stop id or a stop
    string; its completion is the text before them. Prompt i of the file draws with
    fold_in(key(seed), its line number), so a resumed job answers as an uninterrupted one; its
    options (about: the caller's own, such as the model) must be those the output's answers
    record. Returns how many it answered; interrupted (KeyboardInterrupt), it says how many the
    output holds. Across processes (options' mesh spanning them) only process 0 opens
    output_path. form: the answers' form where a request gives none ({"regex": ...},
    {"choices": [...]} or {"json_schema": ...}; recorded)."""
    stop = stops.texts_of(stop)
    record = record_of(max_new_tokens, stop, seed, about, options, form)
    check_paths(input_path, output_path)
    requests = read_requests(input_path)
    writer = jax.process_index() == 0
    with open(output_path, "a", encoding="utf-8") if writer else contextlib.nullcontext() as out:
        if writer:
            _lock(out, output_path)
        pending = _pending(requests, output_path if writer else None, input_path, record)
        written = 0
        try:
            for line in _answer_lines(params, tokenizer, encode, pending, input_path,
                                      max_new_tokens, stop_ids, stop, seed, options, form):
                if out is not None:
                    out.write(json.dumps(dict(line, options=record), ensure_ascii=False) + "\n")
                    out.flush()
                written += 1
        except KeyboardInterrupt:  # every answer ended is in the file: say so, and how to go on
            done = len(requests) - len(pending) + written
            raise KeyboardInterrupt(f"{done} of {len(requests)} prompts answered in "
                                    f"{output_path}; run the same command again to resume") \
                from None
    return written


def flag_options(args, model: str) -> dict:
    """check_job's and answer_file's options that change an answer, from the flags of `jaxkv
    generate` (args); model: the model's path (recorded whole)."""
    return dict(stop=args.stop, seed=args.seed, logprobs=args.logprobs,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                about=dict(model=os.path.abspath(model), dtype=args.dtype, chat=not args.no_chat),
                form=form_of(args))


def form_of(args) -> dict:
    """The answers' form from --regex, --choices or --json-schema (a file, or the schema as
    JSON text): {} without one."""
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choices:
        return {"choices": args.choices}
    if args.json_schema is None:
        return {}
    text = args.json_schema
    if os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            text = f.read()
    try:
        return {"json_schema": json.loads(text)}
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-schema {args.json_schema[:60]}: neither a file nor a JSON "
                         f"schema ({e.msg})") from None


def check_paths(input_path: str, output_path: str):
    """The answers go to another file than the requests."""
    if os.path.exists(output_path) and os.path.samefile(input_path, output_path):
        raise ValueError(f"the output {output_path} is the input file: answers would be "
                         "appended to the requests; write them to another file")


def writable(path: str | None, flag: str) -> None:
    """path (if any) can be written once the work is done (checked before it starts: nothing
    computed is lost to a missing folder): its folder exists and takes files, and it is not a
    folder."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder; give a file path")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: the folder {folder} is not writable")


def _lock(out, output_path: str):
    """Holds output_path for this job alone (released when the job ends, however it ends): a
    second job writing the same answers would answer every id twice."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return
    try:
        fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"{output_path} is being written by another job; wait for it to end, "
                         "or write to another file") from None


def _encoded(encode, request: dict, input_path: str) -> list[int]:
    """The request's prompt as ids; a prompt that cannot be one is an error naming its line."""
    try:
        return encode(request["prompt"])
    except ValueError as e:
        raise ValueError(f"{input_path}:{request['line']}: {e}") from None


def _pending(requests: list[dict], output_path: str | None, input_path: str,
             record: dict) -> list[dict]:
    """The requests whose ids the output (process 0's) does not hold yet, its answers drawn
    with record's options. Across processes every one must have read the same requests: else
    each names the difference."""
    if jax.process_count() > 1:
        digest = hashlib.sha256(json.dumps(requests).encode()).digest()
        same_on_every_process(np.frombuffer(digest, np.uint8), f"the requests of {input_path}")
    done = answered_ids(output_path, record) if output_path is not None else set()
    done_R = np.array([json.dumps(r["id"]) in done for r in requests], bool)
    if jax.process_count() > 1:
        done_R = from_first_process(done_R)
    return [r for r, d in zip(requests, done_R) if not d]


def _answer_lines(params, tokenizer, encode, pending, input_path, max_new_tokens, stop_ids,
                  stop, seed, options, form=None) -> Iterator[dict]:
    """Each pending request's answer line as its prompt ends: {"id", "completion", "tokens"}
    (and "logprobs" with options' logprobs). An error about a prompt names its file and line."""
    prompts = [_encoded(encode, r, input_path) for r in pending]
    if not pending:
        return
    built = {}
    forms = [constraint_of(r if any(k in r for k in FORMS) else form or {}, tokenizer,
                           f"{input_path}:{r['line']}", built) for r in pending]
    if any(f is not None for f in forms):
        options = dict(options, constraint=forms)
    answers = iter_many(params, prompts, [r.get("max_new_tokens", max_new_tokens) for r in pending],
                        key=jax.random.key(seed), eos_id=list(stop_ids) or None,
                        stop=stop or None, tokenizer=tokenizer,
                        indices=[r["line"] for r in pending],
                        name_of=lambda i: f"{input_path}:{pending[i]['line']}", **options)
    for i, answer in answers:
        ids = answer if isinstance(answer, list) else answer.ids
        text_ids = ids[:-1] if ids and ids[-1] in stop_ids else ids
        text = stops.cut(tokenizer.decode(text_ids, skip_special_tokens=True), stop)
        line = {"id": pending[i]["id"], "completion": text, "tokens": len(ids)}
        if not isinstance(answer, list):
            line["logprobs"] = _logprobs(tokenizer, answer)
        yield line


def _logprobs(tokenizer, answer) -> list[dict]:
    """Per token of a Scored answer: its text (the tokenizer's decoding of it alone), id and
    log-probability, and the k likeliest."""
    texts = {}  # id -> text: a token met again is not decoded again

    def entry(i, p):
        if i not in texts:
            texts[i] = tokenizer.decode([i], skip_special_tokens=False)
        return {"token": texts[i], "id": i, "logprob": p}

    return [dict(entry(i, p), top=[entry(j, q) for j, q in top])
            for i, p, top in zip(answer.ids, answer.logprobs, answer.top)]
