"""What a target forward costs: the seconds of one verification forward over n new tokens.

One measurement serves the serving policy's profile, the advisor and the benchmarks: a sequence
at a `context`-token prefix, a forward over n new tokens with logits for all of them and the
token-by-token attention the engine verifies with, then the cache cut back. Sizes are measured
in turn within each repeat, and each keeps its fastest time: on a shared CPU other load only
ever adds time, and a slow spell then hits every size alike instead of one.
"""

from __future__ import annotations

import time

from tandem.model.kv_cache import KVCache
from tandem.model.runner import ModelRunner, SeqInput

CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64)
CONTEXT_FOR_CURVE = 200


def forward_cost_curve(loaded, repeats: int = 5, sizes=CURVE_SIZES, context: int = CONTEXT_FOR_CURVE,
                       clock=time.perf_counter) -> dict[int, float]:
    """{n: fastest seconds of a verification forward over n new tokens} for a LoadedModel."""
    return prefix_costs(loaded, sizes, (context,), repeats, clock)[context]


def prefix_costs(loaded, sizes, contexts, repeats: int = 5, clock=time.perf_counter) -> dict[int, dict[int, float]]:
    """{context: {n: fastest seconds}}: the measurement at several prefixes at once (one for
    forward_cost_curve), one sequence per prefix, every (prefix, size) in turn within each
    repeat, so a slow spell of the shared CPU hits both prefixes alike rather than one."""
    cache = KVCache(loaded.config, len(contexts), max(contexts) + max(sizes) + 1, loaded.dtype,
                    storage=loaded.kv_dtype())
    runner = ModelRunner(loaded.model, cache)
    vocab = loaded.config.vocab_size
    seqs = {}
    for context in contexts:
        seqs[context] = cache.allocate()
        runner.forward([SeqInput(seqs[context], [(100 + i % 1000) % vocab for i in range(context)])])

    def forward(point: tuple[int, int]) -> None:
        context, n = point
        runner.forward([SeqInput(seqs[context], [(200 + i) % vocab for i in range(n)], logits="all")],
                       token_by_token=True)
        cache.truncate(seqs[context], context)

    best = fastest_of(forward, [(c, n) for c in contexts for n in sizes], repeats, clock)
    return {c: {n: best[(c, n)] for n in sizes} for c in contexts}


def fastest_of(fn, sizes, repeats: int, clock=time.perf_counter) -> dict[int, float]:
    """{n: fastest seconds of fn(n)} over `repeats` rounds that run every size in turn, after
    one warm-up round."""
    for n in sizes:
        fn(n)
    best = {n: float("inf") for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            t = clock()
            fn(n)
            best[n] = min(best[n], clock() - t)
    return best
