"""MultiDecode: forests give every node its path's logits; branches, scoring, accept & compact,
and beam search agree with plain decoding and with Hugging Face."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxkv
from jaxkv.decoding import multidecode as md
from jaxkv.decoding.sampling import row_keys
from tests.conftest import hf_configs

TOL = 1e-5


def random_forest(rng, n, roots):
    """A random forest in 'canonical' ids: node i's parent is < i or -1 (the first `roots`)."""
    parents = np.array([-1 if i < roots else rng.integers(-1, i) for i in range(n)])
    parents[rng.random(n) < 0.15] = -1
    return parents


def reorder(parents, order):
    """Relabel a canonical forest so that node order[k] becomes node k."""
    new_id = {old: k for k, old in enumerate(order)}
    return np.array([-1 if parents[o] < 0 else new_id[parents[o]] for o in order])


def orders(parents, rng):
    """DFS (preorder), BFS and a random topological order of the same forest."""
    n = len(parents)
    children = {i: [j for j in range(n) if parents[j] == i] for i in range(-1, n)}
    dfs, stack = [], children[-1][::-1]
    while stack:
        node = stack.pop()
        dfs.append(node)
        stack.extend(children[node][::-1])
    bfs, queue = [], list(children[-1])
    while queue:
        node = queue.pop(0)
        bfs.append(node)
        queue.extend(children[node])
    mixed, ready = [], list(children[-1])
    while ready:
        node = ready.pop(rng.integers(len(ready)))
        mixed.append(node)
        ready.extend(children[node])
    return {"dfs": dfs, "bfs": bfs, "mixed": mixed}


def ancestors(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_builder_mask_and_depth_in_every_order(seed):
    rng = np.random.default_rng(seed)
    canonical = random_forest(rng, 24, 3)
    for order in orders(canonical, rng).values():
        parents = reorder(canonical, order)
        forest = md.build_forest(parents)
        for i in range(len(parents)):
            expected = ancestors(parents, i)
            assert set(np.flatnonzero(forest.mask[i])) == expected
            assert forest.depth[i] == len(expected) - 1
            assert forest.path(i)[-1] == i and len(forest.path(i)) == len(expected)


@pytest.mark.parametrize("parents, match", [
    ([-1, 2, 0], r"parents\[1\] = 2: a parent must come before its children"),
    ([1, 0], "parents form a cycle through node"),
    ([-1, 0, 2], "parents form a cycle through node 2"),
    ([-1, 5], r"parents\[1\] = 5 is out of range"),
    ([-2, 0], r"parents\[0\] = -2 is out of range"),
])
def test_builder_rejects_bad_parents(parents, match):
    with pytest.raises(ValueError, match=match):
        md.build_forest(parents)


_forward = jax.jit(jaxkv.forward)


def path_logits(params, prefix, tokens, forest, i):
    """The plain forward over the path alone (right-padded to 32: causal, so padding after the
    last token changes nothing before it; one compile for all paths)."""
    seq = list(prefix or []) + tokens[forest.path(i)].tolist()
    return _forward(params, np.array([seq + [0] * (32 - len(seq))]))[0, len(seq) - 1]


def test_single_chain_equals_forward(model):
    tokens = np.array([3, 14, 15, 92, 65, 35, 89, 79])
    got = md.forest_logits(model, tokens, np.arange(-1, 7))
    np.testing.assert_allclose(got, jaxkv.forward(model, tokens[None])[0], atol=TOL, rtol=0)


@pytest.mark.parametrize("which", ["gpt2", "llama"])
@pytest.mark.parametrize("prefix", [None, [7, 1, 8, 2, 8]])
def test_every_node_gets_its_path_logits(which, prefix, request):
    params = request.getfixturevalue(which)
    rng = np.random.default_rng(1)
    parents = random_forest(rng, 20, 3)
    tokens = rng.integers(0, 97, 20)
    forest = md.build_forest(parents)
    got = md.forest_logits(params, tokens, parents, prefix=prefix)
    for i in range(20):
        np.testing.assert_allclose(got[i], path_logits(params, prefix, tokens, forest, i),
                                   atol=TOL, rtol=0)


def test_order_does_not_change_logits(llama):
    rng = np.random.default_rng(2)
    canonical = random_forest(rng, 18, 2)
    tokens = rng.integers(0, 97, 18)
    results = {}
    for name, order in orders(canonical, rng).items():
        got = md.forest_logits(llama, tokens[order], reorder(canonical, order), prefix=[4, 5])
        results[name] = np.asarray(got)[np.argsort(order)]  # back to canonical ids
    np.testing.assert_allclose(results["bfs"], results["dfs"], atol=TOL, rtol=0)
    np.testing.assert_allclose(results["mixed"], results["dfs"], atol=TOL, rtol=0)


def test_prefix_prefilled_in_several_calls(llama):
    prefix_tokens = list(range(3, 23))
    whole = md.make_prefix(llama, prefix_tokens)
    chunked = md.make_prefix(llama, prefix_tokens, chunk_size=6)
    np.testing.assert_allclose(chunked.logits, whole.logits, atol=TOL, rtol=0)
    parents, tokens = [-1, 0, 0, 1, -1], np.array([5, 6, 7, 8, 9])
    np.testing.assert_allclose(md.forest_logits(llama, tokens, parents, prefix=chunked),
                               md.forest_logits(llama, tokens, parents, prefix=whole),
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_branches_equal_independent_generates(which, request):
    """Branch b with its key equals generate of the prompt alone with that key (this catches
    an off-by-one position at the first generated token)."""
    params = request.getfixturevalue(which)
    prompt, key = [5, 9, 2, 40, 11], jax.random.key(3)
    options = dict(temperature=0.9, top_k=30)
    branches = md.generate_branches(params, prompt, 4, 10, key=key, **options)
    keys = row_keys(key, 4)
    for b in range(4):
        alone, _ = jaxkv.generate(params, [prompt], 10, key=keys[b:b + 1], **options)
        assert branches[b].tolist() == alone[0].tolist()
    assert len({tuple(r) for r in branches.tolist()}) > 1


def test_ragged_forests_pad_without_effect_and_compile_once(llama):
    rng = np.random.default_rng(4)
    forests = [random_forest(rng, n, 2) for n in (9, 14, 5)]
    tokens = [rng.integers(0, 97, len(p)) for p in forests]
    prefixes = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    jax.clear_caches()  # (an earlier test may have compiled the same signatures)
    jaxkv.trace_counts.clear()
    batched = md.forest_logits(llama, tokens, forests, prefix=md.make_prefix(llama, prefixes))
    assert np.isfinite(np.asarray(batched)).all()
    # Another batch of forests in the same size buckets reuses the compiled pass.
    more = [random_forest(rng, n, 1) for n in (16, 3, 11)]
    md.forest_logits(llama, [rng.integers(0, 97, len(p)) for p in more], more,
                     prefix=md.make_prefix(llama, [[1], [2, 3], [4, 5, 6, 7]]))
    assert jaxkv.trace_counts["forest_pass"] == 1
    for b in range(3):
        alone = md.forest_logits(llama, tokens[b], forests[b], prefix=prefixes[b])
        np.testing.assert_allclose(batched[b, : len(forests[b])], alone, atol=TOL, rtol=0)


def greedy_continue(params, cache, logits, pos, steps):
    """Greedy decode_step loop: the logits it saw and the tokens it chose."""
    step = jax.jit(jaxkv.decode_step, donate_argnames="cache")
    seen, chosen = [], []
    for _ in range(steps):
        token = jnp.argmax(logits, -1).astype(jnp.int32)
        seen.append(np.asarray(logits[0]))
        chosen.append(int(token[0]))
        logits, cache = step(params, cache, token, jnp.array([pos]))
        pos += 1
    return np.stack(seen), chosen


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_accept_branch_then_decode_equals_never_branching(which, request):
    params = request.getfixturevalue(which)
    prompt = [5, 9, 2, 40, 11, 3, 3]
    prefix, branches = md.decode_branches(params, prompt, 3, 6, key=jax.random.key(1))
    b = 2
    cache, pos = md.accept_branch(params, prefix, branches, b, capacity=32)
    assert pos == len(prompt) + 6
    got = greedy_continue(params, cache, branches.logits[b:b + 1], pos, 5)
    straight = prompt + branches.tokens[b].tolist()
    plain = jaxkv.init_cache(params, 1, 32)
    logits, plain = jaxkv.prefill(params, plain, np.array([straight]))
    want = greedy_continue(params, plain, logits, len(straight), 5)
    np.testing.assert_allclose(got[0], want[0], atol=TOL, rtol=0)
    assert got[1] == want[1]


def test_accept_forest_node_then_decode(llama):
    parents, tokens = [-1, 0, 0, 2, 3, 1], np.array([11, 12, 13, 14, 15, 16])
    prefix = md.make_prefix(llama, [1, 2, 3])
    logits, node_cache, (forest,) = md.forest_pass(llama, [tokens], [parents], prefix)
    cache, pos = md.accept_node(llama, prefix, node_cache, forest, 4, capacity=24)
    got = greedy_continue(llama, cache, logits[:, 4], pos, 4)
    straight = [1, 2, 3, 11, 13, 14, 15]
    plain = jaxkv.init_cache(llama, 1, 24)
    first, plain = jaxkv.prefill(llama, plain, np.array([straight]))
    want = greedy_continue(llama, plain, first, len(straight), 4)
    np.testing.assert_allclose(got[0], want[0], atol=TOL, rtol=0)
    assert got[1] == want[1]


def test_score_continuations_equal_separate_forwards(model):
    context = [3, 1, 4, 1, 5, 9]
    candidates = [[2, 6], [2, 6, 5], [3], [2, 7, 1, 8], [50, 60, 70]]  # shared beginnings
    got = md.score_continuations(model, context, candidates)
    for c, cand in enumerate(candidates):
        logp = jax.nn.log_softmax(jaxkv.forward(model, np.array([context + cand]))[0], -1)
        want = sum(float(logp[len(context) - 1 + j, t]) for j, t in enumerate(cand))
        assert abs(float(got[c]) - want) <= 1e-4


@pytest.mark.parametrize("call, match", [
    (lambda p: md.score_continuations(p, [1, 2], [[3], []]), r"candidates\[1\] is empty"),
    (lambda p: md.forest_logits(p, np.array([1, 2]), [-1, 0, 1]), "one token per node"),
    (lambda p: md.forest_logits(p, np.array([1, 200]), [-1, 0]), "not a token id"),
    (lambda p: md.generate_branches(p, [1, 2], 0, 4), "n_branches must be a positive int"),
    (lambda p: md.make_prefix(p, [[1], []]), r"prefix\[1\] is empty"),
])
def test_bad_input(llama, call, match):
    with pytest.raises(ValueError, match=match):
        call(llama)


def test_learned_positions_limit(gpt2):
    with pytest.raises(ValueError, match="need 130 positions; the model has 128"):
        md.forest_logits(gpt2, np.arange(10), np.arange(-1, 9), prefix=[7] * 120)


@pytest.fixture(scope="module")
def peaked_hf(tmp_path_factory):
    """Tiny random HF models with a sharpened head, so beam scores have no near-ties."""
    models = {}
    for name in ("llama_gqa", "gpt2"):
        config, cls = hf_configs()[name]
        torch.manual_seed(0)
        model = cls(config).eval()
        with torch.no_grad():
            (model.lm_head.weight if name != "gpt2" else model.transformer.wte.weight).mul_(8.0)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        models[name] = (model, jaxkv.load(path))
    return models


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
@pytest.mark.parametrize("eos_step, length_penalty, beams, steps", [
    (None, 1.0, 4, 12), (2, 1.0, 4, 12), (3, 2.0, 3, 10), (1, 0.5, 5, 16), (4, -1.0, 4, 12)])
def test_beam_search_equals_hugging_face(peaked_hf, name, eos_step, length_penalty, beams,
                                         steps):
    model, params = peaked_hf[name]
    for prompt in ([54, 90, 26, 79, 65, 0], [12, 7, 33, 81]):
        greedy, _ = jaxkv.generate(params, [prompt], 8)
        eos = None if eos_step is None else int(greedy[0, eos_step])
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=int),
                num_beams=beams, num_return_sequences=beams, do_sample=False,
                max_new_tokens=steps, length_penalty=length_penalty, eos_token_id=eos,
                pad_token_id=0, early_stopping=False, return_dict_in_generate=True,
                output_scores=True)
        tokens, scores, lengths = jaxkv.beam_search(params, prompt, beams, steps,
                                                 length_penalty=length_penalty, eos_id=eos)
        theirs = out.sequences[:, len(prompt):].numpy()
        for i in range(beams):
            n = int(lengths[i])
            assert tokens[i, :n].tolist() == theirs[i, :n].tolist()
            assert (tokens[i, n:] == (0 if eos is None else eos)).all()  # pad_id: EOS or 0
        np.testing.assert_allclose(scores, out.sequences_scores.numpy(), atol=1e-4, rtol=0)
