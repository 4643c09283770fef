"""Model configuration: one frozen, validated dataclass describes every decoder-only model."""

import dataclasses

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu_tanh", "gelu", "silu", "relu")
POSITIONS = ("learned", "rope")


@dataclasses.dataclass(frozen=True)
class Config:
    """Architecture of a decoder-only transformer.

    The GPT-2 family is learned positions + LayerNorm + GELU(tanh) + biases + tied head;
    the Llama family is RoPE + RMSNorm + SwiGLU (gated SiLU) + grouped-query attention.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    max_seq_len: int  # learned positions: the table size (a hard limit); RoPE: the trained context
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    activation: str = "silu"
    gated_mlp: bool = True
    position: str = "rope"
    rope_theta: float = 10000.0
    attn_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    bos_id: int | None = None
    eos_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Config.{name} must be a positive int, got {value!r}")
        _check_choice("norm", self.norm, NORMS)
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("position", self.position, POSITIONS)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Config.n_heads ({self.n_heads}) must be a multiple of "
                             f"Config.n_kv_heads ({self.n_kv_heads})")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"Config.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("Config.norm_eps and Config.rope_theta must be > 0, got "
                             f"{self.norm_eps!r} and {self.rope_theta!r}")
        for name in ("bos_id", "eos_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"Config.{name} must be in [0, {self.vocab_size}), got {value}")

    @property
    def group_size(self) -> int:
        """G: query heads per kv head."""
        return self.n_heads // self.n_kv_heads

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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return cls(**d)


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"Config.{name} must be one of {choices}, got {value!r}")
