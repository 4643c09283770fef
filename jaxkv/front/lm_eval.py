"""jaxkv as an lm-evaluation-harness model (the optional extra `jaxkv[eval]`).

    import lm_eval, jaxkv
    lm_eval.simple_evaluate(model=jaxkv.lm_eval.JaxkvLM("path/to/model"), tasks=["hellaswag"])
    lm_eval --model jaxkv --model_args path=path/to/model --tasks hellaswag
    jaxkv eval --model path/to/model --tasks hellaswag

The harness tokenizes (its TemplateLM: a context's trailing spaces go to the continuation, an
empty context becomes the end-of-text token) and calls the three requests below, which jaxkv
answers with loglikelihood_many (contexts shared by their choices), loglikelihood_rolling
(documents in windows of max_length positions) and generate_many (greedy or sampled, ending at
the task's stop strings). Truncation follows the harness's Hugging Face model: contexts keep
their last tokens.

evaluate and report say on stderr what they are doing, as `jaxkv generate` does ("[loading
...]"): reading the task index, reading the data sets (offline at once when the Hub does not
answer, instead of the hub client's retries), loading the model, writing the results; JaxkvLM
says each kind of request as it runs (generation with a progress line) and what it compiled.
"""

import contextlib
import json
import os
import time

import datasets
import huggingface_hub
import jax
import lm_eval
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable, make_table

from jaxkv.core import checks
from jaxkv.core.sharding import make_mesh
from jaxkv.decoding.batching import generate_many
from jaxkv.decoding.likelihood import loglikelihood_many, loglikelihood_rolling
from jaxkv.formats.load import load
from jaxkv.formats.tokenizer import load_tokenizer
from jaxkv.front.processes import mesh_shape
from jaxkv.front.report import Compiles, status

# Where evaluate's errors send a user with tasks of their own.
OWN_TASKS = ("a folder of task YAML files: --include-path DIR (jaxkv eval) or include_path= "
             "(jaxkv.lm_eval.evaluate); docs/guide.md, \"Tasks of your own\"")
HUB_TIMEOUT_S = 3.0  # how long the Hub may take to answer before evaluate runs offline


def _int_option(value, name: str, minimum: int = 1) -> int:
    """An option given as an int or as the harness's text ("2048")."""
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"JaxkvLM: {name} must be an int, got {value!r}") from None
    return checks.int_arg(value, f"JaxkvLM: {name}", minimum)


def _bool_option(value, name: str) -> bool:
    """An option given as a bool or as the harness's text ("true", "False", "1", "0")."""
    text = {"true": True, "1": True, "false": False, "0": False}
    if isinstance(value, str) and value.lower() in text:
        return text[value.lower()]
    return checks.bool_arg(value, f"JaxkvLM: {name}")


@register_model("jaxkv")
class JaxkvLM(TemplateLM):
    """A model for the harness: path (or pretrained=, the harness's usual argument) is what
    jaxkv.load reads; dtype (float32, bfloat16) and int8 as load's; batch_size: contexts scored
    or prompts generated at once; max_length: positions one request may use (default the
    model's max_seq_len); max_gen_toks: new tokens when a task sets none; kv_dtype: the scoring
    caches' (init_cache's dtype); seed: the key of sampled generations; mesh: a jax Mesh or
    "DATAxMODEL" (the harness's model_args are text), the model loaded and every request
    computed on it, rows over "data", the model over "model"; it may span processes
    (jaxkv.sharding.start_processes), every process then running the same evaluation and
    getting the same results."""

    def __init__(self, path=None, pretrained=None, dtype=None, int8=False, batch_size=16,
                 max_length=None, max_gen_toks=256, kv_dtype=None, seed=0, mesh=None,
                 **_harness_args):
        super().__init__()
        path = path or pretrained
        if path is None:
            raise ValueError("JaxkvLM: pass path= (a model jaxkv.load reads)")
        self.mesh = make_mesh(*mesh_shape(mesh)) if isinstance(mesh, str) else mesh
        self.batch_size = _int_option(batch_size, "batch_size")
        self.max_gen_toks = _int_option(max_gen_toks, "max_gen_toks")
        self.key = jax.random.key(_int_option(seed, "seed", 0))
        self.params = load(path, dtype=dtype, int8=_bool_option(int8, "int8"), mesh=self.mesh)
        self.tokenizer = load_tokenizer(path)
        c = self.params.config
        self.max_length = (c.max_seq_len if max_length is None else
                           _int_option(max_length, "max_length"))
        self.kv_dtype = kv_dtype
        if c.eos_id is None:
            raise ValueError(f"{path}: the model names no eos_id, which the harness needs as its "
                             f"end-of-text token")

    @property
    def eot_token_id(self) -> int:
        return self.params.config.eos_id

    @property
    def prefix_token_id(self) -> int:
        c = self.params.config
        return c.bos_id if c.bos_id is not None else c.eos_id

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        special = True if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_special_tokens=special).ids

    def tok_decode(self, ids, skip_special_tokens=True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """(summed log-probability, is greedy) of each ((context, continuation), context ids,
        continuation ids); a context keeps its last tokens where the pair is too long."""
        pairs = []
        for _, context, continuation in requests:
            room = self.max_length + 1 - len(continuation)
            pairs.append((context[-room:] if len(context) > room else context, continuation))
        with running(len(pairs), "loglikelihood", f"scoring {self.batch_size} at a time"):
            results = loglikelihood_many(self.params, pairs, batch_size=self.batch_size,
                                         kv_dtype=self.kv_dtype, mesh=self.mesh)
        for (cache_key, _, _), result in zip(requests, results):
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False) -> list[float]:
        documents = [self.tok_encode(request.args[0]) for request in requests]
        with running(len(documents), "loglikelihood_rolling",
                     f"scoring {self.batch_size} at a time"):
            results = loglikelihood_rolling(
                self.params, documents, prefix_id=self.prefix_token_id, max_len=self.max_length,
                batch_size=self.batch_size, kv_dtype=self.kv_dtype, mesh=self.mesh)
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, result)
        return results

    def generate_until(self, requests, disable_tqdm=False) -> list[str]:
        """Each request's (context, generation options) answered, requests of the same options
        generated together; the text is cut at the first stop string."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        texts: list = [None] * len(requests)
        with running(len(requests), "generate_until", f"generating {self.batch_size} at a time"):
            for members in groups.values():
                for i, text in zip(members, self._generate([requests[i] for i in members])):
                    texts[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return texts

    def _generate(self, requests) -> list[str]:
        """Texts for requests sharing one set of generation options."""
        options = normalize_gen_kwargs(dict(requests[0].args[1]), self.max_gen_toks)
        until = handle_stop_sequences(options.pop("until", None),
                                      eos=self.tok_decode([self.eot_token_id], False))
        budget = options.pop("max_gen_toks")
        room = self.max_length - budget
        if room <= 0:
            raise ValueError(f"max_gen_toks ({budget}) leaves no room for a context in "
                             f"max_length ({self.max_length})")
        prompts = [self.tok_encode(request.args[0])[-room:] for request in requests]
        temperature = float(options.pop("temperature", 0.0)) if options.pop("do_sample") else 0.0
        answers = generate_many(self.params, prompts, budget, batch_size=self.batch_size,
                                temperature=temperature, key=self.key,
                                stop=[text for text in until if text], tokenizer=self.tokenizer,
                                mesh=self.mesh, progress=True)
        return [postprocess_generated_text(self.tok_decode(answer), until, None)
                for answer in answers]


@contextlib.contextmanager
def running(n: int, kind: str, doing: str):
    """Says on stderr that n requests of a kind start (compiling first) and, when the block
    ends, how long they took and what was compiled."""
    status(f"{n} {kind} requests: compiling, then {doing}")
    began = time.perf_counter()
    with Compiles() as compiles:
        yield
    status(f"{n} {kind} requests answered in {time.perf_counter() - began:.1f} s; "
           f"{compiles.said()}")


def evaluate(path: str, tasks: list[str], *, include_path=None, num_fewshot=None, limit=None,
             batch_size: int = 16, dtype=None, seed: int = 0, mesh=None) -> dict:
    """lm_eval.simple_evaluate of the model at path on tasks (include_path: a folder of task
    YAML files of your own); the harness's seeds all set to seed; mesh: JaxkvLM's. The tasks'
    data sets are read before the model is loaded, so a missing one is said at once."""
    limit = None if limit is None else (int(limit) if limit >= 1 else limit)
    manager = task_index(tasks, include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks and not os.path.isfile(t)]
    if unknown:
        where = f" nor in {include_path}" if include_path else ""
        raise ValueError(f"tasks: {', '.join(unknown)} is not a task, group or tag the harness "
                         f"knows{where} (tasks of your own: {OWN_TASKS})")
    read_tasks(manager, tasks)
    status(f"loading {path}")
    model = JaxkvLM(path, dtype=dtype, batch_size=batch_size, seed=seed, mesh=mesh)
    return lm_eval.simple_evaluate(
        model=model, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)


class TaskIndex(TaskManager):
    """The harness's TaskManager whose load reads a list of tasks once: evaluate reads them
    (their data sets) before loading the model, and simple_evaluate's load gets the same."""

    loaded: tuple = ()  # (the task list, what load gave for it)

    def load(self, task_list):
        if not self.loaded or self.loaded[0] != task_list:
            self.loaded = (list(task_list), super().load(task_list))
        return self.loaded[1]


def task_index(tasks: list[str], include_path) -> TaskIndex:
    """The tasks of include_path alone when they are every task asked for (the harness's own
    index, some 15,000 tasks, takes far longer to read), else the harness's with them."""
    if include_path:
        status(f"reading the tasks in {include_path}")
        own = TaskIndex(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(own.all_subtasks):
            return own
    status("reading the index of lm-evaluation-harness's tasks")
    return TaskIndex(include_path=include_path)


def read_tasks(manager: TaskIndex, tasks: list[str]) -> None:
    """Loads the tasks and their data sets, offline when the Hub does not answer; a data set
    that cannot be had is an error saying what to do."""
    offline = hub_offline()
    status(f"reading the data sets of {', '.join(tasks)}"
           f"{' offline (the local cache and local files)' if offline else ''}")
    try:
        loaded = manager.load(tasks)
    except ConnectionError as e:
        raise ValueError(
            f"{e}; offline, a task reads its data set from the Hugging Face cache "
            f"({datasets.config.HF_DATASETS_CACHE}: run once where the Hub answers, then set "
            f"HF_DATASETS_OFFLINE=1) or from local files (dataset_path: json with "
            f"dataset_kwargs: {{data_files: ...}}, in {OWN_TASKS})") from e
    n = len(loaded["tasks"])
    status(f"{n} task{'s' * (n != 1)} ready; building their requests")


def hub_offline() -> bool:
    """Whether data sets are read offline: asked for (HF_DATASETS_OFFLINE or HF_HUB_OFFLINE),
    or made so here when the Hub does not answer within HUB_TIMEOUT_S (before the hub client
    would retry every file five times)."""
    if datasets.config.HF_HUB_OFFLINE or huggingface_hub.constants.HF_HUB_OFFLINE:
        return True
    endpoint = huggingface_hub.constants.ENDPOINT
    try:
        huggingface_hub.utils.get_session().head(endpoint, timeout=HUB_TIMEOUT_S)
        return False
    except Exception as e:  # any failure to answer (DNS, refused, timeout, proxy)
        status(f"{endpoint} does not answer ({e}): running offline, as HF_DATASETS_OFFLINE=1 "
               f"would")
    # the libraries read their environment once, at import: set both their flags and the
    # environment (for processes they start)
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    return True


def report(results: dict, output=None) -> None:
    """The harness's table on stdout and (output: a path) its results as JSON, by process 0
    alone when several run the evaluation."""
    if jax.process_index() != 0:
        return
    print(make_table(results))
    if output:
        status(f"writing {output}")
        with open(output, "w") as f:
            json.dump({k: v for k, v in results.items() if k != "samples"}, f, indent=1,
                      default=handle_non_serializable)
