"""Llama (1, 2, 3.x with RoPE scaling): config.json keys and defaults, GGUF metadata, and the
Llama-shaped name map that Qwen, Mistral and Gemma reuse with their own tensor names."""

from jaxkv.core.config import ROPE_SCALINGS, Config
from jaxkv.models.maps import (CheckpointError, Src, feed_forward, linear_qkv, norm, out_proj,
                               stacked_experts, unpermute_rope_rows)
from jaxkv.models.common import (activation, gguf_arch_field, gguf_arch_required, gguf_id,
                                 gguf_required, gguf_stop_ids, gguf_tensor_names, special_ids,
                                 with_defaults)

# transformers' LlamaConfig defaults for keys a config.json may omit; the vocabulary size and
# the width have no default worth guessing and must be present
HF_DEFAULTS = dict(intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=None, head_dim=None, hidden_act="silu",
                   max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                   attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                   bos_token_id=1, eos_token_id=2)

HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}

# llama.cpp's names (llama-arch.cpp), shared by its llama, qwen2, qwen3 and gemma architectures
GGUF_NAMES = {
    "embed": "token_embd.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
    "mlp_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}


def name_map(c: Config, names: dict, unpermute_qk=False) -> dict:
    """The Llama-shaped map (also Qwen2, Qwen3, Mistral, Gemma: biases and per-head q/k norms are
    read when the config has them); names gives the source tensor names (HF_NAMES, GGUF_NAMES
    or a family's edit of them). unpermute_qk: undo llama.cpp's Q/K row order (its llama
    architecture only)."""
    fix = {}
    if unpermute_qk:
        fix = {"q": lambda w: unpermute_rope_rows(w, c.n_heads),
               "k": lambda w: unpermute_rope_rows(w, c.n_kv_heads)}
    return {
        "embed": Src(names["embed"], (c.vocab_size, c.d_model)),
        "lm_head": Src(names["lm_head"], (c.vocab_size, c.d_model)),
        **norm(c, "blocks.attn_norm", names["attn_norm"]),
        **linear_qkv(c, "blocks", names["q"], names["k"], names["v"], fix=fix),
        **out_proj(c, "blocks", names["o"]),
        **norm(c, "blocks.q_norm", names["q_norm"], width=c.head_dim),
        **norm(c, "blocks.k_norm", names["k_norm"], width=c.head_dim),
        **norm(c, "blocks.mlp_norm", names["mlp_norm"]),
        **feed_forward(c, "blocks", names["up"], names["down"], names["gate"]),
        **norm(c, "final_norm", names["final_norm"]),
    }


def hf_map(c: Config, tensor_names=()) -> dict:
    return name_map(c, HF_NAMES)


def gguf_map(c: Config, tensor_names=()) -> dict:
    """llama.cpp permutes the llama architecture's Q/K rows (interleaved RoPE pairs); Mixtral's
    experts come stacked (see gguf_experts)."""
    return {**name_map(c, GGUF_NAMES, unpermute_qk=True), **gguf_experts(c)}


def gguf_experts(c: Config) -> dict:
    """A mixture's router and stacked experts as llama.cpp names them (none for a dense
    model)."""
    if not c.n_experts:
        return {}
    return stacked_experts(c, "blk.{i}.ffn_gate_inp.weight", "blk.{i}.ffn_gate_exps.weight",
                           "blk.{i}.ffn_up_exps.weight", "blk.{i}.ffn_down_exps.weight")


# ---- Hugging Face config.json -----------------------------------------------------------------

def hf_config(hf: dict, source: str, tensor_names=()) -> Config:
    hf = with_defaults(hf, HF_DEFAULTS, ("vocab_size", "hidden_size"), source)
    return rope_decoder_config(hf, source, attn_bias=hf["attention_bias"],
                               mlp_bias=hf["mlp_bias"])


def rope_decoder_config(hf: dict, source: str, **family) -> Config:
    """The Llama-shaped part of a decoder-only config (hf already has its family's defaults);
    family: what differs (biases, q/k norms, windows)."""
    if activation(hf["hidden_act"], source) != "silu":
        raise CheckpointError(f"{source}: unsupported hidden_act {hf['hidden_act']!r}")
    n_heads = hf["num_attention_heads"]
    theta, scaling = rope_scaling(hf, source)
    return Config.llama(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf["num_key_value_heads"] or n_heads,
        head_dim=hf["head_dim"], d_ff=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"], norm_eps=hf["rms_norm_eps"],
        rope_theta=theta, rope_scaling=scaling, tie_embeddings=hf["tie_word_embeddings"],
        **family, **special_ids(hf, source, ("bos_token_id", "eos_token_id")))


# Config.rope_scaling's parameter names (config.ROPE_SCALINGS) where Hugging Face's differ
HF_ROPE_KEYS = {"original_max_len": "original_max_position_embeddings"}


def rope_scaling(hf: dict, source: str) -> tuple:
    """(rope_theta, Config.rope_scaling) from rope_parameters (transformers 5) or rope_scaling
    (older configs, whose theta is top-level)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf["rope_theta"])
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{source}: partial rotary embeddings ({rope!r}) are not supported")
    if kind == "default":
        return theta, ()
    if kind not in ROPE_SCALINGS:
        raise CheckpointError(f"{source}: rope scaling {rope!r} is not supported; supported "
                              f"rope_type values: default, {', '.join(ROPE_SCALINGS)}")
    # llama3's context length, as transformers reads it: a top-level key wins over the rope
    # dict's, and max_position_embeddings stands in for both
    context = (hf.get("original_max_position_embeddings")
               or rope.get("original_max_position_embeddings") or hf["max_position_embeddings"])
    rope = {**rope, "original_max_position_embeddings": context}
    keys = [HF_ROPE_KEYS.get(name, name) for name in ROPE_SCALINGS[kind]]
    missing = [key for key in keys if rope.get(key) is None]
    if missing:
        raise CheckpointError(f"{source}: rope scaling {kind!r} lacks {', '.join(missing)} "
                              f"(got {rope!r})")
    return theta, (kind, *(rope[key] for key in keys))


# ---- GGUF -------------------------------------------------------------------------------------

def gguf_config(reader, source: str) -> Config:
    """Llama, and Mixtral (llama.cpp writes it as llama with llama.expert_count experts of
    feed_forward_length units; its runtime renormalizes the top k router weights)."""
    return Config.llama(**gguf_decoder_fields(reader, source), **gguf_moe_fields(reader, True))


def gguf_moe_fields(reader, norm_topk: bool) -> dict:
    """Config's mixture-of-experts fields from <arch>.expert_count / expert_used_count /
    expert_feed_forward_length (none: a dense model). Whether the top k weights are
    renormalized is not in the file: llama.cpp fixes it per architecture (norm_topk)."""
    n_experts = gguf_arch_field(reader, "expert_count", 0)
    if not n_experts:
        return {}
    return dict(n_experts=n_experts, experts_per_token=gguf_arch_field(reader,
                                                                       "expert_used_count", 0),
                expert_d_ff=gguf_arch_field(reader, "expert_feed_forward_length"),
                norm_topk=norm_topk)


def gguf_decoder_fields(reader, source: str) -> dict:
    """Config.llama's arguments from the metadata llama.cpp writes for every Llama-shaped
    architecture (<arch>.block_count, .embedding_length, .attention.head_count, ...): sizes,
    RoPE, the tied head (no output.weight), bos/eos."""
    get = lambda key, default=None: gguf_arch_field(reader, key, default)  # noqa: E731
    need = lambda key: gguf_arch_required(reader, key, source)  # noqa: E731
    n_heads, d_model = need("attention.head_count"), need("embedding_length")
    vocab = get("vocab_size") or len(gguf_required(reader, "tokenizer.ggml.tokens", source))
    names = gguf_tensor_names(reader)
    return dict(
        vocab_size=vocab, d_model=d_model, n_layers=need("block_count"), n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", n_heads),
        head_dim=get("attention.key_length", d_model // n_heads),
        d_ff=need("feed_forward_length"), max_seq_len=get("context_length", 2048),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=gguf_rope_scaling(get, names, source),
        tie_embeddings="output.weight" not in names,
        bos_id=gguf_id(reader, "bos", vocab, source), eos_id=gguf_id(reader, "eos", vocab, source),
        stop_ids=gguf_stop_ids(reader, vocab, source))


def gguf_rope_scaling(get, names: set, source: str) -> tuple:
    """Config.rope_scaling from <arch>.rope.scaling.* metadata: none or linear. llama.cpp stores
    Llama 3.1's scaling as per-frequency divisors (the tensor rope_freqs.weight), which are not
    read yet: loading such a file without them would decode wrongly."""
    if "rope_freqs.weight" in names:
        raise CheckpointError(f"{source}: per-frequency RoPE factors (rope_freqs.weight, Llama "
                              "3.1+ scaling) are not supported yet; load the Hugging Face "
                              "checkpoint instead")
    kind, factor = get("rope.scaling.type", "none"), float(get("rope.scaling.factor", 1.0))
    if kind not in ("none", "linear"):
        raise CheckpointError(f"{source}: rope scaling {kind!r} is not supported; supported: "
                              "none, linear")
    return ("linear", factor) if kind == "linear" and factor != 1.0 else ()
