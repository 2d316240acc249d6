// Segment attention over vLLM's CPU KV cache ("vec" or "amx" layout) or a token-major KV
// pool (SGLang's, "nhd"), with log-sum-exp.
//
// One call attends a list of segments. A segment is a token range of KV blocks (or, in a
// token-major pool, a list of token slots) attended by one or more query rows: a prefix
// group (all of the group's decode queries over the group's shared prefix) or one
// request's suffix. Every (segment, KV head) is one work item; it reads each KV block once
// for all of the segment's query rows, which is the point: a prefix group's KV is read
// once per step instead of once per request.
//
// Layouts read (vLLM 0.32 CPU_ATTN): the layer cache is
// [num_blocks, kv_heads, block_size, 2 * head_dim]; within one (block, head) the first
// block_size * head_dim elements are K and the next block_size * head_dim are V.
// * isa "vec": K column-major ([head_dim][block_size]), V row-major ([block_size][head_dim]).
// * isa "amx" (bf16 on CPUs with AMX; vLLM's reshape_and_cache in cpu_attn_amx.hpp): K in
//   groups of 16 tokens, each [head_dim / 2][16 tokens] of (d, d + 1) pairs, so one 64-byte
//   row is the pairs of 16 tokens for two dims; V in groups of 16 dims, each
//   [block_size / 2][16 dims] of (t, t + 1) pairs, so one 64-byte row is two tokens' 16
//   dims interleaved.
// * "nhd" (SGLang 0.5.23's MHATokenToKVPool): separate K and V buffers [slots, kv_heads,
//   head_dim], a token slot every ``kv_token_stride`` elements; a segment's "blocks" are
//   its token slots (one per token, e.g. a run of SGLang's req_to_token row). Each run of
//   kPack tokens is gathered into one "vec" block in the work item's scratch and attended
//   by the same block loop as vLLM's caches.
//
// Outputs are fp32 partials normalised over the segment's tokens plus their natural-log
// LSE (-inf, with a zero output, for a segment of no tokens), ready for an exact merge.
// Numerics: scores and accumulators in fp32 from the cache's own values (bf16 and fp16
// are widened exactly), as vLLM's vec kernel does; no value is rounded below fp32.
//
// Built at run time with the host's compiler (-march=native). With AVX-512F each block is
// attended in registers (``attend_block``, first version); without, by a portable loop
// that is exact but no faster than vLLM's kernel (``feather_kernel_vectorized`` says which
// was built, so the caller can leave the path off where it would not pay).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

enum DType : int32_t { F32 = 0, BF16 = 1, F16 = 2 };
enum Layout : int32_t { VEC = 0, AMX = 1, NHD = 2 };

// Offsets of K(d, t) and V(t, d) from the start of a (block, head)'s K and V.
template <int LO>
inline int64_t k_offset(int d, int t, int block_size, int head_dim) {
  if constexpr (LO == AMX) {
    return 2 * ((t / 16) * 8 * static_cast<int64_t>(head_dim) + (d / 2) * 16 + t % 16) + d % 2;
  } else {
    return static_cast<int64_t>(d) * block_size + t;
  }
}

template <int LO>
inline int64_t v_offset(int t, int d, int block_size, int head_dim) {
  if constexpr (LO == AMX) {
    return (d / 16) * 16 * static_cast<int64_t>(block_size) + (t / 2) * 32 + (d % 16) * 2 + t % 2;
  } else {
    return static_cast<int64_t>(t) * head_dim + d;
  }
}

// IEEE half to float, exactly (subnormals included).
inline float half_to_float(uint16_t h) {
  const uint32_t exponent = (h >> 10) & 0x1F;
  const uint32_t mantissa = h & 0x3FF;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN()
                         : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400), static_cast<int>(exponent) - 25);
  }
  return (h & 0x8000) ? -magnitude : magnitude;
}

template <int DT>
inline float load1(const void* base, int64_t offset) {
  if constexpr (DT == F32) {
    return static_cast<const float*>(base)[offset];
  } else {
    const uint16_t raw = static_cast<const uint16_t*>(base)[offset];
    if constexpr (DT == BF16) {
      const uint32_t bits = static_cast<uint32_t>(raw) << 16;
      float value;
      std::memcpy(&value, &bits, sizeof value);
      return value;
    } else {
      return half_to_float(raw);
    }
  }
}

struct Geometry {
  int32_t kv_heads, block_size, head_dim, gqa;
  int64_t q_token_stride;  // elements between query tokens
  float scale;
  int64_t kv_token_stride;  // "nhd": elements between token slots of the K and V buffers
  bool tiles;               // "amx": multiply in tiles (``attend_block_tiles``)
};

constexpr int kPack = 64;  // "nhd": tokens gathered into one block of the scratch
constexpr int kChunkRows = 32;  // tiles: rows one pass over a block takes
constexpr int kMinTileRows = 8;  // fewer rows multiply in registers (tiles pad them to 16)

// Tiles: elements between rows of the probabilities' bf16 parts, a block's tokens in whole
// 32-token steps (the same for every block, so padding rows stay zero).
constexpr int probability_width(int block_size) { return (block_size + 31) / 32 * 32; }

template <int DT>
using Element = std::conditional_t<DT == F32, float, uint16_t>;

// Per-row softmax state of one work item, plus scratch, reused across calls.
struct Scratch {
  std::vector<float> q, acc, max, sum, scores;
  std::vector<int32_t> q_pairs;  // bf16 queries as (d, d+1) pairs, for vdpbf16ps and tiles
  std::vector<float> packed;     // "nhd": one gathered block of K then V (any dtype)
  std::vector<uint16_t> p_high, p_low;  // tiles: probabilities as bf16 high + low parts
  std::vector<uint16_t> v_tail;         // tiles: a block's last token pairs, zero-padded

  // ``padded_rows`` (rows rounded up to a tile's 16 where tiles multiply, else rows): the
  // padding rows of the bf16 query and of the accumulator are zeros.
  void reset(int rows, int padded_rows, int head_dim, int block_size, int score_rows) {
    q.resize(static_cast<size_t>(rows) * head_dim);
    q_pairs.assign(static_cast<size_t>(padded_rows) * head_dim / 2, 0);
    acc.assign(static_cast<size_t>(padded_rows) * head_dim, 0.0f);
    max.assign(rows, -std::numeric_limits<float>::infinity());
    sum.assign(rows, 0.0f);
    scores.resize(static_cast<size_t>(score_rows) * block_size);
  }
};

template <int DT>
constexpr int64_t element_bytes() {
  return DT == F32 ? 4 : 2;
}

// Where one KV head's K and V of one block start (2 * block_size * head_dim elements).
template <int DT>
const char* block_start(const Geometry& g, const void* cache, int32_t block, int kv_head) {
  return static_cast<const char*>(cache) +
         (static_cast<int64_t>(block) * g.kv_heads + kv_head) * 2 * g.block_size * g.head_dim *
             element_bytes<DT>();
}

#ifdef __AVX512F__

constexpr int kTokenTile = 16;  // tokens per QK vector (one zmm of fp32 scores)
constexpr int kRowTile = 16;    // query rows whose scores one QK pass computes
constexpr int kPvRows = 6;      // query rows one PV pass accumulates (6 x 4 zmm)
constexpr int kPvVecs = 4;      // head_dim columns per PV pass, in zmm (64 floats)

template <int DT>
inline __m512 load16(const void* base, int64_t offset) {
  if constexpr (DT == F32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + offset);
  } else if constexpr (DT == BF16) {
    __m256i raw = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + offset));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    __m256i raw = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + offset));
    return _mm512_cvtph_ps(raw);
  }
}

template <int DT>
inline __m512 load16_masked(const void* base, int64_t offset, __mmask16 mask) {
  if constexpr (DT == F32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(base) + offset);
  } else {
    __m256i raw = _mm256_maskz_loadu_epi16(
        mask, static_cast<const uint16_t*>(base) + offset);
    if constexpr (DT == BF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    } else {
      return _mm512_cvtph_ps(raw);
    }
  }
}

// exp(x) for x <= 0 (scores minus their running max): Cody-Waite reduction and a
// degree-6 polynomial, within 2 ulp; underflows to 0 below -87.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

// The (low, high) bf16 of each 32-bit lane of ``pairs``, widened exactly to fp32: a K row
// of the "amx" layout holds dims (d, d + 1) of 16 tokens, a V row tokens (t, t + 1).
inline void split_bf16_pairs(__m512i pairs, __m512& low, __m512& high) {
  low = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
  high = _mm512_castsi512_ps(
      _mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

#ifdef __AVX512BF16__
constexpr bool kBf16Dot = true;  // bf16 pairs multiplied exactly, summed in fp32 (vdpbf16ps)
#else
constexpr bool kBf16Dot = false;
#endif

// scores[r][t] = scale * q[r] . K[t] for the tile's rows and the block's first n tokens,
// NT token tiles of 16 at a time (two where rows are few: more independent sums in flight,
// each broadcast query pair used twice). Meanwhile it prefetches ``prefetch_bytes`` from
// ``prefetch`` into L2, spread evenly over the (token tiles, head_dim) steps: the next
// block's K and V, which a random block order would otherwise leave to DRAM latency (the K
// loads stride by block_size, which the hardware prefetcher follows only within a block).
// A bf16 cache on a CPU with AVX512_BF16 takes head_dim in pairs (vdpbf16ps: exact bf16
// products, fp32 sums), at twice the FMA rate; the "amx" layout stores K as those pairs.
template <int DT, int LO, int NR, int NT>
void tile_scores(const float* q, const int32_t* q_pairs, int head_dim, const void* cache,
                 int64_t k_base, int block_size, int n, float scale, float* scores,
                 const char* prefetch, int64_t prefetch_bytes) {
  static_assert(LO == VEC || DT == BF16, "the amx layout holds bf16");
  constexpr bool pairs = DT == BF16 && kBf16Dot;
  constexpr int d_step = pairs || LO == AMX ? 2 : 1;
  constexpr int span = NT * kTokenTile;
  const int64_t steps = static_cast<int64_t>((n + span - 1) / span) * (head_dim / d_step);
  const int64_t stride = 64 * ((prefetch_bytes / 64 + steps - 1) / steps);
  int64_t line = 0;
  for (int t0 = 0; t0 < n; t0 += span) {
    __mmask16 mask[NT];
    for (int j = 0; j < NT; ++j) {
      const int left = n - t0 - j * kTokenTile;
      mask[j] = left >= kTokenTile ? 0xFFFF
                : left > 0         ? static_cast<__mmask16>((1u << left) - 1) : 0;
    }
    __m512 acc[NT][NR];
    for (int j = 0; j < NT; ++j)
      for (int r = 0; r < NR; ++r) acc[j][r] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d += d_step) {
      for (int j = 0; j < NT; ++j) {
        const int64_t row = k_base + k_offset<LO>(d, t0 + j * kTokenTile, block_size, head_dim);
        if constexpr (LO == AMX) {
          // [K(d, t), K(d+1, t)] for the tile's 16 tokens, as stored.
          const __m512i both = _mm512_maskz_loadu_epi32(
              mask[j], static_cast<const uint16_t*>(cache) + row);
          if constexpr (pairs) {
#ifdef __AVX512BF16__
            for (int r = 0; r < NR; ++r) {
              acc[j][r] = _mm512_dpbf16_ps(
                  acc[j][r], (__m512bh)_mm512_set1_epi32(q_pairs[(r * head_dim + d) / 2]),
                  (__m512bh)both);
            }
#endif
          } else {
            __m512 even, odd;
            split_bf16_pairs(both, even, odd);
            for (int r = 0; r < NR; ++r) {
              acc[j][r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * head_dim + d]), even, acc[j][r]);
              acc[j][r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * head_dim + d + 1]), odd,
                                          acc[j][r]);
            }
          }
        } else if constexpr (pairs) {
#ifdef __AVX512BF16__
          const uint16_t* k = static_cast<const uint16_t*>(cache);
          const __m512i both = _mm512_inserti64x4(
              _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask[j], k + row)),
              _mm256_maskz_loadu_epi16(mask[j], k + row + block_size), 1);
          // [K(d, t), K(d+1, t)] for the tile's 16 tokens: the pairs vdpbf16ps sums.
          const __m512i interleave = _mm512_set_epi16(
              31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
          const __m512bh kd = (__m512bh)_mm512_permutexvar_epi16(interleave, both);
          for (int r = 0; r < NR; ++r) {
            acc[j][r] = _mm512_dpbf16_ps(
                acc[j][r], (__m512bh)_mm512_set1_epi32(q_pairs[(r * head_dim + d) / 2]), kd);
          }
#endif
        } else {
          const __m512 k = load16_masked<DT>(cache, row, mask[j]);
          for (int r = 0; r < NR; ++r) {
            acc[j][r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * head_dim + d]), k, acc[j][r]);
          }
        }
      }
      for (const int64_t end = line + stride; line < end && line < prefetch_bytes; line += 64) {
        _mm_prefetch(prefetch + line, _MM_HINT_T1);
      }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int j = 0; j < NT; ++j) {
      if (!mask[j]) continue;
      for (int r = 0; r < NR; ++r) {
        _mm512_storeu_ps(scores + r * block_size + t0 + j * kTokenTile,
                         _mm512_mul_ps(acc[j][r], s));
      }
    }
  }
}

// Rows of at most kPairedRows take two token tiles a pass.
constexpr int kPairedRows = 8;

template <int DT, int LO>
void scores_dispatch(int rows, const float* q, const int32_t* q_pairs, int head_dim,
                     const void* cache, int64_t k_base, int block_size, int n, float scale,
                     float* scores, const char* prefetch, int64_t prefetch_bytes) {
  switch (rows) {
#define FEATHER_ROWS(R)                                                                    \
  case R:                                                                                  \
    return tile_scores<DT, LO, R, (R <= kPairedRows ? 2 : 1)>(                             \
        q, q_pairs, head_dim, cache, k_base, block_size, n, scale, scores, prefetch,       \
        prefetch_bytes);
    FEATHER_ROWS(1) FEATHER_ROWS(2) FEATHER_ROWS(3) FEATHER_ROWS(4) FEATHER_ROWS(5)
    FEATHER_ROWS(6) FEATHER_ROWS(7) FEATHER_ROWS(8) FEATHER_ROWS(9) FEATHER_ROWS(10)
    FEATHER_ROWS(11) FEATHER_ROWS(12) FEATHER_ROWS(13) FEATHER_ROWS(14) FEATHER_ROWS(15)
    FEATHER_ROWS(16)
#undef FEATHER_ROWS
  }
}

// The first ``count`` of a vector's 16 lanes (none where ``count`` <= 0).
inline __mmask16 first_lanes(int count) {
  return count >= kTokenTile ? 0xFFFF
         : count > 0         ? static_cast<__mmask16>((1u << count) - 1) : 0;
}

// The largest of a block row's ``n`` scores.
inline float row_max(const float* s, int n) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int t0 = 0; t0 < n; t0 += kTokenTile) {
    const __mmask16 mask = first_lanes(n - t0);
    vmax = _mm512_mask_max_ps(vmax, mask, vmax, _mm512_maskz_loadu_ps(mask, s + t0));
  }
  return _mm512_reduce_max_ps(vmax);
}

// A row's running max and sum move to ``new_max`` after a block whose probabilities
// (against ``new_max``) sum to ``block_sum``; its accumulator is rescaled to match.
inline void advance_row(float& max, float& sum, float* acc, int head_dim, float new_max,
                        float block_sum) {
  const float alpha = std::exp(max - new_max);  // 0 when max is -inf
  sum = sum * alpha + block_sum;
  max = new_max;
  if (alpha != 1.0f) {
    const __m512 va = _mm512_set1_ps(alpha);
    for (int d = 0; d < head_dim; d += 16) {
      _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), va));
    }
  }
}

// Online softmax over one block: scores become probabilities against the updated running
// max; the running sum and the accumulated output are rescaled to that max.
void softmax_block(int rows, int n, int block_size, int head_dim, float* scores, float* max,
                   float* sum, float* acc) {
  for (int r = 0; r < rows; ++r) {
    float* s = scores + r * block_size;
    const float block_max = row_max(s, n);
    const float new_max = block_max > max[r] ? block_max : max[r];
    const __m512 shift = _mm512_set1_ps(new_max);
    __m512 vsum = _mm512_setzero_ps();
    for (int t0 = 0; t0 < n; t0 += kTokenTile) {
      const __mmask16 mask = first_lanes(n - t0);
      const __m512 p = _mm512_maskz_mov_ps(
          mask, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t0), shift)));
      _mm512_mask_storeu_ps(s + t0, mask, p);
      vsum = _mm512_add_ps(vsum, p);
    }
    advance_row(max[r], sum[r], acc + r * head_dim, head_dim, new_max,
                _mm512_reduce_add_ps(vsum));
  }
}

// acc[r][cols] += sum_t p[r][t] * V[t][cols] for NR rows and NV zmm of columns.
template <int DT, int LO, int NR, int NV>
void tile_values(const float* probs, int block_size, const void* cache, int64_t v_base,
                 int head_dim, int n, int col0, float* acc) {
  __m512 a[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = _mm512_loadu_ps(acc + r * head_dim + col0 + 16 * j);
  if constexpr (LO == AMX) {
    // One 64-byte row holds tokens t and t + 1 (t even) for 16 dims, interleaved.
    for (int t = 0; t < n; t += 2) {
      __m512 even[NV], odd[NV];
      for (int j = 0; j < NV; ++j) {
        split_bf16_pairs(_mm512_loadu_si512(static_cast<const uint16_t*>(cache) + v_base +
                                            v_offset<LO>(t, col0 + 16 * j, block_size,
                                                         head_dim)),
                         even[j], odd[j]);
      }
      for (int r = 0; r < NR; ++r) {
        const __m512 p = _mm512_set1_ps(probs[r * block_size + t]);
        for (int j = 0; j < NV; ++j) a[r][j] = _mm512_fmadd_ps(p, even[j], a[r][j]);
      }
      if (t + 1 < n) {
        for (int r = 0; r < NR; ++r) {
          const __m512 p = _mm512_set1_ps(probs[r * block_size + t + 1]);
          for (int j = 0; j < NV; ++j) a[r][j] = _mm512_fmadd_ps(p, odd[j], a[r][j]);
        }
      }
    }
  } else {
    for (int t = 0; t < n; ++t) {
      __m512 v[NV];
      for (int j = 0; j < NV; ++j) {
        v[j] = load16<DT>(cache, v_base + static_cast<int64_t>(t) * head_dim + col0 + 16 * j);
      }
      for (int r = 0; r < NR; ++r) {
        const __m512 p = _mm512_set1_ps(probs[r * block_size + t]);
        for (int j = 0; j < NV; ++j) a[r][j] = _mm512_fmadd_ps(p, v[j], a[r][j]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + r * head_dim + col0 + 16 * j, a[r][j]);
}

template <int DT, int LO, int NV>
void values_rows(int rows, const float* probs, int block_size, const void* cache, int64_t v_base,
                 int head_dim, int n, int col0, float* acc) {
  switch (rows) {
#define FEATHER_PV(R) \
  case R:             \
    return tile_values<DT, LO, R, NV>(probs, block_size, cache, v_base, head_dim, n, col0, acc);
    FEATHER_PV(1) FEATHER_PV(2) FEATHER_PV(3) FEATHER_PV(4) FEATHER_PV(5) FEATHER_PV(6)
#undef FEATHER_PV
  }
}

template <int DT, int LO>
void tile_values_all(int rows, const float* probs, int block_size, const void* cache,
                     int64_t v_base, int head_dim, int n, float* acc) {
  for (int r0 = 0; r0 < rows; r0 += kPvRows) {
    const int nr = rows - r0 < kPvRows ? rows - r0 : kPvRows;
    const float* p = probs + r0 * block_size;
    float* a = acc + r0 * head_dim;
    for (int col0 = 0; col0 < head_dim; col0 += 16 * kPvVecs) {
      const int nv = (head_dim - col0) / 16 < kPvVecs ? (head_dim - col0) / 16 : kPvVecs;
#define FEATHER_COLS(V) \
  values_rows<DT, LO, V>(nr, p, block_size, cache, v_base, head_dim, n, col0, a)
      switch (nv) {
        case 1: FEATHER_COLS(1); break;
        case 2: FEATHER_COLS(2); break;
        case 3: FEATHER_COLS(3); break;
        default: FEATHER_COLS(4);
      }
#undef FEATHER_COLS
    }
  }
}


// Every row of the work item over one block of n tokens: scores, online softmax, values,
// a tile of kRowTile rows at a time; the next block is prefetched meanwhile.
template <int DT, int LO>
void attend_block(const Geometry& g, const void* cache, Scratch& w, int rows, int64_t k_base,
                  int n, const char* next, int64_t block_bytes) {
  const int D = g.head_dim;
  const int64_t block_elems = static_cast<int64_t>(g.block_size) * D;
  for (int r0 = 0; r0 < rows; r0 += kRowTile) {
    const int nr = rows - r0 < kRowTile ? rows - r0 : kRowTile;
    scores_dispatch<DT, LO>(nr, w.q.data() + r0 * D, w.q_pairs.data() + r0 * D / 2, D, cache,
                            k_base, g.block_size, n, g.scale, w.scores.data(), next,
                            r0 == 0 && next ? block_bytes : 0);
    softmax_block(nr, n, g.block_size, D, w.scores.data(), w.max.data() + r0,
                  w.sum.data() + r0, w.acc.data() + r0 * D);
    tile_values_all<DT, LO>(nr, w.scores.data(), g.block_size, cache, k_base + block_elems, D,
                            n, w.acc.data() + r0 * D);
  }
}

constexpr int kScoreRows = kRowTile;
constexpr int32_t kVectorized = 1;

// ---- Tiles: a (prefix group, KV head) over an "amx" cache as matrix products ----------
//
// Over vLLM's "amx" layout a block's K is already the B operand of a bf16 tile product
// (16 tokens of (d, d + 1) pairs per 64-byte row) and so is its V (16 dims of (t, t + 1)
// pairs), so the group's rows, padded to 16, multiply them in place: scores = Q K^T in
// fp32 (exact bf16 products, as vdpbf16ps), the online softmax in AVX-512, then
// acc += P V with P split into a bf16 high part and the bf16 rounding of the rest, so the
// probabilities keep ~16 bits (within 4e-6 of fp32) where one bf16 would keep 8.
// An "nhd" pool's tokens are gathered into "amx"-layout blocks first. ``Tiles`` is AMX
// (``_tile_dpbf16ps``) where the build has it and Linux grants the tile
// state, or, built with FEATHER_EMULATE_TILES, the same instruction's semantics in plain
// loops, so that this path's layout arithmetic is tested on CPUs without AMX.

#if defined(FEATHER_EMULATE_TILES)

struct Tiles {
  static constexpr int32_t kKind = 2;
  alignas(64) static inline thread_local uint8_t reg[8][16 * 64];

  static bool ready() { return true; }
  static void configure() {}
  static void release() {}
  template <int T>
  static void zero() { std::memset(reg[T], 0, sizeof reg[T]); }
  template <int T>
  static void load(const void* base, int64_t stride) {
    for (int r = 0; r < 16; ++r) {
      std::memcpy(reg[T] + 64 * r, static_cast<const char*>(base) + r * stride, 64);
    }
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    for (int r = 0; r < 16; ++r) {
      std::memcpy(static_cast<char*>(base) + r * stride, reg[T] + 64 * r, 64);
    }
  }
  // tdpbf16ps: C[m][n] += A[m][2k] * B[k][2n] + A[m][2k + 1] * B[k][2n + 1], in fp32.
  template <int C, int A, int B>
  static void dot() {
    float* c = reinterpret_cast<float*>(reg[C]);
    const uint16_t* a = reinterpret_cast<const uint16_t*>(reg[A]);
    const uint16_t* b = reinterpret_cast<const uint16_t*>(reg[B]);
    for (int m = 0; m < 16; ++m) {
      for (int k = 0; k < 16; ++k) {
        for (int n = 0; n < 16; ++n) {
          c[m * 16 + n] += load1<BF16>(a, m * 32 + 2 * k) * load1<BF16>(b, k * 32 + 2 * n);
          c[m * 16 + n] += load1<BF16>(a, m * 32 + 2 * k + 1) * load1<BF16>(b, k * 32 + 2 * n + 1);
        }
      }
    }
  }
};
#define FEATHER_TILES 1

#elif defined(__AMX_TILE__) && defined(__AMX_BF16__)

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

struct Tiles {
  static constexpr int32_t kKind = 1;

  // Linux hands a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM
  // for XFEATURE_XTILEDATA); without it a tile instruction raises SIGILL.
  static bool ready() {
    static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return granted;
  }
  // The thread's tile configuration before ``configure``: another library in the engine
  // (oneDNN, PyTorch's brgemm, SGLang's AMX kernels) may keep one across its calls and
  // skip reloading it, so ``release`` puts it back rather than clearing it.
  alignas(64) static inline thread_local TileConfig before{};

  static void configure() {  // eight tiles of 16 rows x 64 bytes
    _tile_storeconfig(&before);
    TileConfig config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
      config.bytes_per_row[t] = 64;
      config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
  }
  static void release() {
    if (before.palette != 0) {
      _tile_loadconfig(&before);
    } else {
      _tile_release();
    }
  }
  // The tile intrinsics name their registers in the instruction (GCC pastes the number
  // into the assembly), so each template argument is spelled out once.
#define FEATHER_TILE_CASES(OP)                                                       \
  if constexpr (T == 0) { OP(0); } else if constexpr (T == 1) { OP(1); }             \
  else if constexpr (T == 2) { OP(2); } else if constexpr (T == 3) { OP(3); }        \
  else if constexpr (T == 4) { OP(4); } else if constexpr (T == 5) { OP(5); }        \
  else if constexpr (T == 6) { OP(6); } else { static_assert(T == 7); OP(7); }
#define FEATHER_ZERO(I) _tile_zero(I)
#define FEATHER_LOAD(I) _tile_loadd(I, base, stride)
#define FEATHER_STORE(I) _tile_stored(I, base, stride)
  template <int T>
  static void zero() { FEATHER_TILE_CASES(FEATHER_ZERO) }
  template <int T>
  static void load(const void* base, int64_t stride) { FEATHER_TILE_CASES(FEATHER_LOAD) }
  template <int T>
  static void store(void* base, int64_t stride) { FEATHER_TILE_CASES(FEATHER_STORE) }
#undef FEATHER_ZERO
#undef FEATHER_LOAD
#undef FEATHER_STORE
#undef FEATHER_TILE_CASES
  // The products the kernel makes: accumulators 0-3, left operands 4-5, right 6-7.
  template <int C, int A, int B>
  static void dot() {
#define FEATHER_DOT(c, a, b) if constexpr (C == c && A == a && B == b) { _tile_dpbf16ps(c, a, b); } else
    FEATHER_DOT(0, 4, 6) FEATHER_DOT(0, 5, 6) FEATHER_DOT(1, 4, 7) FEATHER_DOT(1, 5, 7)
    FEATHER_DOT(2, 4, 6) FEATHER_DOT(2, 5, 6) FEATHER_DOT(3, 4, 7) FEATHER_DOT(3, 5, 7)
    static_assert(C < 0, "a tile product the kernel does not make");
#undef FEATHER_DOT
  }
};
#define FEATHER_TILES 1

#endif

#ifdef FEATHER_TILES
constexpr int32_t kTileKind = Tiles::kKind;
constexpr int kTileRows = 16;  // rows of every tile; 64 bytes each
static_assert(kChunkRows == 2 * kTileRows, "a chunk is two row tiles (attend_block_tiles)");

// Whether this call's "amx" work items multiply in tiles.
bool tiles_ready() { return Tiles::ready(); }

// scores[r][t] (unscaled) for two or one 16-row tiles of ``q`` (bf16 rows of head_dim) x
// two or one 16-token groups from t0: tiles 0-3 accumulate, 4-5 hold the query rows, 6-7
// the K groups; ``scores``' rows are block_size apart.
template <bool TwoRows, bool TwoGroups>
void score_tiles(const uint16_t* q, int head_dim, const uint16_t* k_block, int block_size,
                 int t0, float* scores) {
  const int64_t q_stride = 2 * static_cast<int64_t>(head_dim);
  const uint16_t* k = k_block + static_cast<int64_t>(t0) * head_dim;  // 16 tokens x head_dim
  Tiles::zero<0>();
  if constexpr (TwoGroups) Tiles::zero<1>();
  if constexpr (TwoRows) Tiles::zero<2>();
  if constexpr (TwoRows && TwoGroups) Tiles::zero<3>();
  for (int d = 0; d < head_dim; d += 32) {
    Tiles::load<4>(q + d, q_stride);
    Tiles::load<6>(k + 16 * d, 64);
    Tiles::dot<0, 4, 6>();
    if constexpr (TwoGroups) {
      Tiles::load<7>(k + 16 * (head_dim + d), 64);
      Tiles::dot<1, 4, 7>();
    }
    if constexpr (TwoRows) {
      Tiles::load<5>(q + kTileRows * head_dim + d, q_stride);
      Tiles::dot<2, 5, 6>();
      if constexpr (TwoGroups) Tiles::dot<3, 5, 7>();
    }
  }
  const int64_t s_stride = 4 * static_cast<int64_t>(block_size);
  float* s = scores + t0;
  Tiles::store<0>(s, s_stride);
  if constexpr (TwoGroups) Tiles::store<1>(s + 16, s_stride);
  if constexpr (TwoRows) Tiles::store<2>(s + kTileRows * block_size, s_stride);
  if constexpr (TwoRows && TwoGroups) Tiles::store<3>(s + kTileRows * block_size + 16, s_stride);
}

// 2^x in the lanes of ``mask`` (0 elsewhere), for x <= 0 plus rounding: x = n + f,
// |f| <= 1/2, 2^f by a degree-5 polynomial (within 3e-7), scaled by 2^n (under fp32's
// normal range it fades to 0, as the fp32 result does).
inline __m512 exp2_nonpositive(__mmask16 mask, __m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.327647129e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675540961e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713092e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402212024e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469440e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000119f));
  return _mm512_maskz_scalef_ps(mask, p, n);
}

// 32 probabilities (``a`` then ``b``) as bf16 high and low parts, high + low = p to ~16
// bits: high is p rounded (half up) to bf16 by integer arithmetic, so it and the rest
// p - high are exact in fp32 (no compiler contraction can touch them); low is the rest
// rounded to bf16.
inline void split_bf16(__m512 a, __m512 b, uint16_t* high, uint16_t* low) {
  const auto top = [](__m512 x) {
    const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(0x8000));
    return _mm512_castsi512_ps(
        _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  };
  const __m512 a_high = top(a), b_high = top(b);
  const __m512 a_low = _mm512_sub_ps(a, a_high), b_low = _mm512_sub_ps(b, b_high);
#ifdef __AVX512BF16__
  _mm512_storeu_si512(high, (__m512i)_mm512_cvtne2ps_pbh(b_high, a_high));
  _mm512_storeu_si512(low, (__m512i)_mm512_cvtne2ps_pbh(b_low, a_low));
#else
  const auto to_bf16 = [](__m512 x) {  // round to nearest even (no NaN here)
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16));
  };
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(high), to_bf16(a_high));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + 16), to_bf16(b_high));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(low), to_bf16(a_low));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(low + 16), to_bf16(b_low));
#endif
}

// The online softmax of one block's unscaled scores, written as bf16 high + low parts of
// the probabilities (``split_bf16``), rows ``width`` apart, zero past the block's n tokens
// up to a whole 32-token step: per row the running max (scaled) and sum are updated and
// the accumulator rescaled, as ``softmax_block`` does; the scale and log2(e) are folded
// into one FMA before ``exp2_nonpositive`` (``scale`` > 0). Meanwhile ``prefetch_bytes``
// from ``prefetch`` (the next block) are prefetched, spread over the rows.
void softmax_split(int rows, int n, int block_size, int head_dim, int width, float scale,
                   const float* scores, float* max, float* sum, float* acc, uint16_t* high,
                   uint16_t* low, const char* prefetch, int64_t prefetch_bytes) {
  constexpr float kLog2e = 1.44269504088896341f;
  const int span = probability_width(n);
  const int64_t pairs = static_cast<int64_t>(rows) * (span / 32);
  const int64_t lines_per_pair = (prefetch_bytes / 64 + pairs - 1) / pairs;
  const char* const prefetch_end = prefetch + prefetch_bytes;
  for (int r = 0; r < rows; ++r) {
    const float* s = scores + static_cast<int64_t>(r) * block_size;
    const float block_max = scale * row_max(s, n);
    const float new_max = block_max > max[r] ? block_max : max[r];
    const __m512 shift = _mm512_set1_ps(-new_max * kLog2e);
    const __m512 factor = _mm512_set1_ps(scale * kLog2e);
    __m512 vsum = _mm512_setzero_ps();
    uint16_t* h = high + static_cast<int64_t>(r) * width;
    uint16_t* l = low + static_cast<int64_t>(r) * width;
    for (int t0 = 0; t0 < span; t0 += 2 * kTokenTile) {
      for (int64_t i = 0; i < lines_per_pair && prefetch < prefetch_end; ++i, prefetch += 64) {
        _mm_prefetch(prefetch, _MM_HINT_T1);
      }
      __m512 p[2];
      for (int j = 0; j < 2; ++j) {
        const __mmask16 mask = first_lanes(n - t0 - j * kTokenTile);
        const __m512 x = _mm512_fmadd_ps(
            _mm512_maskz_loadu_ps(mask, s + t0 + j * kTokenTile), factor, shift);
        p[j] = exp2_nonpositive(mask, x);
        vsum = _mm512_add_ps(vsum, p[j]);
      }
      split_bf16(p[0], p[1], h + t0, l + t0);
    }
    advance_row(max[r], sum[r], acc + static_cast<int64_t>(r) * head_dim, head_dim, new_max,
                _mm512_reduce_add_ps(vsum));
  }
}

// acc[r0 .. r0 + 15][16 * (g0 .. g0 + NG - 1)] += P V over ``steps`` 32-token steps:
// tiles 0-3 accumulate, 4-5 hold P's high and low parts, 6-7 the V pairs. ``v_rows(step,
// group)``: where the 16 rows of (t, t + 1) pairs of that step and 16-dim group start.
template <int NG, class VRows>
void value_tiles(const uint16_t* high, const uint16_t* low, int width, int steps, int r0,
                 int g0, int head_dim, float* acc, const VRows& v_rows) {
  const int64_t p_stride = 2 * static_cast<int64_t>(width);
  const int64_t a_stride = 4 * static_cast<int64_t>(head_dim);
  float* a = acc + static_cast<int64_t>(r0) * head_dim + 16 * g0;
  Tiles::load<0>(a, a_stride);
  if constexpr (NG > 1) Tiles::load<1>(a + 16, a_stride);
  if constexpr (NG > 2) Tiles::load<2>(a + 32, a_stride);
  if constexpr (NG > 3) Tiles::load<3>(a + 48, a_stride);
  const int64_t p0 = static_cast<int64_t>(r0) * width;
  for (int step = 0; step < steps; ++step) {
    Tiles::load<4>(high + p0 + 32 * step, p_stride);
    Tiles::load<5>(low + p0 + 32 * step, p_stride);
    Tiles::load<6>(v_rows(step, g0), 64);
    Tiles::dot<0, 4, 6>();
    Tiles::dot<0, 5, 6>();
    if constexpr (NG > 1) {
      Tiles::load<7>(v_rows(step, g0 + 1), 64);
      Tiles::dot<1, 4, 7>();
      Tiles::dot<1, 5, 7>();
    }
    if constexpr (NG > 2) {
      Tiles::load<6>(v_rows(step, g0 + 2), 64);
      Tiles::dot<2, 4, 6>();
      Tiles::dot<2, 5, 6>();
    }
    if constexpr (NG > 3) {
      Tiles::load<7>(v_rows(step, g0 + 3), 64);
      Tiles::dot<3, 4, 7>();
      Tiles::dot<3, 5, 7>();
    }
  }
  Tiles::store<0>(a, a_stride);
  if constexpr (NG > 1) Tiles::store<1>(a + 16, a_stride);
  if constexpr (NG > 2) Tiles::store<2>(a + 32, a_stride);
  if constexpr (NG > 3) Tiles::store<3>(a + 48, a_stride);
}

// The block's V pairs of the last, partial 32-token step, zero beyond its n tokens (the
// cache past them may hold anything, and 0 x NaN is NaN): [groups][16 rows][32].
void copy_value_tail(const uint16_t* v_block, int block_size, int head_dim, int n,
                     uint16_t* tail) {
  const int t0 = n / 32 * 32;
  for (int group = 0; group < head_dim / 16; ++group) {
    const uint16_t* rows = v_block + static_cast<int64_t>(group) * 16 * block_size + t0 * 16;
    uint16_t* out = tail + group * 512;
    for (int i = 0; i < 512; ++i) {
      const int token = t0 + 2 * (i / 32) + i % 2;
      out[i] = token < n ? rows[i] : 0;
    }
  }
}

// Every row of the work item over one block of n tokens, in tiles (see above), a chunk of
// kChunkRows rows at a time through scores, softmax and values (so a chunk's scores and
// probabilities stay in L1); the next block (``next``, ``block_bytes``) is prefetched
// meanwhile.
void attend_block_tiles(const Geometry& g, const void* cache, Scratch& w, int rows,
                        int64_t k_base, int n, const char* next, int64_t block_bytes) {
  const int D = g.head_dim, bs = g.block_size, width = probability_width(bs);
  const int padded = (rows + kTileRows - 1) / kTileRows * kTileRows;
  const uint16_t* k_block = static_cast<const uint16_t*>(cache) + k_base;
  const uint16_t* v_block = k_block + static_cast<int64_t>(bs) * D;
  const int token_groups = (n + 15) / 16, steps = (n + 31) / 32, groups = D / 16;
  const bool tail = n % 32 != 0;
  if (tail) copy_value_tail(v_block, bs, D, n, w.v_tail.data());
  const auto v_rows = [&](int step, int group) -> const uint16_t* {
    if (tail && step == steps - 1) return w.v_tail.data() + group * 512;
    return v_block + static_cast<int64_t>(group) * 16 * bs + step * 512;
  };
  const int chunks = (padded + kChunkRows - 1) / kChunkRows;
  const int64_t slice = next ? (block_bytes / chunks + 63) / 64 * 64 : 0;
  float* scores = w.scores.data();
  uint16_t *high = w.p_high.data(), *low = w.p_low.data();
  for (int c0 = 0; c0 < padded; c0 += kChunkRows) {
    const bool two_rows = c0 + kTileRows < padded;
    const int real = std::min(rows - c0, kChunkRows);
    const uint16_t* q = reinterpret_cast<const uint16_t*>(w.q_pairs.data()) + c0 * D;
    for (int group = 0; group < token_groups; group += 2) {
      const bool two_groups = group + 1 < token_groups;
      const int t0 = 16 * group;
      if (two_rows) {
        two_groups ? score_tiles<true, true>(q, D, k_block, bs, t0, scores)
                   : score_tiles<true, false>(q, D, k_block, bs, t0, scores);
      } else {
        two_groups ? score_tiles<false, true>(q, D, k_block, bs, t0, scores)
                   : score_tiles<false, false>(q, D, k_block, bs, t0, scores);
      }
    }
    const int64_t from = std::min<int64_t>(c0 / kChunkRows * slice, block_bytes);
    softmax_split(real, n, bs, D, width, g.scale, scores, w.max.data() + c0,
                  w.sum.data() + c0, w.acc.data() + static_cast<int64_t>(c0) * D, high, low,
                  next + from, std::min(slice, block_bytes - from));
    const int tile_rows = two_rows ? kChunkRows : kTileRows;
    if (real < tile_rows) {  // the padding rows of the last chunk multiply as zeros
      std::memset(high + real * width, 0, (tile_rows - real) * width * sizeof(uint16_t));
      std::memset(low + real * width, 0, (tile_rows - real) * width * sizeof(uint16_t));
    }
    float* acc = w.acc.data() + static_cast<int64_t>(c0) * D;
    for (int r0 = 0; r0 < tile_rows; r0 += kTileRows) {
      for (int g0 = 0; g0 < groups; g0 += 4) {
        switch (groups - g0 < 4 ? groups - g0 : 4) {
          case 1: value_tiles<1>(high, low, width, steps, r0, g0, D, acc, v_rows); break;
          case 2: value_tiles<2>(high, low, width, steps, r0, g0, D, acc, v_rows); break;
          case 3: value_tiles<3>(high, low, width, steps, r0, g0, D, acc, v_rows); break;
          default: value_tiles<4>(high, low, width, steps, r0, g0, D, acc, v_rows);
        }
      }
    }
  }
}

void configure_tiles() { Tiles::configure(); }
void release_tiles() { Tiles::release(); }
#endif  // FEATHER_TILES

#else  // no AVX-512F: the same arithmetic, one row and one token at a time

template <int DT, int LO>
void attend_block(const Geometry& g, const void* cache, Scratch& w, int rows, int64_t k_base,
                  int n, const char*, int64_t) {
  const int D = g.head_dim;
  const int64_t v_base = k_base + static_cast<int64_t>(g.block_size) * D;
  float* scores = w.scores.data();
  for (int r = 0; r < rows; ++r) {
    const float* q = w.q.data() + r * D;
    float block_max = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < n; ++t) {
      float dot = 0.0f;
      for (int d = 0; d < D; ++d) {
        dot += q[d] * load1<DT>(cache, k_base + k_offset<LO>(d, t, g.block_size, D));
      }
      scores[t] = dot * g.scale;
      block_max = scores[t] > block_max ? scores[t] : block_max;
    }
    const float new_max = block_max > w.max[r] ? block_max : w.max[r];
    const float alpha = std::exp(w.max[r] - new_max);  // 0 when the old max is -inf
    float block_sum = 0.0f;
    for (int t = 0; t < n; ++t) block_sum += scores[t] = std::exp(scores[t] - new_max);
    w.sum[r] = w.sum[r] * alpha + block_sum;
    w.max[r] = new_max;
    float* acc = w.acc.data() + r * D;
    for (int d = 0; d < D; ++d) acc[d] *= alpha;
    for (int t = 0; t < n; ++t) {
      for (int d = 0; d < D; ++d) {
        acc[d] += scores[t] * load1<DT>(cache, v_base + v_offset<LO>(t, d, g.block_size, D));
      }
    }
  }
}

constexpr int kScoreRows = 1;
constexpr int32_t kVectorized = 0;

#endif

#ifndef FEATHER_TILES
constexpr int32_t kTileKind = 0;
bool tiles_ready() { return false; }
void configure_tiles() {}
void release_tiles() {}
void attend_block_tiles(const Geometry&, const void*, Scratch&, int, int64_t, int,
                        const char*, int64_t) {}
#endif

// "nhd": the K and V of one KV head at ``n`` token slots (at most kPack), gathered into
// one kPack-token block of the layout ``OUT``: "vec" (K [head_dim][kPack], then V
// [kPack][head_dim]) or, for tiles, "amx". Slots are in no order the hardware prefetcher
// follows, so the rows kAhead tokens on (of the ``left`` the segment still holds from
// ``slots``) are prefetched meanwhile.
template <int DT, int OUT>
void gather_tokens(const Geometry& g, const void* keys, const void* values, const int32_t* slots,
                   int n, int64_t left, int kv_head, void* packed) {
  using E = Element<DT>;
  constexpr int kAhead = 4;
  const int D = g.head_dim;
  const int64_t head = static_cast<int64_t>(kv_head) * D;
  const E* k = static_cast<const E*>(keys);
  const E* v = static_cast<const E*>(values);
  E* pk = static_cast<E*>(packed);
  E* pv = pk + static_cast<int64_t>(kPack) * D;
  for (int t = 0; t < n; ++t) {
    if (t + kAhead < left) {
      const int64_t ahead = slots[t + kAhead] * g.kv_token_stride + head;
      for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(E)); byte += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k + ahead) + byte);
        __builtin_prefetch(reinterpret_cast<const char*>(v + ahead) + byte);
      }
    }
    const int64_t row = slots[t] * g.kv_token_stride + head;
    for (int d = 0; d < D; ++d) pk[k_offset<OUT>(d, t, kPack, D)] = k[row + d];
    if constexpr (OUT == AMX) {
      for (int d = 0; d < D; ++d) pv[v_offset<OUT>(t, d, kPack, D)] = v[row + d];
    } else {
      std::memcpy(pv + static_cast<int64_t>(t) * D, v + row, D * sizeof(E));
    }
  }
}

// One work item: every query row of one segment, one KV head, over ``length`` of the
// segment's tokens from ``blocks`` on (``cache``; "nhd": token slots in the ``cache`` and
// ``values`` buffers, gathered kPack at a time). ``following``: the first block of the item
// after this one, prefetched during this item's last block (many short suffix segments
// would otherwise each start cold).
template <int DT, int LO>
void attend_segment(const Geometry& g, const void* cache, const void* values,
                    const void* query, const int64_t* tokens, int num_tokens,
                    const int32_t* blocks, int32_t length, int kv_head, int64_t out_row0,
                    float* out, float* lse, Scratch& w, const char* following) {
  const int rows = num_tokens * g.gqa;
  const int D = g.head_dim;
  const bool tiles = DT == BF16 && LO != VEC && g.tiles && rows >= kMinTileRows;
  const int padded = tiles ? (rows + 15) / 16 * 16 : rows;
  const int block_size = LO == NHD ? kPack : g.block_size;
  w.reset(rows, padded, D, block_size, tiles ? kChunkRows : kScoreRows);
  if (tiles) {  // padding rows of the probabilities stay zero
    const size_t width = probability_width(block_size);
    w.p_high.assign(kChunkRows * width, 0);
    w.p_low.assign(kChunkRows * width, 0);
    w.v_tail.resize(static_cast<size_t>(D) / 16 * 512);
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t q_off = tokens[r / g.gqa] * g.q_token_stride +
                          static_cast<int64_t>(kv_head * g.gqa + r % g.gqa) * D;
    for (int d = 0; d < D; ++d) w.q[r * D + d] = load1<DT>(query, q_off + d);
    if constexpr (DT == BF16) {
      const uint16_t* raw = static_cast<const uint16_t*>(query) + q_off;
      for (int d = 0; d < D; d += 2) {
        w.q_pairs[(r * D + d) / 2] = static_cast<int32_t>(
            static_cast<uint32_t>(raw[d]) | (static_cast<uint32_t>(raw[d + 1]) << 16));
      }
    }
  }
  if constexpr (LO == NHD) {
    Geometry block = g;
    block.block_size = kPack;
    w.packed.resize(2 * kPack * D * element_bytes<DT>() / sizeof(float));
    for (int t0 = 0; t0 < length; t0 += kPack) {
      const int n = length - t0 < kPack ? length - t0 : kPack;
      if (tiles) {
        gather_tokens<DT, AMX>(g, cache, values, blocks + t0, n, length - t0, kv_head,
                               w.packed.data());
        attend_block_tiles(block, w.packed.data(), w, rows, 0, n, nullptr, 0);
      } else {
        gather_tokens<DT, VEC>(g, cache, values, blocks + t0, n, length - t0, kv_head,
                               w.packed.data());
        attend_block<DT, VEC>(block, w.packed.data(), w, rows, 0, n, nullptr, 0);
      }
    }
  } else {
    const int64_t block_elems = static_cast<int64_t>(g.block_size) * D;
    const int64_t block_bytes = 2 * block_elems * element_bytes<DT>();
    for (int b = 0; b * g.block_size < length; ++b) {
      const int n = length - b * g.block_size < g.block_size ? length - b * g.block_size
                                                             : g.block_size;
      const int64_t k_base = (static_cast<int64_t>(blocks[b]) * g.kv_heads + kv_head) * 2 *
                             block_elems;
      const bool last = (b + 1) * g.block_size >= length;
      const char* next = last ? following : block_start<DT>(g, cache, blocks[b + 1], kv_head);
      if (tiles) {
        attend_block_tiles(g, cache, w, rows, k_base, n, next, block_bytes);
        continue;
      }
      attend_block<DT, LO>(g, cache, w, rows, k_base, n, next, block_bytes);
    }
  }
  const int q_heads = g.kv_heads * g.gqa;
  for (int r = 0; r < rows; ++r) {
    const int64_t row = out_row0 + r / g.gqa;
    const int head = kv_head * g.gqa + r % g.gqa;
    float* o = out + (row * q_heads + head) * D;
    const bool seen = w.sum[r] > 0.0f;
    const float inv = seen ? 1.0f / w.sum[r] : 0.0f;
    for (int d = 0; d < D; ++d) o[d] = w.acc[r * D + d] * inv;
    lse[row * q_heads + head] = seen ? w.max[r] + std::log(w.sum[r])
                                     : -std::numeric_limits<float>::infinity();
  }
}

// ---- Work items: where few (segment, KV head) pairs would leave threads idle -----------

constexpr int kMinPartTokens = 512;  // no part of a split segment is shorter
constexpr int kPartsPerThread = 4;   // the share of the work one item may hold, at most

// One work item: a KV head of ``length`` of a segment's tokens from ``first`` on (a whole
// number of units: blocks, "nhd" kPack tokens), into rows ``row0`` on of ``out``/``lse``.
struct Item {
  int64_t segment, row0;
  int32_t kv_head, first, length;
  float *out, *lse;
};

// A split segment's parts: part p's row i is row ``row0 + p * tokens + i`` of the parts'.
struct Split {
  int64_t segment, row0;
  int32_t parts, tokens;
};

// The call's work items. With one thread every (segment, KV head) is one item. With more,
// a segment whose items would each hold over 1 / (kPartsPerThread x threads) of the work
// (its query rows x its tokens) is split into parts of whole units, no shorter than
// kMinPartTokens, each written to the parts' buffers and merged by ``merge_parts``: as
// vLLM's split-KV, so one long prefix group keeps every thread busy. Cost: O(items).
struct Plan {
  std::vector<Item> items;
  std::vector<Split> splits;
  std::vector<float> part_out, part_lse;

  Plan(const Geometry& g, int32_t num_segments, const int64_t* token_offsets,
       const int32_t* lengths, int unit, int32_t threads, float* out, float* lse) {
    double total = 0;
    for (int32_t s = 0; s < num_segments; ++s) {
      total += static_cast<double>(token_offsets[s + 1] - token_offsets[s]) * lengths[s];
    }
    const double cap = total * g.kv_heads / (static_cast<double>(kPartsPerThread) * threads);
    const int32_t shortest = (kMinPartTokens + unit - 1) / unit * unit;
    std::vector<int32_t> part_length(num_segments);
    int64_t part_rows = 0;
    for (int32_t s = 0; s < num_segments; ++s) {
      const int32_t tokens = static_cast<int32_t>(token_offsets[s + 1] - token_offsets[s]);
      const double cost = static_cast<double>(tokens) * lengths[s];
      part_length[s] = lengths[s];
      if (threads > 1 && cost > cap && lengths[s] > shortest) {
        const int32_t parts = static_cast<int32_t>(std::ceil(cost / cap));
        const int32_t even = (lengths[s] + parts - 1) / parts;
        part_length[s] = std::max(shortest, (even + unit - 1) / unit * unit);
      }
      if (part_length[s] < lengths[s]) {
        const int32_t parts = (lengths[s] + part_length[s] - 1) / part_length[s];
        splits.push_back({s, part_rows, parts, tokens});
        part_rows += static_cast<int64_t>(parts) * tokens;
      }
    }
    const int64_t q_heads = static_cast<int64_t>(g.kv_heads) * g.gqa;
    part_out.resize(part_rows * q_heads * g.head_dim);
    part_lse.resize(part_rows * q_heads);
    size_t next_split = 0;
    for (int32_t s = 0; s < num_segments; ++s) {
      const bool split = next_split < splits.size() && splits[next_split].segment == s;
      for (int32_t head = 0; head < g.kv_heads; ++head) {
        if (!split) {
          items.push_back({s, token_offsets[s], head, 0, lengths[s], out, lse});
          continue;
        }
        const Split& parts = splits[next_split];
        for (int32_t p = 0; p < parts.parts; ++p) {
          const int32_t first = p * part_length[s];
          items.push_back({s, parts.row0 + static_cast<int64_t>(p) * parts.tokens, head, first,
                           std::min(part_length[s], lengths[s] - first), part_out.data(),
                           part_lse.data()});
        }
      }
      next_split += split;
    }
  }
};

// One row's attention over the union of ``parts`` disjoint parts (``part(p)``: its output,
// ``part_lse(p)`` its LSE) into ``o`` and ``lse_out``: the exact log-sum-exp merge in fp32
// (a part of no weight, LSE -inf, adds nothing; no weight at all gives 0 and -inf). ``o``
// may be part 0 (each element is read before it is written), no other part.
template <class Out, class Lse>
void merge_row(int parts, const Out& part, const Lse& part_lse, int head_dim, float* o,
               float* lse_out) {
  float top = -std::numeric_limits<float>::infinity();
  for (int p = 0; p < parts; ++p) top = std::max(top, part_lse(p));
  if (top == -std::numeric_limits<float>::infinity()) {
    std::fill(o, o + head_dim, 0.0f);
    *lse_out = top;
    return;
  }
  float total = 0.0f;
  for (int p = 0; p < parts; ++p) {
    const float weight = std::exp(part_lse(p) - top);
    const float* x = part(p);
    if (p == 0) {
      for (int d = 0; d < head_dim; ++d) o[d] = weight * x[d];
    } else {
      for (int d = 0; d < head_dim; ++d) o[d] += weight * x[d];
    }
    total += weight;
  }
  for (int d = 0; d < head_dim; ++d) o[d] /= total;
  *lse_out = top + std::log(total);
}

// Each split segment's rows from its parts' partials (``merge_row``). Parallel over the
// segments' rows.
void merge_parts(const Geometry& g, const Plan& plan, const int64_t* token_offsets,
                 float* out, float* lse) {
  const int64_t q_heads = static_cast<int64_t>(g.kv_heads) * g.gqa;
  const int D = g.head_dim;
  for (const Split& split : plan.splits) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < split.tokens * q_heads; ++i) {
      const int64_t token = i / q_heads, head = i % q_heads;
      const auto part_row = [&](int32_t p) {
        return (split.row0 + static_cast<int64_t>(p) * split.tokens + token) * q_heads + head;
      };
      const int64_t row = (token_offsets[split.segment] + token) * q_heads + head;
      merge_row(split.parts, [&](int p) { return plan.part_out.data() + part_row(p) * D; },
                [&](int p) { return plan.part_lse[part_row(p)]; }, D, out + row * D,
                lse + row);
    }
  }
}

template <int DT, int LO>
void attend_all(const Geometry& g, const void* cache, const void* values, const void* query,
                int32_t num_segments,
                const int64_t* token_offsets, const int64_t* tokens,
                const int64_t* block_offsets, const int32_t* blocks, const int32_t* lengths,
                float* out, float* lse, int32_t threads) {
  const int unit = LO == NHD ? kPack : g.block_size;
  const Plan plan(g, num_segments, token_offsets, lengths, unit, threads, out, lse);
  const int64_t count = static_cast<int64_t>(plan.items.size());
  const auto first_block = [&](const Item& item) -> const int32_t* {
    return blocks + block_offsets[item.segment] + item.first / (LO == NHD ? 1 : g.block_size);
  };
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    Scratch scratch;
    if (g.tiles) configure_tiles();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) {
      const Item& item = plan.items[i];
      const char* following = nullptr;
      if constexpr (LO != NHD) {
        if (i + 1 < count && plan.items[i + 1].length > 0) {
          following = block_start<DT>(g, cache, *first_block(plan.items[i + 1]),
                                      plan.items[i + 1].kv_head);
        }
      }
      const int64_t seg = item.segment;
      attend_segment<DT, LO>(g, cache, values, query, tokens + token_offsets[seg],
                             static_cast<int>(token_offsets[seg + 1] - token_offsets[seg]),
                             first_block(item), item.length, item.kv_head, item.row0,
                             item.out, item.lse, scratch, following);
    }
    merge_parts(g, plan, token_offsets, out, lse);
    if (g.tiles) release_tiles();
  }
}

}  // namespace

extern "C" {

// 1 where blocks are attended with AVX-512 (faster than vLLM's kernel), 0 where by the
// portable loop.
int32_t feather_kernel_vectorized() {
  return kVectorized;
}

// How bf16 "amx" and "nhd" blocks multiply: 0 in AVX-512 registers (or the portable loop), 1
// in AMX tiles (this CPU has them and Linux granted the tile state), 2 in emulated tiles
// (a build with FEATHER_EMULATE_TILES, for tests).
int32_t feather_kernel_tiles() {
  return tiles_ready() ? kTileKind : 0;
}

// Row i of the first ``rows`` rows of ``out`` ([2 * rows, heads, head_dim] fp32) and
// ``lse`` ([2 * rows, heads]) becomes the merge of itself and row ``rows + i`` (a query's
// prefix and suffix partials): the exact log-sum-exp merge, in place, parallel over rows.
void feather_merge_halves(int64_t rows, int32_t heads, int32_t head_dim, float* out, float* lse,
                          int32_t threads) {
  const int64_t half = rows * heads;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t i = 0; i < half; ++i) {
    float* prefix = out + i * head_dim;
    const float* suffix = out + (half + i) * head_dim;
    merge_row(2, [&](int p) -> const float* { return p ? suffix : prefix; },
              [&](int p) { return lse[p ? half + i : i]; }, head_dim, prefix, lse + i);
  }
}

// Attend every segment; see the file comment. Segment s has query tokens
// tokens[token_offsets[s] : token_offsets[s+1]] (indices into the query's first dim), KV
// blocks blocks[block_offsets[s] : ...] ("nhd": token slots) and lengths[s] tokens (at
// most its blocks hold; "nhd": one slot each); its outputs go to rows token_offsets[s] ...
// of out ([rows, q_heads, head_dim] fp32) and lse ([rows, q_heads] fp32). ``layout``: 0
// for vLLM's "vec", 1 for "amx" (bf16 only), 2 for "nhd" (``cache`` then holds K and
// ``values`` V, a slot every ``kv_token_stride`` elements; both unused otherwise).
// ``use_tiles``: a bf16 "amx" cache or "nhd" pool of heads of a multiple of 32 multiplies
// in tiles where ``feather_kernel_tiles`` says they exist; 0 keeps it in AVX-512 registers. Returns 0, or -1 for an unknown dtype or
// layout.
int32_t feather_segment_attention(int32_t dtype, int32_t layout, const void* cache,
                                  const void* values, int64_t kv_token_stride,
                                  const void* query, int64_t q_token_stride,
                                  int32_t kv_heads, int32_t block_size, int32_t head_dim,
                                  int32_t gqa, float scale,
                                  int32_t num_segments, const int64_t* token_offsets,
                                  const int64_t* tokens, const int64_t* block_offsets,
                                  const int32_t* blocks, const int32_t* lengths, float* out,
                                  float* lse, int32_t threads, int32_t use_tiles) {
  using std::integral_constant;
  const bool tiles = use_tiles && dtype == BF16 && (layout == AMX || layout == NHD) &&
                     head_dim % 32 == 0 && scale > 0 && feather_kernel_tiles();
  const Geometry g{kv_heads, block_size, head_dim, gqa, q_token_stride, scale,
                   kv_token_stride, tiles};
  const auto run = [&](auto dt, auto lo) -> int32_t {
    attend_all<decltype(dt)::value, decltype(lo)::value>(
        g, cache, values, query, num_segments, token_offsets, tokens, block_offsets, blocks,
        lengths, out, lse, threads);
    return 0;
  };
  const auto any_dtype = [&](auto lo) -> int32_t {
    switch (dtype) {
      case F32: return run(integral_constant<int, F32>{}, lo);
      case BF16: return run(integral_constant<int, BF16>{}, lo);
      case F16: return run(integral_constant<int, F16>{}, lo);
      default: return -1;
    }
  };
  switch (layout) {
    case VEC: return any_dtype(integral_constant<int, VEC>{});
    case NHD: return any_dtype(integral_constant<int, NHD>{});
    case AMX:
      return dtype == BF16 ? run(integral_constant<int, BF16>{}, integral_constant<int, AMX>{})
                           : -1;
    default: return -1;
  }
}
}
