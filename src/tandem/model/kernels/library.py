"""The compiled kernel library of one variant as Python calls: each method packs its arguments
into the records of records.py and makes one native call (build.py compiles and loads it)."""

from __future__ import annotations

import ctypes
import time

import torch

from tandem.model.kernels.records import (
    GEGLU,
    IDENTITY,
    SWIGLU,
    AttendArgs,
    BlockWeights,
    DecoderArgs,
    DecoderLayerRecord,
    DecoderShape,
    DraftChain,
    DraftChainArgs,
    DraftLayer,
    DraftLayerArgs,
    DraftRows,
    DraftTreeArgs,
    GradeArgs,
    LinearCall,
    RowProcessing,
    SampleArgs,
    TreeKeys,
    kv_half,
    own_caches,
    ptr,
)


class BlockKernels:
    """The compiled library of one variant. Inputs must be contiguous float32 CPU tensors;
    outputs are new float32 tensors unless `out` is given."""

    def __init__(self, lib: ctypes.CDLL, variant: str, build_key: str = "") -> None:
        self.variant = variant
        self.build_key = build_key  # hash of the source and flags it was compiled from
        self.lanes = lib.tandem_lanes()
        self._q8_bias = lib.tandem_q8_bias()
        self._linear = lib.tandem_linear
        self._attend = lib.tandem_attend
        self._decoder = lib.tandem_decoder_forward
        self._draft_layer = lib.tandem_draft_layer
        self._draft_chain = lib.tandem_draft_chain
        self._draft_tree = lib.tandem_draft_tree
        self._linear_argmax = lib.tandem_linear_argmax
        self._linear_argmax.argtypes = [ctypes.POINTER(LinearCall), ctypes.c_void_p, ctypes.c_void_p]
        self._linear_argmax.restype = None
        self._sample_rows = lib.tandem_sample_rows
        self._grade_chain = lib.tandem_grade_chain
        self._peak = lib.tandem_int8_peak
        # Absent from builds of older sources (scripts/kernel_ab.py times those too).
        self._q4_cached_peak = getattr(lib, "tandem_q4_cached_peak", None)
        for fn in (self._peak, self._q4_cached_peak):
            if fn is not None:
                fn.argtypes = [ctypes.c_int64, ctypes.c_int]
                fn.restype = ctypes.c_int64
        for fn, args in ((self._linear, LinearCall), (self._attend, AttendArgs), (self._decoder, DecoderArgs),
                         (self._draft_layer, DraftLayerArgs), (self._draft_chain, DraftChainArgs),
                         (self._draft_tree, DraftTreeArgs), (self._sample_rows, SampleArgs),
                         (self._grade_chain, GradeArgs)):
            fn.argtypes = [ctypes.POINTER(args)]
            fn.restype = None

    def int8_peak(self, threads: int | None = None, seconds: float = 0.3) -> float:
        """Multiply-adds per second of this variant's int8 instruction (vpdpbusd, or
        vpmaddubsw + vpmaddwd on AVX2) in a register-only loop on `threads` threads: best of 5."""
        return _best_rate(self._peak, threads or torch.get_num_threads(), seconds)

    def q4_cached_peak(self, threads: int | None = None, seconds: float = 0.3) -> float:
        """Multiply-adds per second of the q4 GEMM's own loop over 8 activation rows, its weights
        held in L1 (no memory stalls): the ceiling of its instruction mix, best of 5."""
        if self._q4_cached_peak is None:
            raise RuntimeError("these kernels were built from a source without tandem_q4_cached_peak")
        return _best_rate(self._q4_cached_peak, threads or torch.get_num_threads(), seconds)

    def pack(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> BlockWeights:
        """q4 (m given: qs uint8 [N, K/2], GGUF Q4_1 layout) or q8 (qs int8 [N, K]) blocks, with
        d (and m) [N, K/32], in the layout this variant reads."""
        return BlockWeights(qs, d, m, bias, self.lanes, self._q8_bias)

    def linear(self, x: torch.Tensor, w: BlockWeights, *, transform: int = IDENTITY,
               norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """transform(x [n, *]) @ W^T (+ bias) (+ residual) -> [n, N].

        transform RMS_NORM needs norm_weight [K]; SWIGLU/GEGLU read rows of width 2K (gate | up).
        out may be the residual tensor itself (an in-place residual add).
        """
        n, width = x.shape
        expected = 2 * w.in_features if transform in (SWIGLU, GEGLU) else w.in_features
        if width != expected:
            raise ValueError(f"input rows have width {width}, the layer needs {expected}")
        y = torch.empty(n, w.out_features, dtype=torch.float32) if out is None else out
        call = LinearCall(ctypes.pointer(w.record), ptr(x), n, width, transform, ptr(norm_weight), eps,
                           ptr(residual), ptr(y), torch.get_num_threads())
        self._linear(ctypes.byref(call))
        return y

    def linear_argmax(self, x: torch.Tensor, w: BlockWeights, *, transform: int = IDENTITY,
                      norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                      residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`linear` (residual: [n, N], added to the output before the scan), and of each output
        row its argmax (the first index of the largest value, as numpy's) and whether it is all
        finite: (y [n, N], argmax [n] int64, finite [n] bool), found by the threads that wrote
        each row's columns while they are in cache."""
        n, width = x.shape
        expected = 2 * w.in_features if transform in (SWIGLU, GEGLU) else w.in_features
        if width != expected:
            raise ValueError(f"input rows have width {width}, the layer needs {expected}")
        y = torch.empty(n, w.out_features, dtype=torch.float32)
        best = torch.empty(n, dtype=torch.int64)
        finite = torch.empty(n, dtype=torch.int32)
        if residual is not None and (residual.shape != y.shape or not residual.is_contiguous()
                                     or residual.dtype != torch.float32):
            raise ValueError(f"the residual must be a contiguous float32 [{n}, {w.out_features}] tensor")
        call = LinearCall(ctypes.pointer(w.record), ptr(x), n, width, transform, ptr(norm_weight), eps,
                           ptr(residual), ptr(y), torch.get_num_threads())
        self._linear_argmax(ctypes.byref(call), ptr(best), ptr(finite))
        return y, best, finite.bool()

    def attend(self, qkv: torch.Tensor, seq: torch.Tensor, slot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, window: int | None,
               scale: float, tree: "TreeKeys | None" = None, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, eps: float = 0.0, keys_blocked: bool = False) -> torch.Tensor:
        """Per token t: RoPE(q, k) at position slot[t], k/v written to the cache row seq[t] at
        slot[t], attention over that row's slots [lo, slot[t]] -> [T, num_heads * D].

        v_cache [S, Hkv, M, D]; k_cache the same, or with keys_blocked [S, Hkv, M / 16, D, 16]
        (KVCache.block_keys). tree: tree nodes instead (see TreeKeys): RoPE at tree.pos[t],
        attention over slots [lo, tree.hi[t]) and then the node's own path of slots.
        q_norm/k_norm [D]: an RMSNorm of every q/k head before RoPE (Qwen3, Gemma 3).
        """
        T = qkv.shape[0]
        D = cos.shape[1]
        out = torch.empty(T, num_heads * D, dtype=torch.float32)
        pos, hi, key_off, keys = (None,) * 4 if tree is None else (tree.pos, tree.hi, tree.key_off, tree.keys)
        args = AttendArgs(
            ptr(qkv), T, num_heads, num_kv_heads, D, ptr(seq), ptr(slot), ptr(pos), ptr(hi), ptr(key_off),
            ptr(keys), ptr(cos), ptr(sin), ptr(k_cache), ptr(v_cache), v_cache.shape[2], window or 0, scale,
            ptr(out), torch.get_num_threads(), ptr(q_norm), ptr(k_norm), eps, kv_half(k_cache, v_cache),
            None, None, None, int(keys_blocked),
        )
        self._attend(ctypes.byref(args))
        return out

    def attend_own_caches(self, qkv: torch.Tensor, rows: "DraftRows", cos: torch.Tensor, sin: torch.Tensor,
                          caches: list[tuple[torch.Tensor, torch.Tensor]], num_heads: int, num_kv_heads: int,
                          scale: float) -> torch.Tensor:
        """`attend` where every sequence has a cache of its own (a drafter's RowCaches): row t
        belongs to request rows.seq[t], whose keys and values are caches[rows.seq[t]] = (k, v)
        [Hkv, M_s, D], goes to slot rows.slot[t] at rope position rows.pos[t], and sees what
        rows.keys says (None: its cache up to its own slot)."""
        T, D = qkv.shape[0], cos.shape[1]
        out = torch.empty(T, num_heads * D, dtype=torch.float32)
        tree = rows.keys
        hi, key_off, keys = (None,) * 3 if tree is None else (tree.hi, tree.key_off, tree.keys)
        k_ptrs, v_ptrs, capacity = own_caches(caches)
        args = AttendArgs(
            ptr(qkv), T, num_heads, num_kv_heads, D, ptr(rows.seq), ptr(rows.slot), ptr(rows.pos), ptr(hi),
            ptr(key_off), ptr(keys), ptr(cos), ptr(sin), None, None, 0, 0, scale, ptr(out),
            torch.get_num_threads(), None, None, 0.0, kv_half(*caches[0]), k_ptrs, v_ptrs, ptr(capacity),
        )
        self._attend(ctypes.byref(args))
        return out

    def decoder(self, layers: ctypes.Array, x: torch.Tensor, seq: torch.Tensor, slot: torch.Tensor,
                tree: "TreeKeys | None", k_cache: torch.Tensor, v_cache: torch.Tensor, shape: "DecoderShape",
                capture: dict[int, torch.Tensor], keys_blocked: bool = False) -> None:
        """Run every decoder layer over x [T, H] in place (see block_matmul.cpp decoder_forward):
        layers is a ctypes array of DecoderLayerRecord (decoder_layers builds it once per model);
        v_cache [L, S, Hkv, M, D] float32 or float16, k_cache the same or, keys_blocked, in blocks of
        16 slots [L, S, Hkv, M / 16, D, 16] (KVCache.block_keys); capture {layer: [T, H] tensor}
        receives layer outputs."""
        pos, hi, key_off, keys = (None,) * 4 if tree is None else (tree.pos, tree.hi, tree.key_off, tree.keys)
        L = len(layers)
        slots = (ctypes.c_void_p * L)(*[ptr(capture.get(li)) for li in range(L)]) if capture else None
        args = DecoderArgs(
            layers, L, shape.hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.eps, shape.scale,
            shape.activation, ptr(x), x.shape[0], ptr(seq), ptr(slot), ptr(pos), ptr(hi), ptr(key_off),
            ptr(keys), ptr(k_cache), ptr(v_cache), v_cache.shape[3],
            v_cache[0].numel(), slots, torch.get_num_threads(), kv_half(k_cache, v_cache), int(keys_blocked),
        )
        self._decoder(ctypes.byref(args))

    def draft_layer(self, layer: "DraftLayer", x: torch.Tensor, attn_in: torch.Tensor, rows: "DraftRows",
                    caches: list[tuple[torch.Tensor, torch.Tensor]],
                    logit_rows: torch.Tensor | str | None = None) -> torch.Tensor | None:
        """One draft head layer over x [T, H] in place (block_matmul.cpp draft_layer): the
        attention input attn_in [T, Din] (transformed as the layer says), per request r the
        caches[r] = (k, v) [Hkv, M_r, D] its rows (rows.seq == r) write and attend over; then,
        where the layer has a vocabulary head, the logits [n, V'] of the output rows
        logit_rows names (int64 indices, or "all"), returned; else None."""
        logits = index = None
        count = 0
        if logit_rows is not None and layer.vocab is not None:
            if isinstance(logit_rows, str):
                count = x.shape[0]
            else:
                index, count = logit_rows.to(torch.int64).contiguous(), len(logit_rows)
            logits = torch.empty(count, layer.vocab.out_features, dtype=torch.float32)
        tree = rows.keys
        hi, key_off, keys = (None,) * 3 if tree is None else (tree.hi, tree.key_off, tree.keys)
        args, alive = self._draft_layer_args(layer, caches, logits is not None)
        args.x, args.attn_in, args.attn_width, args.T = ptr(x), ptr(attn_in), attn_in.shape[1], x.shape[0]
        args.seq, args.slot, args.pos = ptr(rows.seq), ptr(rows.slot), ptr(rows.pos)
        args.hi, args.key_off, args.keys = ptr(hi), ptr(key_off), ptr(keys)
        if logits is not None:
            args.head_index, args.head_rows, args.logits = ptr(index), count, ptr(logits)
        self._draft_layer(ctypes.byref(args))
        del alive
        return logits

    def draft_chain(self, layer: "DraftLayer", chain: "DraftChain",
                    caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Greedy draft steps for R requests in one call (block_matmul.cpp draft_chain), for a
        layer with a vocabulary head whose input is [embedding | feature]: the keys of step s
        of request r go to slot chain.slot0[r] + s of caches[r], which must have room for
        budget[r] - 1 steps. Returns the drafted target ids [R, max budget], -1 past each
        request's chain."""
        if layer.vocab is None:
            raise ValueError("a draft chain needs a layer with its vocabulary head")
        R = len(caches)
        width = int(chain.budget.max())
        tokens = torch.empty(R, width, dtype=torch.int64)
        args, alive = self._draft_layer_args(layer, caches, True)
        call = DraftChainArgs(args, R, ptr(chain.feat), ptr(chain.logits), ptr(chain.slot0), ptr(chain.pos0),
                               ptr(chain.budget), width, ptr(chain.vocab_ids), ptr(chain.embed), chain.embed_scale,
                               ptr(tokens))
        self._draft_chain(ctypes.byref(call))
        del alive
        return tokens

    def draft_tree(self, layer: "DraftLayer", feat: torch.Tensor, logits: torch.Tensor,
                   caches: list[tuple[torch.Tensor, torch.Tensor]], topk: int, depth: torch.Tensor, prefix: torch.Tensor,
                   pos0: torch.Tensor, vocab_ids: torch.Tensor | None, embed: torch.Tensor,
                   embed_scale: float) -> list[tuple[list[int], list[int], list[float]]]:
        """R requests' EAGLE-2 trees in one call (block_matmul.cpp draft_tree), for the layers
        draft_chain serves: from feat [R, H] and logits [R, V'] of each request's last fed row,
        depth[r] levels of top-`topk` children, each request's `topk` best of a level fed through
        the layer (every request's in one draft_layer) at position pos0[r] + level - 1, writing
        their keys from slot prefix[r] of caches[r] on (which must have room for (depth[r] - 1) *
        topk more) and seeing slots [0, prefix[r]) and their own paths (depth, prefix, pos0: [R]
        int64). Returns per request its nodes' target ids, parents (-1: the root) and path
        log-probabilities."""
        if layer.vocab is None:
            raise ValueError("a draft tree needs a layer with its vocabulary head")
        R = len(caches)
        capacity = topk + max(int(depth.max()) - 1, 0) * topk * topk
        tokens = torch.empty(R, capacity, dtype=torch.int64)
        parents = torch.empty(R, capacity, dtype=torch.int64)
        scores = torch.empty(R, capacity, dtype=torch.float32)
        count = torch.zeros(R, dtype=torch.int64)
        args, alive = self._draft_layer_args(layer, caches, True)
        call = DraftTreeArgs(args, R, ptr(feat), ptr(logits), topk, ptr(depth), ptr(prefix), ptr(pos0), ptr(vocab_ids),
                             ptr(embed), embed_scale, capacity, ptr(tokens), ptr(parents), ptr(scores), ptr(count))
        self._draft_tree(ctypes.byref(call))
        del alive
        return [(tokens[r, :n].tolist(), parents[r, :n].tolist(), scores[r, :n].tolist())
                for r, n in enumerate(count.tolist())]

    def sample_rows(self, logits: torch.Tensor, processing: RowProcessing | list[RowProcessing],
                    uniforms: torch.Tensor | None = None, shift: torch.Tensor | None = None, probs: bool = True,
                    into: tuple[torch.Tensor, int] | None = None, row_of: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """The processed distribution of each row of logits [R, V] (block_matmul.cpp's sampling
        section: one RowProcessing for every row, or one per row; shift [R or 1, V] added first)
        and, given uniforms [R] float64, one draw from each: (p [R, V] or None, tokens [R] int64
        or None, status [R] int32: a SampleStatus each). into=(ids [V] int64, width): p is
        reported over `width` tokens instead, p_t at ids[t] (a draft vocabulary's q over the
        target's), zero elsewhere. row_of [R] int64: row r is logits[row_of[r]] instead."""
        R, V = (logits.shape[0], logits.shape[1]) if row_of is None else (len(row_of), logits.shape[1])
        rows = processing if isinstance(processing, list) else [processing] * R
        inv_t = torch.tensor([r.inv_temperature for r in rows], dtype=torch.float32)
        top_k = torch.tensor([r.top_k for r in rows], dtype=torch.int64)
        top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32)
        min_p = torch.tensor([r.min_p for r in rows], dtype=torch.float32)
        logits = _rows(logits)
        shift = None if shift is None else _rows(shift.float().expand(R, V))
        uniforms = None if uniforms is None else uniforms.to(torch.float64).contiguous()
        row_of = None if row_of is None else row_of.to(torch.int64).contiguous()
        ids, width = (None, V) if into is None else (into[0].to(torch.int64).contiguous(), into[1])
        out = (torch.zeros if into is not None else torch.empty)(R, width, dtype=torch.float32) if probs else None
        tokens = torch.empty(R, dtype=torch.int64) if uniforms is not None else None
        status = torch.empty(R, dtype=torch.int32)
        args = SampleArgs(ptr(logits), ptr(row_of), R, V, logits.stride(0), ptr(shift),
                          0 if shift is None else shift.stride(0),
                          ptr(inv_t), ptr(min_p), ptr(top_k), ptr(top_p), ptr(uniforms), ptr(out), ptr(ids), width,
                          ptr(tokens), ptr(status), torch.get_num_threads())
        self._sample_rows(ctypes.byref(args))
        return out, tokens, status

    def grade_chain(self, logits: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None, uniforms: torch.Tensor,
                    processing: RowProcessing, shift: torch.Tensor | None = None) -> tuple[int, int, int]:
        """One request's chain draft (draft [k] int64; q [>= k, V] float32 rows it was drawn
        from, None for a deterministic draft) graded against the target's rows of logits
        [k + 1, V] (processed as `processing` says, shift [k + 1, V] added first) by the chain
        rule with uniforms [k + 1] float64: (accepted drafts, the token after them, a SampleStatus)."""
        k, V = len(draft), logits.shape[1]
        logits = _rows(logits)
        shift = None if shift is None else _rows(shift.float())
        q = None if q is None else _rows(q)
        draft, uniforms = draft.to(torch.int64).contiguous(), uniforms.to(torch.float64).contiguous()
        result = torch.zeros(3, dtype=torch.int64)  # accepted, token, status
        args = GradeArgs(ptr(logits), k, V, logits.stride(0), ptr(shift), 0 if shift is None else shift.stride(0),
                         processing.inv_temperature, processing.min_p, processing.top_k, processing.top_p, ptr(draft),
                         ptr(q), 0 if q is None else q.stride(0), ptr(uniforms), ptr(result), result.data_ptr() + 8,
                         result.data_ptr() + 16)
        self._grade_chain(ctypes.byref(args))
        accepted, token, status = result.tolist()
        return accepted, token, status

    def _draft_layer_args(self, layer: "DraftLayer", caches: list[tuple[torch.Tensor, torch.Tensor]],
                          with_head: bool) -> tuple["DraftLayerArgs", tuple]:
        """The fields of a draft layer call that do not depend on its rows, and the objects
        they point into (kept alive by the caller until the call returns)."""
        shape = layer.shape
        k_ptrs, v_ptrs, capacity = own_caches(caches)
        head = ctypes.pointer(layer.vocab.record) if with_head else None
        args = DraftLayerArgs(
            ctypes.cast(layer.record, ctypes.POINTER(DecoderLayerRecord)), shape.hidden, shape.num_heads,
            shape.num_kv_heads, shape.head_dim, shape.eps, shape.scale, shape.activation, None, None, 0,
            layer.attn_transform, layer.attn_eps, 0, None, None, None, None, None, None, k_ptrs, v_ptrs,
            ptr(capacity), head, ptr(layer.vocab_norm), layer.vocab_eps, None, 0, None, torch.get_num_threads(),
            kv_half(caches[0][0], caches[0][1]),
        )
        return args, (k_ptrs, v_ptrs, capacity, head)


def _best_rate(loop, threads: int, seconds: float) -> float:
    """Operations per second of a native `loop(iters, threads) -> operations`: sized to about
    `seconds`, best of 5."""
    iters = 1 << 10
    while True:
        t = time.perf_counter()
        ops = loop(iters, threads)
        elapsed = time.perf_counter() - t
        if elapsed > seconds / 4:
            break
        iters *= 4
    best = elapsed
    for _ in range(4):
        t = time.perf_counter()
        loop(iters, threads)
        best = min(best, time.perf_counter() - t)
    return ops / best


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as float32 rows the kernels read (unit stride along a row; any stride between rows)."""
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()
