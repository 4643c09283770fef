"""Shared fixtures: float32 at "highest" matmul precision, tiny configs, tiny HF models."""

import os

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jaxkv  # noqa: E402

TINY = dict(vocab_size=97, d_model=64, n_layers=3, max_seq_len=128)

CONFIGS = {
    "gpt2": jaxkv.Config.gpt2(n_heads=4, **TINY),
    "llama_mha": jaxkv.Config.llama(n_heads=4, n_kv_heads=4, d_ff=96, **TINY),
    "llama_gqa": jaxkv.Config.llama(n_heads=4, n_kv_heads=2, d_ff=96, **TINY),
    "llama_mqa": jaxkv.Config.llama(n_heads=4, n_kv_heads=1, d_ff=96, tie_embeddings=True,
                                    **TINY),
}


@pytest.fixture(params=sorted(CONFIGS))
def model(request):
    """Random params for each tiny config (GPT-2; Llama with MHA, GQA, MQA)."""
    return jaxkv.init_params(CONFIGS[request.param], jax.random.key(0))


@pytest.fixture(scope="session")
def llama():
    return jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(1))


@pytest.fixture(scope="session")
def gpt2():
    return jaxkv.init_params(CONFIGS["gpt2"], jax.random.key(2))


def random_tokens(key, shape, vocab=TINY["vocab_size"]):
    return jax.random.randint(jax.random.key(key), shape, 0, vocab)
