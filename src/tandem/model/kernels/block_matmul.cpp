// Block-quantized weight x block-quantized activation matmuls for AVX2 CPUs (C ABI, OpenMP).
//
// Weights come in blocks of 32 input columns per output row:
//   q4: w = d * q + m with q in 0..15; byte j of a block holds q_j (low nibble) and q_{j+16}
//       (high nibble), the GGUF Q4_1 layout.
//   q8: w = d * q with q in -127..127.
// Each activation row is quantized on entry to int8 blocks of 32 (scale = max|x| / 127), so a
// block's dot product is one integer multiply-add chain: sum_j q_w,j * q_x,j.
//
// Determinism: every output element is computed by one thread, in the same block order, from the
// same quantized activation row, whatever the number of rows or threads. So row i of a call over
// n rows equals the call over row i alone, bit for bit (speculative verification relies on it).

#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
struct QuantizedRows {
  std::vector<int8_t> q;          // [n, K]
  std::vector<float> scale;       // [n, nb]
  std::vector<float> scaled_sum;  // [n, nb]: scale * sum(q), for the q4 offset term
};

void quantize_rows(const float* x, int64_t n, int64_t K, QuantizedRows& out) {
  const int64_t nb = K / kBlock;
  out.q.resize(n * K);
  out.scale.resize(n * nb);
  out.scaled_sum.resize(n * nb);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* src = x + i * K + b * kBlock;
      float amax = 0.f;
      for (int j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(src[j]));
      const float s = amax / 127.f;
      const float inv = s > 0.f ? 1.f / s : 0.f;
      int8_t* dst = out.q.data() + i * K + b * kBlock;
      int sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int v = static_cast<int>(std::nearbyint(src[j] * inv));
        dst[j] = static_cast<int8_t>(v);
        sum += v;
      }
      out.scale[i * nb + b] = s;
      out.scaled_sum[i * nb + b] = s * static_cast<float>(sum);
    }
  }
}

// What the linear applies to each input row before multiplying (fused, so the row never
// round-trips through separate framework ops).
enum InputTransform : int {
  kIdentity = 0,   // x
  kRmsNorm = 1,    // x / sqrt(mean(x^2) + eps) * w   (row width K)
  kSwiGLU = 2,     // silu(x[:K]) * x[K:]             (row width 2K: gate then up)
  kGeGLU = 3,      // gelu_tanh(x[:K]) * x[K:]
};

// Rows of the transformed input [n, K], row by row in a fixed order (deterministic per row).
void transform_rows(const float* x, int64_t n, int64_t K, int64_t x_stride, int transform, const float* w,
                    float eps, std::vector<float>& out) {
  out.resize(n * K);
  for (int64_t i = 0; i < n; ++i) {
    const float* src = x + i * x_stride;
    float* dst = out.data() + i * K;
    if (transform == kRmsNorm) {
      double ss = 0.0;
      for (int64_t j = 0; j < K; ++j) ss += static_cast<double>(src[j]) * src[j];
      const float r = 1.f / std::sqrt(static_cast<float>(ss / K) + eps);
      for (int64_t j = 0; j < K; ++j) dst[j] = src[j] * r * w[j];
    } else if (transform == kSwiGLU) {
      for (int64_t j = 0; j < K; ++j) dst[j] = src[j] / (1.f + std::exp(-src[j])) * src[K + j];
    } else if (transform == kGeGLU) {
      constexpr float c = 0.7978845608028654f;  // sqrt(2 / pi)
      for (int64_t j = 0; j < K; ++j) {
        const float g = src[j];
        dst[j] = 0.5f * g * (1.f + std::tanh(c * (g + 0.044715f * g * g * g))) * src[K + j];
      }
    } else {
      for (int64_t j = 0; j < K; ++j) dst[j] = src[j];
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Sum of products of unsigned (0..255) and signed bytes, as 8 floats.
inline __m256 dot_u8_s8(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

inline __m256i expand_q4(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// out[i] = sum_b a[b] * c[i][b] with a vector dot (used for the per-block scale products).
inline void scale_products(const float* d, const float* xs, int64_t nb, float* ds) {
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) _mm256_storeu_ps(ds + b, _mm256_mul_ps(_mm256_loadu_ps(d + b), _mm256_loadu_ps(xs + b)));
  for (; b < nb; ++b) ds[b] = d[b] * xs[b];
}

inline float dot(const float* a, const float* c, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + b), _mm256_loadu_ps(c + b), acc);
  float s = hsum(acc);
  for (; b < nb; ++b) s += a[b] * c[b];
  return s;
}

// One weight block times one activation block: 8 partial sums as floats.
template <bool kQ4>
inline __m256 block_dot(__m256i w, __m256i w_abs, __m256i xv) {
  // q8: |w| * (x with w's sign) = w * x, with the unsigned operand maddubs needs.
  return kQ4 ? dot_u8_s8(w, xv) : dot_u8_s8(w_abs, _mm256_sign_epi8(xv, w));
}

template <bool kQ4>
inline void load_block(const uint8_t* wrow, int64_t b, __m256i& w, __m256i& w_abs) {
  if constexpr (kQ4) {
    w = expand_q4(wrow + b * (kBlock / 2));
  } else {
    w = load32(reinterpret_cast<const int8_t*>(wrow) + b * kBlock);
    w_abs = _mm256_sign_epi8(w, w);
  }
}

// R activation rows against one weight row. Each row keeps two accumulators (even and odd
// blocks) so consecutive FMAs do not wait on each other; every R uses this same per-row order,
// which keeps results independent of how rows are tiled.
template <bool kQ4, int R>
inline void row_tile(const uint8_t* wrow, const float* ds, int64_t nb, const int8_t* xq, int64_t K, float* sums) {
  __m256 even[R], odd[R];
  for (int i = 0; i < R; ++i) { even[i] = _mm256_setzero_ps(); odd[i] = _mm256_setzero_ps(); }
  int64_t b = 0;
  __m256i w0, a0, w1, a1;
  for (; b + 2 <= nb; b += 2) {
    load_block<kQ4>(wrow, b, w0, a0);
    load_block<kQ4>(wrow, b + 1, w1, a1);
    for (int i = 0; i < R; ++i) {
      const int8_t* xr = xq + i * K + b * kBlock;
      even[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(ds + i * nb + b), block_dot<kQ4>(w0, a0, load32(xr)), even[i]);
      odd[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(ds + i * nb + b + 1), block_dot<kQ4>(w1, a1, load32(xr + kBlock)), odd[i]);
    }
  }
  if (b < nb) {
    load_block<kQ4>(wrow, b, w0, a0);
    for (int i = 0; i < R; ++i)
      even[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(ds + i * nb + b), block_dot<kQ4>(w0, a0, load32(xq + i * K + b * kBlock)), even[i]);
  }
  for (int i = 0; i < R; ++i) sums[i] = hsum(_mm256_add_ps(even[i], odd[i]));
}

constexpr int kMaxTile = 4;

struct LinearArgs {
  const float* x;         // [n, x_stride] input rows
  int64_t n, K, x_stride;
  int transform;          // InputTransform
  const float* norm_w;    // [K] for kRmsNorm
  float eps;
  const void* qs;         // weight blocks [N, K/2] uint8 (q4) or [N, K] int8 (q8)
  const float* d;         // [N, K/32]
  const float* m;         // [N, K/32] (q4 only)
  int64_t N;
  const float* bias;      // [N] or null
  const float* residual;  // [n, N] added to the output, or null (may alias y)
  float* y;               // [n, N]
  int threads;
};

template <bool kQ4>
void block_matmul(const LinearArgs& a) {
  const int64_t n = a.n, K = a.K, N = a.N;
  const float* d = a.d;
  const float* m = a.m;
  float* y = a.y;
  const int threads = a.threads;
  const int64_t nb = K / kBlock;
  const int64_t row_bytes = kQ4 ? K / 2 : K;
  QuantizedRows xq;
  if (a.transform == kIdentity && a.x_stride == K) {
    quantize_rows(a.x, n, K, xq);
  } else {
    std::vector<float> rows;
    transform_rows(a.x, n, K, a.x_stride, a.transform, a.norm_w, a.eps, rows);
    quantize_rows(rows.data(), n, K, xq);
  }
  const void* weights = a.qs;
  const uint8_t* wbytes = static_cast<const uint8_t*>(weights);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> ds(kMaxTile * nb);
    float sums[kMaxTile];
#pragma omp for schedule(static)
    for (int64_t r = 0; r < N; ++r) {
      const uint8_t* wrow = wbytes + r * row_bytes;
      const float* drow = d + r * nb;
      for (int64_t i0 = 0; i0 < n; i0 += kMaxTile) {
        const int64_t rows = n - i0 < kMaxTile ? n - i0 : kMaxTile;
        for (int64_t i = 0; i < rows; ++i)
          scale_products(drow, xq.scale.data() + (i0 + i) * nb, nb, ds.data() + i * nb);
        const int8_t* xr = xq.q.data() + i0 * K;
        switch (rows) {
          case 1: row_tile<kQ4, 1>(wrow, ds.data(), nb, xr, K, sums); break;
          case 2: row_tile<kQ4, 2>(wrow, ds.data(), nb, xr, K, sums); break;
          case 3: row_tile<kQ4, 3>(wrow, ds.data(), nb, xr, K, sums); break;
          default: row_tile<kQ4, 4>(wrow, ds.data(), nb, xr, K, sums); break;
        }
        for (int64_t i = 0; i < rows; ++i) {
          float v = sums[i];
          if constexpr (kQ4) v += dot(m + r * nb, xq.scaled_sum.data() + (i0 + i) * nb, nb);
          if (a.bias) v += a.bias[r];
          if (a.residual) v += a.residual[(i0 + i) * N + r];
          y[(i0 + i) * N + r] = v;
        }
      }
    }
  }
}

// ---- prefill: fp32 weights dequantized per chunk, fp32 activations ----------------------------
//
// Prompt rows come many at a time; for them the integer path above spends more instructions per
// multiply than plain fp32 FMAs over weights dequantized once per chunk and reused by every row.
// Each output element is one 8-lane FMA chain over k in order, then hsum: the same arithmetic for
// every tile shape, so row i still does not depend on the other rows (nor on the thread count).
// The numbers differ from the integer path's (no activation rounding): callers use this for
// prompt tokens only, which every run computes the same way.

constexpr int64_t kDenseChunk = 64;  // weight rows dequantized at a time (64 x K fp32 fits L2)

template <bool kQ4>
void dequantize_rows(const LinearArgs& a, int64_t r0, int64_t rows, float* out) {
  const int64_t K = a.K, nb = K / kBlock;
  for (int64_t r = r0; r < r0 + rows; ++r) {
    float* dst = out + (r - r0) * K;
    for (int64_t b = 0; b < nb; ++b) {
      const float d = a.d[r * nb + b];
      if constexpr (kQ4) {
        const float m = a.m[r * nb + b];
        const uint8_t* q = static_cast<const uint8_t*>(a.qs) + r * (K / 2) + b * (kBlock / 2);
        for (int j = 0; j < kBlock / 2; ++j) {
          dst[b * kBlock + j] = d * static_cast<float>(q[j] & 0x0F) + m;
          dst[b * kBlock + j + kBlock / 2] = d * static_cast<float>(q[j] >> 4) + m;
        }
      } else {
        const int8_t* q = static_cast<const int8_t*>(a.qs) + r * K + b * kBlock;
        for (int j = 0; j < kBlock; ++j) dst[b * kBlock + j] = d * static_cast<float>(q[j]);
      }
    }
  }
}

// WR weight rows x IR activation rows, accumulators in registers.
template <int WR, int IR>
inline void dense_tile(const float* w, const float* x, int64_t K, float* sums) {
  __m256 acc[WR][IR];
  for (int j = 0; j < WR; ++j)
    for (int i = 0; i < IR; ++i) acc[j][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[IR];
    for (int i = 0; i < IR; ++i) xv[i] = _mm256_loadu_ps(x + i * K + k);
    for (int j = 0; j < WR; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + j * K + k);
      for (int i = 0; i < IR; ++i) acc[j][i] = _mm256_fmadd_ps(wv, xv[i], acc[j][i]);
    }
  }
  for (int j = 0; j < WR; ++j)
    for (int i = 0; i < IR; ++i) sums[j * IR + i] = hsum(acc[j][i]);
}

template <int WR>
inline void dense_rows(const float* w, const float* x, int64_t K, int64_t ir, float* sums) {
  switch (ir) {
    case 1: dense_tile<WR, 1>(w, x, K, sums); break;
    case 2: dense_tile<WR, 2>(w, x, K, sums); break;
    case 3: dense_tile<WR, 3>(w, x, K, sums); break;
    default: dense_tile<WR, 4>(w, x, K, sums); break;
  }
}

template <bool kQ4>
void dense_matmul(const LinearArgs& a) {
  const int64_t n = a.n, K = a.K, N = a.N;
  std::vector<float> rows;
  const float* X = a.x;
  if (a.transform != kIdentity || a.x_stride != K) {
    transform_rows(a.x, n, K, a.x_stride, a.transform, a.norm_w, a.eps, rows);
    X = rows.data();
  }
  const int64_t chunks = (N + kDenseChunk - 1) / kDenseChunk;
#pragma omp parallel num_threads(a.threads)
  {
    std::vector<float> w(kDenseChunk * K);
    float sums[2 * 4];
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t r0 = c * kDenseChunk, wrows = std::min(kDenseChunk, N - r0);
      dequantize_rows<kQ4>(a, r0, wrows, w.data());
      for (int64_t i0 = 0; i0 < n; i0 += 4) {
        const int64_t ir = std::min<int64_t>(4, n - i0);
        for (int64_t j0 = 0; j0 < wrows; j0 += 2) {
          const int64_t wr = std::min<int64_t>(2, wrows - j0);
          if (wr == 2) dense_rows<2>(w.data() + j0 * K, X + i0 * K, K, ir, sums);
          else dense_rows<1>(w.data() + j0 * K, X + i0 * K, K, ir, sums);
          for (int64_t j = 0; j < wr; ++j) {
            const int64_t r = r0 + j0 + j;
            for (int64_t i = 0; i < ir; ++i) {
              float v = sums[j * ir + i];
              if (a.bias) v += a.bias[r];
              if (a.residual) v += a.residual[(i0 + i) * N + r];
              a.y[(i0 + i) * N + r] = v;
            }
          }
        }
      }
    }
  }
}

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
  float* kcache;           // [S, Hkv, M, D]
  float* vcache;
  int64_t M;               // slots per sequence row
  int64_t window;          // sliding window (0 = full attention)
  float scale;
  float* out;              // [T, Hq * D]
  int threads;
};

void rope_into(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t h = D / 2;
  for (int64_t j = 0; j < D; ++j) out[j] = x[j] * c[j] + x[(j + h) % D] * s[j];
}

inline float dot_d(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= D; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
  float s = hsum(acc);
  for (; j < D; ++j) s += a[j] * b[j];
  return s;
}

void attend(const AttendArgs& a) {
  const int64_t T = a.T, Hq = a.Hq, Hkv = a.Hkv, D = a.D, M = a.M;
  const int64_t width = (Hq + 2 * Hkv) * D;
  // Phase 1: rotate k and write k, v of every token (later tokens of a chain attend to them).
  for (int64_t t = 0; t < T; ++t) {
    const float* row = a.qkv + t * width;
    const int64_t p = a.pos ? a.pos[t] : a.slot[t];
    const float* c = a.cos + p * D;
    const float* s = a.sin + p * D;
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t at = ((a.seq[t] * Hkv + h) * M + a.slot[t]) * D;
      rope_into(row + (Hq + h) * D, c, s, D, a.kcache + at);
      std::copy(row + (Hq + Hkv + h) * D, row + (Hq + Hkv + h + 1) * D, a.vcache + at);
    }
  }
  // Phase 2: each (token, head) attends over its own keys.
  const int64_t group = Hq / Hkv;
#pragma omp parallel num_threads(a.threads)
  {
    std::vector<float> q(D), scores, acc(D);
#pragma omp for schedule(static)
    for (int64_t th = 0; th < T * Hq; ++th) {
      const int64_t t = th / Hq, h = th % Hq, kvh = h / group;
      const int64_t p = a.pos ? a.pos[t] : a.slot[t];
      const int64_t hi = a.hi ? a.hi[t] : a.slot[t] + 1;
      const int64_t lo = a.window > 0 && p + 1 > a.window ? p + 1 - a.window : 0;
      const int64_t* extra = a.key_off ? a.keys + a.key_off[t] : nullptr;
      const int64_t num_extra = a.key_off ? a.key_off[t + 1] - a.key_off[t] : 0;
      const int64_t n = std::max<int64_t>(hi - lo, 0) + num_extra;
      rope_into(a.qkv + t * width + h * D, a.cos + p * D, a.sin + p * D, D, q.data());
      const float* K = a.kcache + (a.seq[t] * Hkv + kvh) * M * D;
      const float* V = a.vcache + (a.seq[t] * Hkv + kvh) * M * D;
      // The i-th key read: the contiguous range first, then the listed slots.
      auto key_slot = [&](int64_t i) { return i < n - num_extra ? lo + i : extra[i - (n - num_extra)]; };
      scores.resize(n);
      float mx = -INFINITY;
      for (int64_t i = 0; i < n; ++i) {
        scores[i] = dot_d(q.data(), K + key_slot(i) * D, D) * a.scale;
        mx = std::fmax(mx, scores[i]);
      }
      float total = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const float e = std::exp(scores[i] - mx);
        const float* v = V + key_slot(i) * D;
        total += e;
        const __m256 ev = _mm256_set1_ps(e);
        int64_t k = 0;
        for (; k + 8 <= D; k += 8)
          _mm256_storeu_ps(acc.data() + k, _mm256_fmadd_ps(ev, _mm256_loadu_ps(v + k), _mm256_loadu_ps(acc.data() + k)));
        for (; k < D; ++k) acc[k] += e * v[k];
      }
      float* o = a.out + t * Hq * D + h * D;
      const float inv = 1.f / total;
      for (int64_t k = 0; k < D; ++k) o[k] = acc[k] * inv;
    }
  }
}

}  // namespace (API below)

extern "C" {

void tandem_q4_linear(const LinearArgs* a) { block_matmul<true>(*a); }
void tandem_q8_linear(const LinearArgs* a) { block_matmul<false>(*a); }
void tandem_q4_linear_dense(const LinearArgs* a) { dense_matmul<true>(*a); }
void tandem_q8_linear_dense(const LinearArgs* a) { dense_matmul<false>(*a); }
void tandem_attend(const AttendArgs* a) { attend(*a); }
}
