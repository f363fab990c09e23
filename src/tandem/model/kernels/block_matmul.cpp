// Block-quantized weight x int8-quantized activation matmuls for x86 CPUs (C ABI, OpenMP), and a
// decoder-layer loop over them, and sampling (the section near the end), compiled once per
// instruction-set variant (kernels/build.py):
//
//   TANDEM_LANES == 16, AVX-512 VNNI   vpdpbusd on zmm: 16 output rows per instruction
//   TANDEM_LANES == 8, 256-bit VNNI    vpdpbusd on ymm (AVX-VNNI or AVX512-VL VNNI)
//   TANDEM_LANES == 8, AVX2            vpmaddubsw + vpmaddwd in place of vpdpbusd
//
// Weights come in blocks of 32 input columns per output row:
//   q4: w = d * q + m with q in 0..15 (GGUF Q4_1; the GGUF layout: byte j of a block holds q_j in
//       its low nibble and q_{j+16} in its high nibble).
//   q8: w = d * q with q in -127..127 (GGUF Q8_0).
// Each activation row is quantized on entry to int8 blocks of 32 (scale = max|x| / 127), so a
// block's dot product is an exact integer sum_j q_w,j * q_x,j.
//
// The small-batch GEMM (packed_matmul) reads weights repacked at load into groups of LANES output
// rows: for each group and block, the 32 columns of the group's rows are stored as 8 "quads" of
// 4 consecutive columns, each quad one vector of LANES x 4 bytes (lane l = output row l of the
// group). One vpdpbusd then multiplies a quad of LANES rows by the same 4 activation bytes
// broadcast to every lane. A block is unpacked into registers once and used for every
// activation row of the call (up to kRowTile at a time), so verifying k tokens reads each weight
// once, not k times.
//   q4 packed: [groups][blocks][4][LANES][4] bytes; the low nibbles hold quads 0..3 (columns
//              0..15 of the block), the high nibbles quads 4..7 (columns 16..31).
//   q8 packed: [groups][blocks][8][LANES][4] bytes, signed on AVX2, biased by +128 (unsigned,
//              as vpdpbusd's first operand must be) on the VNNI variants, whose integer sums then
//              subtract 128 * sum(q_x) exactly.
//   scales:    d (and m) as [groups][blocks][LANES] fp16 (GGUF stores them as fp16 too, so a
//              step reads the GGUF's own bytes), widened to fp32 in registers.
//
// Threads: each entry point (tandem_linear, tandem_attend, tandem_decoder_forward) opens one
// OpenMP parallel region, and every function below it is called by all threads of that team and
// splits its loops with orphaned worksharing (`omp for`), whose implicit barriers order the
// steps. A decoder forward is therefore one fork/join, not a few per linear: on a machine whose
// cores are shared with a server's other threads, every fork wakes sleeping workers (measured: a
// 2-core server streamed one request at half the speed of 1 thread). Scratch is sized before the
// team starts, and work too small to split (a step's few input rows, the attention block list)
// is done by every thread for itself, so a layer of a decode step waits at six barriers: after
// each of its four GEMMs, after the k/v writes and after attention.
//
// Determinism: every output element is computed by one thread, block by block in the same order,
// from the same quantized activation row, whatever the number of rows, the row tile or the
// thread count (integer partial sums are exact, so splitting them changes nothing). So row i of
// a call over n rows equals the call over row i alone, bit for bit: speculative verification of
// k tokens reproduces k one-token decoding steps. Variants differ from each other only in
// rounding (their float operation orders differ).

#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#ifndef TANDEM_LANES
#error "compile with -DTANDEM_LANES=16 (AVX-512 VNNI) or 8 (256-bit)"
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int kLanes = TANDEM_LANES;
constexpr int kRowTile = 8;  // activation rows per pass over a group's weights, at most
// group_rows prefetches every cache line (4-8) and the scales of the block this many blocks
// ahead: with several activation rows per block the loop runs slower than memory, and the
// hardware prefetchers alone then let each tile wait on the weight stream (docs/kernels.md,
// "Zen 5 again": an extra verified row at half the cost).
constexpr int64_t kPrefetchBlocks = 16;

// ---- the vector type of one variant ---------------------------------------------------------

#if TANDEM_LANES == 16
#if !defined(__AVX512VNNI__) || !defined(__AVX512BW__)
#error "16 lanes need AVX-512 BW and VNNI"
#endif
using vi = __m512i;
using vf = __m512;
constexpr bool kVnni = true;
inline vi vload(const void* p) { return _mm512_loadu_si512(p); }
inline vi vbcast32(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
inline vi vsplat32(int32_t v) { return _mm512_set1_epi32(v); }
inline vi vzero() { return _mm512_setzero_si512(); }
inline vi vadd32(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi vsub32(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vi vlow_nibbles(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline vi vhigh_nibbles(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline vi vhigh_nibbles_x16(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(0xF0))); }
inline vi vdiv16_exact(vi v) { return _mm512_srai_epi32(v, 4); }
// acc + sum over each lane's 4 byte pairs of u (unsigned) * s (signed).
inline vi vdot_u8s8(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline vf vcvt(vi v) { return _mm512_cvtepi32_ps(v); }
inline vf vloadf(const float* p) { return _mm512_loadu_ps(p); }
inline vf vloadh(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vf vsplatf(float f) { return _mm512_set1_ps(f); }
inline vf vzerof() { return _mm512_setzero_ps(); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstoref(float* p, vf v) { _mm512_storeu_ps(p, v); }
#else
#if !defined(__AVX2__) || !defined(__FMA__)
#error "8 lanes need AVX2 and FMA"
#endif
using vi = __m256i;
using vf = __m256;
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool kVnni = true;
inline vi vdot_u8s8(vi acc, vi u, vi s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#else
constexpr bool kVnni = false;
// vpmaddubsw saturates its 16-bit pair sums: callers keep |u * s| pairs below 2^15 (q4 codes are
// at most 15; q8 goes through the sign trick below with |q| <= 127).
inline vi vdot_u8s8(vi acc, vi u, vi s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif
inline vi vload(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline vi vbcast32(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
inline vi vsplat32(int32_t v) { return _mm256_set1_epi32(v); }
inline vi vzero() { return _mm256_setzero_si256(); }
inline vi vadd32(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi vsub32(vi a, vi b) { return _mm256_sub_epi32(a, b); }
inline vi vlow_nibbles(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline vi vhigh_nibbles(vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline vi vhigh_nibbles_x16(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(0xF0))); }
inline vi vdiv16_exact(vi v) { return _mm256_srai_epi32(v, 4); }
inline vf vcvt(vi v) { return _mm256_cvtepi32_ps(v); }
inline vf vloadf(const float* p) { return _mm256_loadu_ps(p); }
inline vf vloadh(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf vsplatf(float f) { return _mm256_set1_ps(f); }
inline vf vzerof() { return _mm256_setzero_ps(); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstoref(float* p, vf v) { _mm256_storeu_ps(p, v); }
#endif

// ---- 8-lane float helpers (every variant has AVX2 + FMA) ------------------------------------

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for 8 floats, within about 2 ulp of std::exp over the range used here: x = n ln2 + r with
// |r| <= ln2 / 2 (ln2 split in two for an exact reduction), e^r by its degree-6 Taylor
// polynomial (truncation error below 2e-7 relative), times 2^n built in the exponent bits.
// Inputs are clamped to [-87, 88], so the result is never inf or a denormal.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

#if TANDEM_LANES == 16
// exp8's steps on 16 lanes: the same operations lane by lane, so the same bits as exp8.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

// Loads/stores of the first `n` (< 8) floats, the rest zero: the tails of rows that are not
// a multiple of 8 wide.
inline __m256i tail_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// ---- weights and activations ----------------------------------------------------------------

struct Weights {          // one linear layer, as BlockKernels.pack lays it out (see the header)
  const uint8_t* packed;  // grouped blocks
  const uint16_t* pd;     // [groups][blocks][LANES] fp16
  const uint16_t* pm;     // [groups][blocks][LANES] fp16 (q4), else null
  const float* bias;      // [N] or null
  int64_t N, K;
  int q4;
};

constexpr int kQ8Bias = kVnni ? 128 : 0;  // added to q8 codes in the packed layout

struct QuantizedRows {
  std::vector<int8_t> q;          // [n, K]
  std::vector<float> scale;       // [n, nb]
  std::vector<float> scaled_sum;  // [n, nb]: scale * sum(q), for the q4 offset term
  std::vector<int32_t> q8_start;  // [n, nb]: -kQ8Bias * sum(q), where a q8 block's sum starts

  // Room for n rows of width K; never shrinks, so a scratch serving linears of different widths
  // in turn is not refilled each time (rows are indexed by the caller's K).
  void size_for(int64_t n, int64_t K) {
    const size_t nb = static_cast<size_t>(n * (K / kBlock));
    if (q.size() < static_cast<size_t>(n * K)) q.resize(n * K);
    if (scale.size() < nb) {
      scale.resize(nb);
      scaled_sum.resize(nb);
      q8_start.resize(nb);
    }
  }
};

// Row i of `out` (already sized, size_for) from the K floats at x: per block of 32, the scale
// amax / 127 and the codes rounded half to even. In three passes, so that the two divisions per
// block run 8 blocks to an instruction (IEEE division: the same bits as one at a time): each
// block's max |x|, then the scales and their inverses, then the codes and their sums.
void quantize_row(const float* x, int64_t i, int64_t K, QuantizedRows& out) {
  const int64_t nb = K / kBlock;
  float* scale = out.scale.data() + i * nb;
  float* inverse = out.scaled_sum.data() + i * nb;  // until the pass that overwrites it reads it
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < nb; ++b) {
    const float* src = x + b * kBlock;
    __m256 amax = _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(src));
    for (int j = 1; j < 4; ++j) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(src + 8 * j)));
    scale[b] = hmax8(amax);
  }
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const __m256 s = _mm256_div_ps(_mm256_loadu_ps(scale + b), _mm256_set1_ps(127.f));
    const __m256 positive = _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ);
    _mm256_storeu_ps(scale + b, s);
    _mm256_storeu_ps(inverse + b, _mm256_and_ps(positive, _mm256_div_ps(_mm256_set1_ps(1.f), s)));
  }
  for (; b < nb; ++b) {
    const float s = scale[b] / 127.f;
    scale[b] = s;
    inverse[b] = s > 0.f ? 1.f / s : 0.f;
  }
  for (b = 0; b < nb; ++b) {
    const float* src = x + b * kBlock;
    const __m256 inv = _mm256_set1_ps(inverse[b]);
    __m256i q[4];
    // cvtps rounds in the default mode: half to even, as std::nearbyint
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + 8 * j), inv));
    const __m256i q16a = _mm256_packs_epi32(q[0], q[1]), q16b = _mm256_packs_epi32(q[2], q[3]);
    // packs interleaves 128-bit lanes: restore element order with one permute.
    const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + i * K + b * kBlock), q8);
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
    const int sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
    out.scaled_sum[i * nb + b] = scale[b] * static_cast<float>(sum);
    out.q8_start[i * nb + b] = -kQ8Bias * sum;
  }
}

// What a linear applies to each input row before multiplying (fused, so the row never
// round-trips through separate framework ops).
enum InputTransform : int {
  kIdentity = 0,   // x
  kRmsNorm = 1,    // x / sqrt(mean(x^2) + eps) * w   (row width K)
  kSwiGLU = 2,     // silu(x[:K]) * x[K:]             (row width 2K: gate then up)
  kGeGLU = 3,      // gelu_tanh(x[:K]) * x[K:]
  kRmsNormHalves = 4,  // [norm(x[:K/2]) * w[:K/2], norm(x[K/2:]) * w[K/2:]]: EAGLE-3's input
                       // [embedding | feature], each normed on its own (K/2 a multiple of 8)
};

// x / sqrt(mean(x^2) + eps) * w over K (a multiple of 8) floats, the squares summed in double.
inline void rms_norm_into(const float* src, int64_t K, const float* w, float eps, float* dst) {
  __m256d ss0 = _mm256_setzero_pd(), ss1 = _mm256_setzero_pd();
  for (int64_t j = 0; j < K; j += 8) {
    const __m256 v = _mm256_loadu_ps(src + j);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    ss0 = _mm256_fmadd_pd(lo, lo, ss0);
    ss1 = _mm256_fmadd_pd(hi, hi, ss1);
  }
  alignas(32) double part[4];
  _mm256_store_pd(part, _mm256_add_pd(ss0, ss1));
  const double ss = (part[0] + part[1]) + (part[2] + part[3]);
  const __m256 r = _mm256_set1_ps(1.f / std::sqrt(static_cast<float>(ss / K) + eps));
  for (int64_t j = 0; j < K; j += 8)
    _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(src + j), r), _mm256_loadu_ps(w + j)));
}

// One input row transformed into `dst` [K], in a fixed order (deterministic per row). K is a
// multiple of 32 (the block size), so rows are whole 8-float vectors.
void transform_row(const float* src, int64_t K, int transform, const float* w, float eps, float* dst) {
  const __m256 one = _mm256_set1_ps(1.f), half = _mm256_set1_ps(0.5f);
  if (transform == kRmsNorm) {
    rms_norm_into(src, K, w, eps, dst);
  } else if (transform == kRmsNormHalves) {
    rms_norm_into(src, K / 2, w, eps, dst);
    rms_norm_into(src + K / 2, K / 2, w + K / 2, eps, dst + K / 2);
  } else if (transform == kSwiGLU) {  // g / (1 + e^-g) * u
    int64_t j = 0;
#if TANDEM_LANES == 16
    // The same operations lane by lane on 16 lanes (exp16), so the same bits.
    for (; j + 16 <= K; j += 16) {
      const __m512 g = _mm512_loadu_ps(src + j), u = _mm512_loadu_ps(src + K + j);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      _mm512_storeu_ps(dst + j, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u));
    }
#endif
    for (; j < K; j += 8) {
      const __m256 g = _mm256_loadu_ps(src + j), u = _mm256_loadu_ps(src + K + j);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
      _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
    }
  } else if (transform == kGeGLU) {  // 0.5 g (1 + tanh(c (g + 0.044715 g^3))) u, tanh z = 1 - 2 / (e^2z + 1)
    const __m256 c2 = _mm256_set1_ps(2.f * 0.7978845608028654f), k3 = _mm256_set1_ps(0.044715f);
    int64_t j = 0;
#if TANDEM_LANES == 16
    const __m512 c2x = _mm512_set1_ps(2.f * 0.7978845608028654f), k3x = _mm512_set1_ps(0.044715f);
    const __m512 onex = _mm512_set1_ps(1.f), halfx = _mm512_set1_ps(0.5f), twox = _mm512_set1_ps(2.f);
    for (; j + 16 <= K; j += 16) {
      const __m512 g = _mm512_loadu_ps(src + j), u = _mm512_loadu_ps(src + K + j);
      const __m512 z2 = _mm512_mul_ps(c2x, _mm512_fmadd_ps(_mm512_mul_ps(k3x, g), _mm512_mul_ps(g, g), g));
      const __m512 t = _mm512_sub_ps(onex, _mm512_div_ps(twox, _mm512_add_ps(exp16(z2), onex)));
      _mm512_storeu_ps(dst + j, _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(halfx, g), _mm512_add_ps(onex, t)), u));
    }
#endif
    for (; j < K; j += 8) {
      const __m256 g = _mm256_loadu_ps(src + j), u = _mm256_loadu_ps(src + K + j);
      const __m256 z2 = _mm256_mul_ps(c2, _mm256_fmadd_ps(_mm256_mul_ps(k3, g), _mm256_mul_ps(g, g), g));
      const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(exp8(z2), one)));
      _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, t)), u));
    }
  }
}

struct LinearCall {
  const Weights* w;
  const float* x;         // [n, x_stride] input rows
  int64_t n, x_stride;
  int transform;          // InputTransform
  const float* norm_w;    // [K] for kRmsNorm
  float eps;
  const float* residual;  // [n, N] added to the output, or null (may alias y)
  float* y;               // [n, N]
  int threads;            // the team tandem_linear opens
};

// ---- the small-batch GEMM -------------------------------------------------------------------

// One block of one group unpacked into registers: quad j of the group's LANES rows in w[j].
template <bool kQ4>
struct BlockRegs {
  vi w[8];
#if TANDEM_LANES == 8
  vi sign[8];  // AVX2 q8: the signed codes (w holds their magnitudes)
#endif
  inline void load(const uint8_t* p) {
    if constexpr (kQ4) {
      for (int j = 0; j < 4; ++j) {
        const vi v = vload(p + j * 4 * kLanes);
        w[j] = vlow_nibbles(v);
        // VNNI takes the high nibbles in place, as 16 q (at most 240, still a u8): their dot
        // products then sum to exactly 16x theirs, and one shift per activation row divides it
        // out, where unpacking them would cost a shift per quad (docs/kernels.md).
        w[j + 4] = kVnni ? vhigh_nibbles_x16(v) : vhigh_nibbles(v);
      }
    } else {
      for (int j = 0; j < 8; ++j) w[j] = vload(p + j * 4 * kLanes);
#if TANDEM_LANES == 8
      if constexpr (!kVnni) {
        for (int j = 0; j < 8; ++j) {
          sign[j] = w[j];
          w[j] = _mm256_sign_epi8(w[j], w[j]);
        }
      }
#endif
    }
  }
  // start + the integer dot product of the block with one activation block (32 int8 at x), per
  // lane, in two chains (even and odd quads) that hide vpdpbusd's latency.
  inline vi dot(const int8_t* x, vi start) const {
#if defined(__AVX512VNNI__) && TANDEM_LANES == 16
    // The 4 activation bytes as vpdpbusd's embedded-broadcast memory operand: one fused uop per
    // quad instead of a broadcast load and the multiply-add (compilers do not fold it).
    if constexpr (kQ4) {  // the low nibbles' chain and the high nibbles' (16 q) chain
      vi lo = start, hi = vzero();
      for (int j = 0; j < 4; ++j) {
        asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(lo) : "v"(w[j]), "m"(*reinterpret_cast<const int32_t*>(x + 4 * j)));
        asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(hi) : "v"(w[j + 4]), "m"(*reinterpret_cast<const int32_t*>(x + 4 * j + 16)));
      }
      return vadd32(lo, vdiv16_exact(hi));
    }
    vi even = start, odd = vzero();
    for (int j = 0; j < 8; j += 2) {
      asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(even) : "v"(w[j]), "m"(*reinterpret_cast<const int32_t*>(x + 4 * j)));
      asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(odd) : "v"(w[j + 1]), "m"(*reinterpret_cast<const int32_t*>(x + 4 * j + 4)));
    }
    return vadd32(even, odd);
#else
#if TANDEM_LANES == 8
    if constexpr (kQ4 && !kVnni) {
      // A q4 code is at most 15 and |x| at most 127, so a vpmaddubsw pair sum is at most 3810 and
      // the eight quads' pair sums (30480 at most) add up exactly in 16 bits: widen them once per
      // block (one vpmaddwd) instead of once per quad, half the multiply-port work of a block.
      __m256i even = _mm256_maddubs_epi16(w[0], vbcast32(x)), odd = _mm256_maddubs_epi16(w[1], vbcast32(x + 4));
      for (int j = 2; j < 8; j += 2) {
        even = _mm256_add_epi16(even, _mm256_maddubs_epi16(w[j], vbcast32(x + 4 * j)));
        odd = _mm256_add_epi16(odd, _mm256_maddubs_epi16(w[j + 1], vbcast32(x + 4 * j + 4)));
      }
      return vadd32(start, _mm256_madd_epi16(_mm256_add_epi16(even, odd), _mm256_set1_epi16(1)));
    }
#endif
    if constexpr (kQ4 && kVnni) {
      vi lo = start, hi = vzero();
      for (int j = 0; j < 4; ++j) {
        lo = vdot_u8s8(lo, w[j], vbcast32(x + 4 * j));
        hi = vdot_u8s8(hi, w[j + 4], vbcast32(x + 4 * j + 16));
      }
      return vadd32(lo, vdiv16_exact(hi));
    }
    vi even = start, odd = vzero();
    for (int j = 0; j < 8; j += 2) {
      vi xa = vbcast32(x + 4 * j), xb = vbcast32(x + 4 * j + 4);
#if TANDEM_LANES == 8
      if constexpr (!kQ4 && !kVnni) {  // |w| * (x with w's sign) = w * x
        xa = _mm256_sign_epi8(xa, sign[j]);
        xb = _mm256_sign_epi8(xb, sign[j + 1]);
      }
#endif
      even = vdot_u8s8(even, w[j], xa);
      odd = vdot_u8s8(odd, w[j + 1], xb);
    }
    return vadd32(even, odd);
#endif
  }
};

inline void prefetch(uintptr_t address) { _mm_prefetch(reinterpret_cast<const char*>(address), _MM_HINT_T0); }

template <bool kQ4, int R>
void group_rows(const Weights& w, int64_t g, const QuantizedRows& xq, int64_t i0, float* out) {
  const int64_t K = w.K, nb = K / kBlock;
  const int64_t block_bytes = kQ4 ? 16 * kLanes : 32 * kLanes;
  const uint8_t* wg = w.packed + g * nb * block_bytes;
  const uint16_t* dg = w.pd + g * nb * kLanes;
  const uint16_t* mg = kQ4 ? w.pm + g * nb * kLanes : nullptr;
  vf acc[R];
  for (int i = 0; i < R; ++i) acc[i] = vzerof();
  BlockRegs<kQ4> regs;
  for (int64_t b = 0; b < nb; ++b) {
    // Integer addresses: near the end they lie past the weights (a prefetch never faults).
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(wg) + (b + kPrefetchBlocks) * block_bytes;
    for (int64_t line = 0; line < block_bytes; line += 64) prefetch(ahead + line);
    prefetch(reinterpret_cast<uintptr_t>(dg) + (b + kPrefetchBlocks) * kLanes * sizeof(uint16_t));
    if constexpr (kQ4) prefetch(reinterpret_cast<uintptr_t>(mg) + (b + kPrefetchBlocks) * kLanes * sizeof(uint16_t));
    regs.load(wg + b * block_bytes);
    const vf dv = vloadh(dg + b * kLanes);
    const vf mv = kQ4 ? vloadh(mg + b * kLanes) : vzerof();
    for (int i = 0; i < R; ++i) {
      const int64_t row = i0 + i;
      const vi start = !kQ4 && kQ8Bias != 0 ? vsplat32(xq.q8_start[row * nb + b]) : vzero();
      const vi s = regs.dot(xq.q.data() + row * K + b * kBlock, start);
      acc[i] = vfma(vcvt(s), vmul(dv, vsplatf(xq.scale[row * nb + b])), acc[i]);
      if constexpr (kQ4) acc[i] = vfma(mv, vsplatf(xq.scaled_sum[row * nb + b]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) vstoref(out + i * kLanes, acc[i]);
}

template <bool kQ4>
void packed_matmul(const LinearCall& c, const QuantizedRows& xq) {
  const Weights& w = *c.w;
  const int64_t n = c.n, N = w.N;
  const int64_t groups = (N + kLanes - 1) / kLanes;
#pragma omp for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    alignas(64) float sums[kRowTile * kLanes];
    const int64_t r0 = g * kLanes, lanes = std::min<int64_t>(kLanes, N - r0);
    // Tiles of equal size (9 rows: 5 + 4, not 8 + 1): a tile of one or two rows waits on its
    // multiply-adds' latency while its weights already sit in L1. Which tile a row falls in
    // changes none of its arithmetic.
    const int64_t tiles = (n + kRowTile - 1) / kRowTile, per_tile = (n + tiles - 1) / tiles;
    for (int64_t i0 = 0; i0 < n; i0 += per_tile) {
      const int64_t rows = std::min<int64_t>(per_tile, n - i0);
      switch (rows) {
        case 1: group_rows<kQ4, 1>(w, g, xq, i0, sums); break;
        case 2: group_rows<kQ4, 2>(w, g, xq, i0, sums); break;
        case 3: group_rows<kQ4, 3>(w, g, xq, i0, sums); break;
        case 4: group_rows<kQ4, 4>(w, g, xq, i0, sums); break;
        case 5: group_rows<kQ4, 5>(w, g, xq, i0, sums); break;
        case 6: group_rows<kQ4, 6>(w, g, xq, i0, sums); break;
        case 7: group_rows<kQ4, 7>(w, g, xq, i0, sums); break;
        default: group_rows<kQ4, 8>(w, g, xq, i0, sums); break;
      }
      for (int64_t i = 0; i < rows; ++i) {
        float* y = c.y + (i0 + i) * N + r0;
        const float* res = c.residual ? c.residual + (i0 + i) * N + r0 : nullptr;
        if (lanes == kLanes) {  // the same additions, a vector at a time
          vf v = vloadf(sums + i * kLanes);
          if (w.bias) v = vadd(v, vloadf(w.bias + r0));
          if (res) v = vadd(v, vloadf(res));
          vstoref(y, v);
          continue;
        }
        for (int64_t l = 0; l < lanes; ++l) {
          float v = sums[i * kLanes + l];
          if (w.bias) v += w.bias[r0 + l];
          if (res) v += res[l];
          y[l] = v;
        }
      }
    }
  }
}

// The quantized input of a linear, shared by the team; sized before the team starts, for the
// widest input of the linears it will serve (rows are indexed by that linear's own K).
struct LinearScratch {
  QuantizedRows xq;

  void size_for(int64_t n, int64_t max_K) { xq.size_for(n, max_K); }
};

// At most this many rows, every thread transforms and quantizes all of them into its own copy, so
// the multiply needs no barrier before it (a decode or verification step has ten barriers per
// layer instead of fourteen). More rows are split over the threads into the shared copy.
constexpr int64_t kPrivateRows = kRowTile;

// Called by every thread of the team, `s` already sized: transform and quantize the rows, then
// multiply (split over the output groups, ended by a barrier). Either way each row is prepared by
// the same code from the same input, so the products do not depend on which copy they read.
void linear(const LinearCall& c, LinearScratch& s) {
  const int64_t K = c.w->K, n = c.n;
  const bool transformed = c.transform != kIdentity;
  static thread_local std::vector<float> row;
  static thread_local QuantizedRows own;
  if (transformed) row.resize(K);
  auto prepare = [&](int64_t i, QuantizedRows& into) {
    const float* src = c.x + i * c.x_stride;
    if (transformed) {
      transform_row(src, K, c.transform, c.norm_w, c.eps, row.data());
      src = row.data();
    }
    quantize_row(src, i, K, into);
  };
  const QuantizedRows* xq = &s.xq;
  if (n <= kPrivateRows) {
    own.size_for(n, K);
    for (int64_t i = 0; i < n; ++i) prepare(i, own);
    xq = &own;
  } else {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) prepare(i, s.xq);
  }
  if (c.w->q4) packed_matmul<true>(c, *xq);
  else packed_matmul<false>(c, *xq);
}

// ---- the greedy token of each output row ---------------------------------------------------

// Per thread and row: the largest value the thread saw, its first index, and whether everything
// it saw was finite. A row's winner is the largest value with the smallest index, whichever
// thread saw it, so the result does not depend on how the columns were split.
struct ArgmaxParts {
  int64_t n, threads;
  std::vector<float> value;
  std::vector<int64_t> index;
  std::vector<int32_t> finite;

  ArgmaxParts(int64_t rows, int64_t team)
      : n(rows), threads(team), value(rows * team, -INFINITY), index(rows * team, INT64_MAX), finite(rows * team, 1) {}

  void combine(int64_t* best, int32_t* all_finite) const {
    for (int64_t i = 0; i < n; ++i) {
      float v = -INFINITY;
      int64_t at = INT64_MAX;
      int32_t ok = 1;
      for (int64_t t = 0; t < threads; ++t) {
        const int64_t k = t * n + i;
        ok &= finite[k];
        if (index[k] != INT64_MAX && (value[k] > v || (value[k] == v && index[k] < at))) {
          v = value[k];
          at = index[k];
        }
      }
      best[i] = at == INT64_MAX ? 0 : at;
      all_finite[i] = ok;
    }
  }
};

// Called by every thread after the linear that wrote y [n, N]: each thread scans a contiguous
// share of the columns (the static split the GEMM's groups get, so they are mostly still in its
// cache), 8 at a time: each lane keeps its largest value and that value's first column, a NaN
// or an infinity marks the row.
void output_argmax(const float* y, int64_t n, int64_t N, ArgmaxParts& parts) {
  const int64_t groups = (N + kLanes - 1) / kLanes;
  const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
  const int64_t per = groups / threads, extra = groups % threads;
  const int64_t g0 = t * per + std::min(t, extra), g1 = g0 + per + (t < extra ? 1 : 0);
  const int64_t begin = g0 * kLanes, end = std::min(g1 * kLanes, N);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), inf = _mm256_set1_ps(INFINITY);
  const __m256i step = _mm256_set1_epi32(8);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = y + i * N;
    __m256 top = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
    __m256i at = _mm256_set1_epi32(INT32_MAX), col = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(begin)),
                                                                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    int64_t c = begin;
    for (; c + 8 <= end; c += 8, col = _mm256_add_epi32(col, step)) {
      const __m256 v = _mm256_loadu_ps(row + c);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(v, abs_mask), inf, _CMP_NLT_UQ));  // NaN or inf
      const __m256 greater = _mm256_cmp_ps(v, top, _CMP_GT_OQ);  // strictly: a lane keeps its first maximum
      top = _mm256_blendv_ps(top, v, greater);
      at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(col), greater));
    }
    alignas(32) float values[8];
    alignas(32) int32_t columns[8];
    _mm256_store_ps(values, top);
    _mm256_store_si256(reinterpret_cast<__m256i*>(columns), at);
    float value = -INFINITY;
    int64_t index = INT64_MAX;
    bool finite = _mm256_movemask_ps(bad) == 0;
    for (int l = 0; l < 8; ++l) {
      if (columns[l] != INT32_MAX && (values[l] > value || (values[l] == value && columns[l] < index))) {
        value = values[l];
        index = columns[l];
      }
    }
    for (; c < end; ++c) {  // the last few columns
      if (!std::isfinite(row[c])) finite = false;
      else if (row[c] > value || (row[c] == value && c < index)) {
        value = row[c];
        index = c;
      }
    }
    parts.value[t * n + i] = value;
    parts.index[t * n + i] = index;
    parts.finite[t * n + i] = finite;
  }
}

// ---- attention --------------------------------------------------------------------------------

// One query token per call row: RoPE on its q and k, k/v written to the cache, attention over
// the cache slots [lo, slot] of its sequence, in a fixed order per token (so a token's output
// does not depend on the other tokens in the call).
struct AttendArgs {
  const float* qkv;        // [T, (Hq + 2 * Hkv) * D] rows: q heads, k heads, v heads
  int64_t T, Hq, Hkv, D;
  const int64_t* seq;      // [T] cache row of each token
  const int64_t* slot;     // [T] slot each token's k/v goes to
  const int64_t* pos;      // [T] rope position of each token, or null: the slot (chains)
  // Tree nodes: token t attends to slots [lo, hi[t]) (the committed prefix) and then to
  // keys[key_off[t] .. key_off[t + 1]) (its ancestors and itself, root first): the keys, in the
  // order, that decoding its path one token at a time would read. Null: slots [lo, slot[t]].
  const int64_t* hi;
  const int64_t* key_off;
  const int64_t* keys;
  const float* cos;        // [P, D] rope tables (sin sign-folded: rot(x) = roll(x, D/2) * sin)
  const float* sin;
  void* kcache;            // [S, Hkv, M, D] float32, or fp16 when kv_half
  void* vcache;
  int64_t M;               // slots per sequence row
  int64_t window;          // sliding window (0 = full attention)
  float scale;
  float* out;              // [T, Hq * D]
  int threads;
  const float* q_norm;     // [D] RMSNorm of each q head before RoPE (Qwen3, Gemma 3), or null
  const float* k_norm;     // [D] the same for k heads
  float norm_eps;
  int kv_half;             // the cache holds fp16
  // Per-sequence caches instead of kcache/vcache (a drafter's per-request RowCache): sequence
  // s's keys are seq_k[s] [Hkv, seq_M[s], D] (values seq_v[s]). Null: the shared cache above.
  void* const* seq_k;
  void* const* seq_v;
  const int64_t* seq_M;
  // The shared cache's keys in blocks of kKeyBlock slots, each block [D][kKeyBlock] (a block's
  // keys side by side, dim by dim; see score_key_blocks); values stay [M, D]. 0: keys [M, D].
  int k_blocked;
};

// Where kv head h of sequence s starts: in the shared cache [S, Hkv, M, D], or in the
// sequence's own cache [Hkv, M_s, D].
template <typename KvT>
inline KvT* kv_head(const AttendArgs& a, KvT* shared, void* const* own, int64_t s, int64_t h) {
  if (own) return static_cast<KvT*>(own[s]) + h * a.seq_M[s] * a.D;
  return shared + (s * a.Hkv + h) * a.M * a.D;
}

// out[j] = x[j] c[j] + x[(j + D/2) % D] s[j] as one fused multiply-add over the rounded second
// product (how the compiler contracted the scalar loop this replaces, so results did not move),
// 8 lanes at a time: a token's rotation in a decoding step was a scalar loop with an integer
// division per element (a 768-token prompt prefills 5-8% faster without it; SmolLM2, avx512).
void rope_into(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t h = D / 2;
  if (D % 16 == 0) {
    for (int64_t j = 0; j < h; j += 8) {
      const __m256 lo = _mm256_loadu_ps(x + j), hi = _mm256_loadu_ps(x + j + h);
      _mm256_storeu_ps(out + j, _mm256_fmadd_ps(lo, _mm256_loadu_ps(c + j), _mm256_mul_ps(hi, _mm256_loadu_ps(s + j))));
      _mm256_storeu_ps(out + j + h,
                       _mm256_fmadd_ps(hi, _mm256_loadu_ps(c + j + h), _mm256_mul_ps(lo, _mm256_loadu_ps(s + j + h))));
    }
    return;
  }
  for (int64_t j = 0; j < D; ++j) out[j] = std::fma(x[j], c[j], x[(j + h) % D] * s[j]);
}

// The KV cache holds float32 or fp16 (uint16_t bits) rows; reads widen to float32, writes round
// to nearest even (as torch's .half() does, so the general path writes the same bits).
inline vf vload_kv(const float* p) { return vloadf(p); }
inline vf vload_kv(const uint16_t* p) { return vloadh(p); }
inline __m256 load8_kv(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_kv(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float kv_float(float v) { return v; }
inline float kv_float(uint16_t v) { return _cvtsh_ss(v); }
inline void store_kv(const float* src, int64_t D, float* dst) { std::copy(src, src + D, dst); }
inline void store_kv(const float* src, int64_t D, uint16_t* dst) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  int64_t j = 0;
  for (; j + 8 <= D; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), _mm256_cvtps_ph(_mm256_loadu_ps(src + j), kRound));
  for (; j < D; ++j) dst[j] = _cvtss_sh(src[j], kRound);
}

template <typename KvT>
inline float dot_d(const float* a, const KvT* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= D; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), load8_kv(b + j), acc);
  float s = hsum8(acc);
  for (; j < D; ++j) s += a[j] * kv_float(b[j]);
  return s;
}

// The keys one query reads, in order: `range` consecutive slots from `lo` (the prefix), then
// `num_extra` listed slots (a tree node's path).
struct KeyList {
  int64_t lo, range;
  const int64_t* extra;
  int64_t num_extra;
  int64_t size() const { return range + num_extra; }
  int64_t end() const { return lo + range; }
  int64_t slot(int64_t i) const { return i < range ? lo + i : extra[i - range]; }
};

// Lane j of the result is the sum of s_j's 8 lanes as ((v0 + v1) + (v2 + v3)) + ((v4 + v5) +
// (v6 + v7)); hsum8_pairwise adds one vector in the same order, so a score does not depend on
// whether it was reduced alone or with three others.
inline __m128 hsum8x4(__m256 s0, __m256 s1, __m256 s2, __m256 s3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

inline float hsum8_pairwise(__m256 v) {
  const __m256 t = _mm256_hadd_ps(v, v);
  const __m256 u = _mm256_hadd_ps(t, t);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}

// Softmax of the n scores in place -> their sum. The 8-lane loop pads the scores to a multiple
// of 8 and zeroes the padding lanes (exp8 clamps -inf to e^-87); the 16-lane one masks its tail
// and leaves what lies past n alone (nothing reads it).
inline float softmax_in_place(float* scores, int64_t n) {
#if TANDEM_LANES == 16
  // exp16 over 16 scores at a time, each half added to the 8-lane total in turn: the bits of the
  // 8-lane loop below (the padding lanes add +0).
  __m512 mx16 = _mm512_set1_ps(-INFINITY);
  const int64_t whole = n / 16 * 16;
  for (int64_t i = 0; i < whole; i += 16) mx16 = _mm512_max_ps(mx16, _mm512_loadu_ps(scores + i));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - whole)) - 1);
  if (tail) mx16 = _mm512_max_ps(mx16, _mm512_mask_loadu_ps(mx16, tail, scores + whole));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mx16));
  __m256 total8 = _mm256_setzero_ps();
  auto add_halves = [&](__m512 e) {
    total8 = _mm256_add_ps(total8, _mm512_castps512_ps256(e));
    total8 = _mm256_add_ps(total8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  };
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + i), mx));
    _mm512_storeu_ps(scores + i, e);
    add_halves(e);
  }
  if (tail) {
    const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + whole), mx)));
    _mm512_mask_storeu_ps(scores + whole, tail, e);
    add_halves(e);
  }
#else
  __m256 mx8 = _mm256_set1_ps(-INFINITY);
  for (int64_t i = n; i < (n + 7) / 8 * 8; ++i) scores[i] = -INFINITY;
  for (int64_t i = 0; i < n; i += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(scores + i));
  const __m256 mx = _mm256_set1_ps(hmax8(mx8));
  __m256 total8 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 live = _mm256_castsi256_ps(tail_mask(n - i));
    const __m256 e = _mm256_and_ps(live, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), mx)));
    _mm256_storeu_ps(scores + i, e);
    total8 = _mm256_add_ps(total8, e);
  }
#endif
  return hsum8(total8);
}

inline __m256 fold8(vf v) {
#if TANDEM_LANES == 16
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#else
  return v;
#endif
}

// ---- scores against keys stored in blocks -------------------------------------------------

// With k_blocked, a kv head's keys are stored kKeyBlock slots to a block, each block [D][16]:
// dim d of its 16 keys side by side. One FMA then adds q[d] * k[d] for 16 keys at once and a
// score needs no horizontal sum, where keys stored [M, D] cost each score a reduction of a
// vector of partial sums (a third of attention's time, and most of it for the extra rows of
// verification). Key slot s of a head lives at block s / 16, lane s % 16.
constexpr int64_t kKeyBlock = 16;

inline int64_t key_block_offset(int64_t slot, int64_t D) { return (slot / kKeyBlock) * D * kKeyBlock; }

// The k of one token at `slot` into its block: dim d at lane slot % 16 of row d.
template <typename KvT>
inline void store_key_blocked(const float* k, int64_t D, KvT* head, int64_t slot) {
  KvT* block = head + key_block_offset(slot, D) + slot % kKeyBlock;
  KvT rounded[512];  // D <= 512: the same rounding as store_kv's rows
  store_kv(k, D, rounded);
  for (int64_t d = 0; d < D; ++d) block[d * kKeyBlock] = rounded[d];
}

// 16 floats: one zmm, or two ymm on the 8-lane variants.
#if TANDEM_LANES == 16
struct Key16 {
  __m512 v;
};
inline Key16 key16_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Key16 key16_load(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline Key16 key16_zero() { return {_mm512_setzero_ps()}; }
inline Key16 key16_fma(Key16 k, float q, Key16 acc) { return {_mm512_fmadd_ps(k.v, _mm512_set1_ps(q), acc.v)}; }
inline Key16 key16_add(Key16 a, Key16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline void key16_store_scaled(float* p, Key16 a, float scale) { _mm512_storeu_ps(p, _mm512_mul_ps(a.v, _mm512_set1_ps(scale))); }
constexpr int kChainsPerDim = 16;  // score chains one pass keeps in registers (queries x key blocks)
#else
struct Key16 {
  __m256 lo, hi;
};
inline Key16 key16_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Key16 key16_load(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline Key16 key16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Key16 key16_fma(Key16 k, float q, Key16 acc) {
  const __m256 b = _mm256_set1_ps(q);
  return {_mm256_fmadd_ps(k.lo, b, acc.lo), _mm256_fmadd_ps(k.hi, b, acc.hi)};
}
inline Key16 key16_add(Key16 a, Key16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline void key16_store_scaled(float* p, Key16 a, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  _mm256_storeu_ps(p, _mm256_mul_ps(a.lo, s));
  _mm256_storeu_ps(p + 8, _mm256_mul_ps(a.hi, s));
}
constexpr int kChainsPerDim = 4;  // 16 registers on AVX2, and a Key16 takes two
#endif

// The scores of NQ queries against NB consecutive key blocks (16 keys each) from `blocks`: query
// j's 16 scores of block b at out[j] + 16 b. Each score is one FMA chain over the dims in order,
// then times scale, whatever else shares the call: a token's scores do not depend on the other
// queries, blocks or tokens of its call, and a key read alone (a tree node's path, below) scores
// as in its whole block. A pass holds NQ x NB chains, so each q[j][d] broadcast serves NB blocks
// and each key row NQ queries: loads, not FMAs, bounded a pass with fewer on an Ice Lake
// (docs/kernels.md, "Everything between the matmuls", attend).
template <int NQ, int NB, typename KvT>
inline void score_key_blocks(const float* const* q, const KvT* blocks, int64_t D, float scale, float* const* out) {
  Key16 acc[NQ][NB];
  for (int j = 0; j < NQ; ++j)
    for (int b = 0; b < NB; ++b) acc[j][b] = key16_zero();
  for (int64_t d = 0; d < D; ++d) {
    float qd[NQ];
    for (int j = 0; j < NQ; ++j) qd[j] = q[j][d];
    for (int b = 0; b < NB; ++b) {
      const Key16 k = key16_load(blocks + (b * D + d) * kKeyBlock);
      for (int j = 0; j < NQ; ++j) acc[j][b] = key16_fma(k, qd[j], acc[j][b]);
    }
  }
  for (int j = 0; j < NQ; ++j)
    for (int b = 0; b < NB; ++b) key16_store_scaled(out[j] + b * kKeyBlock, acc[j][b], scale);
}

// The key blocks [b0, b1) of a kv head's keys K for NQ queries: query j's block b scores at
// at(j, b). Passes of NB blocks, the rest in passes half as wide.
template <int NQ, int NB, typename KvT, typename At>
void score_key_run(const float* const* q, const KvT* K, int64_t D, float scale, int64_t b0, int64_t b1, At at) {
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) {
    float* out[NQ];
    for (int j = 0; j < NQ; ++j) out[j] = at(j, b);
    score_key_blocks<NQ, NB>(q, K + b * D * kKeyBlock, D, scale, out);
  }
  if constexpr (NB > 1)
    if (b < b1) score_key_run<NQ, NB / 2>(q, K, D, scale, b, b1, at);
}

// One query of one kv head: its rotated q [D], the keys it reads, its score buffer (at least
// keys.size() rounded up to 8; with blocked keys see score_blocked) and its output [D].
struct Query {
  const float* q;
  KeyList keys;
  float* scores;
  float* out;
};

// Each query's scores against blocked keys: its range (slots lo .. end - 1) at scores[0 ..
// range), then its extra keys (a tree node's path) after them. Blocks every query reads are
// scored for all of them at once, the others per query. A block's lanes outside a query's
// range are written too, as far as 15 floats before scores[0] and past scores[range] (the
// buffer is padded for it; attend_typed), and then overwritten or never read.
template <int NQ, typename KvT>
void score_blocked(const Query* qs, const KvT* K, int64_t D, float scale) {
  const float* q[NQ];
  int64_t first[NQ], end[NQ], common_lo = 0, common_hi = INT64_MAX;  // in blocks
  for (int j = 0; j < NQ; ++j) {
    const KeyList& kl = qs[j].keys;
    q[j] = qs[j].q;
    first[j] = kl.lo / kKeyBlock;
    end[j] = kl.range > 0 ? (kl.end() + kKeyBlock - 1) / kKeyBlock : first[j];
    common_lo = std::max(common_lo, first[j]);
    common_hi = std::min(common_hi, end[j]);
  }
  common_hi = std::max(common_hi, common_lo);
  auto at = [&](int j, int64_t b) { return qs[j].scores + b * kKeyBlock - qs[j].keys.lo; };
  for (int j = 0; j < NQ; ++j) {  // each query's blocks outside the common range
    auto own = [&](int, int64_t b) { return at(j, b); };
    score_key_run<1, kChainsPerDim>(&q[j], K, D, scale, first[j], std::min(end[j], common_lo), own);
    score_key_run<1, kChainsPerDim>(&q[j], K, D, scale, std::max(first[j], common_hi), end[j], own);
  }
  score_key_run<NQ, std::max(1, kChainsPerDim / NQ)>(q, K, D, scale, common_lo, common_hi, at);
  for (int j = 0; j < NQ; ++j) {  // last: block lanes past the range may have landed here
    const KeyList& kl = qs[j].keys;
    for (int64_t i = kl.range; i < kl.size(); ++i) {
      const int64_t slot = kl.extra[i - kl.range];
      alignas(64) float lanes[kKeyBlock];
      float* out = lanes;
      score_key_blocks<1, 1>(&q[j], K + key_block_offset(slot, D), D, scale, &out);
      qs[j].scores[i] = lanes[slot % kKeyBlock];
    }
  }
}

// NQ queries of one kv head with head dim DV * LANES. A key that all of them read is loaded once
// for all (the keys [clo, chi) below); the others are read per query. For each query, every
// score is the same FMA chain over the dims and the same reduction, and the output accumulates
// the same keys in the same order, as if the query ran alone: results do not depend on which
// queries share a call.
template <int DV, int NQ, typename KvT, bool kBlocked>
void attend_heads(const Query* qs, const KvT* K, const KvT* V, float scale) {
  constexpr int64_t D = DV * kLanes;
  vf q[NQ][DV];
  int64_t clo = qs[0].keys.lo, chi = qs[0].keys.end();
  for (int j = 0; j < NQ; ++j) {
    for (int d = 0; d < DV; ++d) q[j][d] = vloadf(qs[j].q + kLanes * d);
    clo = std::max(clo, qs[j].keys.lo);
    chi = std::min(chi, qs[j].keys.end());
  }
  chi = std::max(chi, clo);
  auto dot = [&](int j, const KvT* k) {
    vf s = vzerof();
    for (int d = 0; d < DV; ++d) s = vfma(q[j][d], vload_kv(k + kLanes * d), s);
    return fold8(s);
  };
  auto score_one = [&](int j, int64_t slot) { return hsum8_pairwise(dot(j, K + slot * D)) * scale; };
  if constexpr (kBlocked) score_blocked<NQ>(qs, K, D, scale);
  else {
  for (int j = 0; j < NQ; ++j) {
    const KeyList& kl = qs[j].keys;
    for (int64_t s = kl.lo; s < clo; ++s) qs[j].scores[s - kl.lo] = score_one(j, s);
  }
  const __m256 none = _mm256_setzero_ps();
  int64_t s0 = clo;
  if constexpr (NQ == 1) {
    // One query: four keys at a time, each its own FMA chain in the same order, so the chains'
    // latencies overlap (one chain at a time waited on every FMA) and every score is the one the
    // key-by-key loop below computes.
    for (; s0 + 4 <= chi; s0 += 4) {
      vf a[4] = {vzerof(), vzerof(), vzerof(), vzerof()};
      for (int d = 0; d < DV; ++d)
        for (int k = 0; k < 4; ++k) a[k] = vfma(q[0][d], vload_kv(K + (s0 + k) * D + kLanes * d), a[k]);
      _mm_storeu_ps(qs[0].scores + (s0 - qs[0].keys.lo),
                    _mm_mul_ps(hsum8x4(fold8(a[0]), fold8(a[1]), fold8(a[2]), fold8(a[3])), _mm_set1_ps(scale)));
    }
  }
  for (int64_t s = s0; s < chi; ++s) {
    vf kr[DV];
    for (int d = 0; d < DV; ++d) kr[d] = vload_kv(K + s * D + kLanes * d);
    __m256 r[4] = {none, none, none, none};
    for (int j = 0; j < NQ; ++j) {
      vf a = vzerof();
      for (int d = 0; d < DV; ++d) a = vfma(q[j][d], kr[d], a);
      r[j] = fold8(a);
    }
    alignas(16) float four[4];
    _mm_store_ps(four, _mm_mul_ps(hsum8x4(r[0], r[1], r[2], r[3]), _mm_set1_ps(scale)));
    for (int j = 0; j < NQ; ++j) qs[j].scores[s - qs[j].keys.lo] = four[j];
  }
  for (int j = 0; j < NQ; ++j) {
    const KeyList& kl = qs[j].keys;
    for (int64_t s = std::max(chi, kl.lo); s < kl.end(); ++s) qs[j].scores[s - kl.lo] = score_one(j, s);
    for (int64_t i = kl.range; i < kl.size(); ++i) qs[j].scores[i] = score_one(j, kl.extra[i - kl.range]);
  }
  }
  float total[NQ];
  for (int j = 0; j < NQ; ++j) total[j] = softmax_in_place(qs[j].scores, qs[j].keys.size());
  vf acc[NQ][DV];
  auto accumulate = [&](int j, int64_t i, const KvT* v) {
    const vf e = vsplatf(qs[j].scores[i]);
    for (int d = 0; d < DV; ++d) acc[j][d] = vfma(e, vload_kv(v + kLanes * d), acc[j][d]);
  };
  for (int j = 0; j < NQ; ++j) {
    for (int d = 0; d < DV; ++d) acc[j][d] = vzerof();
    const KeyList& kl = qs[j].keys;
    for (int64_t s = kl.lo; s < clo; ++s) accumulate(j, s - kl.lo, V + s * D);
  }
  for (int64_t s = clo; s < chi; ++s) {
    vf vr[DV];
    for (int d = 0; d < DV; ++d) vr[d] = vload_kv(V + s * D + kLanes * d);
    for (int j = 0; j < NQ; ++j) {
      const vf e = vsplatf(qs[j].scores[s - qs[j].keys.lo]);
      for (int d = 0; d < DV; ++d) acc[j][d] = vfma(e, vr[d], acc[j][d]);
    }
  }
  for (int j = 0; j < NQ; ++j) {
    const KeyList& kl = qs[j].keys;
    for (int64_t s = std::max(chi, kl.lo); s < kl.end(); ++s) accumulate(j, s - kl.lo, V + s * D);
    for (int64_t i = kl.range; i < kl.size(); ++i) accumulate(j, i, V + kl.extra[i - kl.range] * D);
    const vf inv = vsplatf(1.f / total[j]);
    for (int d = 0; d < DV; ++d) vstoref(qs[j].out + kLanes * d, vmul(acc[j][d], inv));
  }
}

// Any head dim, one query: the same steps with the output accumulated in memory.
template <typename KvT>
void attend_head_any(const Query& query, const KvT* K, const KvT* V, int64_t D, float scale, bool blocked) {
  const KeyList& keys = query.keys;
  float* scores = query.scores;
  float* o = query.out;
  const int64_t n = keys.size();
  if (blocked) score_blocked<1>(&query, K, D, scale);
  else
    for (int64_t i = 0; i < n; ++i) scores[i] = dot_d(query.q, K + keys.slot(i) * D, D) * scale;
  const float total = softmax_in_place(scores, n);
  std::fill(o, o + D, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const KvT* v = V + keys.slot(i) * D;
    for (int64_t k = 0; k < D; ++k) o[k] += scores[i] * kv_float(v[k]);
  }
  const float inv = 1.f / total;
  for (int64_t k = 0; k < D; ++k) o[k] *= inv;
}

// How many queries share one pass over a kv head's keys, at most: as many as keep their q (and
// then their outputs) in registers. On AVX2 (8 lanes) one query at D = 64 already fills half the
// 16 registers, so there a query runs alone and its scores take four keys at a time instead.
constexpr int max_shared_queries(int64_t D) {
  return D / kLanes <= 4 ? 4 : D / kLanes <= 8 && kLanes == 16 ? 2 : 1;
}

template <int DV, typename KvT, bool kBlocked>
void attend_block(const Query* qs, int n, const KvT* K, const KvT* V, float scale) {
  switch (n) {
    case 1: attend_heads<DV, 1, KvT, kBlocked>(qs, K, V, scale); break;
    case 2: if constexpr (max_shared_queries(DV * kLanes) >= 2) attend_heads<DV, 2, KvT, kBlocked>(qs, K, V, scale); break;
    case 3: if constexpr (max_shared_queries(DV * kLanes) >= 3) attend_heads<DV, 3, KvT, kBlocked>(qs, K, V, scale); break;
    default: if constexpr (max_shared_queries(DV * kLanes) >= 4) attend_heads<DV, 4, KvT, kBlocked>(qs, K, V, scale); break;
  }
}

template <int DV, typename KvT>
void attend_block(const Query* qs, int n, const KvT* K, const KvT* V, float scale, bool blocked) {
  if (blocked) attend_block<DV, KvT, true>(qs, n, K, V, scale);
  else attend_block<DV, KvT, false>(qs, n, K, V, scale);
}

// Called by every thread of the team.
template <typename KvT>
void attend_typed(const AttendArgs& a, KvT* kcache, KvT* vcache) {
  const int64_t T = a.T, Hq = a.Hq, Hkv = a.Hkv, D = a.D;
  const int64_t width = (Hq + 2 * Hkv) * D;
  // Phase 1: rotate k and write k, v of every token (later tokens of a chain attend to them);
  // each token writes its own slot. The loop's barrier orders this before any query reads.
  {
    std::vector<float> normed(D), rotated(D);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = a.qkv + t * width;
      const int64_t p = a.pos ? a.pos[t] : a.slot[t];
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t at = a.slot[t] * D;
        const float* k = row + (Hq + h) * D;
        if (a.k_norm) {
          rms_norm_into(k, D, a.k_norm, a.norm_eps, normed.data());
          k = normed.data();
        }
        rope_into(k, a.cos + p * D, a.sin + p * D, D, rotated.data());
        if (a.k_blocked) store_key_blocked(rotated.data(), D, kv_head(a, kcache, a.seq_k, a.seq[t], h), a.slot[t]);
        else store_kv(rotated.data(), D, kv_head(a, kcache, a.seq_k, a.seq[t], h) + at);
        store_kv(row + (Hq + Hkv + h) * D, D, kv_head(a, vcache, a.seq_v, a.seq[t], h) + at);
      }
    }
  }
  // Phase 2: the (token, head) queries in blocks of up to `share` queries of one sequence's kv
  // head, which read that head's keys once per block. The blocks are small enough to give every
  // thread work; how the queries are blocked changes no arithmetic (see attend_heads). Every
  // thread lists the same blocks for itself (a few hundred entries), which costs less than
  // another barrier to share one list.
  const int64_t group = Hq / Hkv;
  const int fast = D == 64 || D == 128 || D == 256;
  const int64_t share = fast ? std::clamp<int64_t>(T * Hq / (2 * a.threads), 1, max_shared_queries(D)) : 1;
  static thread_local std::vector<std::pair<int64_t, int64_t>> blocks;  // [first, end) into `order`
  static thread_local std::vector<int64_t> order;                      // t * Hq + h
  {
    blocks.clear();
    order.clear();
    order.reserve(T * Hq);
    for (int64_t t0 = 0, t1 = 0; t0 < T; t0 = t1) {
      while (t1 < T && a.seq[t1] == a.seq[t0]) ++t1;
      for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
        const int64_t first = static_cast<int64_t>(order.size());
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) order.push_back(t * Hq + h);
        const int64_t end = static_cast<int64_t>(order.size());
        for (int64_t b = first; b < end; b += share) blocks.emplace_back(b, std::min(end, b + share));
      }
    }
  }
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  {
    std::vector<float> rotated(4 * D), normed(D);
    std::vector<float> scores[4];
    Query qs[4];
#pragma omp for schedule(static)
    for (int64_t bi = 0; bi < num_blocks; ++bi) {
      const auto [first, end] = blocks[bi];
      const int n = static_cast<int>(end - first);
      const int64_t t_first = order[first] / Hq, kvh = (order[first] % Hq) / group;
      for (int j = 0; j < n; ++j) {
        const int64_t t = order[first + j] / Hq, h = order[first + j] % Hq;
        const int64_t p = a.pos ? a.pos[t] : a.slot[t];
        const int64_t hi = a.hi ? a.hi[t] : a.slot[t] + 1;
        const int64_t lo = a.window > 0 && p + 1 > a.window ? p + 1 - a.window : 0;
        KeyList keys{lo, std::max<int64_t>(hi - lo, 0), a.key_off ? a.keys + a.key_off[t] : nullptr,
                     a.key_off ? a.key_off[t + 1] - a.key_off[t] : 0};
        const float* qh = a.qkv + t * width + h * D;
        if (a.q_norm) {
          rms_norm_into(qh, D, a.q_norm, a.norm_eps, normed.data());
          qh = normed.data();
        }
        rope_into(qh, a.cos + p * D, a.sin + p * D, D, rotated.data() + j * D);
        // Blocked keys write whole blocks of scores: room for a block's lanes on either side.
        const int64_t pad = a.k_blocked ? kKeyBlock : 0;
        scores[j].resize(pad + (keys.size() + pad + 7) / 8 * 8);
        qs[j] = {rotated.data() + j * D, keys, scores[j].data() + pad, a.out + t * Hq * D + h * D};
      }
      const KvT* K = kv_head(a, kcache, a.seq_k, a.seq[t_first], kvh);
      const KvT* V = kv_head(a, vcache, a.seq_v, a.seq[t_first], kvh);
      const bool blocked = a.k_blocked;
      if (D == 64) attend_block<64 / kLanes>(qs, n, K, V, a.scale, blocked);
      else if (D == 128) attend_block<128 / kLanes>(qs, n, K, V, a.scale, blocked);
      else if (D == 256) attend_block<256 / kLanes>(qs, n, K, V, a.scale, blocked);
      else attend_head_any(qs[0], K, V, D, a.scale, blocked);
    }
  }
}

// Called by every thread of the team.
void attend(const AttendArgs& a) {
  if (a.kv_half) attend_typed(a, static_cast<uint16_t*>(a.kcache), static_cast<uint16_t*>(a.vcache));
  else attend_typed(a, static_cast<float*>(a.kcache), static_cast<float*>(a.vcache));
}

// ---- the decoder stack in one call ----------------------------------------------------------

struct DecoderLayer {
  const Weights* qkv;
  const Weights* o;
  const Weights* gate_up;
  const Weights* down;
  const float* attn_norm;       // [H]
  const float* mlp_norm;        // [H] (Gemma 3: the pre-feedforward norm)
  int64_t window;               // 0 = full attention
  const float* q_norm;          // [D] or null (Qwen3, Gemma 3)
  const float* k_norm;          // [D] or null
  const float* post_attn_norm;  // [H] or null: sandwich norms (Gemma 3) on the attention output
  const float* post_mlp_norm;   // [H] or null: and on the MLP output
  const float* cos;             // [P, D] this layer's rope table (Gemma 3 has a local and a global one)
  const float* sin;
};

struct DecoderArgs {
  const DecoderLayer* layers;
  int64_t num_layers;
  int64_t H, Hq, Hkv, D;
  float eps, scale;
  int activation;          // kSwiGLU or kGeGLU
  float* x;                // [T, H] the embedded tokens in, the last layer's output out
  int64_t T;
  const int64_t* seq;      // as AttendArgs
  const int64_t* slot;
  const int64_t* pos;
  const int64_t* hi;
  const int64_t* key_off;
  const int64_t* keys;
  void* kcache;            // [L, S, Hkv, M, D] float32, or fp16 when kv_half
  void* vcache;
  int64_t M;
  int64_t layer_stride;    // elements between two layers' caches (S * Hkv * M * D)
  float* const* capture;   // [num_layers]: where to copy layer l's output [T, H], or null
  int threads;
  int kv_half;
  int k_blocked;           // keys stored in blocks (AttendArgs.k_blocked)
};

// x[i] += rms_norm(y[i]) * w for each of n rows of width H (a sandwich norm before the residual).
void add_normed(float* x, const float* y, int64_t n, int64_t H, const float* w, float eps) {
  std::vector<float> normed(H);
#pragma omp for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    rms_norm_into(y + i * H, H, w, eps, normed.data());
    for (int64_t j = 0; j < H; ++j) x[i * H + j] += normed[j];
  }
}

// Everything a decoder forward needs between its steps, sized before the team starts.
struct ForwardScratch {
  std::vector<float> qkv, attn, gate_up, projected;
  LinearScratch linear;
};

// Each layer: x += post(o(attend(qkv(rms_norm(x))))); x += post(down(act(gate_up(rms_norm(x)))))
// where post is the sandwich norm when the layer has one, else the identity.
// x += post(transform(in) @ W): the residual add fused into the linear, or, with a sandwich norm
// (post non-null), the projection into `projected` then its normed rows added.
void add_projection(const Weights* w, const float* in, int64_t T, int64_t in_stride, int transform, const float* post,
                    float eps, float* x, int64_t H, ForwardScratch& s) {
  if (!post) {
    linear({w, in, T, in_stride, transform, nullptr, 0.f, x, x, 0}, s.linear);
    return;
  }
  linear({w, in, T, in_stride, transform, nullptr, 0.f, nullptr, s.projected.data(), 0}, s.linear);
  add_normed(x, s.projected.data(), T, H, post, eps);
}

// The whole stack in one parallel region: every thread runs the layer loop, and each step
// splits its work over them (see the note at the top).
void decoder_forward(const DecoderArgs& a) {
  const int64_t T = a.T, H = a.H;
  ForwardScratch s;
  int64_t qkv_n = 0, gate_up_n = 0, max_K = 0;
  for (int64_t l = 0; l < a.num_layers; ++l) {
    const DecoderLayer& layer = a.layers[l];
    qkv_n = std::max(qkv_n, layer.qkv->N);
    gate_up_n = std::max(gate_up_n, layer.gate_up->N);
    for (const Weights* w : {layer.qkv, layer.o, layer.gate_up, layer.down}) max_K = std::max(max_K, w->K);
  }
  s.linear.size_for(T, max_K);
  s.qkv.resize(T * qkv_n);
  s.gate_up.resize(T * gate_up_n);
  s.attn.resize(T * a.Hq * a.D);
  s.projected.resize(T * H);
  const int64_t layer_bytes = a.layer_stride * (a.kv_half ? 2 : 4);
#pragma omp parallel num_threads(a.threads)
  for (int64_t l = 0; l < a.num_layers; ++l) {
    const DecoderLayer& layer = a.layers[l];
    linear({layer.qkv, a.x, T, H, kRmsNorm, layer.attn_norm, a.eps, nullptr, s.qkv.data(), 0}, s.linear);
    attend({s.qkv.data(), T, a.Hq, a.Hkv, a.D, a.seq, a.slot, a.pos, a.hi, a.key_off, a.keys, layer.cos, layer.sin,
            static_cast<char*>(a.kcache) + l * layer_bytes, static_cast<char*>(a.vcache) + l * layer_bytes, a.M,
            layer.window, a.scale, s.attn.data(), a.threads, layer.q_norm, layer.k_norm, a.eps, a.kv_half, nullptr,
            nullptr, nullptr, a.k_blocked});
    add_projection(layer.o, s.attn.data(), T, a.Hq * a.D, kIdentity, layer.post_attn_norm, a.eps, a.x, H, s);
    linear({layer.gate_up, a.x, T, H, kRmsNorm, layer.mlp_norm, a.eps, nullptr, s.gate_up.data(), 0}, s.linear);
    add_projection(layer.down, s.gate_up.data(), T, layer.gate_up->N, a.activation, layer.post_mlp_norm, a.eps, a.x,
                   H, s);
    if (a.capture && a.capture[l]) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < T; ++i) std::copy(a.x + i * H, a.x + (i + 1) * H, a.capture[l] + i * H);
    }
  }
}

// ---- a drafter's layer in one call ----------------------------------------------------------

// One decoder layer of a draft head (EAGLE, EAGLE-3, DFlash, MTP) over the rows of several
// requests, each with a cache of its own, and optionally the head's LM head after it: what a
// draft step needs in one parallel region instead of four linears, an attention call per
// request and the norms between them as separate operations.
struct DraftLayerArgs {
  const DecoderLayer* layer;  // qkv, o, gate_up, down, mlp_norm, cos/sin; attn_norm: see attn_transform
  int64_t H, Hq, Hkv, D;
  float eps, scale;           // eps: the MLP norm's
  int activation;             // kSwiGLU or kGeGLU
  float* x;                   // [T, H] the residual stream in, the layer's output out
  const float* attn_in;       // [T, attn_width] the attention input (may be x itself)
  int64_t attn_width;
  int attn_transform;         // kIdentity, kRmsNorm or kRmsNormHalves, with layer->attn_norm
  float attn_eps;
  int64_t T;
  const int64_t* seq;         // [T] the request (index into seq_k/seq_v/seq_M) of each row
  const int64_t* slot;        // as AttendArgs
  const int64_t* pos;
  const int64_t* hi;
  const int64_t* key_off;
  const int64_t* keys;
  void* const* seq_k;         // per request: [Hkv, M_s, D] keys, float32 or fp16 (kv_half)
  void* const* seq_v;
  const int64_t* seq_M;
  const Weights* head;        // the LM head over head_norm(output rows), or null
  const float* head_norm;     // [H]
  float head_eps;
  const int64_t* head_index;  // [head_rows] the output rows it reads, or null: rows 0 .. head_rows - 1
  int64_t head_rows;
  float* logits;              // [head_rows, head->N]
  int threads;
  int kv_half;
};

void draft_layer(const DraftLayerArgs& a) {
  const DecoderLayer& layer = *a.layer;
  const int64_t T = a.T, H = a.H;
  ForwardScratch s;
  int64_t max_K = 0;
  for (const Weights* w : {layer.qkv, layer.o, layer.gate_up, layer.down, a.head})
    if (w) max_K = std::max(max_K, w->K);
  s.linear.size_for(T, max_K);
  s.qkv.resize(T * layer.qkv->N);
  s.gate_up.resize(T * layer.gate_up->N);
  s.attn.resize(T * a.Hq * a.D);
  if (a.head_index) s.projected.resize(a.head_rows * H);
#pragma omp parallel num_threads(a.threads)
  {
    linear({layer.qkv, a.attn_in, T, a.attn_width, a.attn_transform, layer.attn_norm, a.attn_eps, nullptr, s.qkv.data(), 0},
           s.linear);
    attend({s.qkv.data(), T, a.Hq, a.Hkv, a.D, a.seq, a.slot, a.pos, a.hi, a.key_off, a.keys, layer.cos, layer.sin,
            nullptr, nullptr, 0, 0, a.scale, s.attn.data(), a.threads, nullptr, nullptr, a.eps, a.kv_half, a.seq_k,
            a.seq_v, a.seq_M});
    linear({layer.o, s.attn.data(), T, a.Hq * a.D, kIdentity, nullptr, 0.f, a.x, a.x, 0}, s.linear);
    linear({layer.gate_up, a.x, T, H, kRmsNorm, layer.mlp_norm, a.eps, nullptr, s.gate_up.data(), 0}, s.linear);
    linear({layer.down, s.gate_up.data(), T, layer.gate_up->N, a.activation, nullptr, 0.f, a.x, a.x, 0}, s.linear);
    if (a.head) {
      const float* rows = a.x;
      if (a.head_index) {  // gathered into one block (a few rows: one thread copies them)
#pragma omp single
        for (int64_t i = 0; i < a.head_rows; ++i)
          std::copy(a.x + a.head_index[i] * H, a.x + (a.head_index[i] + 1) * H, s.projected.data() + i * H);
        rows = s.projected.data();
      }
      linear({a.head, rows, a.head_rows, H, kRmsNorm, a.head_norm, a.head_eps, nullptr, a.logits, 0}, s.linear);
    }
  }
}

// A greedy chain of draft steps for heads whose layer input is [embedding | feature] with the
// feature as the residual stream (EAGLE-3): from each request's first logits, the argmax token
// (in target ids), its embedding beside the feature that produced it, one draft_layer over the
// requests still drafting, and again, up to each request's budget. A request's chain ends early
// at a logits row holding a NaN or an infinity (its drafts so far stand), as the Python loop's.
struct DraftChainArgs {
  DraftLayerArgs layer;       // one step's call; x, attn_in, T, seq, slot, pos, logits and the head rows are set per step
  int64_t R;                  // requests; request r's cache is layer.seq_k[r]
  const float* feat;          // [R, H] the feature each request's first step feeds (the catch-up's last output)
  const float* logits;        // [R, V'] the logits that give each request's draft token 1
  const int64_t* slot0;       // [R] the cache slot of each request's first draft step
  const int64_t* pos0;        // [R] and its position
  const int64_t* budget;      // [R] draft tokens wanted (>= 1)
  int64_t width;              // columns of `tokens`, >= every budget
  const int64_t* vocab_ids;   // [V'] draft index -> target id, or null (the same)
  const float* embed;         // [V, H] the target's embedding
  float embed_scale;          // its scale (1 where there is none)
  int64_t* tokens;            // [R, width] out: target ids, -1 past each request's chain
};

// A draft step's input row for heads whose layer input is [embedding | feature] with the feature
// as the residual stream: x_row [H] = the feature, in_row [2H] = [embedding * scale | feature].
inline void step_input(const float* feature, const float* embedding, float embed_scale, int64_t H, float* x_row,
                       float* in_row) {
  std::copy(feature, feature + H, x_row);
  for (int64_t i = 0; i < H; ++i) in_row[i] = embedding[i] * embed_scale;
  std::copy(feature, feature + H, in_row + H);
}

// One draft_layer over T such rows (x [T, H] in place, in [T, 2H]) at seq/slot/pos, seeing the
// tree keys hi/key_off/keys (null: a chain's causal rule), with every row's logits into `logits`.
void draft_step(DraftLayerArgs step, float* x, const float* in, int64_t T, const int64_t* seq, const int64_t* slot,
                const int64_t* pos, const int64_t* hi, const int64_t* key_off, const int64_t* keys, float* logits) {
  step.x = x;
  step.attn_in = in;
  step.attn_width = 2 * step.H;
  step.T = T;
  step.seq = seq;
  step.slot = slot;
  step.pos = pos;
  step.hi = hi;
  step.key_off = key_off;
  step.keys = keys;
  step.head_index = nullptr;
  step.head_rows = T;
  step.logits = logits;
  draft_layer(step);
}

// The first index of the largest value (numpy's argmax), or -1 when the row is not all finite.
int64_t finite_argmax(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(row[i])) return -1;
    if (row[i] > row[best]) best = i;
  }
  return best;
}

void draft_chain(const DraftChainArgs& a) {
  const int64_t R = a.R, H = a.layer.H, V = a.layer.head->N;
  std::fill(a.tokens, a.tokens + R * a.width, int64_t{-1});
  std::vector<int64_t> live(R), kept, kept_tokens, seq, slot, pos;
  for (int64_t r = 0; r < R; ++r) live[r] = r;
  std::vector<float> feat(a.feat, a.feat + R * H), logits(a.logits, a.logits + R * V), x, in, next;
  for (int64_t s = 0;; ++s) {
    kept.clear();
    kept_tokens.clear();
    std::vector<int64_t> kept_rows;
    for (int64_t j = 0; j < static_cast<int64_t>(live.size()); ++j) {
      const int64_t r = live[j], best = finite_argmax(logits.data() + j * V, V);
      if (best < 0) continue;
      const int64_t token = a.vocab_ids ? a.vocab_ids[best] : best;
      a.tokens[r * a.width + s] = token;
      if (s + 1 < a.budget[r]) {
        kept.push_back(r);
        kept_rows.push_back(j);
        kept_tokens.push_back(token);
      }
    }
    const int64_t T = static_cast<int64_t>(kept.size());
    if (T == 0) break;
    x.resize(T * H);
    in.resize(T * 2 * H);
    seq.assign(kept.begin(), kept.end());
    slot.resize(T);
    pos.resize(T);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t r = kept[t];
      step_input(feat.data() + kept_rows[t] * H, a.embed + kept_tokens[t] * H, a.embed_scale, H, x.data() + t * H,
                 in.data() + t * 2 * H);
      slot[t] = a.slot0[r] + s;
      pos[t] = a.pos0[r] + s;
    }
    next.resize(T * V);
    draft_step(a.layer, x.data(), in.data(), T, seq.data(), slot.data(), pos.data(), nullptr, nullptr, nullptr,
               next.data());
    feat.swap(x);
    logits.swap(next);
    live = kept;
  }
}

// EAGLE-2 trees of R requests in one call, for the heads draft_chain serves: each depth gives
// every frontier node its top-k children scored by path log-probability (the frontier node's
// score plus the child's log-softmax), then feeds each request's k best new nodes through the
// layer, all requests' in one draft_layer, each node at its depth's position, seeing its
// request's committed context (slots [0, prefix)) and then the slots of its own path, root
// first. The order and arithmetic are the Python loop's (EagleDrafter._grow_tree): children row
// by row in rank order, expansions in descending score, ties to the lower index. A request
// whose frontier logits hold a NaN or an infinity stops growing (its nodes so far stand).
struct DraftTreeArgs {
  DraftLayerArgs layer;       // one step's call; request r's cache is layer.seq_k[r]; rows set per depth
  int64_t R;
  const float* feat;          // [R, H] the feature that produced each root's logits (the catch-up's last output)
  const float* logits;        // [R, V'] the root logits
  int64_t topk;
  const int64_t* depth;       // [R] levels of each request's tree (0: none)
  const int64_t* prefix;      // [R] cache slots every node of the request sees (its committed context)
  const int64_t* pos0;        // [R] rope position of its depth-1 nodes
  const int64_t* vocab_ids;   // [V'] draft index -> target id, or null (the same)
  const float* embed;         // [V, H] the target's embedding
  float embed_scale;
  int64_t capacity;           // room per request in tokens/parents/scores: topk + (max depth - 1) * topk * topk
  int64_t* tokens;            // [R, capacity] out: each node's target id
  int64_t* parents;           // [R, capacity] out: its parent node (-1: the root)
  float* scores;              // [R, capacity] out: its path log-probability
  int64_t* count;             // [R] out: nodes written
};

// The indices of the k largest of values[0, n), largest first, ties to the lower index.
void top_indices(const float* values, int64_t n, int64_t k, std::vector<int64_t>& out) {
  out.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (static_cast<int64_t>(out.size()) == k && !(values[i] > values[out.back()])) continue;
    auto at = out.end();
    while (at != out.begin() && values[i] > values[*(at - 1)]) --at;
    out.insert(at, i);
    if (static_cast<int64_t>(out.size()) > k) out.pop_back();
  }
}

// sum_i e^(x_i - top) over x[0, n), 8 lanes at a time (exp8; the tail masked off).
float sum_exp_below(const float* x, int64_t n, float top) {
  const __m256 mx = _mm256_set1_ps(top);
  __m256 total8 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i live = tail_mask(n - i);
    const __m256 v = _mm256_maskload_ps(x + i, live);
    total8 = _mm256_add_ps(total8, _mm256_and_ps(_mm256_castsi256_ps(live), exp8(_mm256_sub_ps(v, mx))));
  }
  return hsum8(total8);
}

// One request's tree while it grows: its frontier (nodes, scores, and the rows of the last
// call that hold their features and logits) and each expanded node's path of cache slots.
struct GrowingTree {
  std::vector<int64_t> frontier{-1}, rows{0};
  std::vector<float> frontier_score{0.f};
  std::vector<std::vector<int64_t>> path_of;  // node -> its path's slots, root first (expanded nodes)
  int64_t n = 0, next_slot = 0;
  bool growing = true;
};

void draft_tree(const DraftTreeArgs& a) {
  const int64_t R = a.R, H = a.layer.H, V = a.layer.head->N, k = std::min(a.topk, V);
  std::vector<float> feat(a.feat, a.feat + R * H), logits(a.logits, a.logits + R * V), x, in, next;
  std::vector<int64_t> ranked, best, argmax, seq, slot, pos, hi, key_off, keys;
  std::vector<GrowingTree> trees(R);
  for (int64_t r = 0; r < R; ++r) {
    trees[r].rows[0] = r;
    trees[r].next_slot = a.prefix[r];
    trees[r].path_of.reserve(a.capacity);
  }
  const int64_t max_depth = R ? *std::max_element(a.depth, a.depth + R) : 0;
  for (int64_t d = 1; d <= max_depth; ++d) {
    x.clear();
    in.clear();
    seq.clear();
    slot.clear();
    pos.clear();
    hi.clear();
    key_off.assign(1, 0);
    keys.clear();
    for (int64_t r = 0; r < R; ++r) {
      GrowingTree& tree = trees[r];
      if (!tree.growing || d > a.depth[r]) continue;
      int64_t* tokens = a.tokens + r * a.capacity;
      int64_t* parents = a.parents + r * a.capacity;
      float* scores = a.scores + r * a.capacity;
      const int64_t F = static_cast<int64_t>(tree.frontier.size());
      argmax.resize(F);
      bool finite = true;
      for (int64_t f = 0; f < F && finite; ++f) {
        argmax[f] = finite_argmax(logits.data() + tree.rows[f] * V, V);
        finite = argmax[f] >= 0;
      }
      if (!finite) {
        tree.growing = false;
        continue;
      }
      const int64_t first = tree.n;
      for (int64_t f = 0; f < F; ++f) {
        const float* row = logits.data() + tree.rows[f] * V;
        const float top = row[argmax[f]];
        const float log_sum = std::log(sum_exp_below(row, V, top));
        top_indices(row, V, k, ranked);
        for (int64_t id : ranked) {
          if (tree.n == a.capacity) break;
          tokens[tree.n] = a.vocab_ids ? a.vocab_ids[id] : id;
          parents[tree.n] = tree.frontier[f];
          scores[tree.n] = tree.frontier_score[f] + ((row[id] - top) - log_sum);
          tree.path_of.emplace_back();
          ++tree.n;
        }
      }
      if (d == a.depth[r]) continue;
      top_indices(scores + first, tree.n - first, std::min(a.topk, tree.n - first), best);
      // This request's new nodes take the call's next T rows, from first_row on.
      const int64_t T = static_cast<int64_t>(best.size()), first_row = static_cast<int64_t>(seq.size());
      x.resize((first_row + T) * H);
      in.resize((first_row + T) * 2 * H);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t node = first + best[t], parent = parents[node], row = first_row + t;
        step_input(feat.data() + tree.rows[best[t] / k] * H, a.embed + tokens[node] * H, a.embed_scale, H,
                   x.data() + row * H, in.data() + row * 2 * H);
        seq.push_back(r);
        slot.push_back(tree.next_slot + t);
        pos.push_back(a.pos0[r] + d - 1);
        hi.push_back(a.prefix[r]);
        tree.path_of[node] = parent >= 0 ? tree.path_of[parent] : std::vector<int64_t>{};
        tree.path_of[node].push_back(tree.next_slot + t);
        keys.insert(keys.end(), tree.path_of[node].begin(), tree.path_of[node].end());
        key_off.push_back(static_cast<int64_t>(keys.size()));
      }
      tree.next_slot += T;
      tree.frontier.resize(T);
      tree.frontier_score.resize(T);
      tree.rows.resize(T);
      for (int64_t t = 0; t < T; ++t) {
        tree.frontier[t] = first + best[t];
        tree.frontier_score[t] = scores[first + best[t]];
        tree.rows[t] = first_row + t;
      }
    }
    const int64_t T = static_cast<int64_t>(seq.size());
    if (T == 0) break;
    next.resize(T * V);
    draft_step(a.layer, x.data(), in.data(), T, seq.data(), slot.data(), pos.data(), hi.data(), key_off.data(),
               keys.data(), next.data());
    feat.swap(x);
    logits.swap(next);
  }
  for (int64_t r = 0; r < R; ++r) a.count[r] = trees[r].n;
}

// ---- the int8 multiply-add peak, for `tandem bench base` ------------------------------------

// `iters` rounds of kChains independent multiply-add chains per thread, registers only, inputs
// from a volatile seed. vpdpbusd accumulates into its chain, so it cannot be hoisted; the AVX2
// pair (vpmaddubsw + vpmaddwd, then an add) could be, so there each chain feeds its accumulator
// back as the unsigned operand. Returns the multiply-adds done (all threads).
int64_t int8_peak(int64_t iters, int threads) {
  constexpr int kChains = kLanes == 16 ? 16 : 10;
  int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    volatile int32_t seed = omp_get_thread_num() + 3;
    const vi s = vsplat32(seed * 0x01010101), u = vsplat32(seed * 0x02030405);
    vi acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = vsplat32(seed + c);
    for (int64_t it = 0; it < iters; ++it)
      for (int c = 0; c < kChains; ++c) acc[c] = vdot_u8s8(acc[c], kVnni ? u : acc[c], s);
    vi sum = acc[0];
    for (int c = 1; c < kChains; ++c) sum = vadd32(sum, acc[c]);
    alignas(64) int32_t lanes[kLanes];
    std::memcpy(lanes, &sum, sizeof(lanes));
    volatile int32_t sink = lanes[0];
    (void)sink;
    total += iters * kChains * kLanes * 4;
  }
  return total;
}

// Multiply-adds per second of the q4 GEMM's own loop (group_rows, 8 activation rows) over one
// group of weights small enough to stay in L1 (32 blocks, 8 KB), `iters` times on `threads`
// threads: what its instruction mix allows when no weight ever waits on memory, the ceiling an
// extra verified row's GEMM work can approach (docs/kernels.md).
int64_t q4_cached_peak(int64_t iters, int threads) {
  constexpr int64_t K = 32 * kBlock, kRows = kRowTile;
  int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    std::vector<uint8_t> packed(K / 2 * kLanes);
    std::vector<uint16_t> d(K / kBlock * kLanes, 0x2000), m(K / kBlock * kLanes, 0xA000);  // fp16 2^-7, -2^-7
    for (size_t i = 0; i < packed.size(); ++i) packed[i] = static_cast<uint8_t>(i * 37 + omp_get_thread_num());
    const Weights w{packed.data(), d.data(), m.data(), nullptr, kLanes, K, 1};
    QuantizedRows xq;
    xq.size_for(kRows, K);
    std::vector<float> x(K);
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t j = 0; j < K; ++j) x[j] = std::sin(static_cast<float>(r * K + j));
      quantize_row(x.data(), r, K, xq);
    }
    alignas(64) float out[kRows * kLanes];
    float sink = 0.f;
    for (int64_t it = 0; it < iters; ++it) {
      group_rows<true, kRows>(w, 0, xq, 0, out);
      sink += out[it % (kRows * kLanes)];
    }
    volatile float keep = sink;
    (void)keep;
    total += iters * kRows * kLanes * K;
  }
  return total;
}

// ---- sampling: the default processed distribution, inverse-CDF draws, the chain rule --------
//
// For a request without a penalty (sampling.py sends those to torch), a row of logits x and its
// shift s (0, a logit bias, or -inf for a refused token) give, in fp32:
//   w_t = exp((x_t + s_t - M) / T), M the row's largest x + s, so the top token's w is 1; w_t = 0
//         where x_t + s_t = -inf, below the k-th largest x + s (top-k), outside the top-p set
//         (top_p_cut), or where w_t < min_p (p_t < min_p * max p), in that order;
//   Z   = the sum of w, over blocks of kDrawBlock tokens: fp32 within a block, fp64 across them;
//   p_t = w_t * float(1 / Z).
// Every row is read by one thread in a fixed order, so p and every draw from it depend on
// neither the thread count nor the variant (exp8 is the same AVX2 code in all of them).
//
// A draw with a uniform u in [0, 1) takes the first token whose running sum of weights exceeds
// u * (their total): a block by the blocks' sums, then a token inside it. A weight-0 token is
// never drawn. The chain rule (docs/algorithms.md section 1) grades a draft d_1..d_k with k + 1
// uniforms: d_i passes when u_i * q_i(d_i) < p_i(d_i) (q = 1 for a deterministic draft); at the
// first failure the token comes from max(0, p_i - q_i) (p_i without d_i for a deterministic
// draft; p_i itself when nothing is left), after a full run from p_{k+1}; u_{k+1} draws it.

constexpr int64_t kDrawBlock = 256;

enum SampleStatus : int32_t { kSampled = 0, kNonFinite = 1, kNoMass = 2, kBadToken = 3, kBadDraftProbs = 4 };

struct DrawWeights {        // one row's unnormalised weights and their block sums
  std::vector<float> w;
  std::vector<double> block;
  double total = 0;
  std::vector<float> heap;        // scratch: top-k
  std::vector<double> mass;       // scratch: top-p
  std::vector<int64_t> members;

  void size_for(int64_t V) {
    w.resize(V);
    block.resize((V + kDrawBlock - 1) / kDrawBlock);
  }
};

// A thread's two DrawWeights, kept from call to call: a row's weights are a vocabulary wide
// (192 KB for SmolLM2, 1 MB for Gemma 3), too much to allocate and clear on every draw.
DrawWeights& draw_scratch(int which) {
  thread_local DrawWeights scratch[2];
  return scratch[which];
}

// Whether v[0..n) holds no NaN and no infinity (x * 0 is NaN exactly there).
bool finite_row(const float* v, int64_t n) {
  __m256 bad = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) bad = _mm256_add_ps(bad, _mm256_mul_ps(_mm256_loadu_ps(v + t), _mm256_setzero_ps()));
  if (t < n) bad = _mm256_add_ps(bad, _mm256_mul_ps(_mm256_maskload_ps(v + t, tail_mask(n - t)), _mm256_setzero_ps()));
  return !std::isnan(hsum8(bad));
}

// The block sums (and their total) of weights w[0..V).
double sum_blocks(const float* w, int64_t V, double* block) {
  double total = 0;
  for (int64_t lo = 0, b = 0; lo < V; lo += kDrawBlock, ++b) {
    const int64_t hi = std::min(V, lo + kDrawBlock);
    __m256 acc = _mm256_setzero_ps();
    int64_t t = lo;
    for (; t + 8 <= hi; t += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(w + t));
    if (t < hi) acc = _mm256_add_ps(acc, _mm256_maskload_ps(w + t, tail_mask(hi - t)));
    block[b] = hsum8(acc);
    total += block[b];
  }
  return total;
}

// One request's processing: temperature (as 1 / T), top-k (0: off), top-p (1: off), min-p (0: off).
struct Processing {
  float inv_t;
  int64_t top_k;
  float top_p;
  float min_p;
};

// The k-th largest of x + shift over [0, V) (a min-heap of the k largest, -inf for refused tokens).
float kth_largest(const float* x, const float* shift, int64_t V, int64_t k, std::vector<float>& heap) {
  heap.clear();
  const auto later = std::greater<float>();
  for (int64_t t = 0; t < V; ++t) {
    const float v = shift == nullptr ? x[t] : x[t] + shift[t];
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.push_back(v);
      std::push_heap(heap.begin(), heap.end(), later);
    } else if (v > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), later);
      heap.back() = v;
      std::push_heap(heap.begin(), heap.end(), later);
    }
  }
  return heap.front();
}

// Top-p: zero the weights outside the smallest set of the largest ones whose mass reaches top_p
// of the total (a token stays while the mass of those before it, largest first and ties in index
// order, is below it; the largest always stays). Positive floats order as their bits, so the
// weights are bucketed by their top 12 bits (a bucket spans a factor of 2^(1/8)); buckets above
// the cut stay whole, those below go, and only the bucket the cut falls in is sorted.
void top_p_cut(float* w, int64_t V, float top_p, std::vector<double>& mass, std::vector<int64_t>& members) {
  constexpr int kBuckets = 1024;
  auto bucket = [](float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    return static_cast<int>(bits >> 20);
  };
  mass.assign(kBuckets, 0.0);
  double total = 0;
  for (int64_t t = 0; t < V; ++t) {
    if (w[t] > 0) {
      mass[bucket(w[t])] += w[t];
      total += w[t];
    }
  }
  const double reach = static_cast<double>(top_p) * total;
  double before = 0;
  int lowest = 0;  // the lowest bucket that keeps any token
  for (int b = kBuckets - 1; b >= 0; --b) {
    if (mass[b] == 0) continue;
    if (before + mass[b] < reach) {
      before += mass[b];
      continue;
    }
    members.clear();
    for (int64_t t = 0; t < V; ++t)
      if (w[t] > 0 && bucket(w[t]) == b) members.push_back(t);
    auto larger = [&](int64_t i, int64_t j) { return w[i] > w[j] || (w[i] == w[j] && i < j); };
    std::sort(members.begin(), members.end(), larger);
    for (int64_t t : members) {
      if (before > 0 && before >= reach) w[t] = 0.f;
      before += w[t];
    }
    lowest = b;
    break;
  }
  for (int64_t t = 0; t < V; ++t)
    if (w[t] > 0 && bucket(w[t]) < lowest) w[t] = 0.f;
}

// x (+ shift) -> the weights of the processed distribution (above), into d. Returns kNonFinite
// when x holds NaN or +-inf and kNoMass when the shift refuses every token.
int32_t row_weights(const float* x, const float* shift, int64_t V, const Processing& how, DrawWeights& d) {
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  __m256 best = neg_inf, bad = _mm256_setzero_ps();  // bad: x * 0 is NaN where x is NaN or inf
  int64_t t = 0;
  // x + shift at [at, at + 8) (-inf past the mask); the first pass also checks x (`checked`).
  auto logit = [&](int64_t at, __m256i mask) {
    __m256 v = _mm256_maskload_ps(x + at, mask);
    if (shift != nullptr) v = _mm256_add_ps(v, _mm256_maskload_ps(shift + at, mask));
    return _mm256_blendv_ps(neg_inf, v, _mm256_castsi256_ps(mask));
  };
  auto checked = [&](int64_t at, __m256i mask) {
    bad = _mm256_add_ps(bad, _mm256_mul_ps(_mm256_maskload_ps(x + at, mask), _mm256_setzero_ps()));
    return logit(at, mask);
  };
  const __m256i all = _mm256_set1_epi32(-1);
  for (; t + 8 <= V; t += 8) best = _mm256_max_ps(best, checked(t, all));
  if (t < V) best = _mm256_max_ps(best, checked(t, tail_mask(V - t)));
  if (std::isnan(hsum8(bad))) return kNonFinite;
  const float top = hmax8(best);
  if (top == -INFINITY) return kNoMass;
  // top-k keeps the logits at or above the k-th largest (ties included), as torch's
  const float kth = how.top_k > 0 && how.top_k < V ? kth_largest(x, shift, V, how.top_k, d.heap) : -INFINITY;
  const __m256 m = _mm256_set1_ps(top), scale = _mm256_set1_ps(how.inv_t), floor_k = _mm256_set1_ps(kth);
  auto weight = [&](int64_t at, __m256i mask) {
    const __m256 v = logit(at, mask);
    const __m256 w = exp8(_mm256_mul_ps(_mm256_sub_ps(v, m), scale));
    const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(v, neg_inf, _CMP_NEQ_OQ), _mm256_cmp_ps(v, floor_k, _CMP_GE_OQ));
    return _mm256_and_ps(w, keep);
  };
  d.size_for(V);
  float* w = d.w.data();
  for (t = 0; t + 8 <= V; t += 8) _mm256_storeu_ps(w + t, weight(t, all));
  if (t < V) _mm256_maskstore_ps(w + t, tail_mask(V - t), weight(t, tail_mask(V - t)));
  if (how.top_p < 1.f) top_p_cut(w, V, how.top_p, d.mass, d.members);
  if (how.min_p > 0.f) {  // the top token's weight is 1: min-p drops w < min_p
    const __m256 floor_p = _mm256_set1_ps(how.min_p);
    for (t = 0; t + 8 <= V; t += 8) {
      const __m256 v = _mm256_loadu_ps(w + t);
      _mm256_storeu_ps(w + t, _mm256_and_ps(v, _mm256_cmp_ps(v, floor_p, _CMP_GE_OQ)));
    }
    for (; t < V; ++t)
      if (w[t] < how.min_p) w[t] = 0.f;
  }
  d.total = sum_blocks(w, V, d.block.data());
  return kSampled;
}

// The first token whose running weight exceeds u * total (see the section's header).
int64_t draw(const float* w, const double* block, int64_t V, double total, double u) {
  const double target = u * total;
  const int64_t blocks = static_cast<int64_t>((V + kDrawBlock - 1) / kDrawBlock);
  double before = 0;
  int64_t b = 0;
  for (; b < blocks; ++b) {
    if (block[b] > 0 && before + block[b] > target) break;
    before += block[b];
  }
  if (b == blocks) {  // rounding put the target past the last block: its last token with weight
    for (int64_t t = V - 1; t >= 0; --t)
      if (w[t] > 0) return t;
    return 0;
  }
  int64_t last = -1;
  double run = before;
  for (int64_t t = b * kDrawBlock, hi = std::min(V, t + kDrawBlock); t < hi; ++t) {
    if (w[t] <= 0) continue;
    last = t;
    run += w[t];
    if (run > target) return t;
  }
  return last;  // rounding between the block's fp32 sum and its tokens' fp64 running sum
}

struct SampleArgs {
  const float* logits;  // row r at logits + row_of[r] * ld (row_of null: r), `vocab` wide
  const int64_t* row_of;
  int64_t rows, vocab, ld;
  const float* shift;   // the same layout (shift_ld), or null
  int64_t shift_ld;
  const float* inv_temperature;  // [rows]
  const float* min_p;            // [rows]
  const int64_t* top_k;          // [rows]
  const float* top_p;            // [rows]
  const double* uniforms;        // [rows], or null: no draw
  float* probs;                  // [rows, vocab] p out, or null; with out_ids [rows, out_width],
  const int64_t* out_ids;        // p_t written at out_ids[t] of its row (the rest left as it is)
  int64_t out_width;
  int64_t* tokens;               // [rows] the draws out (with uniforms)
  int32_t* status;               // [rows]
  int threads;
};

// Each row's processed distribution (into probs) and one draw from it (into tokens).
void sample_rows(const SampleArgs& a) {
#pragma omp parallel num_threads(static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(a.threads, a.rows))))
  {
    DrawWeights& d = draw_scratch(0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a.rows; ++r) {
      const float* shift = a.shift == nullptr ? nullptr : a.shift + r * a.shift_ld;
      const Processing how{a.inv_temperature[r], a.top_k[r], a.top_p[r], a.min_p[r]};
      const int64_t row = a.row_of == nullptr ? r : a.row_of[r];
      a.status[r] = row_weights(a.logits + row * a.ld, shift, a.vocab, how, d);
      if (a.status[r] != kSampled) continue;
      const float inv_total = static_cast<float>(1.0 / d.total);
      if (a.probs != nullptr && a.out_ids != nullptr) {
        float* p = a.probs + r * a.out_width;
        for (int64_t t = 0; t < a.vocab; ++t) p[a.out_ids[t]] = d.w[t] * inv_total;
      } else if (a.probs != nullptr) {
        float* p = a.probs + r * a.vocab;
        for (int64_t t = 0; t < a.vocab; ++t) p[t] = d.w[t] * inv_total;
      }
      if (a.uniforms != nullptr) a.tokens[r] = draw(d.w.data(), d.block.data(), a.vocab, d.total, a.uniforms[r]);
    }
  }
}

struct GradeArgs {
  const float* logits;  // [k + 1] rows at logits + i * ld: the target's rows for d_1..d_k and the bonus
  int64_t k, vocab, ld;
  const float* shift;   // the same layout (shift_ld), or null
  int64_t shift_ld;
  float inv_temperature, min_p;
  int64_t top_k;
  float top_p;
  const int64_t* draft;  // [k]
  const float* q;        // [k] rows of q at q + i * q_ld, or null: a deterministic draft
  int64_t q_ld;
  const double* uniforms;  // [k + 1]
  int64_t* accepted;
  int64_t* token;
  int64_t* status;
};

// One request's chain, graded by the rule in the section's header; the target's rows are
// processed lazily, up to the first failure.
void grade_chain(const GradeArgs& a) {
  const int64_t V = a.vocab;
  *a.status = kSampled;
  for (int64_t i = 0; i < a.k; ++i) {
    if (a.draft[i] < 0 || a.draft[i] >= V) {
      *a.status = kBadToken;
      return;
    }
    if (a.q != nullptr && !finite_row(a.q + i * a.q_ld, V)) {
      *a.status = kBadDraftProbs;
      return;
    }
  }
  DrawWeights &d = draw_scratch(0), &rest = draw_scratch(1);
  const Processing how{a.inv_temperature, a.top_k, a.top_p, a.min_p};
  for (int64_t i = 0; i <= a.k; ++i) {
    const float* shift = a.shift == nullptr ? nullptr : a.shift + i * a.shift_ld;
    *a.status = row_weights(a.logits + i * a.ld, shift, V, how, d);
    if (*a.status != kSampled) return;
    const float inv_total = static_cast<float>(1.0 / d.total);
    if (i == a.k) {  // every draft passed: the bonus token from p_{k+1}
      *a.accepted = a.k;
      *a.token = draw(d.w.data(), d.block.data(), V, d.total, a.uniforms[a.k]);
      return;
    }
    const int64_t drafted = a.draft[i];
    const float p = d.w[drafted] * inv_total;
    const float* q = a.q == nullptr ? nullptr : a.q + i * a.q_ld;
    const double q_at = q == nullptr ? 1.0 : static_cast<double>(q[drafted]);
    if (a.uniforms[i] * q_at < static_cast<double>(p)) continue;
    *a.accepted = i;
    rest.size_for(V);
    if (q == nullptr) {
      std::copy(d.w.begin(), d.w.end(), rest.w.begin());
      rest.w[drafted] = 0.f;
    } else {
      for (int64_t t = 0; t < V; ++t) rest.w[t] = std::max(d.w[t] * inv_total - q[t], 0.f);
    }
    rest.total = sum_blocks(rest.w.data(), V, rest.block.data());
    const DrawWeights& from = rest.total > 0 ? rest : d;
    *a.token = draw(from.w.data(), from.block.data(), V, from.total, a.uniforms[a.k]);
    return;
  }
}

}  // namespace (API below)

extern "C" {

int tandem_lanes() { return kLanes; }
int tandem_q8_bias() { return kQ8Bias; }
void tandem_linear(const LinearCall* c) {
  LinearScratch s;
  s.size_for(c->n, c->w->K);
#pragma omp parallel num_threads(c->threads)
  linear(*c, s);
}
// tandem_linear, and of each output row the first index of its largest value (numpy's argmax)
// and whether every value is finite, read by the threads that wrote the row's columns.
void tandem_linear_argmax(const LinearCall* c, int64_t* best, int32_t* finite) {
  LinearScratch s;
  s.size_for(c->n, c->w->K);
  ArgmaxParts parts(c->n, c->threads);
#pragma omp parallel num_threads(c->threads)
  {
    linear(*c, s);
    output_argmax(c->y, c->n, c->w->N, parts);
  }
  parts.combine(best, finite);
}
void tandem_attend(const AttendArgs* a) {
#pragma omp parallel num_threads(a->threads)
  attend(*a);
}
void tandem_decoder_forward(const DecoderArgs* a) { decoder_forward(*a); }
void tandem_draft_layer(const DraftLayerArgs* a) { draft_layer(*a); }
void tandem_draft_chain(const DraftChainArgs* a) { draft_chain(*a); }
void tandem_draft_tree(const DraftTreeArgs* a) { draft_tree(*a); }
int64_t tandem_int8_peak(int64_t iters, int threads) { return int8_peak(iters, threads); }
int64_t tandem_q4_cached_peak(int64_t iters, int threads) { return q4_cached_peak(iters, threads); }
void tandem_sample_rows(const SampleArgs* a) { sample_rows(*a); }
void tandem_grade_chain(const GradeArgs* a) { grade_chain(*a); }
}
