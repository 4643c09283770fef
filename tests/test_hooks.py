"""Hooks (core/hooks.py): captures and edits in the cached, compiled decode step equal the
uncached forward's, position by position."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.core.tracecount import TRACE_COUNTS
from tests.conftest import CONFIGS, HF_TINY, encoder_inputs, random_tokens, save_tiny_models

TOL = 1e-5
ALL = ("embed", "resid_pre", "head_out", "attn_out", "mlp_out", "resid_post", "final")


def add_vector(x_BTD, pos_BT, v_D):
    """A steering edit: v added at every position."""
    return x_BTD + v_D


def flat(site, x):
    """A capture with head_out's [.., N, H] as [.., N H], like the other sites' [.., D]."""
    x = np.asarray(x)
    return x.reshape(*x.shape[:-2], -1) if site == "head_out" else x


def decode_all(params, tokens_BT, delay_B, hooks, capacity=32, **cache_options):
    """Every token of each row through decode steps from position 0, row b delay_B[b] steps
    behind (it holds position 0 until then), so a step's rows sit at different positions.
    Returns logits [B, T, V] and the captures {site: [.., B, T, D]} by position."""
    B, T = tokens_BT.shape
    step = jax.jit(jaxkv.decode_step)
    cache = jaxkv.init_cache(params, B, capacity, **cache_options)
    logits, acts = np.zeros((B, T, params.config.vocab_size), np.float32), {}
    for i in range(T + max(delay_B)):
        pos_B = np.clip(i - np.asarray(delay_B), 0, T - 1)
        token_B = tokens_BT[np.arange(B), pos_B]
        logits_BV, cache, acts_i = step(params, cache, token_B, jnp.asarray(pos_B), hooks)
        for b in range(B):
            if 0 <= i - delay_B[b] < T:
                logits[b, pos_B[b]] = logits_BV[b]
                for site, x in acts_i.items():
                    x = flat(site, x)
                    acts.setdefault(site, np.zeros((*x.shape[:-3], B, T, x.shape[-1])))
                    acts[site][..., b, pos_B[b], :] = x[..., b, 0, :]
    return logits, acts


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_sites_add_up(name):
    """resid_post = resid_pre + attn_out + mlp_out; each layer's resid_pre the last one's
    resid_post (the first: embed); the logits are final through the head."""
    params = jaxkv.init_params(CONFIGS[name], jax.random.key(0))
    tokens_BT = random_tokens(0, (2, 9))
    logits_BTV, acts = jaxkv.forward(params, tokens_BT, hooks=jaxkv.Hooks(capture=ALL))
    np.testing.assert_allclose(acts["resid_post"],
                               acts["resid_pre"] + acts["attn_out"] + acts["mlp_out"], atol=TOL)
    np.testing.assert_array_equal(acts["resid_pre"][0], acts["embed"])
    np.testing.assert_array_equal(acts["resid_pre"][1:], acts["resid_post"][:-1])
    head_VD = params.embed if params.lm_head is None else params.lm_head
    np.testing.assert_allclose(acts["final"] @ head_VD.T, logits_BTV, atol=1e-4)
    np.testing.assert_array_equal(logits_BTV, jaxkv.forward(params, tokens_BT))


def test_decode_captures_equal_forward(model):
    """Every site, every layer, rows at different positions in a step: the decode steps'
    captures equal the forward's at the same positions."""
    tokens_BT = np.asarray(random_tokens(1, (2, 10)))
    hooks = jaxkv.Hooks(capture=ALL)
    ref_BTV, ref = jaxkv.forward(model, tokens_BT, hooks=hooks)
    got_BTV, got = decode_all(model, tokens_BT, [0, 4], hooks)
    assert sorted(got) == sorted(ALL)
    np.testing.assert_allclose(got_BTV, ref_BTV, atol=1e-4)
    for site in ALL:
        np.testing.assert_allclose(got[site], flat(site, ref[site]), atol=1e-4, err_msg=site)


@pytest.mark.parametrize("chunk", [None, 4])
def test_prefill_captures_equal_forward(llama, chunk):
    """Ragged prompts, in one pass or chunks of 4: each row's captures at its own tokens equal
    the forward's; the logits are the last token's."""
    tokens_BT = np.asarray(random_tokens(7, (2, 11)))
    lengths_B = np.array([11, 6])
    hooks = jaxkv.Hooks(capture=ALL, layers=[0, 2])
    ref_BTV, ref = jaxkv.forward(llama, tokens_BT, hooks=hooks)
    cache = jaxkv.init_cache(llama, 2, 32)
    if chunk is None:
        logits_BV, _, got = jaxkv.prefill(llama, cache, tokens_BT, lengths_B, hooks=hooks)
    else:
        logits_BV, _, got = jaxkv.core.decoder.prefill_padded(
            llama, cache, jnp.asarray(tokens_BT), jnp.asarray(lengths_B), jnp.zeros(2, jnp.int32),
            chunk=chunk, hooks=hooks)
    for b, n in enumerate(lengths_B):
        np.testing.assert_allclose(logits_BV[b], ref_BTV[b, n - 1], atol=1e-4)
        for site in ALL:
            np.testing.assert_allclose(flat(site, got[site])[..., b, :n, :],
                                       flat(site, ref[site])[..., b, :n, :], atol=1e-4,
                                       err_msg=site)


def test_prefill_then_steps_with_an_edit_equal_forward(llama):
    """A steering edit through prefill and the decode steps after it: the logits of every
    position equal the forward's with the same edit."""
    v_D = jax.random.normal(jax.random.key(8), (llama.config.d_model,))
    hooks = jaxkv.Hooks(edit={("resid_post", 0): jax.tree_util.Partial(add_vector, v_D=v_D),
                              "final": lambda x, pos: x * 1.5})
    tokens_BT = np.asarray(random_tokens(9, (1, 10)))
    ref_BTV, _ = jaxkv.forward(llama, tokens_BT, hooks=hooks)
    assert_prefill_then_steps_give(llama, tokens_BT, 6, hooks, ref_BTV)


def assert_prefill_then_steps_give(params, tokens_BT, split, hooks, want_BTV, capacity=32):
    """One row's first `split` tokens prefilled, the rest decode steps, all with hooks: the
    logits at each position equal want_BTV's."""
    cache = jaxkv.init_cache(params, 1, capacity)
    logits_BV, cache, _ = jaxkv.prefill(params, cache, tokens_BT[:, :split], hooks=hooks)
    np.testing.assert_allclose(logits_BV[0], want_BTV[0, split - 1], atol=1e-4)
    for t in range(split, tokens_BT.shape[1]):
        logits_BV, cache, _ = jaxkv.decode_step(params, cache, tokens_BT[:, t], jnp.array([t]),
                                                hooks)
        np.testing.assert_allclose(logits_BV[0], want_BTV[0, t], atol=1e-4)


def test_encoder_decoder_captures_and_edits(encdec):
    """T5 and Whisper's decoders: the decode steps' captures, with an edit, equal the forward's
    (the sites are the decoder's; resid_post comes after its cross-attention too)."""
    v_D = jax.random.normal(jax.random.key(12), (encdec.config.d_model,))
    hooks = jaxkv.Hooks(capture=ALL, edit={("attn_out", 0): jax.tree_util.Partial(add_vector,
                                                                                  v_D=v_D)})
    enc = encoder_inputs(encdec.config, 0, 2)
    tokens_BT = np.asarray(random_tokens(13, (2, 7)))
    ref_BTV, ref = jaxkv.forward(encdec, tokens_BT, encoder_inputs=enc, hooks=hooks)
    got_BTV, got = decode_all(encdec, tokens_BT, [0, 2], hooks, encoder_inputs=enc)
    np.testing.assert_allclose(got_BTV, ref_BTV, atol=1e-4)
    for site in ALL:
        np.testing.assert_allclose(got[site], flat(site, ref[site]), atol=1e-4, err_msg=site)


def test_layers_choose_what_is_captured(llama):
    """layers in any order, repeated or not: each once, in the model's order (prefill's loop
    too)."""
    tokens_BT = random_tokens(2, (1, 6))
    _, every = jaxkv.forward(llama, tokens_BT, hooks=jaxkv.Hooks(capture=["resid_post"]))
    some_hooks = jaxkv.Hooks(capture=["resid_post"], layers=[2, 0, 2])
    assert some_hooks.layers == (0, 2)
    _, some = jaxkv.forward(llama, tokens_BT, hooks=some_hooks)
    assert every["resid_post"].shape[0] == llama.config.n_layers
    np.testing.assert_array_equal(some["resid_post"], every["resid_post"][np.array([0, 2])])
    _, _, prefilled = jaxkv.prefill(llama, jaxkv.init_cache(llama, 1, 16), tokens_BT,
                                    hooks=some_hooks)
    np.testing.assert_allclose(prefilled["resid_post"], some["resid_post"], atol=1e-4)


@pytest.mark.parametrize("site,layer", [("resid_post", 1), ("attn_out", None), ("mlp_out", 0),
                                        ("embed", None), ("final", None)])
def test_edit_in_decode_equals_forward(llama, site, layer):
    """A steering vector added at a site changes the logits, the same in the decode steps as in
    the forward."""
    v_D = jax.random.normal(jax.random.key(3), (llama.config.d_model,)) * 0.5
    hooks = jaxkv.Hooks(capture=["resid_post"],
                        edit={(site, layer): jax.tree_util.Partial(add_vector, v_D=v_D)})
    tokens_BT = np.asarray(random_tokens(4, (2, 8)))
    ref_BTV, ref = jaxkv.forward(llama, tokens_BT, hooks=hooks)
    assert np.abs(ref_BTV - jaxkv.forward(llama, tokens_BT)).max() > 1e-3
    got_BTV, got = decode_all(llama, tokens_BT, [0, 3], hooks)
    np.testing.assert_allclose(got_BTV, ref_BTV, atol=1e-4)
    np.testing.assert_allclose(got["resid_post"], ref["resid_post"], atol=1e-4)


def test_edit_by_position(llama):
    """fn sees each token's position: an edit at positions >= 5 only leaves the logits before
    them as without hooks."""
    def ablate_late(x_BTD, pos_BT):
        return jnp.where(pos_BT[..., None] >= 5, 0.0, x_BTD)
    tokens_BT = random_tokens(5, (1, 8))
    plain_BTV = jaxkv.forward(llama, tokens_BT)
    edited_BTV, _ = jaxkv.forward(llama, tokens_BT,
                                  hooks=jaxkv.Hooks(edit={"attn_out": ablate_late}))
    np.testing.assert_allclose(edited_BTV[:, :5], plain_BTV[:, :5], atol=1e-6)
    assert np.abs(edited_BTV[:, 5:] - plain_BTV[:, 5:]).max() > 1e-3


def test_unchanged_edit_keeps_the_logits(model):
    """Edits that return x as it came leave the logits bitwise as without hooks (float32 on the
    CPU: the sublayers' residual additions, unfused where edited, round the same)."""
    same = {(site, None): (lambda x, pos: x) for site in ALL}
    tokens_BT = random_tokens(6, (2, 7))
    edited_BTV, _ = jaxkv.forward(model, tokens_BT, hooks=jaxkv.Hooks(edit=same))
    np.testing.assert_array_equal(edited_BTV, jaxkv.forward(model, tokens_BT))


def test_new_arrays_reuse_the_compiled_step(llama):
    """Hooks whose edits are Partials of arrays compile once per structure: a new steering
    vector reuses the step; no hooks and empty Hooks are the same program."""
    step = jax.jit(jaxkv.decode_step)
    cache = jaxkv.init_cache(llama, 1, 8)
    token, pos = jnp.array([3]), jnp.array([0])
    before = TRACE_COUNTS["decode_step"]
    for seed in range(3):
        v_D = jax.random.normal(jax.random.key(seed), (llama.config.d_model,))
        edit = {("resid_post", 1): jax.tree_util.Partial(add_vector, v_D=v_D)}
        step(llama, cache, token, pos, jaxkv.Hooks(edit=edit))
    assert TRACE_COUNTS["decode_step"] == before + 1
    plain = jax.jit(jaxkv.decode_step).lower(llama, cache, token, pos).as_text()
    empty = jax.jit(jaxkv.decode_step).lower(llama, cache, token, pos, jaxkv.Hooks()).as_text()
    assert plain == empty


def test_bad_hooks_name_the_problem(llama):
    with pytest.raises(ValueError, match="unknown site 'resid_mid'"):
        jaxkv.Hooks(capture=["resid_mid"])
    with pytest.raises(ValueError, match="'final' has no layers"):
        jaxkv.Hooks(edit={("final", 2): lambda x, pos: x})
    with pytest.raises(TypeError, match="expected a function"):
        jaxkv.Hooks(edit={"embed": 3.0})
    with pytest.raises(ValueError, match="layers 0..2, got layer 7"):
        jaxkv.forward(llama, random_tokens(0, (1, 4)),
                      hooks=jaxkv.Hooks(capture=["resid_pre"], layers=[7]))
    with pytest.raises(ValueError, match=r"Hooks edit at \('mlp_out', 1\): expected x's shape "
                                         r"\(1, 4, 64\) back, got \(1, 4\)"):
        jaxkv.forward(llama, random_tokens(0, (1, 4)),
                      hooks=jaxkv.Hooks(edit={("mlp_out", 1): lambda x, pos: x.sum(-1)}))
    with pytest.raises(TypeError, match="expected a jaxkv.Hooks"):
        jaxkv.forward(llama, random_tokens(0, (1, 4)), hooks={"capture": ["embed"]})


def greedy_by_forward(params, prompt, new_tokens, hooks):
    """Greedy tokens by the uncached forward with hooks, one whole pass per token."""
    tokens = list(prompt)
    for _ in range(new_tokens):
        logits_BTV, _ = jaxkv.forward(params, np.array([tokens]), hooks=hooks)
        tokens.append(int(np.argmax(logits_BTV[0, -1])))
    return tokens


def test_generate_with_hooks_equals_forward(llama):
    """Ragged prompts, greedy, a steering edit: generate's tokens equal the forward's greedy
    tokens with the same edit, and its captures, by position over prompt and answer, equal the
    forward's over the whole sequence."""
    v_D = jax.random.normal(jax.random.key(10), (llama.config.d_model,)) * 2
    hooks = jaxkv.Hooks(capture=["resid_post", "final"],
                        edit={("mlp_out", 1): jax.tree_util.Partial(add_vector, v_D=v_D)})
    prompts = [[5, 9, 2, 7, 1, 3, 8], [4, 6, 11]]
    tokens_BN, lengths_B, acts = jaxkv.generate(llama, prompts, 6, hooks=hooks)
    plain_BN, _ = jaxkv.generate(llama, prompts, 6)
    assert (np.asarray(tokens_BN) != np.asarray(plain_BN)).any()
    for b, prompt in enumerate(prompts):
        want = greedy_by_forward(llama, prompt, 6, hooks)
        assert list(np.asarray(tokens_BN[b])) == want[len(prompt):]
        _, ref = jaxkv.forward(llama, np.array([want[:-1]]), hooks=hooks)
        n = len(want) - 1
        for site in ("resid_post", "final"):
            np.testing.assert_allclose(acts[site][..., b, :n, :], ref[site][..., 0, :, :],
                                       atol=1e-4, err_msg=site)


def test_a_capture_too_large_is_refused():
    """generate checks its captures' size before it runs (check_fits): here 3 layers x 64 rows x
    2**20 positions x 4,096 float32s, 3 TiB."""
    from jaxkv.core.hooks import check_fits
    config = jaxkv.Config.llama(n_heads=32, n_kv_heads=8, d_ff=96, vocab_size=97, d_model=4096,
                                n_layers=3, max_seq_len=2 ** 20)
    with pytest.raises(ValueError, match=r"hooks: capturing resid_post over 3 layer\(s\) x 64 "
                                         r"row\(s\) x 1048576 positions takes 3072.0 GiB"):
        check_fits(jaxkv.Hooks(capture=["resid_post"]), config, 64, 2 ** 20, jnp.float32)
    check_fits(jaxkv.Hooks(capture=["resid_post", "head_out"]), config, 2, 64, jnp.float32)


def test_head_ablation_in_decode_equals_forward(llama):
    """Zeroing one head's output at one layer: the decode steps' logits equal the forward's, and
    head_out's capture shows the zeros where the edit made them."""
    def ablate(x_BTNH, pos_BT, head):
        return x_BTNH.at[:, :, head].set(0)
    hooks = jaxkv.Hooks(capture=["head_out"], layers=[1],
                        edit={("head_out", 1): jax.tree_util.Partial(ablate, head=2)})
    tokens_BT = np.asarray(random_tokens(11, (2, 8)))
    ref_BTV, ref = jaxkv.forward(llama, tokens_BT, hooks=hooks)
    assert np.abs(ref_BTV - jaxkv.forward(llama, tokens_BT)).max() > 1e-4
    assert ref["head_out"].shape == (1, 2, 8, llama.config.n_heads, llama.config.head_dim)
    assert not np.asarray(ref["head_out"][:, :, :, 2]).any()
    got_BTV, _ = decode_all(llama, tokens_BT, [0, 2], hooks)
    np.testing.assert_allclose(got_BTV, ref_BTV, atol=1e-4)


# ---- attn_probs, generate_many, loglikelihood_many, edits given their layer ---------------

WINDOWED = jaxkv.Config.llama(n_heads=4, n_kv_heads=2, d_ff=96, sliding_window=5,
                              window_layers=(0, 2), vocab_size=97, d_model=64, n_layers=3,
                              max_seq_len=128)


def hf_attention_configs():
    import transformers as tf

    small = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 max_position_embeddings=128, **HF_TINY)
    return {
        "llama_gqa": (tf.LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **small),
                      tf.LlamaForCausalLM),
        "gemma2_window_capped": (tf.Gemma2Config(
            num_hidden_layers=3, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
            attn_logit_softcapping=0.05, sliding_window=4, **small), tf.Gemma2ForCausalLM),
    }


@pytest.fixture(scope="module")
def hf_attention(tmp_path_factory):
    """Tiny random transformers models with eager attention (which returns its weights)."""
    return save_tiny_models(hf_attention_configs(), tmp_path_factory, seed=400, eager=True)


@pytest.mark.parametrize("name", ["llama_gqa", "gemma2_window_capped"])
def test_attn_probs_equal_transformers(hf_attention, name):
    """The forward's attn_probs equal transformers' attention weights (output_attentions), a
    sliding window and soft-capped scores included."""
    import torch

    torch_model, path = hf_attention[name]
    params = jaxkv.load(path)
    tokens_BT = np.asarray(random_tokens(12, (2, 10)))
    _, acts = jaxkv.forward(params, tokens_BT, hooks=jaxkv.Hooks(capture=["attn_probs"]))
    with torch.no_grad():
        out = torch_model(torch.tensor(tokens_BT), output_attentions=True)
    want = np.stack([a.numpy() for a in out.attentions])
    assert acts["attn_probs"].shape == want.shape == (params.config.n_layers, 2, 4, 10, 10)
    np.testing.assert_allclose(acts["attn_probs"], want, atol=1e-5)


@pytest.mark.parametrize("config", [CONFIGS["llama_gqa"], WINDOWED], ids=["global", "window"])
def test_attn_probs_in_cached_passes_equal_forward(config):
    """attn_probs by key position from prefill (chunks of 4, ragged), from decode steps (rows
    at different positions; a window layer's ring past its window) and from generate equal the
    forward's; positions no query reads hold 0."""
    params = jaxkv.init_params(config, jax.random.key(13))
    tokens_BT = np.asarray(random_tokens(14, (2, 12)))
    hooks = jaxkv.Hooks(capture=["attn_probs"])
    _, ref = jaxkv.forward(params, tokens_BT, hooks=hooks)
    ref = np.asarray(ref["attn_probs"])  # [L, B, N, T, T]
    lengths_B = np.array([12, 7])
    _, _, got = jaxkv.core.decoder.prefill_padded(
        params, jaxkv.init_cache(params, 2, 32), jnp.asarray(tokens_BT), jnp.asarray(lengths_B),
        jnp.zeros(2, jnp.int32), chunk=4, hooks=hooks)
    for b, n in enumerate(lengths_B):
        np.testing.assert_allclose(got["attn_probs"][:, b, :, :n, :n], ref[:, b, :, :n, :n],
                                   atol=1e-5)
        assert not np.asarray(got["attn_probs"][:, b, :, :n, n:]).any()
    step = jax.jit(jaxkv.decode_step)
    cache = jaxkv.init_cache(params, 2, 32)
    delay_B = np.array([0, 3])
    for i in range(12 + 3):
        pos_B = np.clip(i - delay_B, 0, 11)
        _, cache, acts = step(params, cache, tokens_BT[[0, 1], pos_B], jnp.asarray(pos_B), hooks)
        for b in range(2):
            if 0 <= i - delay_B[b] < 12:
                p = pos_B[b]
                np.testing.assert_allclose(acts["attn_probs"][:, b, :, 0, :12],
                                           ref[:, b, :, p, :], atol=1e-5)
    prompts = [list(tokens_BT[0, :5]), list(tokens_BT[1, :3])]
    out_BN, _, acts = jaxkv.generate(params, prompts, 6, hooks=hooks)
    for b, prompt in enumerate(prompts):
        seq = prompt + list(np.asarray(out_BN[b]))[:-1]
        _, want = jaxkv.forward(params, np.array([seq]), hooks=hooks)
        n = len(seq)
        np.testing.assert_allclose(acts["attn_probs"][:, b, :, :n, :n],
                                   want["attn_probs"][:, 0], atol=1e-5)


def test_generate_many_answers_carry_their_captures(llama):
    """generate_many with a steering edit and captures, 3 prompts over 2 rows (a row serves a
    second prompt): each answer equals the forward's greedy tokens with the edit, and its acts
    equal the forward's over prompt + answer but its last token."""
    v_D = jax.random.normal(jax.random.key(15), (llama.config.d_model,)) * 2
    hooks = jaxkv.Hooks(capture=["resid_post", "attn_probs"], layers=[1],
                        edit={("mlp_out", 1): jax.tree_util.Partial(add_vector, v_D=v_D)})
    prompts = [[5, 9, 2, 7, 1, 3, 8], [4, 6, 11], [12, 3, 3, 40, 7]]
    got = jaxkv.generate_many(llama, prompts, 6, batch_size=2, hooks=hooks)
    for prompt, (ids, acts) in zip(prompts, got):
        want = greedy_by_forward(llama, prompt, 6, hooks)
        assert list(prompt) + list(ids) == want
        _, ref = jaxkv.forward(llama, np.array([want[:-1]]), hooks=hooks)
        n = len(want) - 1
        assert acts["resid_post"].shape == (1, n, llama.config.d_model)
        np.testing.assert_allclose(acts["resid_post"], ref["resid_post"][:, 0], atol=1e-4)
        np.testing.assert_allclose(acts["attn_probs"][..., :n], ref["attn_probs"][:, 0],
                                   atol=1e-5)
        assert not acts["attn_probs"][..., n:].any()


def test_loglikelihood_many_with_hooks_equals_forward(llama):
    """Scored with an edit, requests sharing a context (a trie) and not: each log-probability
    equals the forward's with the edit, and each request's captures equal the forward's over
    context + continuation but its last token."""
    v_D = jax.random.normal(jax.random.key(16), (llama.config.d_model,)) * 2
    hooks = jaxkv.Hooks(capture=["resid_pre", "head_out"],
                        edit={("resid_post", 0): jax.tree_util.Partial(add_vector, v_D=v_D)})
    requests = [([5, 9, 2], [7, 1, 3]), ([5, 9, 2], [7, 4]), ([4, 6], [11]), ([8], [2, 2])]
    results = jaxkv.loglikelihood_many(llama, requests, batch_size=2, hooks=hooks)
    plain = jaxkv.loglikelihood_many(llama, requests, batch_size=2)
    for (context, continuation), (logp, _, acts), (plain_logp, _) in zip(requests, results,
                                                                         plain):
        seq = context + continuation
        logits_BTV, ref = jaxkv.forward(llama, np.array([seq[:-1]]), hooks=hooks)
        logp_TV = jax.nn.log_softmax(logits_BTV[0, len(context) - 1:])
        want = float(sum(logp_TV[i, t] for i, t in enumerate(continuation)))
        assert logp == pytest.approx(want, abs=1e-4) and logp != pytest.approx(plain_logp)
        for site in ("resid_pre", "head_out"):
            np.testing.assert_allclose(acts[site], ref[site][:, 0], atol=1e-4, err_msg=site)
    with pytest.raises(ValueError, match="attn_probs is not captured in passes over a shared"):
        jaxkv.loglikelihood_many(llama, requests, hooks=jaxkv.Hooks(capture=["attn_probs"]))


def test_an_edit_given_its_layer_sweeps_layers_in_one_program(llama):
    """Activation patching over layers: an edit keyed (site, None) that takes the layer patches
    the layer an array names; every target runs the same compiled forward, and equals an edit
    keyed at that layer."""
    def patch(x_BTD, pos_BT, layer, target, source_LBTD):
        return jnp.where(layer == target, source_LBTD[layer], x_BTD)

    def patch_one(x_BTD, pos_BT, source_BTD):
        return source_BTD

    clean_BT, corrupt_BT = random_tokens(17, (1, 6)), random_tokens(18, (1, 6))
    _, clean = jaxkv.forward(llama, clean_BT, hooks=jaxkv.Hooks(capture=["resid_pre"]))
    forward = jaxkv.core.decoder._forward
    before = forward._cache_size()
    for target in range(llama.config.n_layers):
        edit = jax.tree_util.Partial(patch, target=jnp.int32(target),
                                     source_LBTD=clean["resid_pre"])
        got_BTV = jaxkv.forward(llama, corrupt_BT,
                                hooks=jaxkv.Hooks(edit={("resid_pre", None): edit}))
        one = jax.tree_util.Partial(patch_one, source_BTD=clean["resid_pre"][target])
        want_BTV = jaxkv.forward(llama, corrupt_BT,
                                 hooks=jaxkv.Hooks(edit={("resid_pre", target): one}))
        np.testing.assert_array_equal(got_BTV[0], want_BTV[0])
    assert forward._cache_size() == before + 1 + llama.config.n_layers


def test_attn_probs_cannot_be_edited():
    with pytest.raises(ValueError, match="'attn_probs' can be captured, not edited"):
        jaxkv.Hooks(edit={("attn_probs", 0): lambda x, pos: x})


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_unchanged_edits_keep_generate_bitwise(llama, weights):
    """bfloat16 and int8 weights: edits that return x as it came, at every site, with every
    site captured, leave generate's tokens and the forward's logits bitwise as without hooks
    (the sublayers' residual additions, unfused where edited, round as the fused ones)."""
    params = jaxkv.cast(llama, jnp.bfloat16) if weights == "bfloat16" else jaxkv.quantize(llama)
    hooks = jaxkv.Hooks(capture=ALL, edit={(site, None): (lambda x, pos: x) for site in ALL})
    prompts = [[5, 9, 2, 7, 1, 3, 8], [4, 6, 11]]
    tokens_BN, lengths_B, _ = jaxkv.generate(params, prompts, 12, hooks=hooks)
    plain_BN, plain_B = jaxkv.generate(params, prompts, 12)
    np.testing.assert_array_equal(tokens_BN, plain_BN)
    np.testing.assert_array_equal(lengths_B, plain_B)
    tokens_BT = random_tokens(19, (2, 9))
    np.testing.assert_array_equal(jaxkv.forward(params, tokens_BT, hooks=hooks)[0],
                                  jaxkv.forward(params, tokens_BT))


GEMMA_LIKE = dataclasses.replace(
    CONFIGS["llama_gqa"], post_norms=True, attn_softcap=0.5, logit_softcap=3.0,
    scale_embeddings=True, qk_norm=True, attn_bias=True, sliding_window=5, window_layers=(0, 2),
    local_rope_theta=100.0)


def test_decode_captures_equal_forward_gemma_like():
    """Sublayer outputs normed before the residual add, soft-capped scores and logits, q/k norms
    and biases, window layers whose ring the steps pass: every site's decode captures (rows at
    different positions) equal the forward's."""
    params = jaxkv.init_params(GEMMA_LIKE, jax.random.key(20))
    tokens_BT = np.asarray(random_tokens(21, (2, 11)))
    hooks = jaxkv.Hooks(capture=ALL)
    ref_BTV, ref = jaxkv.forward(params, tokens_BT, hooks=hooks)
    got_BTV, got = decode_all(params, tokens_BT, [0, 3], hooks)
    np.testing.assert_allclose(got_BTV, ref_BTV, atol=1e-4)
    for site in ALL:
        np.testing.assert_allclose(got[site], flat(site, ref[site]), atol=1e-4, err_msg=site)


# a mixture (4 experts, top 2, layer 1 dense as Qwen3-MoE's mlp_only_layers make one)
MOE = dataclasses.replace(CONFIGS["llama_gqa"], n_experts=4, experts_per_token=2,
                          norm_topk=True, dense_layers=(1,))


def test_router_captures_in_decode_equal_forward():
    """A mixture's router logits [L, B, T, E], float32: the decode steps' equal the forward's,
    the dense layer's are zeros, and generate's loop carries them for its new tokens."""
    params = jaxkv.init_params(MOE, jax.random.key(0))
    tokens_BT = np.asarray(random_tokens(20, (2, 8)))
    hooks = jaxkv.Hooks(capture=["router"])
    ref_BTV, ref = jaxkv.forward(params, tokens_BT, hooks=hooks)
    assert ref["router"].shape == (MOE.n_layers, 2, 8, 4) and ref["router"].dtype == jnp.float32
    assert not np.asarray(ref["router"][1]).any() and np.asarray(ref["router"][0]).any()
    got_BTV, got = decode_all(params, tokens_BT, [0, 3], hooks)
    np.testing.assert_allclose(got_BTV, ref_BTV, atol=1e-4)
    np.testing.assert_allclose(got["router"], ref["router"], atol=1e-4)
    new_BN, _, acts = jaxkv.generate(params, tokens_BT[:, :5].tolist(), 3, hooks=hooks)
    seen_BT = np.concatenate([tokens_BT[:, :5], np.asarray(new_BN)[:, :2]], 1)
    _, again = jaxkv.forward(params, seen_BT, hooks=hooks)
    np.testing.assert_allclose(np.asarray(acts["router"])[:, :, :7], again["router"], atol=1e-4)


def test_a_router_edit_that_bans_experts_equals_a_mixture_without_them():
    """Experts 2 and 3 banned (-inf logits) in every MoE layer: the logits, in the forward and
    in prefill + decode steps, equal a mixture made of experts 0 and 1 alone (the same router
    rows; its softmax over two is the renormalized top 2 of four)."""
    params = jaxkv.init_params(MOE, jax.random.key(1))
    hooks = jaxkv.Hooks(edit={"router": lambda x, pos: x.at[..., 2:].set(-jnp.inf)})
    two = dataclasses.replace(params, config=dataclasses.replace(MOE, n_experts=2), blocks=tuple(
        b if b.router is None else dataclasses.replace(
            b, router=b.router[:2], experts_in=b.experts_in[:2], experts_out=b.experts_out[:2])
        for b in params.blocks))
    tokens_BT = np.asarray(random_tokens(21, (1, 9)))
    want_BTV = jaxkv.forward(two, tokens_BT)
    got_BTV, _ = jaxkv.forward(params, tokens_BT, hooks=hooks)
    np.testing.assert_allclose(got_BTV, want_BTV, atol=1e-5)
    assert np.abs(want_BTV - jaxkv.forward(params, tokens_BT)).max() > 1e-3
    assert_prefill_then_steps_give(params, tokens_BT, 5, hooks, want_BTV, capacity=16)


def test_the_router_of_a_model_without_experts_is_refused(llama):
    with pytest.raises(ValueError, match="'router' is a mixture of experts' site"):
        jaxkv.forward(llama, random_tokens(0, (1, 4)), hooks=jaxkv.Hooks(capture=["router"]))
