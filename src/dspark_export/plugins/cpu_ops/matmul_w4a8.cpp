// dspark.cpu::MatMulW4A8: y = x @ Wᵀ for int4 block-quantized weights and int8 activation blocks, row-local.
//
// Inputs are MatMulNBits' (bits 4, block 32, symmetric, no zero points): B [N, K/32, 16] uint8 (two 4-bit
// values per byte, the even k in the low nibble), scales [N, K/32] (or flat) float32; W[n, k] =
// scales[n, k/32] · (q[n, k] − 8). x [..., K] float32 -> y [..., N] float32.
//
// Arithmetic (MatMulNBits' accuracy_level 4, MLAS CompInt8): each row of x is quantized to int8 per block of
// 32, scale_x = max|x| / 127, q_x = round-half-even(x · 127 / max|x|); per block the int32 sum
// Σ q_w·q_x − 8·Σ q_x is exact, and y accumulates fma(float(sum), scale_x · scale_w, y) over the blocks in
// increasing order. Every output element is computed by one thread with that one sequence whatever the row
// count or the thread split, so a row's output is bitwise the same alone or packed with others, and the
// AVX512-VNNI path equals the portable one bit for bit (fma and float(int32) are exact-rounded in both).
//
// Why not MatMulNBits: its kernel costs about one one-row pass per extra row (compute-bound past two rows on
// AVX512 CPUs: reports/quant/block-size/), so each verification row costs ~14 % of a decode step. Here the
// weights are unpacked once per 16-column tile and block and reused for up to 8 rows (vpdpbusd, u8 weights
// 0..15 × s8 activations), so a row costs the int8 dot products only.
//
// Attribute swiglu (int, default 0): with 1, the output is y[..., j] = silu(g_j) · u_j over the halves g = y[..., :N/2],
// u = y[..., N/2:] of the product (a gate/up projection followed by QuickGelu(alpha 1) and Mul, in one node), shape
// [..., N/2]. silu(g) = g · 1/(1 + e), e = exp(min(−g, 88)) by the same polynomial as RaggedAttention's, the same
// operations in the vectorized and portable paths, so they agree bit for bit.
//
// ONNX Runtime's C API: ort_api.h; the op is registered with the others in register.cpp.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "exp_poly.h"
#include "ort_api.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define W4A8_X86 1
#endif

namespace {

using namespace dspark_cpu;

constexpr int64_t kBlock = 32;   // input features per quantization block
constexpr int64_t kTile = 16;    // output features per tile (one 512-bit vector of int32 sums)
constexpr int64_t kRows = 8;     // rows that share one unpacked tile block
constexpr int64_t kTileBlockBytes = kTile * kBlock / 2;  // 256

// ---- the packed layout -------------------------------------------------------------------------------------
// For tile t (columns 16t..16t+15) and block b, 256 bytes: 4 groups of 64, group j holding for column c and
// u = 0..3 at byte 4c+u the weight of k = 32b + 4j + u in the low nibble and k = 32b + 4(j+4) + u in the high
// nibble. One 64-byte load then gives, after a mask and a shift, the u8 operands of two vpdpbusd (16 columns
// × 4 consecutive k). Scales are [tiles, blocks, 16].

struct Packed {
  int64_t n = 0, k = 0;
  std::vector<uint8_t> w;
  std::vector<float> s;
};

std::shared_ptr<Packed> pack(const uint8_t* b, const float* scales, int64_t n, int64_t k) {
  auto p = std::make_shared<Packed>();
  const int64_t nb = k / kBlock, tiles = n / kTile;
  p->n = n;
  p->k = k;
  p->w.assign(static_cast<size_t>(tiles * nb * kTileBlockBytes), 0);
  p->s.assign(static_cast<size_t>(tiles * nb * kTile), 0.f);
  auto q = [&](int64_t col, int64_t kk) -> uint8_t {
    const uint8_t byte = b[(col * nb + kk / kBlock) * (kBlock / 2) + (kk % kBlock) / 2];
    return (kk % 2) ? (byte >> 4) : (byte & 15);
  };
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t blk = 0; blk < nb; ++blk) {
      uint8_t* dst = p->w.data() + (t * nb + blk) * kTileBlockBytes;
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t c = 0; c < kTile; ++c)
          for (int64_t u = 0; u < 4; ++u) {
            const int64_t col = t * kTile + c, k0 = blk * kBlock + 4 * j + u;
            dst[64 * j + 4 * c + u] = static_cast<uint8_t>(q(col, k0) | (q(col, k0 + 16) << 4));
          }
      for (int64_t c = 0; c < kTile; ++c) p->s[(t * nb + blk) * kTile + c] = scales[(t * kTile + c) * nb + blk];
    }
  return p;
}

// ---- activations ---------------------------------------------------------------------------------------------

void quantize_rows_portable(const float* x, int64_t m0, int64_t m1, int64_t k, int8_t* xq, float* xs,
                            int32_t* xsum) {
  const int64_t nb = k / kBlock;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t blk = 0; blk < nb; ++blk) {
      const float* p = x + m * k + blk * kBlock;
      float amax = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(p[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < kBlock; ++i) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(p[i] * inv));
        xq[m * k + blk * kBlock + i] = static_cast<int8_t>(v);
        sum += v;
      }
      xs[m * nb + blk] = amax / 127.f;
      xsum[m * nb + blk] = sum;
    }
}

struct Problem {
  int8_t* xq;      // [m, k] int8 activations, written by the quantize tasks, read by the tile tasks
  float* xs;       // [m, k/32] their scales
  int32_t* xsum;   // [m, k/32] their block sums
  int64_t m, k, n;
  const Packed* w;
  float* y;
  // output element (row, column) goes to y[(row − row0) · ldy + column − col0]: ldy = n for the whole [m, n] product,
  // 16 for one tile's rows of a row group in the swiglu form
  int64_t ldy = 0, row0 = 0, col0 = 0;
  float* out(int64_t row, int64_t col) const { return y + (row - row0) * ldy + col - col0; }
};

// ---- the tile kernels: columns [16t, 16t+16) of every row ------------------------------------------------------

void tiles_portable(const Problem& p, int64_t t0, int64_t t1, int64_t r0, int64_t r1) {
  const int64_t nb = p.k / kBlock;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m = r0; m < r1; ++m)
      for (int64_t c = 0; c < kTile; ++c) {
        float acc = 0.f;
        for (int64_t blk = 0; blk < nb; ++blk) {
          const uint8_t* wb = p.w->w.data() + (t * nb + blk) * kTileBlockBytes;
          const int8_t* xb = p.xq + m * p.k + blk * kBlock;
          int32_t sum = 0;
          for (int64_t j = 0; j < 4; ++j)
            for (int64_t u = 0; u < 4; ++u) {
              const uint8_t byte = wb[64 * j + 4 * c + u];
              sum += static_cast<int32_t>(byte & 15) * xb[4 * j + u];
              sum += static_cast<int32_t>(byte >> 4) * xb[4 * (j + 4) + u];
            }
          sum -= 8 * p.xsum[m * nb + blk];
          const float scale = p.xs[m * nb + blk] * p.w->s[(t * nb + blk) * kTile + c];
          acc = std::fma(static_cast<float>(sum), scale, acc);
        }
        *p.out(m, t * kTile + c) = acc;
      }
}

#ifdef W4A8_X86
inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// the same per-block steps as quantize_rows_portable: max|x| (exact in any order), 127/max, x·(127/max) rounded
// to nearest even (MXCSR's default, as nearbyint), the scale max/127
__attribute__((target("avx512f,avx512bw"))) void quantize_rows_avx512(const float* x, int64_t m0, int64_t m1,
                                                                     int64_t k, int8_t* xq, float* xs,
                                                                     int32_t* xsum) {
  const int64_t nb = k / kBlock;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t blk = 0; blk < nb; ++blk) {
      const float* p = x + m * k + blk * kBlock;
      const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m512 vinv = _mm512_set1_ps(inv);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vinv));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vinv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * k + blk * kBlock), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * k + blk * kBlock + 16), _mm512_cvtsepi32_epi8(qb));
      xs[m * nb + blk] = amax / 127.f;
      xsum[m * nb + blk] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

// R rows (1..kRows) of one 16-column tile: R is a template argument so the accumulators live in registers
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile_rows_avx512vnni(
    const Problem& p, const uint8_t* wt, const float* st, int64_t nb, int64_t m0, int64_t col) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    __m512i w[8];
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(static_cast<const void*>(wt + blk * kTileBlockBytes + 64 * j));
      w[j] = _mm512_and_si512(v, low);
      w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 sw = _mm512_loadu_ps(st + blk * kTile);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int8_t* xb = p.xq + m * p.k + blk * kBlock;
      // the sum starts at the zero-point term −8·Σq_x (exact in int32, so the order does not matter) and each
      // 4-byte group of activations is broadcast straight from memory
      __m512i sum = _mm512_set1_epi32(-8 * p.xsum[m * nb + blk]);
      for (int j = 0; j < 8; ++j) sum = _mm512_dpbusd_epi32(sum, w[j], _mm512_set1_epi32(load_i32(xb + 4 * j)));
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(p.xs[m * nb + blk]), sw);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(p.out(m0 + r, col), acc[r]);
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tiles_avx512vnni(const Problem& p, int64_t t0,
                                                                              int64_t t1, int64_t r0, int64_t r1) {
  const int64_t nb = p.k / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = p.w->w.data() + t * nb * kTileBlockBytes;
    const float* st = p.w->s.data() + t * nb * kTile;
    for (int64_t m0 = r0; m0 < r1; m0 += kRows) {
      switch (std::min<int64_t>(kRows, r1 - m0)) {
        case 1: tile_rows_avx512vnni<1>(p, wt, st, nb, m0, t * kTile); break;
        case 2: tile_rows_avx512vnni<2>(p, wt, st, nb, m0, t * kTile); break;
        case 3: tile_rows_avx512vnni<3>(p, wt, st, nb, m0, t * kTile); break;
        case 4: tile_rows_avx512vnni<4>(p, wt, st, nb, m0, t * kTile); break;
        case 5: tile_rows_avx512vnni<5>(p, wt, st, nb, m0, t * kTile); break;
        case 6: tile_rows_avx512vnni<6>(p, wt, st, nb, m0, t * kTile); break;
        case 7: tile_rows_avx512vnni<7>(p, wt, st, nb, m0, t * kTile); break;
        default: tile_rows_avx512vnni<kRows>(p, wt, st, nb, m0, t * kTile); break;
      }
    }
  }
}
#endif

// ---- the swiglu epilogue: out[j] = (g[j] · 1/(1 + e)) · u[j], e = exp(min(−g[j], 88)) ----------------------------
// e = exp_poly(min(−g, 88)) (exp_poly.h): x ≤ 88 keeps 2^k finite.

void silu_mul_portable(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = (g[j] * (1.f / (1.f + exp_poly(std::fmin(-g[j], 88.f))))) * u[j];
}

#ifdef W4A8_X86
// n a multiple of kTile: the op's halves are whole tiles (N % 32 == 0 is checked)
__attribute__((target("avx512f"))) void silu_mul_avx512(const float* g, const float* u, float* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t j = 0; j < n; j += kTile) {
    const __m512 vg = _mm512_loadu_ps(g + j), vu = _mm512_loadu_ps(u + j);
    const __m512 x = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), vg), _mm512_set1_ps(88.f));
    const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, exp_poly16(x)));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_mul_ps(vg, s), vu));
  }
}
#endif

using TileFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t);
using SiluMulFn = void (*)(const float*, const float*, float*, int64_t);
using QuantizeFn = void (*)(const float*, int64_t, int64_t, int64_t, int8_t*, float*, int32_t*);

bool use_avx512() {
#ifdef W4A8_X86
  return !portable_forced() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

#ifdef W4A8_X86
const TileFn g_tiles = use_avx512() ? tiles_avx512vnni : tiles_portable;
const QuantizeFn g_quantize = use_avx512() ? quantize_rows_avx512 : quantize_rows_portable;
const SiluMulFn g_silu_mul = use_avx512() ? silu_mul_avx512 : silu_mul_portable;
#else
const TileFn g_tiles = tiles_portable;
const QuantizeFn g_quantize = quantize_rows_portable;
const SiluMulFn g_silu_mul = silu_mul_portable;
#endif

struct Kernel {
  explicit Kernel(const OrtKernelInfo* info) : weights(constant_input(info, 1) && constant_input(info, 2)) {
    int64_t flag = 0;
    if (Status st = attribute_int(info, "swiglu", flag)) api<void (*)(Status)>(kReleaseStatus)(st);  // default 0
    swiglu = flag != 0;
  }
  PackedWeights<Packed> weights;  // B and scales
  bool swiglu = false;
};

// Work splits into tasks of (tile group × row group); each output element still belongs to one task, computed by
// the one sequence above, so the split never changes a bit.
constexpr int64_t kRowsPerTask = 32;

struct ParallelJob {
  const Problem* p;
  const float* x;
  int64_t tiles_per_task, tiles, tile_groups;
};

void run_tiles(void* data, size_t i) {
  auto* job = static_cast<ParallelJob*>(data);
  const int64_t g = static_cast<int64_t>(i) % job->tile_groups, r = static_cast<int64_t>(i) / job->tile_groups;
  const int64_t t0 = g * job->tiles_per_task, r0 = r * kRowsPerTask;
  g_tiles(*job->p, t0, std::min(job->tiles, t0 + job->tiles_per_task), r0, std::min(job->p->m, r0 + kRowsPerTask));
}

// swiglu: a task's half-tiles t, each the gate tile t and the up tile t + tiles, into buffers of its row group, then
// the epilogue into the [m, N/2] output
void run_swiglu(void* data, size_t i) {
  auto* job = static_cast<ParallelJob*>(data);
  const Problem& p = *job->p;
  const int64_t g = static_cast<int64_t>(i) % job->tile_groups, r = static_cast<int64_t>(i) / job->tile_groups;
  const int64_t t0 = g * job->tiles_per_task, t1 = std::min(job->tiles, t0 + job->tiles_per_task);
  const int64_t r0 = r * kRowsPerTask, r1 = std::min(p.m, r0 + kRowsPerTask);
  float gate[kRowsPerTask * kTile], up[kRowsPerTask * kTile];
  for (int64_t t = t0; t < t1; ++t) {
    Problem q = p;
    q.ldy = kTile, q.row0 = r0;
    q.y = gate, q.col0 = t * kTile;
    g_tiles(q, t, t + 1, r0, r1);
    q.y = up, q.col0 = (t + job->tiles) * kTile;
    g_tiles(q, t + job->tiles, t + job->tiles + 1, r0, r1);
    for (int64_t m = r0; m < r1; ++m)
      g_silu_mul(gate + (m - r0) * kTile, up + (m - r0) * kTile, p.y + m * (p.n / 2) + t * kTile, kTile);
  }
}

void run_quantize(void* data, size_t i) {
  auto* job = static_cast<ParallelJob*>(data);
  const Problem& p = *job->p;
  const int64_t r0 = static_cast<int64_t>(i) * kRowsPerTask, r1 = std::min(p.m, r0 + kRowsPerTask);
  g_quantize(job->x, r0, r1, p.k, p.xq, p.xs, p.xsum);
}

Status compute(void* state, OrtKernelContext* ctx) {
  auto* kernel = static_cast<Kernel*>(state);
  const OrtValue *x = nullptr, *b = nullptr, *s = nullptr;
  DSPARK_TRY(input(ctx, 0, x));
  DSPARK_TRY(input(ctx, 1, b));
  DSPARK_TRY(input(ctx, 2, s));
  std::vector<int64_t> xd, bd, sd;
  int xt = 0, bt = 0, st = 0;
  DSPARK_TRY(shape_of(x, xd, xt));
  DSPARK_TRY(shape_of(b, bd, bt));
  DSPARK_TRY(shape_of(s, sd, st));
  if (xt != kFloat || bt != kUint8 || st != kFloat)
    return make_error("MatMulW4A8: expected x float32, B uint8, scales float32");
  if (bd.size() != 3 || bd[2] != kBlock / 2 || bd[0] % kTile != 0)
    return make_error("MatMulW4A8: B must be [N, K/32, 16] uint8 with N a multiple of 16 (int4, block 32)");
  const int64_t n = bd[0], nb = bd[1], k = nb * kBlock;
  int64_t s_count = 1;
  for (int64_t d : sd) s_count *= d;
  if (s_count != n * nb) return make_error("MatMulW4A8: scales must hold N*K/32 = " + std::to_string(n * nb) +
                                           " values, found " + std::to_string(s_count));
  if (xd.empty() || xd.back() != k)
    return make_error("MatMulW4A8: x's last dimension must be K = " + std::to_string(k) + ", found " +
                      (xd.empty() ? std::string("a scalar") : std::to_string(xd.back())));
  int64_t m = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) m *= xd[i];
  if (kernel->swiglu && n % (2 * kTile) != 0)
    return make_error("MatMulW4A8 with swiglu: N must be a multiple of 32 (two halves of whole 16-column tiles), "
                      "found " + std::to_string(n));
  std::vector<int64_t> yd = xd;
  yd.back() = kernel->swiglu ? n / 2 : n;
  OrtValue* y = nullptr;
  DSPARK_TRY(output(ctx, 0, yd, y));
  const float *xp = nullptr, *sp = nullptr;
  const uint8_t* bp = nullptr;
  float* yp = nullptr;
  DSPARK_TRY(data_of(x, xp));
  DSPARK_TRY(data_of(b, bp));
  DSPARK_TRY(data_of(s, sp));
  DSPARK_TRY(data_of(y, yp));
  if (m == 0) return nullptr;

  const std::shared_ptr<Packed> packed = kernel->weights.get({bp, sp, n, k}, [&] { return pack(bp, sp, n, k); });
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs;
  thread_local std::vector<int32_t> xsum;
  xq.resize(static_cast<size_t>(m * k));
  xs.resize(static_cast<size_t>(m * nb));
  xsum.resize(static_cast<size_t>(m * nb));
  Problem p{xq.data(), xs.data(), xsum.data(), m, k, n, packed.get(), yp, n};
  const int64_t tiles = kernel->swiglu ? n / kTile / 2 : n / kTile;   // the tiles a task loop runs over
  // tile groups of at least ~32k multiply-adds per row, so small layers do not pay for scheduling
  const int64_t per_task = std::max<int64_t>(1, (32768 / (kTile * k)) + 1);
  const int64_t groups = (tiles + per_task - 1) / per_task, row_groups = (m + kRowsPerTask - 1) / kRowsPerTask;
  ParallelJob job{&p, xp, per_task, tiles, groups};
  if (row_groups > 1)
    DSPARK_TRY(parallel_for(ctx, run_quantize, static_cast<size_t>(row_groups), &job));
  else
    run_quantize(&job, 0);
  return parallel_for(ctx, kernel->swiglu ? run_swiglu : run_tiles, static_cast<size_t>(groups * row_groups), &job);
}

struct Spec {
  static constexpr const char* kName = "MatMulW4A8";
  static constexpr int kInputs[] = {kFloat, kUint8, kFloat}, kOutputs[] = {kFloat};
  static constexpr size_t kRequired = 3;
};

}  // namespace

namespace dspark_cpu {
const CustomOp* matmul_w4a8_op() { return op_of<Spec, Kernel, compute>(); }
}  // namespace dspark_cpu

extern "C" {

// Direct entry points for tests and benchmarks (numpy through ctypes), same arithmetic as the op.
// swiglu: y is [m, n/2], the epilogue over the whole [m, n] product
__attribute__((visibility("default"))) void dspark_w4a8_matmul(const float* x, int64_t m, int64_t k, int64_t n,
                                                              const uint8_t* b, const float* scales, float* y,
                                                              int portable, int swiglu) {
  auto packed = pack(b, scales, n, k);
  const int64_t nb = k / kBlock;
  std::vector<int8_t> xq(static_cast<size_t>(m * k));
  std::vector<float> xs(static_cast<size_t>(m * nb));
  std::vector<int32_t> xsum(static_cast<size_t>(m * nb));
  (portable ? quantize_rows_portable : g_quantize)(x, 0, m, k, xq.data(), xs.data(), xsum.data());
  std::vector<float> full(swiglu ? static_cast<size_t>(m * n) : 0);
  Problem p{xq.data(), xs.data(), xsum.data(), m, k, n, packed.get(), swiglu ? full.data() : y, n};
  (portable ? tiles_portable : g_tiles)(p, 0, n / kTile, 0, m);
  for (int64_t row = 0; swiglu && row < m; ++row)
    (portable ? silu_mul_portable : g_silu_mul)(full.data() + row * n, full.data() + row * n + n / 2, y + row * (n / 2),
                                                n / 2);
}

__attribute__((visibility("default"))) int dspark_w4a8_vectorized() { return g_tiles != tiles_portable; }

}  // extern "C"
