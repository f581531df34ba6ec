// dspark.cpu::RaggedAttention: the target's attention over a packed ragged batch, reading the KV cache in place.
//
// Inputs: q [1, N, nH·D] and k, v [1, N, kvH·D] float32 (this pass's rows, after RoPE; request r owns packed
// rows query_start[r] .. query_start[r+1]-1), past_key, past_value [R, kvH, P, D] float32 (entries at or past
// cache_lens[r] are ignored), query_start [R+1] int64, cache_lens [R] int64. Attributes: scale (float), causal
// (int, default 1). Output: [1, N, nH·D] float32.
//
// Row j of request r, head h (kv head h / (nH/kvH), grouped-query attention) attends to the keys
// t = 0 .. L + j, L = cache_lens[r] (causal; with causal 0, to all L + rows keys: the drafter block's
// bidirectional attention over its context, DSpark §3.1): the cache's for t < L, this pass's row
// query_start[r] + t - L after:
//   s_t = scale · (q · K_t),   e_t = exp(s_t − max s),   out = (Σ_t e_t V_t) / (Σ_t e_t)
// Every sum runs over t in increasing order (the dot over D in 16 lane partials, then a fixed tree), so a row's
// output depends only on its own keys' values, never on where they sit (cache or this pass), on the other
// requests, on P or on the thread split: a verification row equals the decode row of the same token bit for
// bit, as the exact-attention contract (exporter/target.py: `_exact_attention`) asks. The vectorized path and
// the portable one run the same element-wise operations (no reassociation), so they give the same bits.
//
// Why: in ONNX ops the attention was ~25 nodes a layer over the whole capacity P (masked), with gathers and
// scatters to keep the sums in order. Here it reads only the live entries.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "exp_poly.h"
#include "ort_api.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ATTENTION_X86 1
#endif

namespace {

using namespace dspark_cpu;

constexpr int64_t kLanes = 16;

struct Problem {
  const float *q, *k, *v, *past_key, *past_value;
  const int64_t *query_start, *cache_lens;
  float* out;
  int64_t num_heads, kv_heads, head_dim, capacity;
  float scale;
  bool causal;
};

// ---- the arithmetic, element-wise identical in both paths ------------------------------------------------------
// For one (request r, kv head g): its G query heads × its rows, row a = j·G + gh (head g·G + gh, row j) attending
// to keys t ≤ L + j, so each key and value row is read once for all of them. Scores s [n, keys] (n = rows·G):
//   dot: 16 lane partials over D (lane l sums d ≡ l mod 16 in increasing d, one fma each), then the tree
//        l += l+8, l += l+4, l += l+2, l += l+1; times scale.
//   exp: e = 2^k · p(x − k·ln 2) (ln 2 in two parts), k = nearest(x·log2 e), p a degree-6 Horner polynomial;
//        0 for x < −88 (x = s − max ≤ 0).
//   total: 16 lane partials over t (t mod 16, increasing t), then the same tree.
//   values: acc[a] = fma(e[a, t], V_t, acc[a]) over increasing t; out = acc / total.
// (exp: exp_poly.h, shared with MatMulW4A8's swiglu.)

struct Group {  // one (request, kv head)
  const float *pk, *pv;  // the cache rows of kv head g, [P, D]
  const float *q, *k, *v;  // this pass's rows of request r (q at its first row; k, v at kv head g)
  int64_t len, rows, group, keys, d, q_stride, kv_stride;
  int64_t a0, a1;  // the rows this task computes; s, acc and total are indexed by a − a0
  bool causal;
  const float* key(int64_t t) const { return t < len ? pk + t * d : k + (t - len) * kv_stride; }
  const float* value(int64_t t) const { return t < len ? pv + t * d : v + (t - len) * kv_stride; }
  const float* query(int64_t a) const { return q + (a / group) * q_stride + (a % group) * d; }
  int64_t first_row(int64_t t) const {  // the first row that sees key t
    return causal ? std::max<int64_t>(0, t - len) * group : 0;
  }
  int64_t live(int64_t a) const { return causal ? len + a / group + 1 : keys; }  // the keys row a sees
};

struct Portable {
  static float tree(float* part) {
    for (int64_t w = kLanes / 2; w > 0; w /= 2)
      for (int64_t l = 0; l < w; ++l) part[l] += part[l + w];
    return part[0];
  }
  static void scores(const Group& w, float scale, float* s) {
    for (int64_t t = 0; t < w.keys; ++t)
      for (int64_t a = std::max(w.first_row(t), w.a0); a < w.a1; ++a) {
        const float *q = w.query(a), *k = w.key(t);
        float part[kLanes] = {};
        for (int64_t c = 0; c < w.d; c += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) part[l] = std::fma(q[c + l], k[c + l], part[l]);
        s[(a - w.a0) * w.keys + t] = tree(part) * scale;
      }
  }
  static float softmax_row(float* s, int64_t n) {  // s -> e; returns the total
    float top = -INFINITY, part[kLanes] = {};
    for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
    for (int64_t t = 0; t < n; ++t) part[t % kLanes] += (s[t] = exp_poly(s[t] - top));
    return tree(part);
  }
  static void values(const Group& w, const float* e, float* acc) {
    for (int64_t t = 0; t < w.keys; ++t)
      for (int64_t a = std::max(w.first_row(t), w.a0); a < w.a1; ++a) {
        const float *v = w.value(t), ea = e[(a - w.a0) * w.keys + t];
        float* out = acc + (a - w.a0) * w.d;
        for (int64_t c = 0; c < w.d; ++c) out[c] = std::fma(ea, v[c], out[c]);
      }
  }
};

#ifdef ATTENTION_X86
#define AVX512 __attribute__((target("avx512f,fma"))) static
struct Avx512 {
  // the lanes of the 16 elements from i when `left` remain: all 16, or the first `left`
  AVX512 inline __mmask16 tail_mask(int64_t left) {
    return left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
  }
  AVX512 inline float tree(__m512 v) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
  }
  // 16 keys' partials reduced at once by the same tree: each add below is one of the tree's additions, for
  // two keys side by side. The result's lane 4q + m holds key 4m + q.
  AVX512 inline __m512 tree16(const __m512* p) {
    __m512 c[8], f[4], g[2];
    for (int i = 0; i < 8; ++i)   // l += l + 8
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x44), _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)   // l += l + 4
      f[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)   // l += l + 2
      g[i] = _mm512_add_ps(_mm512_shuffle_ps(f[2 * i], f[2 * i + 1], 0x44), _mm512_shuffle_ps(f[2 * i], f[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));  // l += l + 1
  }
  // 16 keys of one row: lane partials part[i] of key t + i over D (q in registers when D = 64, the common head
  // size), reduced by tree16; the keys are read from L1 again for each of a task's rows
  template <int D>
  AVX512 void scores_d(const Group& w, float scale, float* s) {
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512 vscale = _mm512_set1_ps(scale);
    const int64_t d = D ? D : w.d;
    for (int64_t a = w.a0; a < w.a1; ++a) {
      const float* q = w.query(a);
      __m512 qv[4];
      if (D) for (int64_t c = 0; c < D / kLanes; ++c) qv[c] = _mm512_loadu_ps(q + c * kLanes);
      float* row = s + (a - w.a0) * w.keys;
      const int64_t live = w.live(a);
      for (int64_t t = 0; t < live; t += kLanes) {
        // 16 keys at once; past the last live key the block repeats it (readable memory) and its lanes are not
        // stored: each key's lane sums only its own partials, so the padding changes no bit of the others
        __m512 part[kLanes];
        const float* k[kLanes];
        for (int64_t i = 0; i < kLanes; ++i) k[i] = w.key(std::min(t + i, live - 1)), part[i] = _mm512_setzero_ps();
        // each key's partials still add over c in increasing order; the keys interleave, so the fma chains overlap
        for (int64_t c = 0; c < d; c += kLanes) {
          const __m512 qc = D ? qv[c / kLanes] : _mm512_loadu_ps(q + c);
          for (int64_t i = 0; i < kLanes; ++i) part[i] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k[i] + c), part[i]);
        }
        const __mmask16 m = tail_mask(live - t);
        _mm512_mask_storeu_ps(row + t, m, _mm512_mul_ps(_mm512_permutexvar_ps(order, tree16(part)), vscale));
      }
    }
  }
  AVX512 void scores(const Group& w, float scale, float* s) {
    if (w.d == 64) scores_d<64>(w, scale, s);
    else scores_d<0>(w, scale, s);
  }
  AVX512 float softmax_row(float* s, int64_t n) {
    // max in 16 lanes: exact in any order (a ±0 tie gives exp(±0) = 1 either way)
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += kLanes) {
      const __mmask16 m = tail_mask(n - i);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, s + i));
    }
    const __m512 vt = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 part = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += kLanes) {
      const __mmask16 m = tail_mask(n - i);
      const __m512 e = exp_poly16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), vt));
      _mm512_mask_storeu_ps(s + i, m, e);
      part = _mm512_mask_add_ps(part, m, part, e);
    }
    return tree(part);
  }
  // N row-heads of one row (the same live keys) side by side: each value row is loaded once for all of them, every
  // accumulator still adds one fma a key in increasing t
  template <int N>
  AVX512 void values_n(const Group& w, const float* e, float* acc, int64_t a) {
    const int64_t live = w.live(a);
    const float* ew = e + (a - w.a0) * w.keys;
    for (int64_t c = 0; c < w.d; c += 4 * kLanes) {
      if (w.d - c >= 4 * kLanes) values_cols<N, 4>(w, ew, acc + (a - w.a0) * w.d + c, live, c);
      else if (w.d - c >= 3 * kLanes) values_cols<N, 3>(w, ew, acc + (a - w.a0) * w.d + c, live, c);
      else if (w.d - c >= 2 * kLanes) values_cols<N, 2>(w, ew, acc + (a - w.a0) * w.d + c, live, c);
      else values_cols<N, 1>(w, ew, acc + (a - w.a0) * w.d + c, live, c);
    }
  }
  // columns c .. c + 16·V of N row-heads; N and V compile-time, so the N·V accumulators stay in registers (with a
  // runtime width they lived in memory, a store and a load around every fma)
  template <int N, int V>
  AVX512 void values_cols(const Group& w, const float* ew, float* out, int64_t live, int64_t c) {
    __m512 r[N][V];
    for (int n = 0; n < N; ++n)
      for (int i = 0; i < V; ++i) r[n][i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < live; ++t) {
      const float* v = w.value(t) + c;
      __m512 vv[V];
      for (int i = 0; i < V; ++i) vv[i] = _mm512_loadu_ps(v + i * kLanes);
      for (int n = 0; n < N; ++n) {
        const __m512 ea = _mm512_set1_ps(ew[n * w.keys + t]);
        for (int i = 0; i < V; ++i) r[n][i] = _mm512_fmadd_ps(ea, vv[i], r[n][i]);
      }
    }
    for (int n = 0; n < N; ++n)
      for (int i = 0; i < V; ++i) _mm512_storeu_ps(out + n * w.d + i * kLanes, r[n][i]);
  }
  AVX512 void values(const Group& w, const float* e, float* acc) {
    for (int64_t a = w.a0; a < w.a1;) {
      // the row-heads from a to the end of its row (or of the task), at most 4 at once
      const int64_t n = std::min<int64_t>({4, w.a1 - a, w.group - a % w.group});
      switch (n) {
        case 1: values_n<1>(w, e, acc, a); break;
        case 2: values_n<2>(w, e, acc, a); break;
        case 3: values_n<3>(w, e, acc, a); break;
        default: values_n<4>(w, e, acc, a); break;
      }
      a += n;
    }
  }
};
#undef AVX512
#endif

// Rows [a0, a1) of one (request r, kv head g): row a = j·G + gh is head g·G + gh of the request's row j.
template <class K>
void attend(const Problem* pp, int64_t r, int64_t g, int64_t a0, int64_t a1, std::vector<float>& scratch) {
  const Problem& p = *pp;
  Group w{};
  w.d = p.head_dim, w.group = p.num_heads / p.kv_heads, w.len = p.cache_lens[r], w.causal = p.causal;
  const int64_t first = p.query_start[r];
  w.rows = p.query_start[r + 1] - first, w.keys = w.len + w.rows, w.a0 = a0, w.a1 = a1;
  const int64_t n = a1 - a0;
  if (n <= 0) return;
  w.q_stride = p.num_heads * w.d, w.kv_stride = p.kv_heads * w.d;
  w.pk = p.past_key + ((r * p.kv_heads + g) * p.capacity) * w.d;
  w.pv = p.past_value + ((r * p.kv_heads + g) * p.capacity) * w.d;
  w.q = p.q + first * w.q_stride + g * w.group * w.d;
  w.k = p.k + first * w.kv_stride + g * w.d;
  w.v = p.v + first * w.kv_stride + g * w.d;
  scratch.assign(static_cast<size_t>(n * (w.keys + w.d + 1)), 0.f);
  float* s = scratch.data();          // [n, keys] scores, then weights
  float* acc = s + n * w.keys;        // [n, D]
  float* total = acc + n * w.d;       // [n]
  K::scores(w, p.scale, s);
  for (int64_t a = a0; a < a1; ++a) total[a - a0] = K::softmax_row(s + (a - a0) * w.keys, w.live(a));
  K::values(w, s, acc);
  for (int64_t a = a0; a < a1; ++a) {
    float* o = p.out + (first + a / w.group) * w.q_stride + (g * w.group + a % w.group) * w.d;
    for (int64_t c = 0; c < w.d; ++c) o[c] = acc[(a - a0) * w.d + c] / total[a - a0];
  }
}

using AttendFn = void (*)(const Problem*, int64_t, int64_t, int64_t, int64_t, std::vector<float>&);

AttendFn pick() {
#ifdef ATTENTION_X86
  if (!portable_forced() && __builtin_cpu_supports("avx512f")) return attend<Avx512>;
#endif
  return attend<Portable>;
}

const AttendFn g_attend = pick();

// A task is one row j of a request for the G heads of one kv head (each key read once for the G of them), or,
// when that gives fewer than kMinTasks tasks (a lone decode row), one row and one head: an even split over
// the threads matters more there than reading a key G times from cache.
constexpr int64_t kMinTasks = 8;

struct Task {
  int64_t r, g, a0, a1;
};

struct Job {
  const Problem* p;
  AttendFn attend;
  std::vector<Task>& tasks;
};

void run_task(void* data, size_t i) {
  auto* job = static_cast<Job*>(data);
  thread_local std::vector<float> scratch;
  const Task& t = job->tasks[i];
  job->attend(job->p, t.r, t.g, t.a0, t.a1, scratch);
}

struct Kernel {
  explicit Kernel(const OrtKernelInfo* info) {
    if (Status st = attribute_float(info, "scale", scale)) {
      api<void (*)(Status)>(kReleaseStatus)(st);
      scale = NAN;  // compute() names the missing attribute
    }
    int64_t flag = 1;
    if (Status st = attribute_int(info, "causal", flag)) api<void (*)(Status)>(kReleaseStatus)(st);  // default 1
    causal = flag != 0;
  }
  float scale = NAN;
  bool causal = true;
};

// Checks the shapes and the ragged layout; `heads` gets nH.
Status check(const std::vector<int64_t> (&d)[7], const int64_t* qs, const int64_t* lens, int64_t& heads) {
  const auto& pk = d[3];
  const std::string found = " (q " + dims_text(d[0]) + ", k " + dims_text(d[1]) + ", v " + dims_text(d[2]) +
                            ", past_key " + dims_text(pk) + ", past_value " + dims_text(d[4]) + ", query_start " +
                            dims_text(d[5]) + ", cache_lens " + dims_text(d[6]) + ")";
  if (d[0].size() != 3 || d[1].size() != 3 || d[2].size() != 3 || pk.size() != 4 || d[4] != pk ||
      d[5].size() != 1 || d[6].size() != 1)
    return make_error("RaggedAttention: expected q [1, N, nH·D], k and v [1, N, kvH·D], past_key and past_value "
                      "[R, kvH, P, D], query_start [R+1], cache_lens [R]" + found);
  const int64_t r = pk[0], kvh = pk[1], p = pk[2], dim = pk[3], n = d[0][1];
  if (dim % kLanes || dim > 512 || kvh < 1 || d[0][2] % (kvh * dim) || d[1] != std::vector<int64_t>{1, n, kvh * dim} ||
      d[2] != d[1] || d[0][0] != 1 || d[5][0] != r + 1 || d[6][0] != r)
    return make_error("RaggedAttention: shapes do not fit together (D a multiple of 16 up to 512, nH a multiple "
                      "of kvH)" + found);
  heads = d[0][2] / dim;
  if (qs[0] != 0 || qs[r] != n)
    return make_error("RaggedAttention input 'query_start': expected 0 .. N = " + std::to_string(n) + found);
  for (int64_t i = 0; i < r; ++i) {
    if (qs[i + 1] < qs[i])
      return make_error("RaggedAttention input 'query_start': expected non-decreasing values, found " +
                        std::to_string(qs[i]) + " then " + std::to_string(qs[i + 1]));
    if (lens[i] < 0 || lens[i] > p)
      return make_error("RaggedAttention input 'cache_lens': request " + std::to_string(i) + " has " +
                        std::to_string(lens[i]) + " entries, outside [0, P=" + std::to_string(p) + "]");
  }
  return nullptr;
}

Status compute(void* state, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<Kernel*>(state);
  const float scale = kernel.scale;
  if (std::isnan(scale)) return make_error("RaggedAttention: the node has no float attribute 'scale'");
  const OrtValue* in[7] = {};
  std::vector<int64_t> d[7];
  for (size_t i = 0; i < 7; ++i) {
    int type = 0;
    DSPARK_TRY(input(ctx, i, in[i]));
    DSPARK_TRY(shape_of(in[i], d[i], type));
    if (type != (i < 5 ? kFloat : kInt64))
      return make_error("RaggedAttention input " + std::to_string(i) + ": expected " + (i < 5 ? "float32" : "int64"));
  }
  Problem p{};
  DSPARK_TRY(data_of(in[0], p.q));
  DSPARK_TRY(data_of(in[1], p.k));
  DSPARK_TRY(data_of(in[2], p.v));
  DSPARK_TRY(data_of(in[3], p.past_key));
  DSPARK_TRY(data_of(in[4], p.past_value));
  DSPARK_TRY(data_of(in[5], p.query_start));
  DSPARK_TRY(data_of(in[6], p.cache_lens));
  int64_t heads = 0;
  DSPARK_TRY(check(d, p.query_start, p.cache_lens, heads));
  OrtValue* out = nullptr;
  DSPARK_TRY(output(ctx, 0, d[0], out));
  DSPARK_TRY(data_of(out, p.out));
  p.num_heads = heads, p.kv_heads = d[3][1], p.head_dim = d[3][3], p.capacity = d[3][2], p.scale = scale;
  p.causal = kernel.causal;
  thread_local std::vector<Task> tasks;   // reused: this runs once a layer every pass
  tasks.clear();
  Job job{&p, g_attend, tasks};
  const int64_t group = heads / p.kv_heads;
  const int64_t width = d[0][1] * p.kv_heads >= kMinTasks ? group : 1;   // query rows (heads of a row) per task
  for (int64_t r = 0; r < d[3][0]; ++r)
    for (int64_t g = 0; g < p.kv_heads; ++g)
      for (int64_t a = 0; a < (p.query_start[r + 1] - p.query_start[r]) * group; a += width)
        tasks.push_back({r, g, a, a + width});
  if (tasks.empty()) return nullptr;
  return parallel_for(ctx, run_task, tasks.size(), &job);
}

struct Spec {
  static constexpr const char* kName = "RaggedAttention";
  static constexpr int kInputs[] = {kFloat, kFloat, kFloat, kFloat, kFloat, kInt64, kInt64}, kOutputs[] = {kFloat};
  static constexpr size_t kRequired = 7;
};

}  // namespace

namespace dspark_cpu {
const CustomOp* ragged_attention_op() { return op_of<Spec, Kernel, compute>(); }
}  // namespace dspark_cpu

extern "C" {

// Direct entry point for tests (numpy through ctypes): the op's arithmetic on one batch. Returns 0.
__attribute__((visibility("default"))) int dspark_ragged_attention(const float* q, const float* k, const float* v,
                                                                  const float* past_key, const float* past_value,
                                                                  const int64_t* query_start,
                                                                  const int64_t* cache_lens, int64_t requests,
                                                                  int64_t num_heads, int64_t kv_heads,
                                                                  int64_t head_dim, int64_t capacity, float scale,
                                                                  int causal, float* out, int portable) {
  Problem p{q, k, v, past_key, past_value, query_start, cache_lens, out, num_heads, kv_heads, head_dim, capacity,
            scale, causal != 0};
  std::vector<float> scratch;
  for (int64_t r = 0; r < requests; ++r)
    for (int64_t g = 0; g < kv_heads; ++g)
      (portable ? attend<Portable> : g_attend)(&p, r, g, 0, (query_start[r + 1] - query_start[r]) * (num_heads / kv_heads),
                                               scratch);
  return 0;
}

}  // extern "C"
