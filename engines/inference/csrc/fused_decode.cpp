// One Llama decode step (float32, CPU) in a single call: see engines/inference/fused_decode.py.
//
// The Python step (kv_decode.LlamaDecoder) issues ~140 aten calls a step; at batch 64 on
// the example model their dispatch, the temporaries between them and a thread-pool wake-up
// per op cost more than the matmuls. Here the matmuls stay ATen's (MKL/oneDNN; the
// batch-invariant mode has fixed-order chains of its own, below), and everything between
// them runs as plain loops over the same buffers: RMS norm, RoPE and the cache write in one
// pass, attention in one pass per (row, kv head) over its keys and values. Rows never meet
// in a decode step, so each pool thread takes a block of rows through the whole step: one
// wake-up of the pool a step. The arithmetic is the same as HF's Llama in float32
// (summation order aside): log-probs stay within 1e-6 of it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

using at::Tensor;

namespace {

// Batch-invariant mode (`fixed`, engine.batch_invariant): every reduction below runs in one
// order written out here, whatever the row's address, the batch size or the thread: a
// matmul's output one chain of fused multiply-adds along its inputs (matvec_rows), a dot
// product of the norms and attention 16 lanes then a fixed tree (dot_fixed). A compiler may
// vectorise them but not reorder them (no -ffast-math), so a row's numbers depend on that
// row alone. MKL's matmuls pick kernels by the batch's shape.
constexpr int64_t kLanes = 16;

inline float lanes_sum(const float* acc) {
  float half[kLanes / 2];
  for (int64_t l = 0; l < kLanes / 2; ++l) half[l] = acc[l] + acc[l + kLanes / 2];
  float quarter[kLanes / 4];
  for (int64_t l = 0; l < kLanes / 4; ++l) quarter[l] = half[l] + half[l + kLanes / 4];
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

// Each lane a chain of fused multiply-adds (written out, not left to the compiler's
// contraction), so the vector path below (dots16_fixed) gives the same bits.
inline float dot_fixed(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] = __builtin_fmaf(a[i + l], b[i + l], acc[l]);
  for (int64_t l = 0; i + l < n; ++l) acc[l] = __builtin_fmaf(a[i + l], b[i + l], acc[l]);
  return lanes_sum(acc);
}

// exp(x) as one fixed sequence of operations per element: x clamped to [-104, 89] (exp is 0
// or inf there in float32), k = round(x / ln 2), r = x - k ln 2 in two steps (|r| <= ln 2 / 2),
// the Taylor polynomial of degree 7 in r (error under 1e-8, relative), then times 2^k. About an
// ulp from std::exp, and vectorised below with the same operations: the same bits in every
// lane and in this scalar version.
constexpr float kLog2e = 1.44269504f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpTaylor[8] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720,
                                 1.f / 5040};

inline float exp_fixed(float x) {
  x = x > -104.f ? x : -104.f;  // (the vector max and min, NaN included)
  x = x < 89.f ? x : 89.f;
  const float k = std::nearbyint(x * kLog2e);
  const float r = __builtin_fmaf(-k, kLn2Lo, __builtin_fmaf(-k, kLn2Hi, x));
  float p = kExpTaylor[7];
  for (int d = 6; d >= 0; --d) p = __builtin_fmaf(p, r, kExpTaylor[d]);
  return std::ldexp(p, static_cast<int>(k));
}

#ifdef __AVX512F__
inline __m512 exp16_fixed(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Lo),
                                    _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpTaylor[7]);
  for (int d = 6; d >= 0; --d) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[d]));
  return _mm512_scalef_ps(p, k);
}
#endif

// One row of the MLP's activation: o = silu(g) * u = g / (1 + exp(-g)) * u, for a row's
// gate|up pair `gu` [2 * inner], each element by exp_fixed's operations.
inline void silu_mul_fixed(const float* gu, int64_t inner, float* o) {
#ifdef __AVX512F__
  for (int64_t i = 0; i < inner; i += 16) {
    const __mmask16 m = inner - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (inner - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(m, gu + i), u = _mm512_maskz_loadu_ps(m, gu + inner + i);
    const __m512 e = exp16_fixed(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(silu, u));
  }
#else
  for (int64_t i = 0; i < inner; ++i) o[i] = gu[i] / (1.f + exp_fixed(0.f - gu[i])) * gu[inner + i];
#endif
}

#ifdef __AVX512F__
// lanes_sum of 16 registers at once, in its order, each register's sum in one lane
// (register q's in lane q): the tree's adds run across registers instead of within one.
inline __m512 lanes_sum16(const __m512* v) {
  // indices into (a, b): 0-15 pick from a, 16-31 from b
  const __m512i lo8 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i hi8 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  __m512 half[8];  // [a.h0..h7 | b.h0..h7], h_l = x_l + x_{l+8}
  for (int p = 0; p < 8; ++p)
    half[p] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * p], lo8, v[2 * p + 1]),
                            _mm512_permutex2var_ps(v[2 * p], hi8, v[2 * p + 1]));
  const __m512i lo4 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i hi4 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  __m512 quarter[4];  // 4 registers' q0..q3 each, q_l = h_l + h_{l+4}
  for (int p = 0; p < 4; ++p)
    quarter[p] = _mm512_add_ps(_mm512_permutex2var_ps(half[2 * p], lo4, half[2 * p + 1]),
                               _mm512_permutex2var_ps(half[2 * p], hi4, half[2 * p + 1]));
  const __m512i lo2 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i hi2 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  __m512 pair[2];  // 8 registers' (q0 + q2, q1 + q3) each
  for (int p = 0; p < 2; ++p)
    pair[p] = _mm512_add_ps(_mm512_permutex2var_ps(quarter[2 * p], lo2, quarter[2 * p + 1]),
                            _mm512_permutex2var_ps(quarter[2 * p], hi2, quarter[2 * p + 1]));
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_add_ps(_mm512_permutex2var_ps(pair[0], even, pair[1]),
                       _mm512_permutex2var_ps(pair[0], odd, pair[1]));
}

// R rows x C registers (16 outputs each) of y = x . w, `wt` a panel of w (Panels) with its rows
// `ldw` apart and y's rows `ldy` apart: every output is one chain of fused multiply-adds over
// i = 0, 1, ..., n - 1, whatever R and C are, so a row's numbers do not depend on the rows
// processed beside it. The lanes run along the outputs, so no sum ever crosses lanes. `last`
// masks the last register's lanes (the outputs past `out`) in the stores, and in the loads
// only where the panel has no zeros there (`Masked`): with a masked load in the loop, GCC
// kept the 24 accumulators in memory as well, a store per multiply-add (bench/RESULTS.md,
// "Deterministic mode").
template <int R, int C, bool Masked>
inline void chain_tile(const float* x, int64_t n, const float* wt, int64_t ldw, float* y,
                       int64_t ldy, __mmask16 last, bool accumulate) {
  __m512 c[R][C];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < C; ++k) c[r][k] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    __m512 wv[C];
    for (int k = 0; k < C; ++k)
      wv[k] = k + 1 < C || !Masked ? _mm512_loadu_ps(wt + i * ldw + 16 * k)
                                   : _mm512_maskz_loadu_ps(last, wt + i * ldw + 16 * k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * n + i]);
      for (int k = 0; k < C; ++k) c[r][k] = _mm512_fmadd_ps(xv, wv[k], c[r][k]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < C; ++k) {
      const __mmask16 lanes = k + 1 < C ? static_cast<__mmask16>(0xFFFF) : last;
      float* out = y + r * ldy + 16 * k;
      const __m512 sum = accumulate ? _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, out), c[r][k])
                                    : c[r][k];
      _mm512_mask_storeu_ps(out, lanes, sum);
    }
}

// dot_fixed(q, keys + j * d, d) for the 16 keys j = 0..15 at once (d a multiple of 16): the
// attention scores of a row's cache, their lanes_sum trees side by side (lanes_sum16).
inline void dots16_fixed(const float* q, const float* keys, int64_t d, float* out) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += kLanes) {
    const __m512 qv = _mm512_loadu_ps(q + i);
    for (int j = 0; j < 16; ++j)
      acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys + j * d + i), acc[j]);
  }
  _mm512_storeu_ps(out, lanes_sum16(acc));
}

#endif

// A weight [n, out] as the chains read it, in panels of 64 outputs: panel b's row i (outputs
// 64b .. 64b + 63) at `w + b * panel + i * ldw`. The projections come packed
// ([ceil(out / 64), n, 64], zeros past `out`; ldw 64, panel n * 64), each panel read front
// to back; the lm_head plain ([n, out]; ldw out, panel 64), whose rows are short.
struct Panels {
  const float* w;
  int64_t out, ldw, panel;
};

#ifdef __AVX512F__
// R rows of `a` against one panel's `left` (<= 64) outputs; `padded`: the panel's lanes past
// `left` hold zeros up to a whole register (packed panels), so its loads need no mask
template <int R>
void panel_tile(const float* a, int64_t n, const float* panel, int64_t ldw, float* y, int64_t ldy,
                int64_t left, bool padded, bool accumulate) {
  const __mmask16 last = left % 16 == 0 ? 0xFFFF : static_cast<__mmask16>((1u << (left % 16)) - 1);
  const int registers = static_cast<int>((left + 15) / 16);
  if (padded || last == 0xFFFF) {
    switch (registers) {
      case 1: chain_tile<R, 1, false>(a, n, panel, ldw, y, ldy, last, accumulate); break;
      case 2: chain_tile<R, 2, false>(a, n, panel, ldw, y, ldy, last, accumulate); break;
      case 3: chain_tile<R, 3, false>(a, n, panel, ldw, y, ldy, last, accumulate); break;
      default: chain_tile<R, 4, false>(a, n, panel, ldw, y, ldy, last, accumulate); break;
    }
  } else {
    switch (registers) {
      case 1: chain_tile<R, 1, true>(a, n, panel, ldw, y, ldy, last, accumulate); break;
      case 2: chain_tile<R, 2, true>(a, n, panel, ldw, y, ldy, last, accumulate); break;
      case 3: chain_tile<R, 3, true>(a, n, panel, ldw, y, ldy, last, accumulate); break;
      default: chain_tile<R, 4, true>(a, n, panel, ldw, y, ldy, last, accumulate); break;
    }
  }
}

// y[r, j] (+)= a[r, :] . w[:, j] for `rows` rows of `a` [rows, n]: panel by panel (a packed
// panel stays in the cache while every row passes it), rows in tiles of 6, the last rows in one
// smaller tile: the same numbers for every row either way.
void matvec_rows(const float* a, int64_t rows, int64_t n, const Panels& w, float* y,
                 bool accumulate) {
  const bool packed = w.ldw == 64;  // (a plain [n, 64] is whole registers anyway)
  for (int64_t j = 0; j < w.out; j += 64) {
    const float* panel = w.w + (j / 64) * w.panel;
    const int64_t left = std::min<int64_t>(64, w.out - j);
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6)
      panel_tile<6>(a + r * n, n, panel, w.ldw, y + r * w.out + j, w.out, left, packed,
                    accumulate);
    const float* rest = a + r * n;
    float* into = y + r * w.out + j;
    switch (rows - r) {
      case 1: panel_tile<1>(rest, n, panel, w.ldw, into, w.out, left, packed, accumulate); break;
      case 2: panel_tile<2>(rest, n, panel, w.ldw, into, w.out, left, packed, accumulate); break;
      case 3: panel_tile<3>(rest, n, panel, w.ldw, into, w.out, left, packed, accumulate); break;
      case 4: panel_tile<4>(rest, n, panel, w.ldw, into, w.out, left, packed, accumulate); break;
      case 5: panel_tile<5>(rest, n, panel, w.ldw, into, w.out, left, packed, accumulate); break;
      default: break;
    }
  }
}
#else
// y[r, j] (+)= a[r, :] . w[:, j] for `rows` rows of `a` [rows, n]: the AVX-512 path's chains
// (one fused multiply-add per i, in order), which the compiler may vectorise along j without
// reordering any one output's sum: the same bits.
void matvec_rows(const float* a, int64_t rows, int64_t n, const Panels& w, float* y,
                 bool accumulate) {
  float sum[64];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < w.out; j += 64) {
      const float* panel = w.w + (j / 64) * w.panel;
      const int64_t left = std::min<int64_t>(64, w.out - j);
      std::fill(sum, sum + left, 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const float v = a[r * n + i];
        for (int64_t k = 0; k < left; ++k) sum[k] = __builtin_fmaf(v, panel[i * w.ldw + k], sum[k]);
      }
      float* yr = y + r * w.out + j;
      for (int64_t k = 0; k < left; ++k) yr[k] = accumulate ? yr[k] + sum[k] : sum[k];
    }
}
#endif

// HF's LlamaRMSNorm: x * rsqrt(mean(x^2) + eps), then the weight.
void rms_norm(const float* x, const float* weight, float eps, float* out, int64_t rows,
              int64_t n, bool fixed) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    float squares = 0.f;
    if (fixed) {
      squares = dot_fixed(xr, xr, n);
    } else {
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < n; ++i) squares += xr[i] * xr[i];
    }
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] = (xr[i] * inv) * weight[i];
  }
}

struct Shape {
  int64_t rows, heads, kv_heads, head_dim, capacity, col;
  int64_t width() const { return (heads + 2 * kv_heads) * head_dim; }  // q | k | v
};

// RoPE on the q and k heads of `qkv` in place (`table[pos]` is cos | sign-folded sin, so
// rotate_half(x) * sin is x rolled by half a head times the folded sin), then the new keys
// and values into column `col` of the layer's `[rows, kv_heads, 2, capacity, d]` cache.
void rope_and_store(float* qkv, const int64_t* positions, const float* table, float* cache,
                    const Shape& s) {
  const int64_t d = s.head_dim, half = d / 2;
  std::vector<float> head(d);
  for (int64_t r = 0; r < s.rows; ++r) {
    const float* cos = table + positions[r] * 2 * d;
    const float* sin = cos + d;
    float* row = qkv + r * s.width();
    for (int64_t h = 0; h < s.heads + s.kv_heads; ++h) {
      float* x = row + h * d;
      std::copy(x, x + d, head.begin());
      const float* first = head.data();
      const float* second = first + half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) x[i] = first[i] * cos[i] + second[i] * sin[i];
#pragma omp simd
      for (int64_t i = 0; i < half; ++i)
        x[half + i] = second[i] * cos[half + i] + first[i] * sin[half + i];
    }
    for (int64_t k = 0; k < s.kv_heads; ++k) {
      float* keys = cache + (r * s.kv_heads + k) * 2 * s.capacity * d;
      const float* key = row + (s.heads + k) * d;
      const float* value = key + s.kv_heads * d;
      std::copy(key, key + d, keys + s.col * d);
      std::copy(value, value + d, keys + (s.capacity + s.col) * d);
    }
  }
}

// Attention of each row's new token over columns [0, col] of its cache: the q heads that
// share a kv head (HF's repeat_kv: kv head k serves q heads k*g .. k*g+g-1) read its keys
// and values once. `mask` (null when no column is padding) marks the real columns.
void attention(const float* qkv, const float* cache, const bool* mask, int64_t mask_stride,
               float scale, float* out, const Shape& s, bool fixed) {
  const int64_t d = s.head_dim, g = s.heads / s.kv_heads, length = s.col + 1;
  std::vector<float> scores(length);
  for (int64_t item = 0; item < s.rows * s.kv_heads; ++item) {
    const int64_t r = item / s.kv_heads, k = item % s.kv_heads;
    const float* keys = cache + item * 2 * s.capacity * d;
    const float* values = keys + s.capacity * d;
    const bool* real = mask == nullptr ? nullptr : mask + r * mask_stride;
    if (item + 1 < s.rows * s.kv_heads) {  // ask for the next item's keys and values now:
      // each item's are two short runs, too short for the hardware prefetcher to catch
      const char* next = reinterpret_cast<const char*>(keys + 2 * s.capacity * d);
      const int64_t bytes = length * d * static_cast<int64_t>(sizeof(float));
      for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(next + b);
        __builtin_prefetch(next + s.capacity * d * static_cast<int64_t>(sizeof(float)) + b);
      }
    }
    for (int64_t h = k * g; h < (k + 1) * g; ++h) {
      const float* q = qkv + r * s.width() + h * d;
      float best = -INFINITY;
      int64_t done = 0;  // keys whose fixed-order dot is in scores[] already
#ifdef __AVX512F__
      if (fixed && d % kLanes == 0)
        for (; done + 16 <= length; done += 16) dots16_fixed(q, keys + done * d, d, &scores[done]);
#endif
      for (int64_t t = 0; t < length; ++t) {
        if (real != nullptr && !real[t]) {
          scores[t] = -INFINITY;
          continue;
        }
        const float* key = keys + t * d;
        float dot = 0.f;
        if (t < done) {
          dot = scores[t];
        } else if (fixed) {
          dot = dot_fixed(q, key, d);
        } else {
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < d; ++i) dot += q[i] * key[i];
        }
        scores[t] = dot * scale;
        best = std::max(best, scores[t]);
      }
      float total = 0.f;
      for (int64_t t = 0; t < length; ++t) total += (scores[t] = std::exp(scores[t] - best));
      float* o = out + (r * s.heads + h) * d;
      std::fill(o, o + d, 0.f);
      for (int64_t t = 0; t < length; ++t) {
        const float p = scores[t] / total;
        if (p == 0.f) continue;  // padding
        const float* value = values + t * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] += p * value[i];
      }
    }
  }
}

void check(const Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "fused decode: ", what, " must be a contiguous float32 CPU tensor");
}

}  // namespace

// The step for rows [r0, r1) of the batch, through every layer: rows never meet in a decode
// step, so each thread takes a block of rows for the whole step (one thread-pool wake-up a
// step; ATen's matmuls inside run on the calling thread).
struct Step {
  const std::vector<Tensor>& weights;
  const std::vector<double>& scalars;
  const std::vector<Tensor>& caches;
  const Tensor &positions, &mask, &rope_table, &final_norm, &lm_head_t;
  bool padded;
  double final_eps;
  int64_t heads, kv_heads, col;
  bool fixed;  // batch-invariant: fixed-order loops instead of MKL's matmuls

  // a @ w (added to `into` when given) for a weight of `out` outputs: MKL's matmul of `w`
  // [n, out] (a transposed view of the weight), or the fixed chains over `w` packed in panels
  // ([ceil(out / 64), n, 64], Panels) or plain ([n, out], contiguous)
  Tensor linear(const Tensor& a, const Tensor& w, int64_t out, Tensor* into = nullptr) const {
    if (!fixed) {
      if (into == nullptr) return at::mm(a, w);
      into->addmm_(a, w);
      return *into;
    }
    const Tensor in = a.contiguous();
    const int64_t n = in.size(1);
    const bool packed = w.dim() == 3;
    TORCH_CHECK(packed ? (w.size(0) * 64 >= out && w.size(1) == n && w.size(2) == 64)
                       : (w.size(0) == n && w.size(1) == out),
                "fused decode: a fixed-step weight of the wrong shape");
    Tensor result = into != nullptr ? *into : at::empty({a.size(0), out}, a.options());
    const Panels panels{w.data_ptr<float>(), out, packed ? 64 : out, packed ? n * 64 : 64};
    matvec_rows(in.data_ptr<float>(), in.size(0), n, panels, result.data_ptr<float>(),
                into != nullptr);
    return result;
  }

  void run(Tensor x, Tensor logits, int64_t r0, int64_t r1) const {
    const int64_t rows = r1 - r0, hidden = x.size(1);
    Tensor h = at::empty_like(x);
    for (size_t l = 0; l < caches.size(); ++l) {
      const Tensor* w = &weights[6 * l];
      const Tensor& cache = caches[l];
      const Shape s{rows, heads, kv_heads, cache.size(4), cache.size(3), col};
      const int64_t block = cache.stride(0) * r0;  // this block's first row of the cache
      rms_norm(x.data_ptr<float>(), w[0].data_ptr<float>(), static_cast<float>(scalars[3 * l]),
               h.data_ptr<float>(), rows, hidden, fixed);
      Tensor qkv = linear(h, w[1], s.width());
      rope_and_store(qkv.data_ptr<float>(), positions.data_ptr<int64_t>() + r0,
                     rope_table.data_ptr<float>(), cache.data_ptr<float>() + block, s);
      Tensor attended = at::empty({rows, heads * s.head_dim}, x.options());
      attention(qkv.data_ptr<float>(), cache.data_ptr<float>() + block,
                padded ? mask.data_ptr<bool>() + r0 * mask.size(1) : nullptr, mask.size(1),
                static_cast<float>(scalars[3 * l + 2]), attended.data_ptr<float>(), s, fixed);
      linear(attended, w[2], hidden, &x);
      rms_norm(x.data_ptr<float>(), w[3].data_ptr<float>(),
               static_cast<float>(scalars[3 * l + 1]), h.data_ptr<float>(), rows, hidden, fixed);
      const int64_t inner = w[5].size(w[5].dim() - 2);  // down's inputs
      Tensor gate_up = linear(h, w[4], 2 * inner);
      Tensor act;
      if (fixed) {  // the same elementwise code for every row (silu_mul_fixed)
        act = at::empty({rows, inner}, x.options());
        const float* gu = gate_up.data_ptr<float>();
        float* o = act.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r) silu_mul_fixed(gu + r * 2 * inner, inner, o + r * inner);
      } else {
        act = at::silu(gate_up.narrow(1, 0, inner)).mul_(gate_up.narrow(1, inner, inner));
      }
      linear(act, w[5], hidden, &x);
    }
    rms_norm(x.data_ptr<float>(), final_norm.data_ptr<float>(), static_cast<float>(final_eps),
             h.data_ptr<float>(), rows, hidden, fixed);
    if (fixed) {
      const int64_t vocab = lm_head_t.size(1);  // (plain [hidden, vocab], checked by the caller)
      const Panels head{lm_head_t.data_ptr<float>(), vocab, vocab, 64};
      matvec_rows(h.data_ptr<float>(), rows, hidden, head, logits.data_ptr<float>(), false);
    } else {
      at::mm_out(logits, h, lm_head_t);
    }
  }
};

// `weights`: per layer norm1, qkv_t [hidden, (H+2KV)d], o_t [Hd, hidden], norm2,
// gate_up_t [hidden, 2I], down_t [I, hidden] (each projection's weight transposed: views for
// MKL, contiguous copies for `fixed`); `scalars`: per layer eps1, eps2, scaling. `lm_head_t`
// [hidden, vocab], likewise.
// `caches`: per layer [rows, kv_heads, 2, capacity, d]; writes column `col` of each.
// `min_block_rows`: the fewest rows a pool thread takes (fused_decode.MIN_BLOCK_ROWS).
Tensor decode_step(const Tensor& tokens, const Tensor& positions, const std::vector<Tensor>& weights,
                   const std::vector<double>& scalars, const std::vector<Tensor>& caches,
                   const Tensor& mask, bool padded, const Tensor& rope_table,
                   const Tensor& embed, const Tensor& final_norm, double final_eps,
                   const Tensor& lm_head_t, int64_t heads, int64_t kv_heads, int64_t col,
                   int64_t min_block_rows, bool fixed) {
  TORCH_CHECK(weights.size() == 6 * caches.size() && scalars.size() == 3 * caches.size(),
              "fused decode: 6 weights and 3 scalars per layer");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
              tokens.is_contiguous() && positions.is_contiguous(),
              "fused decode: tokens and positions must be contiguous int64");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.size(1) > col,
              "fused decode: the mask must be contiguous bool with a column ", col);
  check(rope_table, "the RoPE table");
  check(final_norm, "the final norm");
  const at::NoGradGuard no_grad;  // a decode step never trains
  const int64_t rows = tokens.size(0);
  TORCH_CHECK(positions.size(0) == rows, "fused decode: one position per row");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)  // (the table is read unchecked below)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < rope_table.size(0), "fused decode: position ", pos[r],
                " is outside the RoPE table (", rope_table.size(0), " rows)");
  for (size_t l = 0; l < caches.size(); ++l) {
    check(caches[l], "a KV cache layer");
    check(weights[6 * l], "a norm weight");
    check(weights[6 * l + 3], "a norm weight");
    TORCH_CHECK(caches[l].size(0) == rows && caches[l].size(1) == kv_heads &&
                col < caches[l].size(3), "fused decode: a KV cache layer of the wrong shape");
  }
  Tensor x = embed.index_select(0, tokens);
  Tensor logits = at::empty({rows, lm_head_t.size(1)}, x.options());
  if (fixed) {  // (the fixed chains read them unchecked)
    for (const Tensor& w : weights) check(w, "a weight of the fixed step");
    check(lm_head_t, "the fixed step's lm_head");
    TORCH_CHECK(lm_head_t.dim() == 2 && lm_head_t.size(0) == x.size(1),
                "fused decode: the fixed step's lm_head must be [hidden, vocab]");
  }
  const Step step{weights, scalars, caches, positions, mask, rope_table, final_norm, lm_head_t,
                  padded, final_eps, heads, kv_heads, col, fixed};
  const at::ThreadLocalState caller;  // inference and grad mode are per thread
  // blocks of at least `min_block_rows` rows: below that a second thread costs more than it
  // saves
  at::parallel_for(0, rows, min_block_rows, [&](int64_t r0, int64_t r1) {
    const at::ThreadLocalStateGuard as_caller(caller);
    step.run(x.narrow(0, r0, r1 - r0), logits.narrow(0, r0, r1 - r0), r0, r1);
  });
  return logits;
}

// sampling.sample_tokens for rows without top-p/top-k, in one call rather than ~12 aten ops:
// softmax(logits / divisor) in float32, the token where its CDF passes `uniform` x total
// (the first with cdf > u * total, never a zero-probability one), the argmax for greedy rows
// (all when `uniform` is undefined); returns (tokens, their log-probs).
std::tuple<Tensor, Tensor> sample_rows(const Tensor& logits, const c10::optional<Tensor>& divisor,
                                       const c10::optional<Tensor>& uniform,
                                       const c10::optional<Tensor>& greedy) {
  check(logits, "the logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  for (const auto* t : {&divisor, &uniform, &greedy})
    TORCH_CHECK(!t->has_value() || ((*t)->numel() == rows && (*t)->is_contiguous() &&
                                    (*t)->device().is_cpu()),
                "fused sampling: one contiguous CPU value per row");
  TORCH_CHECK(!divisor || divisor->scalar_type() == at::kFloat, "fused sampling: float divisor");
  TORCH_CHECK(!uniform || uniform->scalar_type() == at::kFloat, "fused sampling: float uniform");
  TORCH_CHECK(!greedy || greedy->scalar_type() == at::kBool, "fused sampling: bool greedy");
  Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  Tensor logps = at::empty({rows}, logits.options());
  const float* all = logits.data_ptr<float>();
  std::vector<float> logp(vocab), probs(vocab);
  for (int64_t r = 0; r < rows; ++r) {
    const float* z = all + r * vocab;
    const float div = divisor ? divisor->data_ptr<float>()[r] : 1.f;
    float best = -INFINITY;
    int64_t argmax = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      logp[i] = z[i] / div;
      if (logp[i] > best) best = logp[i], argmax = i;
    }
    double total = 0.0;
    for (int64_t i = 0; i < vocab; ++i) total += std::exp(logp[i] - best);
    const float log_total = static_cast<float>(std::log(total));
    for (int64_t i = 0; i < vocab; ++i) logp[i] = (logp[i] - best) - log_total;
    int64_t token = argmax;  // (dividing by a positive temperature keeps the argmax)
    if (uniform && !(greedy && greedy->data_ptr<bool>()[r])) {
      double mass = 0.0;
      for (int64_t i = 0; i < vocab; ++i) mass += (probs[i] = std::exp(logp[i]));
      const double target = uniform->data_ptr<float>()[r] * mass;
      double cdf = 0.0;
      token = vocab - 1;
      for (int64_t i = 0; i < vocab; ++i) {
        cdf += probs[i];
        if (cdf > target) {
          token = i;
          break;
        }
      }
      if (probs[token] == 0.f) token = argmax;  // rounding past the last real token
    }
    tokens.data_ptr<int64_t>()[r] = token;
    logps.data_ptr<float>()[r] = logp[token];
  }
  return {tokens, logps};
}

// Up to `steps` tokens per row without returning to Python: decode_step then sample_rows,
// feeding each step's tokens to the next, for a batch whose rows need nothing from Python
// between tokens (no stop strings, no top-p/top-k). Step s writes cache column col + s and
// marks it real in `mask` (capacity for all `steps` is the caller's). It stops after the
// first step at which a `live` row finishes, so that the caller sees every finish at the
// token it happens: the row drew one of its `stop_ids` ([rows, n], -1 pads) or used the last
// of its `left` tokens. `uniforms`: [steps, rows]. Returns (tokens, log-probs), each
// [steps taken, rows].
std::tuple<Tensor, Tensor> decode_steps(
    const Tensor& tokens, const Tensor& positions, const std::vector<Tensor>& weights,
    const std::vector<double>& scalars, const std::vector<Tensor>& caches, Tensor mask,
    bool padded, const Tensor& rope_table, const Tensor& embed, const Tensor& final_norm,
    double final_eps, const Tensor& lm_head_t, int64_t heads, int64_t kv_heads, int64_t col,
    int64_t min_block_rows, bool fixed, int64_t steps, const c10::optional<Tensor>& divisor,
    const c10::optional<Tensor>& uniforms, const c10::optional<Tensor>& greedy,
    const Tensor& live, const Tensor& left, const Tensor& stop_ids) {
  const int64_t rows = tokens.size(0);
  TORCH_CHECK(steps >= 1 && col + steps <= mask.size(1), "fused decode: no room for ", steps,
              " steps after column ", col);
  TORCH_CHECK(!uniforms || (uniforms->size(0) >= steps && uniforms->size(1) == rows &&
                            uniforms->is_contiguous()),
              "fused decode: uniforms must be [steps, rows] and contiguous");
  TORCH_CHECK(live.scalar_type() == at::kBool && live.numel() == rows && live.is_contiguous() &&
              left.scalar_type() == at::kLong && left.numel() == rows && left.is_contiguous() &&
              stop_ids.scalar_type() == at::kLong && stop_ids.dim() == 2 &&
              stop_ids.size(0) == rows && stop_ids.is_contiguous(),
              "fused decode: live (bool), left (int64) and stop_ids (int64 [rows, n]) per row");
  Tensor out_tokens = at::empty({steps, rows}, tokens.options());
  Tensor out_logps = at::empty({steps, rows}, embed.options());
  Tensor current = tokens.contiguous(), pos = positions.clone();
  bool* real = mask.data_ptr<bool>();
  const bool* alive = live.data_ptr<bool>();
  const int64_t *budget = left.data_ptr<int64_t>(), *stops = stop_ids.data_ptr<int64_t>();
  const int64_t n_stops = stop_ids.size(1);
  int64_t taken = 0;
  bool finished = false;
  while (taken < steps && !finished) {
    for (int64_t r = 0; r < rows; ++r) real[r * mask.size(1) + col + taken] = true;
    Tensor logits = decode_step(current, pos, weights, scalars, caches, mask, padded, rope_table,
                                embed, final_norm, final_eps, lm_head_t, heads, kv_heads,
                                col + taken, min_block_rows, fixed);
    c10::optional<Tensor> uniform;
    if (uniforms) uniform = uniforms->select(0, taken);
    auto [drawn, logps] = sample_rows(logits, divisor, uniform, greedy);
    out_tokens.select(0, taken).copy_(drawn);
    out_logps.select(0, taken).copy_(logps);
    current = drawn;
    pos.add_(1);
    ++taken;
    const int64_t* token = drawn.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows && !finished; ++r) {
      if (!alive[r]) continue;
      finished = budget[r] <= taken;
      for (int64_t j = 0; j < n_stops && !finished; ++j) finished = stops[r * n_stops + j] == token[r];
    }
  }
  return {out_tokens.narrow(0, 0, taken), out_logps.narrow(0, 0, taken)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_step", &decode_step, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sample_rows", &sample_rows, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("decode_steps", &decode_steps, pybind11::call_guard<pybind11::gil_scoped_release>());
}
