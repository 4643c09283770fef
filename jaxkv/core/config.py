"""Model configuration: frozen, validated dataclasses for decoder-only and encoder-decoder
models."""

import dataclasses

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu_tanh", "gelu", "silu", "relu")
POSITIONS = ("learned", "rope", "relative")
# Config.rope_scaling: the kind, then its parameters in this order
ROPE_SCALINGS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                            "original_max_len")}
ENCODER_INPUTS = ("tokens", "audio")


def _positive_ints(obj, names):
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be a positive int, got {value!r}")


def _optional_positive(obj, names):
    for name in names:
        value = getattr(obj, name)
        if value is not None and (isinstance(value, bool) or
                                  not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{type(obj).__name__}.{name} must be None or a number > 0, got "
                             f"{value!r}")


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"Config.{name} must be one of {choices}, got {value!r}")


def _check_rope_scaling(scaling: tuple):
    if not scaling:
        return
    kind, values = scaling[0], scaling[1:]
    _check_choice("rope_scaling[0]", kind, tuple(ROPE_SCALINGS))
    names = ROPE_SCALINGS[kind]
    if len(values) != len(names) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
        raise ValueError(f"Config.rope_scaling {kind!r} needs positive numbers "
                         f"{', '.join(names)}, got {scaling!r}")
    if kind == "llama3" and not values[2] > values[1]:
        raise ValueError(f"Config.rope_scaling 'llama3' needs high_freq_factor > "
                         f"low_freq_factor, got {scaling!r}")


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """The encoder of an encoder-decoder model; it shares width, heads, MLP and norms with the
    decoder. Token encoders (T5) use the decoder's position scheme; audio encoders (Whisper) take
    log-mel frames through two convolutions (the second halves the length) and a position table.
    """

    n_layers: int
    max_len: int  # encoder positions: tokens (T5) or frames after the convolutions (Whisper)
    input: str = "tokens"
    n_mels: int = 80

    def __post_init__(self):
        _positive_ints(self, ("n_layers", "max_len", "n_mels"))
        if self.input not in ENCODER_INPUTS:
            raise ValueError(f"EncoderConfig.input must be one of {ENCODER_INPUTS}, got "
                             f"{self.input!r}")

    @property
    def max_input_len(self) -> int:
        """The longest encoder input: tokens, or mel frames (twice the positions) for audio."""
        return 2 * self.max_len if self.input == "audio" else self.max_len


@dataclasses.dataclass(frozen=True)
class Config:
    """Architecture of a transformer: a decoder, and an encoder when `encoder` is set.

    GPT-2 family: learned positions + LayerNorm + GELU(tanh) + biases + tied head.
    Llama family: RoPE + RMSNorm + SwiGLU (gated SiLU) + grouped-query attention; Llama 3.1+
    scales RoPE (rope_scaling), Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms (qk_norm).
    Gemma 2/3: Llama with gated GELU-tanh, embeddings scaled by sqrt(d_model), a norm after each
    sublayer too (post_norms), scores scaled by attn_scale_base**-0.5, local (windowed) and global
    layers; Gemma 2 soft-caps scores and logits, Gemma 3 has per-head q/k norms and a RoPE base
    of its own in the local layers (local_rope_theta).
    T5: relative position bias + RMSNorm + unscaled attention + ReLU or gated-GELU MLP.
    Whisper: audio encoder; decoder with learned positions + LayerNorm + GELU + biases.
    """

    vocab_size: int
    d_model: int
    n_layers: int  # decoder layers
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    max_seq_len: int  # learned positions: the table size (a hard limit); otherwise informational
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    activation: str = "silu"
    gated_mlp: bool = True
    position: str = "rope"
    rope_theta: float = 10000.0
    # () plain RoPE, or (kind, *parameters) as ROPE_SCALINGS lists them: ("linear", factor),
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_len)
    rope_scaling: tuple = ()
    relative_buckets: int = 32  # T5 relative position bias
    relative_max_distance: int = 128
    scale_attention: bool = True  # scores * head_dim**-0.5 (T5 folds this into its weights)
    attn_scale_base: float | None = None  # scores * attn_scale_base**-0.5 instead (Gemma's
    # query_pre_attn_scalar); None: head_dim
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    scale_embeddings: bool = False  # embeddings * sqrt(d_model), in their dtype (Gemma)
    post_norms: bool = False  # each sublayer's output normed before the residual add (Gemma 2/3)
    attn_bias: bool = False  # q/k/v projection biases
    attn_out_bias: bool | None = None  # output projection bias; None: as attn_bias (Qwen2: off)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
    qk_norm_all: bool = False  # qk_norm over all heads' dims at once, [N * H] / [K * H] (OLMo 2)
    pre_norms: bool = True  # each sublayer's input normed; False: outputs only (OLMo 2)
    # Sliding-window attention: in the layers listed in window_layers (all of them when
    # sliding_window is set and window_layers is empty), a query at position p reads only keys
    # at positions > p - sliding_window (Mistral; Qwen2 with use_sliding_window).
    sliding_window: int | None = None
    window_layers: tuple = ()
    local_rope_theta: float | None = None  # RoPE base of the window layers, unscaled (Gemma 3);
    # None: rope_theta and rope_scaling as in every layer
    mlp_bias: bool = False
    # GPT-NeoX (Pythia): attention and MLP read the same layer input, both added to it
    parallel_residual: bool = False
    rotary_dim: int | None = None  # RoPE on each head's first rotary_dim dims only; None: all
    # Mixture of experts: each token's MLP is the weighted sum of experts_per_token of n_experts
    # MLPs (width expert_d_ff; None: d_ff), chosen by a router: softmax over the experts, the
    # top k, renormalized to sum 1 where norm_topk (Mixtral, Qwen3-MoE's norm_topk_prob);
    # dense_layers keep a plain MLP of width d_ff (Qwen3-MoE's mlp_only_layers)
    n_experts: int = 0
    experts_per_token: int = 0
    expert_d_ff: int | None = None
    norm_topk: bool = False
    dense_layers: tuple = ()
    tie_embeddings: bool = False
    rescale_logits: bool = False  # T5 (original): the head sees hidden * d_model**-0.5
    encoder: EncoderConfig | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    stop_ids: tuple = ()  # more ids that end a turn (eos_token_id lists, end-of-turn tokens)
    decoder_start_id: int | None = None  # encoder-decoder models: the first decoder token
    suppress_ids: tuple = ()  # generation defaults (Whisper): never sampled
    begin_suppress_ids: tuple = ()  # not sampled as the first generated token

    def __post_init__(self):
        _positive_ints(self, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                              "head_dim", "d_ff", "max_seq_len", "relative_buckets",
                              "relative_max_distance"))
        _check_choice("norm", self.norm, NORMS)
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("position", self.position, POSITIONS)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Config.n_heads ({self.n_heads}) must be a multiple of "
                             f"Config.n_kv_heads ({self.n_kv_heads})")
        if self.position == "rope" and self.rope_dim % 2:
            which = "rotary_dim" if self.rotary_dim else "head_dim"
            raise ValueError(f"Config.{which} must be even for RoPE, got {self.rope_dim}")
        if self.rotary_dim is not None and not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"Config.rotary_dim must be in (0, head_dim={self.head_dim}], got "
                             f"{self.rotary_dim}")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("Config.norm_eps and Config.rope_theta must be > 0, got "
                             f"{self.norm_eps!r} and {self.rope_theta!r}")
        _optional_positive(self, ("attn_scale_base", "attn_softcap", "logit_softcap",
                                  "local_rope_theta"))
        for name in ("bos_id", "eos_id", "decoder_start_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"Config.{name} must be in [0, {self.vocab_size}), got {value}")
        if self.encoder is not None and self.encoder.input == "audio" and \
                self.position == "relative":
            raise ValueError("Config: an audio encoder needs position='learned' or 'rope'")
        object.__setattr__(self, "suppress_ids", tuple(self.suppress_ids))
        object.__setattr__(self, "stop_ids", tuple(self.stop_ids))
        for i in self.stop_ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"Config.stop_ids must be in [0, {self.vocab_size}), got {i}")
        object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling))
        if self.attn_out_bias is None:
            object.__setattr__(self, "attn_out_bias", self.attn_bias)
        _check_rope_scaling(self.rope_scaling)
        object.__setattr__(self, "begin_suppress_ids", tuple(self.begin_suppress_ids))
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        if self.n_experts and not 0 < self.experts_per_token <= self.n_experts:
            raise ValueError(f"Config.experts_per_token must be in [1, n_experts="
                             f"{self.n_experts}], got {self.experts_per_token}")
        if self.qk_norm_all and not self.qk_norm:
            raise ValueError("Config.qk_norm_all needs Config.qk_norm")
        if not (self.pre_norms or self.post_norms):
            raise ValueError("Config: a model without pre_norms needs post_norms")
        self._check_window()

    def _check_window(self):
        layers = tuple(self.window_layers)
        if self.sliding_window is None:
            if layers:
                raise ValueError("Config.window_layers needs Config.sliding_window")
            object.__setattr__(self, "window_layers", ())
            return
        _positive_ints(self, ("sliding_window",))
        layers = layers or tuple(range(self.n_layers))
        if any(not 0 <= i < self.n_layers for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"Config.window_layers must be distinct layer indices in [0, "
                             f"{self.n_layers}), got {layers}")
        object.__setattr__(self, "window_layers", tuple(sorted(layers)))

    @property
    def group_size(self) -> int:
        """G: query heads per kv head."""
        return self.n_heads // self.n_kv_heads

    def is_moe(self, layer: int) -> bool:
        """Whether layer's MLP is a mixture of experts."""
        return self.n_experts > 0 and layer not in self.dense_layers

    @property
    def rope_dim(self) -> int:
        """The dims of each head RoPE turns: the first rotary_dim, or all head_dim."""
        return self.rotary_dim or self.head_dim

    @property
    def attn_scale(self) -> float:
        if not self.scale_attention:
            return 1.0
        return (self.attn_scale_base or self.head_dim) ** -0.5

    def rope(self, local: bool = False) -> tuple:
        """(theta, scaling) of a layer's RoPE: local_rope_theta, unscaled, in a window (local)
        layer when it is set; rope_theta and rope_scaling otherwise."""
        if local and self.local_rope_theta is not None:
            return self.local_rope_theta, ()
        return self.rope_theta, self.rope_scaling

    @property
    def is_encoder_decoder(self) -> bool:
        return self.encoder is not None

    @classmethod
    def gpt2(cls, *, vocab_size, d_model, n_layers, n_heads, max_seq_len, d_ff=None,
             norm_eps=1e-5, **overrides):
        """A GPT-2 family config (MHA, LayerNorm, GELU-tanh, biases, tied head)."""
        family = dict(n_kv_heads=n_heads, head_dim=d_model // n_heads, d_ff=d_ff or 4 * d_model,
                      norm="layernorm", norm_eps=norm_eps, activation="gelu_tanh",
                      gated_mlp=False, position="learned", attn_bias=True, mlp_bias=True,
                      tie_embeddings=True)
        return cls(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                   max_seq_len=max_seq_len, **{**family, **overrides})

    @classmethod
    def llama(cls, *, vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, max_seq_len,
              head_dim=None, **overrides):
        """A Llama family config (RoPE, RMSNorm, SwiGLU, grouped-query attention)."""
        return cls(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                   n_kv_heads=n_kv_heads, head_dim=head_dim or d_model // n_heads, d_ff=d_ff,
                   max_seq_len=max_seq_len, **overrides)

    @classmethod
    def t5(cls, *, vocab_size, d_model, n_layers, n_encoder_layers, n_heads, head_dim, d_ff,
           gated=False, tie_embeddings=True, max_source_len=512, **overrides):
        """A T5 config: ReLU MLP (original) or gated-GELU (v1.1 / flan, gated=True)."""
        family = dict(n_kv_heads=n_heads, head_dim=head_dim, d_ff=d_ff, max_seq_len=512,
                      norm="rmsnorm", norm_eps=1e-6, activation="gelu_tanh" if gated else "relu",
                      gated_mlp=gated, position="relative", scale_attention=False,
                      tie_embeddings=tie_embeddings, rescale_logits=tie_embeddings,
                      encoder=EncoderConfig(n_encoder_layers, max_source_len), decoder_start_id=0)
        return cls(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                   **{**family, **overrides})

    @classmethod
    def whisper(cls, *, vocab_size, d_model, n_layers, n_encoder_layers, n_heads, d_ff=None,
                n_mels=80, max_source_len=1500, max_seq_len=448, **overrides):
        """A Whisper config (audio encoder; decoder with learned positions, LayerNorm, GELU)."""
        family = dict(n_kv_heads=n_heads, head_dim=d_model // n_heads, d_ff=d_ff or 4 * d_model,
                      norm="layernorm", norm_eps=1e-5, activation="gelu", gated_mlp=False,
                      position="learned", attn_bias=True, mlp_bias=True, tie_embeddings=True,
                      encoder=EncoderConfig(n_encoder_layers, max_source_len, "audio", n_mels))
        return cls(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                   max_seq_len=max_seq_len, **{**family, **overrides})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def end_ids(self) -> tuple:
        """Every id that ends generation: eos_id, then stop_ids."""
        return tuple(i for i in (self.eos_id, *self.stop_ids) if i is not None)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        encoder = d.get("encoder")
        return cls(**{**d, "encoder": encoder and EncoderConfig(**encoder)})
