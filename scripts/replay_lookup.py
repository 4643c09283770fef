"""What n-gram lookup would get accepted, replayed over generate's greedy answers (no tree passes).

Greedy speculative decoding commits exactly generate's tokens, so the passes a drafting rule
takes follow from the answers alone: this replays drafts.lookup_chains, drafting every
round, over SmolLM2's answers to scripts/bench_speculative.py's prompts, and counts the drafted
tokens accepted per chain by the length of the match that proposed it. This is what chose
drafts.MIN_MATCH (one-token matches on free-form text: 0.23 tokens per chain).

  python scripts/replay_lookup.py                  # n_draft 8, both prompt kinds, 4 of each
  python scripts/replay_lookup.py --prompts 1 --new-tokens 16        # quick
"""

import argparse
import collections
import json
import os

import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.decoding import drafts

from bench_checks import cpu_name, results_dir  # scripts/
from bench_speculative import prompts_of  # scripts/


def match_length(hist, n):
    """The longest g <= NGRAM whose last g tokens of hist[:n] also end earlier (0: none)."""
    for g in range(drafts.NGRAM, 0, -1):
        tail = hist[n - g:n]
        if n - 1 >= g and any(np.array_equal(hist[i - g + 1:i + 1], tail)
                              for i in range(g - 1, n - 1)):
            return g
    return 0


def replay(prompt, answer, D):
    """[(match length, drafted tokens accepted)] per round of one row, drafting every round
    from matches of any length."""
    hist = np.array(list(prompt) + list(answer), np.int32)
    n, rounds = len(prompt) + 1, []  # the history holds the prompt and the pending token
    while n < len(hist):
        g = match_length(hist, n)
        chain, usable = drafts.lookup_chains(jnp.asarray(hist[None]), jnp.array([n]), 1, D)
        truth = hist[n:n + D]
        chain_D, usable_D = (np.asarray(x[0, 0, :len(truth)]) for x in (chain, usable))
        same = (chain_D == truth) & usable_D
        a = int(np.cumprod(same).sum())
        rounds.append((g, a))
        n += a + 1
    return rounds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="prompts of each kind (at most 4)")
    ap.add_argument("--n-draft", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=f"{results_dir()}/replay_lookup.json")
    args = ap.parse_args()
    drafts.MIN_MATCH = 1  # every match proposes; the table splits them by length
    path = jaxkv.default_model()
    params, tokenizer = jaxkv.load(path), jaxkv.load_tokenizer(path)
    template = jaxkv.chat_template(path)
    result = dict(cpu=cpu_name(), n_draft=args.n_draft, kinds={})
    for kind in ("grounded", "free"):
        prompts = prompts_of(kind, tokenizer, template, args.prompts)
        out, lengths = jaxkv.generate(params, prompts, args.new_tokens, eos_id=params.config.eos_id)
        by_length = collections.defaultdict(list)
        for prompt, row, length in zip(prompts, np.asarray(out), np.asarray(lengths)):
            for g, a in replay(prompt, row[:length], args.n_draft):
                by_length[g].append(a)
        result["kinds"][kind] = {g: dict(chains=len(a), accepted_per_chain=float(np.mean(a)))
                                 for g, a in sorted(by_length.items())}
        for g, row in result["kinds"][kind].items():
            print(f"{kind:8s} match of {g} tokens: {row['chains']:3d} rounds, "
                  f"{row['accepted_per_chain']:.2f} drafted tokens accepted per chain", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
