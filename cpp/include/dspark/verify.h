// dspark/verify.h: the lossless acceptance rule on host-side logits, natively (one request).
//
// A C++ port of `dspark_export.plugins.speculative_verify.reference` (the spec of the
// `dspark::SpeculativeVerify` op) and of the shared warping in `plugins/common.py`, for a C++ service
// that verifies on the host. Sources: Leviathan et al. 2023 (arXiv 2211.17192, Algorithm 1); DSpark
// paper §2; DeepSpec `verify_draft_tokens`. Everything is float32, as in the reference.
#pragma once

#include <cstdint>
#include <vector>

#include "dspark/status.h"

namespace dspark {

// The sampling distribution of one row of logits [V] (ARCHITECTURE.md "The two ops"):
// temperature 0 → one-hot at the first argmax. Otherwise l/T → top-k (keep values ≥ the k-th largest;
// 0 = off) → softmax → top-p (stable descending sort, keep tokens whose exclusive cumulative probability
// is < top_p, the top-1 always kept; 1 = off) → renormalise. probs: [V] float32 written.
void WarpProbs(const float* logits, int64_t vocab, float temperature, int64_t top_k, float top_p, float* probs);

// The first index i with cumsum(p)_i > u · Σp (Σp = the last cumulative sum); never an index with p = 0.
int64_t SampleFromProbs(const float* probs, int64_t vocab, float uniform);

// One request's verification inputs. Row-major arrays, not owned.
struct VerifyRequest {
  int64_t vocab = 0;                   // V
  int64_t gamma = 0;                   // γ ≥ 1 draft slots
  int64_t verify_len = 0;              // ℓ in [0, γ]: drafts 0..ℓ-1 are verified
  const float* target_logits = nullptr;  // [ℓ+1, V]: the target's rows for the anchor and each verified draft
  const float* draft_logits = nullptr;   // [γ, V]: the logits each draft was drawn from (before warping)
  const int64_t* draft_ids = nullptr;    // [γ]: drafts (entries ≥ ℓ ignored)
  float temperature = 0.0f;            // 0 = greedy; applied to target and draft rows alike
  int64_t top_k = 0;                   // 0 = off
  float top_p = 1.0f;                  // 1 = off
  const float* uniforms = nullptr;     // [γ+1] in [0, 1): u[j] tests draft j, u[γ] draws the next token
};

struct VerifyResult {
  int64_t num_accepted = 0;  // the leading accepted run, in [0, ℓ]
  int64_t next_id = 0;       // recovered token (residual sample) if a draft was rejected, else the bonus token
};

// Draft j < ℓ is accepted iff u[j]·q_j(x_j) < p_j(x_j); num_accepted = the leading accepted run a.
// next_id at a: residual sample ∝ max(p_a − q_a, 0) with u[γ] when a < ℓ (p_a if the residual is all
// zero), else the bonus sample from p_a. Greedy: next = argmax of target row a. Inputs are never modified.
// Errors: kInvalidArgument naming the field (γ < 1, ℓ outside [0, γ], a verified id outside [0, V),
// temperature < 0 or not finite, top_k < 0, top_p outside [0, 1], a uniform outside [0, 1), null arrays).
Status SpeculativeVerify(const VerifyRequest& request, VerifyResult* result);

}  // namespace dspark
