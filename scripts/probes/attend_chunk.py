"""The CPU attention kernel on one prefill chunk: 256 tokens of SmolLM2's heads (9 query, 3 kv,
head size 64) over S cached keys and their own keys (causal), as a prefill pass calls it
(jaxkv.ops.cpu.attention, jitted); the best 3 of 5 rounds of 20 calls, in ms. Swap attend.cc
between runs to compare two forms (the kernels are rebuilt by the source's hash).

  python scripts/probes/attend_chunk.py [S]        # default 1,792
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.ops import cpu

S = int(sys.argv[1]) if len(sys.argv) > 1 else 1792
T, N, K, H = 256, 9, 3, 64
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((1, T, N, H)), jnp.float32)
k, v = (jnp.asarray(rng.standard_normal((1, K, S + T, H)), jnp.float32) for _ in range(2))
mask = jnp.asarray(np.arange(S + T)[None, None, :] < S, bool).repeat(T, 1)
k_own, v_own = (jnp.asarray(rng.standard_normal((1, K, T, H)), jnp.float32) for _ in range(2))
own_mask = jnp.tril(jnp.ones((T, T), bool))[None]
f = jax.jit(lambda q, k, v, mask, ko, vo, om: cpu.attention(q, k, v, mask, 0.125,
                                                            own=(ko, vo, om, None))[0])
args = (q, k, v, mask, k_own, v_own, own_mask)
f(*args).block_until_ready()
rounds = []
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(20):
        out = f(*args)
    out.block_until_ready()
    rounds.append((time.perf_counter() - t0) / 20 * 1e3)
print(f"S={S}: best rounds {sorted(rounds)[:3]} ms")
