"""Configs are frozen and validated."""

import dataclasses

import pytest

import jaxkv
from tests.conftest import CONFIGS


@pytest.mark.parametrize("change, match", [
    (dict(n_kv_heads=3), r"n_heads \(4\) must be a multiple of Config.n_kv_heads \(3\)"),
    (dict(d_model=0), "d_model must be a positive int"),
    (dict(norm="batchnorm"), "norm must be one of"),
    (dict(head_dim=15), "head_dim must be even for RoPE"),
    (dict(rotary_dim=5), "rotary_dim must be even for RoPE, got 5"),
    (dict(rotary_dim=18), r"rotary_dim must be in \(0, head_dim=16\], got 18"),
    (dict(qk_norm_all=True), "qk_norm_all needs Config.qk_norm"),
    (dict(pre_norms=False), "without pre_norms needs post_norms"),
    (dict(eos_id=97), r"eos_id must be in \[0, 97\)"),
    (dict(stop_ids=[3, 97]), r"stop_ids must be in \[0, 97\), got 97"),
    (dict(rope_scaling=("yarn", 4.0)), r"rope_scaling\[0\] must be one of \('linear', 'llama3'\)"),
    (dict(rope_scaling=("linear",)), "rope_scaling 'linear' needs positive numbers factor"),
    (dict(rope_scaling=("llama3", 8.0, 1.0, 4.0, -1)),
     "needs positive numbers factor, low_freq_factor, high_freq_factor, original_max_len"),
])
def test_invalid_configs_are_rejected(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CONFIGS["llama_gqa"], **change)


def test_config_is_frozen_and_round_trips():
    config = CONFIGS["gpt2"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.n_layers = 4
    assert jaxkv.Config.from_dict(config.to_dict()) == config
