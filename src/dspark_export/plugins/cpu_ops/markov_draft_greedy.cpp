// dspark.cpu::MarkovDraftGreedy: the γ greedy slots of dspark::MarkovDraft in one kernel (CPU).
//
// Per request, left to right over the slots (x_{-1} = the anchor; markov_draft/schema.py, paper Eq. 5):
//   bias_k[j] = Σ_c W2[j, c] · W1[x_{k-1}, c]     c = 0..r-1 in order, one fma each, from 0
//   L_k[j]    = U_k[j] + bias_k[j]
//   j_k       = the first j of max_j L_k[j];  x_k = d2t[j_k] (j_k without d2t)
// Inputs: base_logits U [R, γ, Vd] float32, anchor_ids [R] int64, markov_w1 [V, r] float32, markov_w2
// [Vd, r] float32, d2t [Vd] int64 (optional). Outputs: draft_ids [R, γ] int64, draft_logits L [R, γ, Vd].
// These are the values of the ONNX function's greedy branch to float rounding (its MatMul sums in MLAS's order).
// The AVX512 path and the portable one give the same bits (fma and add are exact-rounded in both; the argmax
// keeps the first index of the maximum). A request's outputs never depend on the others in the batch.
//
// Why: in the ONNX function these slots are ~25 small nodes run in an If subgraph, and each slot reads W2
// through a generic MatMul. Here W2 is packed once into blocks of 16 rows ([Vd/16, r, 16]) and each slot is
// one pass over it that fuses the bias, the add and the argmax.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "ort_api.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MARKOV_X86 1
#endif

namespace {

using namespace dspark_cpu;

constexpr int64_t kLanes = 16;

struct PackedW2 {
  int64_t vd = 0, r = 0;
  std::vector<float> w;  // [ceil(Vd/16), r, 16], rows past Vd zero
};

std::shared_ptr<PackedW2> pack_w2(const float* w2, int64_t vd, int64_t r) {
  auto p = std::make_shared<PackedW2>();
  const int64_t blocks = (vd + kLanes - 1) / kLanes;
  p->vd = vd;
  p->r = r;
  p->w.assign(static_cast<size_t>(blocks * r * kLanes), 0.f);
  for (int64_t j = 0; j < vd; ++j)
    for (int64_t c = 0; c < r; ++c) p->w[((j / kLanes) * r + c) * kLanes + j % kLanes] = w2[j * r + c];
  return p;
}

// One slot: L = u + W2·e over the Vd rows, written to `l`; returns the first index of max L.
int64_t slot_portable(const PackedW2& w, const float* e, const float* u, float* l) {
  float best_value = -std::numeric_limits<float>::infinity();
  int64_t best = 0;
  for (int64_t j = 0; j < w.vd; ++j) {
    const float* wj = w.w.data() + (j / kLanes) * w.r * kLanes + j % kLanes;
    float acc = 0.f;
    for (int64_t c = 0; c < w.r; ++c) acc = std::fma(wj[c * kLanes], e[c], acc);
    l[j] = u[j] + acc;
    if (l[j] > best_value) best_value = l[j], best = j;
  }
  return best;
}

#ifdef MARKOV_X86
__attribute__((target("avx512f"))) int64_t slot_avx512(const PackedW2& w, const float* e, const float* u,
                                                       float* l) {
  const int64_t blocks = (w.vd + kLanes - 1) / kLanes;
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i vidx = _mm512_setzero_si512();
  for (int64_t b = 0; b < blocks; ++b) {
    const float* wb = w.w.data() + b * w.r * kLanes;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < w.r; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(wb + c * kLanes), _mm512_set1_ps(e[c]), acc);
    const int64_t j0 = b * kLanes, count = std::min(kLanes, w.vd - j0);
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1u);
    const __m512 lv = _mm512_add_ps(_mm512_maskz_loadu_ps(valid, u + j0), acc);
    _mm512_mask_storeu_ps(l + j0, valid, lv);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(valid, lv, vmax, _CMP_GT_OQ);
    vmax = _mm512_mask_mov_ps(vmax, gt, lv);
    vidx = _mm512_mask_mov_epi32(vidx, gt, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j0)), iota));
  }
  // each lane holds its first index of its maximum; the first index of the overall maximum is the least of
  // the lanes' indices whose maximum equals it
  const float top = _mm512_reduce_max_ps(vmax);
  const __mmask16 at_top = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(top), _CMP_EQ_OQ);
  if (!at_top) return 0;  // every value NaN or -inf: index 0, as the portable scan gives
  return _mm512_mask_reduce_min_epi32(at_top, vidx);
}
#endif

using SlotFn = int64_t (*)(const PackedW2&, const float*, const float*, float*);

bool use_avx512() {
#ifdef MARKOV_X86
  return !portable_forced() && __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

#ifdef MARKOV_X86
const SlotFn g_slot = use_avx512() ? slot_avx512 : slot_portable;
#else
const SlotFn g_slot = slot_portable;
#endif

struct Problem {
  const float* u;       // [R, γ, Vd]
  const int64_t* anchor;  // [R]
  const float* w1;      // [V, r]
  int64_t v, g;
  const int64_t* d2t;   // [Vd] or nullptr
  const PackedW2* w2;
  int64_t* ids;         // [R, γ]
  float* logits;        // [R, γ, Vd]
  SlotFn slot;
  std::atomic<int64_t> bad_request{-1};  // a request whose previous token fell outside [0, V)
  std::atomic<int64_t> bad_id{0};
};

void draft_request(void* data, size_t i) {
  auto& p = *static_cast<Problem*>(data);
  const int64_t req = static_cast<int64_t>(i), vd = p.w2->vd;
  int64_t prev = p.anchor[req];
  for (int64_t k = 0; k < p.g; ++k) {
    if (prev < 0 || prev >= p.v) {
      p.bad_id = prev;
      p.bad_request = req;
      return;
    }
    const int64_t row = req * p.g + k;
    const int64_t j = p.slot(*p.w2, p.w1 + prev * p.w2->r, p.u + row * vd, p.logits + row * vd);
    prev = p.d2t ? p.d2t[j] : j;
    p.ids[row] = prev;
  }
}

struct Kernel {
  explicit Kernel(const OrtKernelInfo* info) : weights(constant_input(info, 3)) {}
  PackedWeights<PackedW2> weights;  // markov_w2
};

Status compute(void* state, OrtKernelContext* ctx) {
  auto* kernel = static_cast<Kernel*>(state);
  size_t count = 0;
  DSPARK_TRY(input_count(ctx, count));
  const OrtValue* in[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};
  for (size_t i = 0; i < std::min<size_t>(count, 5); ++i) DSPARK_TRY(input(ctx, i, in[i]));
  static const char* names[5] = {"base_logits", "anchor_ids", "markov_w1", "markov_w2", "d2t"};
  static const int types[5] = {kFloat, kInt64, kFloat, kFloat, kInt64};
  static const size_t ranks[5] = {3, 1, 2, 2, 1};
  std::vector<int64_t> d[5];
  for (int i = 0; i < 5; ++i) {
    if (!in[i]) {
      if (i < 4) return make_error(std::string("MarkovDraftGreedy: input '") + names[i] + "' is required");
      continue;
    }
    int t = 0;
    DSPARK_TRY(shape_of(in[i], d[i], t));
    if (t != types[i] || d[i].size() != ranks[i])
      return make_error(std::string("MarkovDraftGreedy input '") + names[i] + "': expected rank " +
                        std::to_string(ranks[i]) + (types[i] == kFloat ? " float32" : " int64") +
                        ", found rank " + std::to_string(d[i].size()) + " of element type " + std::to_string(t));
  }
  const int64_t rq = d[0][0], g = d[0][1], vd = d[0][2], v = d[2][0], r = d[2][1];
  if (d[1][0] != rq || d[3][0] != vd || d[3][1] != r || (in[4] && d[4][0] != vd))
    return make_error("MarkovDraftGreedy: expected base_logits [R, γ, Vd], anchor_ids [R], markov_w1 [V, r], "
                      "markov_w2 [Vd, r], d2t [Vd]; found " + dims_text(d[0]) + ", " + dims_text(d[1]) + ", " +
                      dims_text(d[2]) + ", " + dims_text(d[3]) + (in[4] ? ", " + dims_text(d[4]) : ""));
  if (!in[4] && vd != v)
    return make_error("MarkovDraftGreedy: without d2t the slots run over V, so markov_w1 [V, r] must have V = Vd = " +
                      std::to_string(vd) + ", found " + std::to_string(v));
  OrtValue *ids = nullptr, *logits = nullptr;
  DSPARK_TRY(output(ctx, 0, {rq, g}, ids));
  DSPARK_TRY(output(ctx, 1, d[0], logits));
  Problem p{};
  const float *w2 = nullptr;
  DSPARK_TRY(data_of(in[0], p.u));
  DSPARK_TRY(data_of(in[1], p.anchor));
  DSPARK_TRY(data_of(in[2], p.w1));
  DSPARK_TRY(data_of(in[3], w2));
  if (in[4]) DSPARK_TRY(data_of(in[4], p.d2t));
  DSPARK_TRY(data_of(ids, p.ids));
  DSPARK_TRY(data_of(logits, p.logits));
  if (rq == 0 || g == 0) return nullptr;
  const std::shared_ptr<PackedW2> packed = kernel->weights.get({w2, nullptr, vd, r}, [&] { return pack_w2(w2, vd, r); });
  p.v = v, p.g = g, p.w2 = packed.get(), p.slot = g_slot;
  if (rq > 1)
    DSPARK_TRY(parallel_for(ctx, draft_request, static_cast<size_t>(rq), &p));
  else
    draft_request(&p, 0);
  if (p.bad_request >= 0)
    return make_error("MarkovDraftGreedy: request " + std::to_string(p.bad_request) + " feeds token id " +
                      std::to_string(p.bad_id) + " to markov_w1, outside [0, V=" + std::to_string(v) +
                      ") (anchor_ids or d2t out of range)");
  return nullptr;
}

struct Spec {
  static constexpr const char* kName = "MarkovDraftGreedy";
  static constexpr int kInputs[] = {kFloat, kInt64, kFloat, kFloat, kInt64}, kOutputs[] = {kInt64, kFloat};
  static constexpr size_t kRequired = 4;  // d2t is optional
};

}  // namespace

namespace dspark_cpu {
const CustomOp* markov_draft_greedy_op() { return op_of<Spec, Kernel, compute>(); }
}  // namespace dspark_cpu

extern "C" {

// Direct entry point for tests and benchmarks (numpy through ctypes), same arithmetic as the op. d2t may be
// null. Returns 0, or -1 when a token fed to W1 is outside [0, V).
__attribute__((visibility("default"))) int dspark_markov_draft_greedy(const float* u, int64_t rq, int64_t g,
                                                                     int64_t vd, const int64_t* anchor,
                                                                     const float* w1, int64_t v, int64_t r,
                                                                     const float* w2, const int64_t* d2t,
                                                                     int64_t* ids, float* logits, int portable) {
  auto packed = pack_w2(w2, vd, r);
  Problem p{};
  p.u = u, p.anchor = anchor, p.w1 = w1, p.v = v, p.g = g, p.d2t = d2t, p.w2 = packed.get(), p.ids = ids;
  p.logits = logits, p.slot = portable ? slot_portable : g_slot;
  for (int64_t i = 0; i < rq && p.bad_request < 0; ++i) draft_request(&p, static_cast<size_t>(i));
  return p.bad_request >= 0 ? -1 : 0;
}

}  // extern "C"
