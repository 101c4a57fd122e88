// One Llama decode step (float32, CPU) in a single call: see engines/inference/fused_decode.py.
//
// The Python step (kv_decode.LlamaDecoder) issues ~140 aten calls a step; at batch 64 on
// the example model their dispatch, the temporaries between them and a thread-pool wake-up
// per op cost more than the matmuls. Here the matmuls stay ATen's (MKL/oneDNN), and
// everything between them runs as plain loops over the same buffers: RMS norm, RoPE and the
// cache write in one pass, attention in one pass per (row, kv head) over its keys and
// values. Rows never meet in a decode step, so each pool thread takes a block of rows
// through the whole step: one wake-up of the pool a step. The arithmetic is the same as
// HF's Llama in float32 (summation order aside): log-probs stay within 1e-6 of it.
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
// order written out here, 16 lanes then a fixed tree, whatever the row's address, the batch
// size or the thread; a compiler may vectorise it but not reorder it (no -ffast-math), so a
// row's numbers depend on that row alone. MKL's matmuls pick kernels by the batch's shape.
constexpr int64_t kLanes = 16;

inline float lanes_sum(const float* acc) {
  float half[kLanes / 2];
  for (int64_t l = 0; l < kLanes / 2; ++l) half[l] = acc[l] + acc[l + kLanes / 2];
  float quarter[kLanes / 4];
  for (int64_t l = 0; l < kLanes / 4; ++l) quarter[l] = half[l] + half[l + kLanes / 4];
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

// Each lane a chain of fused multiply-adds (written out, not left to the compiler's
// contraction), so the vector paths below (tile_fixed, dots16_fixed) give the same bits.
inline float dot_fixed(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] = __builtin_fmaf(a[i + l], b[i + l], acc[l]);
  for (int64_t l = 0; i + l < n; ++l) acc[l] = __builtin_fmaf(a[i + l], b[i + l], acc[l]);
  return lanes_sum(acc);
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

// R rows x C outputs of y = a . w^T (y's rows `ldy` apart): each output element's sum runs in
// dot_fixed's order (16 lanes along n, each lane a chain of fused multiply-adds, then
// lanes_sum) whatever R and C are, so a row's numbers do not depend on the rows processed
// beside it. The tile shares loads (each row's values serve C outputs, each weight row's R
// rows) and, with AVX-512 at 4 x 4, runs the 16 outputs' lanes_sum trees side by side
// across registers (lanes_sum16) instead of one lane at a time.
template <int R, int C>
inline void tile_fixed(const float* x, int64_t n, const float* w, float* y, int64_t ldy,
                       bool accumulate) {
  static_assert(kLanes == 16, "one AVX-512 register of lanes");
  __m512 c[R][C];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < C; ++k) c[r][k] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    // each row's and weight row's values loaded once, held in registers: left to itself
    // GCC folds the loads of one side into each multiply-add that uses them (R x C loads an
    // iteration instead of R + C), and the tile waited on its loads (bench/RESULTS.md,
    // "Deterministic mode")
    __m512 xv[R], wv[C];
    for (int r = 0; r < R; ++r) {
      xv[r] = _mm512_loadu_ps(x + r * n + i);
      asm("" : "+v"(xv[r]));
    }
    for (int k = 0; k < C; ++k) {
      wv[k] = _mm512_loadu_ps(w + k * n + i);
      asm("" : "+v"(wv[k]));
    }
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < C; ++k) c[r][k] = _mm512_fmadd_ps(xv[r], wv[k], c[r][k]);
  }
  if constexpr (R == 4 && C == 4) {
    if (i == n) {  // (n a multiple of 16) the 16 sums at once, in lanes_sum's order
      const __m512 sums = lanes_sum16(&c[0][0]);  // row r's C = 4 outputs in lanes 4r..4r+3
      for (int r = 0; r < R; ++r) {
        __m128 out = r == 0 ? _mm512_castps512_ps128(sums)
                   : r == 1 ? _mm512_extractf32x4_ps(sums, 1)
                   : r == 2 ? _mm512_extractf32x4_ps(sums, 2)
                            : _mm512_extractf32x4_ps(sums, 3);
        if (accumulate) out = _mm_add_ps(_mm_loadu_ps(y + r * ldy), out);
        _mm_storeu_ps(y + r * ldy, out);
      }
      return;
    }
  }
  alignas(64) float acc[kLanes];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < C; ++k) {
      _mm512_store_ps(acc, c[r][k]);
      for (int64_t l = 0; i + l < n; ++l)
        acc[l] = __builtin_fmaf(x[r * n + i + l], w[k * n + i + l], acc[l]);
      const float d = lanes_sum(acc);
      float& out = y[r * ldy + k];
      out = accumulate ? out + d : d;
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

// R rows of `a` against every row of `w` [out, n]: four outputs a tile, then the rest singly.
template <int R>
void rows_fixed(const float* a, int64_t n, const float* w, int64_t out, float* y,
                bool accumulate) {
  int64_t j = 0;
  for (; j + 4 <= out; j += 4) tile_fixed<R, 4>(a, n, w + j * n, y + j, out, accumulate);
  for (; j < out; ++j) tile_fixed<R, 1>(a, n, w + j * n, y + j, out, accumulate);
}

// y[r, j] (+)= a[r, :] . w[j, :] for `rows` rows of `a` [rows, n] and `w` [out, n], in tiles
// of 4 rows, the last rows one at a time: the same numbers for every row either way.
void matvec_rows(const float* a, int64_t rows, int64_t n, const float* w, int64_t out, float* y,
                 bool accumulate) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) rows_fixed<4>(a + r * n, n, w, out, y + r * out, accumulate);
  for (; r < rows; ++r) rows_fixed<1>(a + r * n, n, w, out, y + r * out, accumulate);
}
#else
// y[r, j] (+)= a[r, :] . w[j, :] for `rows` rows of `a` [rows, n] and `w` [out, n]; four
// outputs at a time share the loads of a row, each with its own fixed-order accumulators.
void matvec_rows(const float* a, int64_t rows, int64_t n, const float* w, int64_t out, float* y,
                 bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = a + r * n;
    float* yr = y + r * out;
    int64_t j = 0;
    for (; j + 4 <= out; j += 4) {
      const float *w0 = w + j * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
      float c0[kLanes] = {}, c1[kLanes] = {}, c2[kLanes] = {}, c3[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) {
          const float v = x[i + l];
          c0[l] += v * w0[i + l];
          c1[l] += v * w1[i + l];
          c2[l] += v * w2[i + l];
          c3[l] += v * w3[i + l];
        }
      for (int64_t l = 0; i + l < n; ++l) {
        const float v = x[i + l];
        c0[l] += v * w0[i + l];
        c1[l] += v * w1[i + l];
        c2[l] += v * w2[i + l];
        c3[l] += v * w3[i + l];
      }
      const float d[4] = {lanes_sum(c0), lanes_sum(c1), lanes_sum(c2), lanes_sum(c3)};
      for (int64_t k = 0; k < 4; ++k) yr[j + k] = accumulate ? yr[j + k] + d[k] : d[k];
    }
    for (; j < out; ++j) {
      const float d = dot_fixed(x, w + j * n, n);
      yr[j] = accumulate ? yr[j] + d : d;
    }
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
  const Tensor &positions, &mask, &rope_table, &final_norm, &lm_head;
  bool padded;
  double final_eps;
  int64_t heads, kv_heads, col;
  bool fixed;  // batch-invariant: fixed-order loops instead of MKL's matmuls

  // a @ w.T (added to `into` when given), `w` [out, n] contiguous: MKL's or the fixed loops
  Tensor linear(const Tensor& a, const Tensor& w, Tensor* into = nullptr) const {
    if (!fixed) {
      if (into == nullptr) return at::mm(a, w.t());
      into->addmm_(a, w.t());
      return *into;
    }
    const Tensor in = a.contiguous();
    Tensor out = into != nullptr ? *into : at::empty({a.size(0), w.size(0)}, a.options());
    matvec_rows(in.data_ptr<float>(), in.size(0), in.size(1), w.data_ptr<float>(), w.size(0),
                out.data_ptr<float>(), into != nullptr);
    return out;
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
      Tensor qkv = linear(h, w[1]);
      rope_and_store(qkv.data_ptr<float>(), positions.data_ptr<int64_t>() + r0,
                     rope_table.data_ptr<float>(), cache.data_ptr<float>() + block, s);
      Tensor attended = at::empty({rows, heads * s.head_dim}, x.options());
      attention(qkv.data_ptr<float>(), cache.data_ptr<float>() + block,
                padded ? mask.data_ptr<bool>() + r0 * mask.size(1) : nullptr, mask.size(1),
                static_cast<float>(scalars[3 * l + 2]), attended.data_ptr<float>(), s, fixed);
      linear(attended, w[2].t(), &x);  // (o_t is a transposed view: .t() is o_proj's weight)
      rms_norm(x.data_ptr<float>(), w[3].data_ptr<float>(),
               static_cast<float>(scalars[3 * l + 1]), h.data_ptr<float>(), rows, hidden, fixed);
      Tensor gate_up = linear(h, w[4]);
      const int64_t inner = gate_up.size(1) / 2;
      Tensor act;
      if (fixed) {  // element by element, the same scalar code for every row
        act = at::empty({rows, inner}, x.options());
        const float* gu = gate_up.data_ptr<float>();
        float* o = act.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t i = 0; i < inner; ++i) {
            const float g = gu[r * 2 * inner + i], u = gu[r * 2 * inner + inner + i];
            o[r * inner + i] = g / (1.f + std::exp(-g)) * u;
          }
      } else {
        act = at::silu(gate_up.narrow(1, 0, inner)).mul_(gate_up.narrow(1, inner, inner));
      }
      linear(act, w[5].t(), &x);
    }
    rms_norm(x.data_ptr<float>(), final_norm.data_ptr<float>(), static_cast<float>(final_eps),
             h.data_ptr<float>(), rows, hidden, fixed);
    if (fixed) {
      matvec_rows(h.data_ptr<float>(), rows, hidden, lm_head.data_ptr<float>(), lm_head.size(0),
                  logits.data_ptr<float>(), false);
    } else {
      at::mm_out(logits, h, lm_head.t());
    }
  }
};

// `weights`: per layer norm1, qkv [(H+2KV)d, hidden], o_t [Hd, hidden] (a transposed view),
// norm2, gate_up [2I, hidden], down_t [I, hidden]; `scalars`: per layer eps1, eps2, scaling.
// `caches`: per layer [rows, kv_heads, 2, capacity, d]; writes column `col` of each.
// `min_block_rows`: the fewest rows a pool thread takes (fused_decode.MIN_BLOCK_ROWS).
Tensor decode_step(const Tensor& tokens, const Tensor& positions, const std::vector<Tensor>& weights,
                   const std::vector<double>& scalars, const std::vector<Tensor>& caches,
                   const Tensor& mask, bool padded, const Tensor& rope_table,
                   const Tensor& embed, const Tensor& final_norm, double final_eps,
                   const Tensor& lm_head, int64_t heads, int64_t kv_heads, int64_t col,
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
  Tensor logits = at::empty({rows, lm_head.size(0)}, x.options());
  TORCH_CHECK(!fixed || lm_head.is_contiguous(), "fused decode: lm_head must be contiguous");
  const Step step{weights, scalars, caches, positions, mask, rope_table, final_norm, lm_head,
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
    double final_eps, const Tensor& lm_head, int64_t heads, int64_t kv_heads, int64_t col,
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
                                embed, final_norm, final_eps, lm_head, heads, kv_heads,
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
