"""What a target forward costs: the seconds of one verification forward over n new tokens.

One measurement serves the serving policy's profile, the advisor and the benchmarks: a sequence
at a `context`-token prefix, a forward over n new tokens with logits for all of them and the
token-by-token attention the engine verifies with, then the cache cut back. Sizes are measured
in turn within each repeat, and each keeps its fastest time: on a shared CPU other load only
ever adds time, and a slow spell then hits every size alike instead of one. A size measured
right after a larger one is first run a few times untimed: the forwards just after a long one
run slow (see fastest_of), and a decoding loop, whose forwards are all small, never sees that.
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

    best = fastest_of(forward, [(c, n) for c in contexts for n in sorted(sizes)], repeats, clock,
                      size=lambda point: point[1])
    return {c: {n: best[(c, n)] for n in sizes} for c in contexts}


# Untimed runs of a size before timing it when it follows a larger one. On a 2-vCPU Xeon whose
# 480 MB L3 holds SmolLM2's weights, the few one-token forwards after a 32-row one ran 1.2-1.9x
# slower before settling (2.6 ms), as if part of the weights had left the cache shared with
# other tenants while the long forward read them once: timed right after the largest size, the
# one-token step read 3.4-3.9 ms instead of 2.6, and every ratio to it came out low.
SETTLE_RUNS = 4


def fastest_of(fn, sizes, repeats: int, clock=time.perf_counter, size=None) -> dict:
    """{point: fastest seconds of fn(point)} over `repeats` rounds that run every point in turn,
    after one warm-up round. With `size` (a point's size), a point that follows a larger one
    is first run SETTLE_RUNS times untimed."""
    for n in sizes:
        fn(n)
    best = {n: float("inf") for n in sizes}
    previous = sizes[-1]
    for _ in range(repeats):
        for n in sizes:
            if size is not None and size(n) < size(previous):
                for _ in range(SETTLE_RUNS):
                    fn(n)
            t = clock()
            fn(n)
            best[n] = min(best[n], clock() - t)
            previous = n
    return best
