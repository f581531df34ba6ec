// Native port of dspark_export.runtime.scheduler / runtime.policies. Every floating-point operation is
// done in the order numpy does it (float64 cumulative products and sums, sequential), so the results
// are bit-identical to the Python implementation on the shared vectors.
#include "dspark/scheduler.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <sstream>

#include <nlohmann/json.hpp>

namespace dspark {
namespace {

const char* kPolicyForms =
    "'ar', 'fixed:K' (integer K >= 1), 'threshold:C' (0 < C <= 1), 'dspark' or 'dspark-async'";

std::string Trim(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(ws);
  return s.substr(b, e - b + 1);
}

// Python repr() of a float: the shortest text that reads back to the same double, with ".0" on integers.
std::string PyFloatRepr(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, res.ptr);
  if (s.find_first_of(".eEni") == std::string::npos) s += ".0";
  return s;
}

Status CheckConfidence(const ConfidenceView& c, const char* name) {
  if (c.rows < 0 || c.cols < 0 || (c.rows * c.cols > 0 && c.data == nullptr)) {
    return Status(StatusCode::kInvalidArgument, std::string(name) + ": expected an [R, γ] float matrix");
  }
  for (int64_t i = 0; i < c.rows * c.cols; ++i) {
    float v = c.data[i];
    if (!(v >= 0.0f && v <= 1.0f)) {  // also rejects NaN
      std::ostringstream msg;
      msg << name << ": expected probabilities in [0, 1], found " << v << " at row " << i / c.cols << ", position "
          << i % c.cols;
      return Status(StatusCode::kInvalidArgument, msg.str());
    }
  }
  return Status::Ok();
}

// Candidates with a > 0 sorted by a descending; ties by lower j, then lower r (flat index j·R + r).
void SortedCandidates(const std::vector<double>& survival, int64_t rows, int64_t cols, std::vector<int64_t>* order,
                      std::vector<double>* ranked) {
  std::vector<double> flat(static_cast<size_t>(rows * cols));
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t r = 0; r < rows; ++r) flat[j * rows + r] = survival[r * cols + j];
  std::vector<int64_t> idx(flat.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t x, int64_t y) { return -flat[x] < -flat[y]; });
  order->clear();
  ranked->clear();
  for (int64_t i : idx) {
    if (!(flat[i] > 0)) break;  // positives come first
    order->push_back(i);
    ranked->push_back(flat[i]);
  }
}

// Θ_k for k = 0..n (runtime/scheduler.py `_throughputs`): τ_k = R + Σ_{i ≤ k} ranked_i over
// Θ_k = τ_k·SPS(R+k), or with the drafter cost τ_k / (1/SPS(R+k) + d(R)), where k = 0 pays d(R) only
// when draft_at_zero (dspark-async may skip the drafter when it verifies nothing). With a layout cost
// and depth (the position j of each ranked candidate), 1/SPS(R+k) becomes t(R+k, 1 + max depth so far).
std::vector<double> Thetas(const std::vector<double>& ranked, const std::vector<int64_t>* depth, int64_t num_requests,
                           const ThroughputProfile& profile, bool draft_at_zero) {
  const size_t n = ranked.size();
  std::vector<double> tau(n + 1);
  tau[0] = 0.0;
  double acc = 0.0;
  for (size_t i = 0; i < n; ++i) tau[i + 1] = (acc += ranked[i]);
  std::vector<double> theta(n + 1);
  const double draft = profile.DraftSeconds(num_requests);
  const bool layout = depth != nullptr && profile.has_layout_cost();
  int64_t width = 1;
  for (size_t k = 0; k <= n; ++k) {
    double t = tau[k] + static_cast<double>(num_requests);
    if (layout) {
      if (k > 0) width = std::max(width, (*depth)[k - 1] + 1);
      double step_s = profile.StepSeconds(num_requests + static_cast<int64_t>(k), width);
      theta[k] = t / (step_s + ((k == 0 && !draft_at_zero) ? 0.0 : draft));
      continue;
    }
    double sps = profile.Sps(num_requests + static_cast<int64_t>(k));
    if (!profile.has_draft_cost()) {
      theta[k] = t * sps;
    } else {
      double step_s = sps > 0 ? 1.0 / sps : std::numeric_limits<double>::infinity();
      theta[k] = t / (step_s + ((k == 0 && !draft_at_zero) ? 0.0 : draft));
    }
  }
  return theta;
}

// K: early_stop → the last k before the first Θ_k ≤ Θ_{k-1}; else the first argmax of Θ.
int64_t PickCapacity(const std::vector<double>& theta, bool early_stop) {
  if (!early_stop) return std::max_element(theta.begin(), theta.end()) - theta.begin();
  for (size_t k = 1; k < theta.size(); ++k)
    if (theta[k] <= theta[k - 1]) return static_cast<int64_t>(k - 1);
  return static_cast<int64_t>(theta.size() - 1);
}

// Global search (runtime/scheduler.py `_best_plan`): the count K and the cap L on every ℓ_r (-1: no
// cap); without a layout cost no cap and K = argmax Θ; with one, the best (L, K) over L = 1..D, D the
// deepest position with a positive survival (strictly better Θ wins, so the smallest L on ties), and
// L = D is no cap.
void BestPlan(const std::vector<double>& survival, int64_t rows, int64_t cols, int64_t num_requests,
              const ThroughputProfile& profile, bool draft_at_zero, int64_t* k_out, int64_t* cap_out) {
  std::vector<int64_t> order;
  std::vector<double> ranked;
  SortedCandidates(survival, rows, cols, &order, &ranked);
  if (!profile.has_layout_cost()) {
    *k_out = PickCapacity(Thetas(ranked, nullptr, num_requests, profile, draft_at_zero), false);
    *cap_out = -1;
    return;
  }
  std::vector<int64_t> depth(order.size());
  int64_t deepest = 1;
  for (size_t i = 0; i < order.size(); ++i) deepest = std::max(deepest, depth[i] = order[i] / std::max<int64_t>(rows, 1) + 1);
  bool found = false;
  double best = 0.0;
  for (int64_t cap = 1; cap <= deepest; ++cap) {
    std::vector<double> r;
    std::vector<int64_t> d;
    for (size_t i = 0; i < order.size(); ++i)
      if (depth[i] <= cap) { r.push_back(ranked[i]); d.push_back(depth[i]); }
    std::vector<double> theta = Thetas(r, &d, num_requests, profile, draft_at_zero);
    int64_t k = PickCapacity(theta, false);
    if (!found || theta[k] > best) {
      found = true;
      best = theta[k];
      *k_out = k;
      *cap_out = cap < deepest ? cap : -1;
    }
  }
}

std::vector<int64_t> TopKLengths(const std::vector<int64_t>& order, int64_t num_requests, int64_t k) {
  std::vector<int64_t> lengths(static_cast<size_t>(num_requests), 0);
  for (int64_t i = 0; i < k && i < static_cast<int64_t>(order.size()); ++i) lengths[order[i] % num_requests] += 1;
  return lengths;
}

}  // namespace

// ---------------------------------------------------------------------------- ThroughputProfile
Status ThroughputProfile::Create(std::vector<int64_t> buckets, std::vector<double> steps_per_s,
                                 ThroughputProfile* out, std::vector<int64_t> draft_requests,
                                 std::vector<double> draft_ms) {
  bool drafts_ok = draft_requests.size() == draft_ms.size() && (draft_requests.empty() || draft_requests[0] >= 1);
  for (size_t i = 1; i < draft_requests.size() && drafts_ok; ++i) drafts_ok = draft_requests[i] > draft_requests[i - 1];
  for (double ms : draft_ms) drafts_ok = drafts_ok && std::isfinite(ms) && ms >= 0;
  if (!drafts_ok) {
    return Status(StatusCode::kProfile, "profile: drafter rows must pair strictly increasing request buckets >= 1 "
                                        "with finite latencies >= 0 ms");
  }
  if (buckets.empty() || buckets.size() != steps_per_s.size()) {
    return Status(StatusCode::kProfile, "profile: expected equal, non-empty lists of buckets and SPS, found " +
                                            std::to_string(buckets.size()) + " buckets and " +
                                            std::to_string(steps_per_s.size()) + " SPS values");
  }
  bool sorted = buckets[0] >= 1;
  for (size_t i = 1; i < buckets.size() && sorted; ++i) sorted = buckets[i] > buckets[i - 1];
  if (!sorted) return Status(StatusCode::kProfile, "profile: buckets must be >= 1 and strictly increasing");
  for (double s : steps_per_s) {
    if (!(std::isfinite(s) && s > 0)) {
      return Status(StatusCode::kProfile, "profile: SPS must be finite and > 0, found " + std::to_string(s));
    }
  }
  ThroughputProfile p;
  p.draft_requests_ = std::move(draft_requests);
  p.draft_ms_ = std::move(draft_ms);
  p.buckets_ = std::move(buckets);
  p.steps_per_s_ = std::move(steps_per_s);
  p.effective_.assign(p.steps_per_s_.size() + 1, 0.0);
  double best = 0.0;
  for (size_t i = p.steps_per_s_.size(); i-- > 0;) p.effective_[i] = best = std::max(best, p.steps_per_s_[i]);
  const size_t nb = p.steps_per_s_.size();
  p.best_.assign(nb + 1, nb);
  for (size_t i = nb; i-- > 0;)
    p.best_[i] = (i == nb - 1 || p.steps_per_s_[i] >= p.steps_per_s_[p.best_[i + 1]]) ? i : p.best_[i + 1];
  *out = std::move(p);
  return Status::Ok();
}

Status ThroughputProfile::FromSpsJson(const std::string& json_text, ThroughputProfile* out, bool use_drafter) {
  nlohmann::json data = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (data.is_discarded()) return Status(StatusCode::kProfile, "profile: sps.json is not valid JSON");
  if (!data.is_object() || !data.contains("target") || !data["target"].is_array() || data["target"].empty()) {
    return Status(StatusCode::kProfile, "profile: expected an sps.json object with a non-empty 'target' list of rows");
  }
  std::vector<std::pair<int64_t, double>> rows;
  std::vector<std::pair<int64_t, std::array<int64_t, 3>>> layout_rows;
  if (data.contains("attention") && !data["attention"].is_null() && !data["attention"].is_object()) {
    return Status(StatusCode::kProfile, "profile: 'attention' must be an object {\"ms_per_row_entry\": number, "
                                        "\"ms_per_slot_entry\": number, ...}, found " + std::string(data["attention"].type_name()));
  }
  const bool fit = data.contains("attention") && data["attention"].is_object() && !data["attention"].empty();
  for (const auto& row : data["target"]) {
    if (!row.is_object() || !row.contains("B") || !row.contains("sps") || !row["B"].is_number_integer() ||
        !row["sps"].is_number()) {
      return Status(StatusCode::kProfile, "profile: every 'target' row needs an integer 'B' and a numeric 'sps'");
    }
    rows.emplace_back(row["B"].get<int64_t>(), row["sps"].get<double>());
    if (fit) {
      for (const char* key : {"S", "Q", "P"}) {
        if (!row.contains(key) || !row[key].is_number_integer()) {
          return Status(StatusCode::kProfile, std::string("profile: an 'attention' fit needs every 'target' row's "
                                                          "integer 'S', 'Q', 'P'; a row has no integer '") + key + "'");
        }
      }
      layout_rows.push_back({row["B"].get<int64_t>(),
                             {row["S"].get<int64_t>(), row["Q"].get<int64_t>(), row["P"].get<int64_t>()}});
    }
  }
  std::sort(rows.begin(), rows.end());
  std::sort(layout_rows.begin(), layout_rows.end());
  std::vector<int64_t> b;
  std::vector<double> s;
  for (auto& [bucket, sps] : rows) {
    b.push_back(bucket);
    s.push_back(sps);
  }
  std::vector<std::pair<int64_t, double>> drows;
  if (use_drafter && data.contains("drafter_block") && data["drafter_block"].is_array()) {
    for (const auto& row : data["drafter_block"]) {
      if (!row.is_object() || !row.contains("R") || !row.contains("median_ms") || !row["R"].is_number_integer() ||
          !row["median_ms"].is_number()) {
        return Status(StatusCode::kProfile,
                      "profile: every 'drafter_block' row needs an integer 'R' and a numeric 'median_ms'");
      }
      drows.emplace_back(row["R"].get<int64_t>(), row["median_ms"].get<double>());
    }
  }
  std::sort(drows.begin(), drows.end());
  std::vector<int64_t> dr;
  std::vector<double> dms;
  for (auto& [r, ms] : drows) {
    dr.push_back(r);
    dms.push_back(ms);
  }
  Status st = Create(std::move(b), std::move(s), out, std::move(dr), std::move(dms));
  if (!st.ok() || !fit) return st;
  const auto& att = data["attention"];
  if (!att.contains("ms_per_row_entry") || !att["ms_per_row_entry"].is_number() ||
      !att.contains("ms_per_slot_entry") || !att["ms_per_slot_entry"].is_number()) {
    return Status(StatusCode::kProfile, "profile: an 'attention' fit needs numeric 'ms_per_row_entry' and "
                                        "'ms_per_slot_entry'");
  }
  std::vector<std::array<int64_t, 3>> layout;
  for (auto& [bucket, shape] : layout_rows) layout.push_back(shape);
  return out->SetLayoutCost(att["ms_per_row_entry"].get<double>(), att["ms_per_slot_entry"].get<double>(),
                            std::move(layout));
}

Status ThroughputProfile::SetLayoutCost(double attention_ms, double kv_read_ms,
                                        std::vector<std::array<int64_t, 3>> layout) {
  if (!(std::isfinite(attention_ms) && attention_ms >= 0 && std::isfinite(kv_read_ms) && kv_read_ms >= 0)) {
    return Status(StatusCode::kProfile, "profile: the attention fit's coefficients must be finite and >= 0 ms");
  }
  bool ok = layout.empty() || layout.size() == buckets_.size();
  for (const auto& row : layout) ok = ok && row[0] >= 1 && row[1] >= 1 && row[2] >= 1;
  if (!ok) {
    return Status(StatusCode::kProfile, "profile: expected one (slots, query width, KV capacity) >= 1 per bucket (" +
                                            std::to_string(buckets_.size()) + "), found " +
                                            std::to_string(layout.size()));
  }
  attention_ms_ = attention_ms;
  kv_read_ms_ = kv_read_ms;
  layout_ = std::move(layout);
  return Status::Ok();
}

ThroughputProfile ThroughputProfile::At(int64_t num_slots, int64_t kv_capacity) const {
  ThroughputProfile p = *this;
  p.num_slots_ = std::max<int64_t>(num_slots, 1);
  p.kv_capacity_ = std::max<int64_t>(kv_capacity, 1);
  return p;
}

bool ThroughputProfile::has_layout_cost() const {
  return !layout_.empty() && num_slots_ > 0 && kv_capacity_ > 0 && (attention_ms_ > 0 || kv_read_ms_ > 0);
}

double ThroughputProfile::StepSeconds(int64_t num_tokens, int64_t width) const {
  size_t i = static_cast<size_t>(std::lower_bound(buckets_.begin(), buckets_.end(), num_tokens) - buckets_.begin());
  if (i >= buckets_.size()) return std::numeric_limits<double>::infinity();
  const size_t b = best_[i];
  const double base = 1.0 / steps_per_s_[b];
  if (!has_layout_cost()) return base;
  const int64_t s = num_slots_, p = kv_capacity_;
  const int64_t q = std::max(width, (buckets_[b] + s - 1) / s);
  const auto& l = layout_[b];
  const double corr = (attention_ms_ * static_cast<double>(s * q * p - l[0] * l[1] * l[2]) +
                       kv_read_ms_ * static_cast<double>(s * p - l[0] * l[2])) / 1000.0;
  return std::max(base + corr, 0.5 * base);
}

Status ThroughputProfile::FromFile(const std::string& path, ThroughputProfile* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status(StatusCode::kProfile, path + ": cannot read the throughput profile");
  std::stringstream ss;
  ss << f.rdbuf();
  Status st = FromSpsJson(ss.str(), out);
  return st.ok() ? st : Status(st.code(), path + ": " + st.message());
}

double ThroughputProfile::DraftSeconds(int64_t num_requests) const {
  if (draft_requests_.empty()) return 0.0;
  size_t i = static_cast<size_t>(std::lower_bound(draft_requests_.begin(), draft_requests_.end(), num_requests) -
                                 draft_requests_.begin());
  return draft_ms_[std::min(i, draft_ms_.size() - 1)] / 1000.0;
}

double ThroughputProfile::Sps(int64_t num_tokens) const {
  auto it = std::lower_bound(buckets_.begin(), buckets_.end(), num_tokens);
  return effective_[static_cast<size_t>(it - buckets_.begin())];
}

// ---------------------------------------------------------------------------- Policy
Status Policy::Parse(const std::string& raw, Policy* out) {
  const std::string text = Trim(raw);
  if (text == "ar") { *out = Policy{PolicyKind::kAr}; return Status::Ok(); }
  if (text == "dspark") { *out = Policy{PolicyKind::kDspark}; return Status::Ok(); }
  if (text == "dspark-async") { *out = Policy{PolicyKind::kDsparkAsync}; return Status::Ok(); }
  size_t colon = text.find(':');
  std::string name = text.substr(0, colon);
  std::string arg = colon == std::string::npos ? "" : Trim(text.substr(colon + 1));
  if (name == "fixed") {
    int64_t k = -1;
    const char* b = arg.data() + (!arg.empty() && arg[0] == '+' ? 1 : 0);
    auto res = std::from_chars(b, arg.data() + arg.size(), k);
    if (res.ec != std::errc() || res.ptr != arg.data() + arg.size() || arg.empty()) k = -1;
    if (k >= 1) { *out = Policy{PolicyKind::kFixed, k, 0.0}; return Status::Ok(); }
    return Status(StatusCode::kInvalidArgument, "policy: 'fixed:K' needs an integer K >= 1, found '" + raw +
                                                    "'; accepted: " + kPolicyForms);
  }
  if (name == "threshold") {
    double c = std::nan("");
    if (!arg.empty()) {
      char* end = nullptr;
      double v = std::strtod(arg.c_str(), &end);
      if (end == arg.c_str() + arg.size()) c = v;
    }
    if (c > 0.0 && c <= 1.0) { *out = Policy{PolicyKind::kThreshold, 0, c}; return Status::Ok(); }
    return Status(StatusCode::kInvalidArgument, "policy: 'threshold:C' needs a number C in (0, 1], found '" + raw +
                                                    "'; accepted: " + kPolicyForms);
  }
  return Status(StatusCode::kInvalidArgument,
                std::string("policy: expected one of ") + kPolicyForms + ", found '" + raw + "'");
}

std::string Policy::Name() const {
  switch (kind) {
    case PolicyKind::kAr: return "ar";
    case PolicyKind::kFixed: return "fixed";
    case PolicyKind::kThreshold: return "threshold";
    case PolicyKind::kDspark: return "dspark";
    case PolicyKind::kDsparkAsync: return "dspark-async";
  }
  return "?";
}

std::string Policy::ToString() const {
  if (kind == PolicyKind::kFixed) return "fixed:" + std::to_string(k);
  if (kind == PolicyKind::kThreshold) return "threshold:" + PyFloatRepr(threshold);
  return Name();
}

// ---------------------------------------------------------------------------- scheduling
Status SurvivalProbs(const ConfidenceView& c, const int64_t* max_lengths, std::vector<double>* survival) {
  Status st = CheckConfidence(c, "confidence");
  if (!st.ok()) return st;
  survival->assign(static_cast<size_t>(c.rows * c.cols), 0.0);
  for (int64_t r = 0; r < c.rows; ++r) {
    double a = 1.0;
    for (int64_t j = 0; j < c.cols; ++j) {
      a = (j == 0) ? static_cast<double>(c.at(r, j)) : a * static_cast<double>(c.at(r, j));
      (*survival)[r * c.cols + j] = (max_lengths != nullptr && j >= max_lengths[r]) ? 0.0 : a;
    }
  }
  return Status::Ok();
}

static Status DsparkLengths(const ConfidenceView& c, const ThroughputProfile& profile, const int64_t* max_lengths,
                            std::vector<int64_t>* lengths) {
  std::vector<double> a;
  Status st = SurvivalProbs(c, max_lengths, &a);
  if (!st.ok()) return st;
  std::vector<int64_t> order;
  std::vector<double> ranked;
  SortedCandidates(a, c.rows, c.cols, &order, &ranked);
  // SPS(B) alone, even with a layout cost (runtime/scheduler.py dspark_lengths: the layout-priced early
  // stop fires at the first saw-tooth of Θ).
  *lengths = TopKLengths(order, c.rows, PickCapacity(Thetas(ranked, nullptr, c.rows, profile, true), true));
  return Status::Ok();
}

static Status DsparkAsyncLengths(const ConfidenceView& c, const ConfidenceView* lagged,
                                 const ThroughputProfile& profile, const int64_t* max_lengths,
                                 std::vector<int64_t>* lengths) {
  if (lagged == nullptr || lagged->data == nullptr || lagged->rows * lagged->cols == 0) return DsparkLengths(c, profile, max_lengths, lengths);
  Status cst = CheckConfidence(c, "confidence");
  if (!cst.ok()) return cst;
  Status lst = CheckConfidence(*lagged, "lagged_confidence");
  if (!lst.ok()) return lst;
  std::vector<double> lagged_a;
  SurvivalProbs(*lagged, nullptr, &lagged_a);
  int64_t k = 0, cap = -1;
  BestPlan(lagged_a, lagged->rows, lagged->cols, c.rows, profile, /*draft_at_zero=*/false, &k, &cap);
  std::vector<int64_t> limit(static_cast<size_t>(c.rows));
  for (int64_t r = 0; r < c.rows && cap >= 0; ++r) limit[r] = max_lengths != nullptr ? std::min(max_lengths[r], cap) : cap;
  std::vector<double> a;
  Status st = SurvivalProbs(c, cap >= 0 ? limit.data() : max_lengths, &a);
  if (!st.ok()) return st;
  std::vector<int64_t> order;
  std::vector<double> ranked;
  SortedCandidates(a, c.rows, c.cols, &order, &ranked);
  *lengths = TopKLengths(order, c.rows, k);
  return Status::Ok();
}

Status VerifyLengths(const Policy& policy, const ConfidenceView& c, int64_t gamma, const ThroughputProfile* profile,
                     const ConfidenceView* lagged, const int64_t* max_lengths, std::vector<int64_t>* lengths) {
  if (c.cols != gamma || c.rows < 0) {
    return Status(StatusCode::kInvalidArgument, "policy " + policy.ToString() + ": expected confidence [R, γ=" +
                                                    std::to_string(gamma) + "], found [" + std::to_string(c.rows) +
                                                    ", " + std::to_string(c.cols) + "]");
  }
  if (policy.needs_profile() && (profile == nullptr || profile->empty())) {
    return Status(StatusCode::kProfile, "policy " + policy.ToString() +
                                            " needs the throughput profile SPS(B) (profile/sps.json), found none; "
                                            "use 'fixed:K' or 'threshold:C' for engines without a profile");
  }
  if (policy.kind == PolicyKind::kDspark) return DsparkLengths(c, *profile, max_lengths, lengths);
  if (policy.kind == PolicyKind::kDsparkAsync) return DsparkAsyncLengths(c, lagged, *profile, max_lengths, lengths);
  lengths->assign(static_cast<size_t>(c.rows), 0);
  if (policy.kind == PolicyKind::kFixed) {
    std::fill(lengths->begin(), lengths->end(), std::min<int64_t>(policy.k, gamma));
  } else if (policy.kind == PolicyKind::kThreshold) {
    const float threshold = static_cast<float>(policy.threshold);  // numpy compares float32 with a float32 C
    for (int64_t r = 0; r < c.rows; ++r) {
      int64_t l = gamma;
      for (int64_t j = 0; j < gamma; ++j) {
        if (c.at(r, j) < threshold) { l = j; break; }
      }
      (*lengths)[r] = l;
    }
  }
  if (max_lengths != nullptr)
    for (int64_t r = 0; r < c.rows; ++r) (*lengths)[r] = std::min((*lengths)[r], max_lengths[r]);
  return Status::Ok();
}

}  // namespace dspark
