"""Name maps and layout fixes used when converting foreign checkpoints."""

import jax
import numpy as np
import pytest

from jaxkv.core.params import init_params
from jaxkv.models import gpt2, llama
from jaxkv.models import maps as convert
from tests.conftest import CONFIGS


def llama_cpp_permute(w, n_heads):
    """llama.cpp's convert_hf_to_gguf Q/K permutation (rotate-half -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def test_split_layer():
    assert convert.split_layer("blocks.3.wqkv") == ("blocks.wqkv", 3)
    assert convert.split_layer("encoder.blocks.11.attn_norm.scale") == (
        "encoder.blocks.attn_norm.scale", 11)
    assert convert.split_layer("embed") == ("embed", None)


@pytest.mark.parametrize("n_heads, shape", [(4, (64, 32)), (2, (32, 48)), (3, (48,))])
def test_unpermute_inverts_llama_cpp(n_heads, shape):
    w = np.random.default_rng(0).normal(size=shape)
    np.testing.assert_array_equal(convert.unpermute_rope_rows(llama_cpp_permute(w, n_heads),
                                                              n_heads), w)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_name_maps_cover_every_parameter(name):
    config = CONFIGS[name]
    skeleton = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    paths = {convert.split_layer(convert.path_name(p))[0]
             for p, _ in jax.tree_util.tree_flatten_with_path(skeleton)[0]}
    maps = ([gpt2.name_map(config)] if config.position == "learned" else
            [llama.hf_map(config), llama.gguf_map(config)])
    for name_map in maps:
        assert paths <= set(name_map)
