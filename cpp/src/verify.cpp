// Native acceptance rule, operation for operation as plugins/common.py and
// plugins/speculative_verify/reference.py do it in numpy float32.
#include "dspark/verify.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

namespace dspark {
namespace {

float SumF32(const float* x, int64_t n) {
  double acc = 0.0;  // a float64 accumulator: within the rounding of numpy's pairwise float32 sum
  for (int64_t i = 0; i < n; ++i) acc += x[i];
  return static_cast<float>(acc);
}

Status Invalid(const std::string& what) {
  return Status(StatusCode::kInvalidArgument, "SpeculativeVerify " + what);
}

}  // namespace

void WarpProbs(const float* logits, int64_t vocab, float temperature, int64_t top_k, float top_p, float* probs) {
  if (temperature == 0.0f) {
    int64_t best = std::max_element(logits, logits + vocab) - logits;  // first index on ties
    std::fill(probs, probs + vocab, 0.0f);
    probs[best] = 1.0f;
    return;
  }
  std::vector<float> scaled(logits, logits + vocab);
  for (float& v : scaled) v = v / temperature;
  if (top_k > 0) {
    std::vector<float> desc(scaled);
    int64_t k = std::min<int64_t>(std::max<int64_t>(top_k, 1), vocab);
    std::nth_element(desc.begin(), desc.begin() + (k - 1), desc.end(), std::greater<float>());
    float kth = desc[k - 1];
    for (float& v : scaled)
      if (!(v >= kth)) v = -std::numeric_limits<float>::infinity();
  }
  float mx = *std::max_element(scaled.begin(), scaled.end());
  for (int64_t i = 0; i < vocab; ++i) probs[i] = std::exp(scaled[i] - mx);
  float total = SumF32(probs, vocab);
  for (int64_t i = 0; i < vocab; ++i) probs[i] = probs[i] / total;
  // top-p on a stable descending order; exclusive cumulative sum as a sequential float32 cumsum
  std::vector<int64_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return -probs[a] < -probs[b]; });
  std::vector<char> keep(vocab, 0);
  float inclusive = 0.0f;
  for (int64_t i = 0; i < vocab; ++i) {
    float exclusive = inclusive;
    inclusive += probs[order[i]];
    keep[order[i]] = (i == 0) || exclusive < top_p || top_p >= 1.0f;
  }
  for (int64_t i = 0; i < vocab; ++i)
    if (!keep[i]) probs[i] = 0.0f;
  float kept = SumF32(probs, vocab);
  for (int64_t i = 0; i < vocab; ++i) probs[i] = probs[i] / kept;
}

int64_t SampleFromProbs(const float* probs, int64_t vocab, float uniform) {
  std::vector<float> cumulative(vocab);
  float acc = 0.0f;
  for (int64_t i = 0; i < vocab; ++i) cumulative[i] = (acc += probs[i]);
  const float threshold = uniform * cumulative[vocab - 1];
  int64_t count = 0;
  for (int64_t i = 0; i < vocab; ++i) count += cumulative[i] <= threshold;
  int64_t last_nonzero = 0;
  for (int64_t i = vocab - 1; i >= 0; --i) {
    if (probs[i] > 0) { last_nonzero = i; break; }
  }
  return std::min(count, last_nonzero);
}

Status SpeculativeVerify(const VerifyRequest& q, VerifyResult* result) {
  if (q.gamma < 1) return Invalid("input 'draft_ids': expected gamma >= 1 draft slots, found " + std::to_string(q.gamma));
  if (q.vocab < 1) return Invalid("input 'target_logits': expected V >= 1, found " + std::to_string(q.vocab));
  if (q.verify_len < 0 || q.verify_len > q.gamma) {
    return Invalid("input 'verify_lens': expected a value in [0, gamma=" + std::to_string(q.gamma) + "], found " +
                   std::to_string(q.verify_len));
  }
  if (!q.target_logits || !q.uniforms || (!q.draft_logits && q.verify_len > 0) || (!q.draft_ids && q.verify_len > 0)) {
    return Invalid("inputs: target_logits, uniforms, and (for verify_len > 0) draft_logits and draft_ids are required");
  }
  if (!(std::isfinite(q.temperature) && q.temperature >= 0)) {
    return Invalid("input 'temperature': every value must be finite and >= 0, found " + std::to_string(q.temperature));
  }
  if (q.top_k < 0) return Invalid("input 'top_k': every value must be >= 0, found " + std::to_string(q.top_k));
  if (!(q.top_p >= 0 && q.top_p <= 1)) {
    return Invalid("input 'top_p': every value must be in [0, 1], found " + std::to_string(q.top_p));
  }
  for (int64_t j = 0; j <= q.gamma; ++j) {
    if (!(q.uniforms[j] >= 0 && q.uniforms[j] < 1)) {
      return Invalid("input 'uniforms': every value must be in [0, 1), found " + std::to_string(q.uniforms[j]));
    }
  }
  for (int64_t j = 0; j < q.verify_len; ++j) {
    if (q.draft_ids[j] < 0 || q.draft_ids[j] >= q.vocab) {
      return Invalid("input 'draft_ids': expected verified ids in [0, V=" + std::to_string(q.vocab) + "), found " +
                     std::to_string(q.draft_ids[j]));
    }
  }
  const int64_t V = q.vocab;
  std::vector<float> p(V), d(V);
  int64_t accepted = 0;
  for (; accepted < q.verify_len; ++accepted) {
    WarpProbs(q.target_logits + accepted * V, V, q.temperature, q.top_k, q.top_p, p.data());
    WarpProbs(q.draft_logits + accepted * V, V, q.temperature, q.top_k, q.top_p, d.data());
    const int64_t x = q.draft_ids[accepted];
    if (!(q.uniforms[accepted] * d[x] < p[x])) break;
  }
  const bool rejected = accepted < q.verify_len;
  WarpProbs(q.target_logits + accepted * V, V, q.temperature, q.top_k, q.top_p, p.data());
  std::vector<float> next(p);
  if (rejected) {
    WarpProbs(q.draft_logits + std::min(accepted, q.gamma - 1) * V, V, q.temperature, q.top_k, q.top_p, d.data());
    std::vector<float> residual(V);
    for (int64_t i = 0; i < V; ++i) residual[i] = std::max(p[i] - d[i], 0.0f);
    if (SumF32(residual.data(), V) > 0) next = std::move(residual);
  }
  result->num_accepted = accepted;
  result->next_id = SampleFromProbs(next.data(), V, q.uniforms[q.gamma]);
  return Status::Ok();
}

}  // namespace dspark
