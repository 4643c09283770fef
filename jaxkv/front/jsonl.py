"""Answering a data set file: one JSON request per line in, one JSON answer per line out,
appended as each prompt ends, so a job killed at any moment resumes where it stopped.

A job of several processes (a mesh that spans them) runs the same call on every process, each
reading its own copy of the requests: process 0 alone writes the answers, and tells the others
which ids its file holds.

Input lines: {"prompt": text, "id": optional (default: the line number, from 1),
"max_new_tokens": optional}. Output lines: {"id", "completion", "tokens"} (tokens: how many the
answer drew, a stop token included); with logprobs=k also "logprobs": per token drawn, its
{"token", "id", "logprob"} and "top": the k likeliest as {"token", "id", "logprob"}.
"""

import contextlib
import hashlib
import json
import os

import jax
import numpy as np

from jaxkv.core.sharding import from_first_process, same_on_every_process
from jaxkv.decoding import stops
from jaxkv.decoding.batching import iter_many


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
    return request


def answered_ids(path: str) -> set[str]:
    """The ids (as JSON text) already answered in an output file. A last line cut short by a
    kill (no newline, or not JSON) is removed from the file; a bad line before it is an error."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) < len(data):  # a torn last line: the answer is drawn again
        with open(path, "r+b") as f:
            f.truncate(len(whole))
    done = set()
    for line_no, line in enumerate(whole.decode("utf-8").splitlines(), 1):
        try:
            done.add(json.dumps(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line_no}: not an answer line of jaxkv ({e}); is it "
                             "the output file of another job?") from e
    return done


def answer_file(params, tokenizer, encode, input_path: str, output_path: str,
                max_new_tokens: int, *, stop_ids=(), stop=(), seed: int = 0, **options) -> int:
    """Answers every request of input_path not yet in output_path, appending each answer as
    its prompt ends (one whole line, flushed). encode(text) -> ids makes a prompt; options go
    to iter_many (batch_size, sampling, progress). An answer ends at a stop id or a stop
    string; its completion is the text before them. Prompt i of the file draws with
    fold_in(key(seed), its line number), so a resumed job answers as an uninterrupted one.
    Returns how many it answered. Across processes (options' mesh spanning them) only process
    0 opens output_path."""
    stop = stops.texts_of(stop)
    check_paths(input_path, output_path)
    requests = read_requests(input_path)
    writer = jax.process_index() == 0
    with open(output_path, "a", encoding="utf-8") if writer else contextlib.nullcontext() as out:
        if writer:
            _lock(out, output_path)
        pending = _pending(requests, output_path if writer else None, input_path)
        return _answer(params, tokenizer, encode, pending, input_path, out, max_new_tokens,
                       stop_ids, stop, seed, options)


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


def _pending(requests: list[dict], output_path: str | None, input_path: str) -> list[dict]:
    """The requests whose ids the output (process 0's) does not hold yet. Across processes
    every one must have read the same requests: else each names the difference."""
    if jax.process_count() > 1:
        digest = hashlib.sha256(json.dumps(requests).encode()).digest()
        same_on_every_process(np.frombuffer(digest, np.uint8), f"the requests of {input_path}")
    done = answered_ids(output_path) if output_path is not None else set()
    done_R = np.array([json.dumps(r["id"]) in done for r in requests], bool)
    if jax.process_count() > 1:
        done_R = from_first_process(done_R)
    return [r for r, d in zip(requests, done_R) if not d]


def _answer(params, tokenizer, encode, pending, input_path, out, max_new_tokens, stop_ids,
            stop, seed, options) -> int:
    """answer_file's work, its output open (and held) as out (None: another process writes)."""
    prompts = [_encoded(encode, r, input_path) for r in pending]
    budgets = [r.get("max_new_tokens", max_new_tokens) for r in pending]
    if not pending:
        return 0
    answers = iter_many(params, prompts, budgets, key=jax.random.key(seed),
                        eos_id=list(stop_ids) or None, stop=stop or None,
                        tokenizer=tokenizer, indices=[r["line"] for r in pending], **options)
    for i, answer in answers:
        ids = answer if isinstance(answer, list) else answer.ids
        text_ids = ids[:-1] if ids and ids[-1] in stop_ids else ids
        text = stops.cut(tokenizer.decode(text_ids, skip_special_tokens=True), stop)
        line = {"id": pending[i]["id"], "completion": text, "tokens": len(ids)}
        if not isinstance(answer, list):
            line["logprobs"] = _logprobs(tokenizer, answer)
        if out is not None:
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()
    return len(pending)


def _logprobs(tokenizer, answer) -> list[dict]:
    """Per token of a Scored answer: its text, id and log-probability, and the k likeliest."""
    entry = lambda i, p: {"token": tokenizer.id_to_token(i), "id": i, "logprob": p}  # noqa: E731
    return [dict(entry(i, p), top=[entry(j, q) for j, q in top])
            for i, p, top in zip(answer.ids, answer.logprobs, answer.top)]
