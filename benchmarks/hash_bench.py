"""How long the router's hot path takes to hash a prompt as vLLM does.

    .venv/bin/python benchmarks/hash_bench.py [--tokens 32768] [--block-size 16]

Prints, per algorithm, the best of 5 runs for a whole prompt and for extending a session's
chain by 512 appended tokens (what a multi-turn session pays per turn).
"""

from __future__ import annotations

import argparse
import random
import time

from appliance.domain.block_hash import BlockHasher, HashAlgo


def best_of(n: int, fn) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32_768)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    rng = random.Random(1)
    tokens = [rng.randrange(128_256) for _ in range(args.tokens)]
    print(f"{'algo':<12} {'whole prompt':>14} {'extend by 512':>14}")
    for algo in HashAlgo:
        hasher = BlockHasher(algo, args.block_size)
        whole = best_of(5, lambda h=hasher: h.hash_blocks(tokens))
        chain = hasher.chain(tokens[:-512], keys=hasher.chain([]).keys)
        extend = best_of(5, lambda h=hasher, c=chain: h.extend(c, tokens[-512:]))
        print(f"{algo.value:<12} {whole * 1e3:>11.2f} ms {extend * 1e3:>11.3f} ms")


if __name__ == "__main__":
    main()
