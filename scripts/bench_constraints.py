"""What a constraint costs a decoding step: generate's loop body (draw, record, decode_step) with
and without a JSON schema's automaton (mask the logits with the row's state, advance it), the
same number of steps in one compiled loop each, SmolLM2-135M-Instruct at batch 16; and what
the constraint costs to build (cold, then from the disk cache) and to hold.

    python scripts/bench_constraints.py [--batch 16] [--steps 64] [--repeats 5] [--out PATH]

Writes PATH.json (default results/<machine>/bench_constraints.json): step ms plain /
constrained (best of repeats, alternating) and their ratio."""

import argparse
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxkv  # noqa: E402
from bench_checks import cpu_name, results_dir  # noqa: E402 - scripts/
from jaxkv.core.decoder import decode_step, init_cache, prefill_padded  # noqa: E402
from jaxkv.decoding import constraints, rows  # noqa: E402
from jaxkv.decoding.sampling import row_keys, sampling_params  # noqa: E402

TYPES = ["string", "integer", "boolean", "number", "string"]
SCHEMA = {"type": "object", "required": [f"field_{i}" for i in range(10)],
          "properties": {f"field_{i}": {"type": TYPES[i % 5]} for i in range(10)}}


def steps_program(params, steps: int, constrained: bool):
    """A jitted loop of `steps` of generate's step body from a prefilled state."""
    V = params.config.vocab_size

    def run(cache, logits_BV, pos_B, answers, sampling, keys_B, eos_E, automaton):
        def body(_, carry):
            cache, logits_BV, pos_B, answers = carry
            banned_BV = ~rows.allowed(answers, automaton if constrained else None,
                                      answers.length + steps + 1, eos_E, V)
            token_B = rows.draw(answers, logits_BV, sampling, keys_B, banned_BV)
            answers, _ = rows.append(answers, token_B[:, None], jnp.ones_like(pos_B), eos_E,
                                     None, 1 << 20, automaton if constrained else None)
            answers = answers.replace(done=jnp.zeros_like(answers.done))  # every row steps
            logits_BV, cache = decode_step(params, cache, token_B, pos_B)
            return cache, logits_BV, pos_B + 1, answers
        _, logits_BV, _, answers = jax.lax.fori_loop(0, steps, body,
                                                     (cache, logits_BV, pos_B, answers))
        return logits_BV, answers
    return jax.jit(run)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = jaxkv.default_model()
    params, tokenizer = jaxkv.load(path), jaxkv.load_tokenizer(path)
    os.environ["JAXKV_CACHE"] = tempfile.mkdtemp()
    cold = jaxkv.constraints.JsonSchema(SCHEMA, tokenizer)
    start = time.perf_counter()
    warm = jaxkv.constraints.JsonSchema(SCHEMA, tokenizer)
    warm_s = time.perf_counter() - start
    B, T = args.batch, 32
    text = "Describe a person as JSON with ten fields:"
    ids = tokenizer.encode(text).ids
    tokens_BT = jnp.asarray([(ids * T)[:T]] * B, jnp.int32)
    capacity = T + args.steps + 16
    logits_BV, cache = prefill_padded(params, init_cache(params, B, capacity), tokens_BT,
                                      jnp.full((B,), T, jnp.int32), jnp.zeros((B,), jnp.int32))
    eos_E = jnp.asarray([params.config.eos_id], jnp.int32)
    automaton, starts_B = constraints.for_rows(cold, B, params.config.vocab_size, True,
                                               1 << 20)  # (the loop below keeps no budget)
    answers = rows.empty(B, args.steps + 1, state_B=starts_B)
    inputs = (cache, logits_BV, jnp.full((B,), T, jnp.int32), answers, sampling_params(B),
              row_keys(None, B), eos_E, automaton)
    programs = {kind: steps_program(params, args.steps, kind == "constrained")
                for kind in ("plain", "constrained")}
    best = {}
    for kind, fn in programs.items():  # compile, and check the constrained rows stay in form
        jax.block_until_ready(fn(*inputs))
    for _ in range(args.repeats):
        for kind, fn in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*inputs))
            seconds = time.perf_counter() - start
            best[kind] = min(best.get(kind, seconds), seconds)
    out = jax.device_get(programs["constrained"](*inputs)[1])
    texts = [tokenizer.decode(np.asarray(r[:n]).tolist()) for r, n in zip(out.tokens, out.length)]
    result = dict(
        cpu=cpu_name(), model=os.path.basename(path), batch=B, steps=args.steps,
        step_ms_plain=best["plain"] / args.steps * 1e3,
        step_ms_constrained=best["constrained"] / args.steps * 1e3,
        constrained_over_plain=best["constrained"] / best["plain"],
        schema_fields=10, states=len(cold.final), exceptions=len(cold.exc_token),
        widest_state=int(np.diff(cold.offsets).max()), table_mib=cold.nbytes / 2 ** 20,
        bitmask_per_state_mib=len(cold.final) * params.config.vocab_size / 8 / 2 ** 20,
        build_s_cold=cold.build_seconds, build_s_from_disk_cache=warm_s,
        sample_answer=texts[0][:200])
    print(json.dumps(result, indent=1))
    assert warm.build_seconds == 0
    out = args.out or os.path.join(results_dir(), "bench_constraints")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
