// The native scheduler, profile, manifest reader and acceptance rule against the Python implementation:
// JSON vectors written by scripts/make_cpp_vectors.py (ctest fixture "vectors", path in $DSPARK_VECTORS).
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dspark/manifest.h"
#include "dspark/scheduler.h"
#include "dspark/verify.h"

using nlohmann::json;

namespace {

std::string VectorsDir() {
  const char* dir = std::getenv("DSPARK_VECTORS");
  return dir ? dir : "vectors";
}

json ReadJson(const std::string& name) {
  std::ifstream f(VectorsDir() + "/" + name);
  if (!f) throw std::runtime_error("missing test vectors " + VectorsDir() + "/" + name +
                                   " (run scripts/make_cpp_vectors.py or ctest, which does)");
  std::stringstream ss;
  ss << f.rdbuf();
  return json::parse(ss.str());
}

std::vector<float> Flat(const json& rows, int64_t* n_rows, int64_t* n_cols) {
  std::vector<float> out;
  *n_rows = static_cast<int64_t>(rows.size());
  *n_cols = 0;
  for (const auto& row : rows) {
    *n_cols = static_cast<int64_t>(row.size());
    for (const auto& v : row) out.push_back(static_cast<float>(v.get<double>()));
  }
  return out;
}

}  // namespace

TEST(Policy, ParseMatchesPython) {
  json data = ReadJson("policies.json");
  int checked = 0;
  for (const auto& c : data["parse"]) {
    dspark::Policy p;
    dspark::Status st = dspark::Policy::Parse(c["text"], &p);
    ASSERT_EQ(st.ok(), c["ok"].get<bool>()) << "'" << c["text"].get<std::string>() << "': " << st.ToString();
    if (st.ok()) {
      EXPECT_EQ(p.Name(), c["name"].get<std::string>());
      EXPECT_EQ(p.k, c["k"].get<int64_t>());
      EXPECT_EQ(p.threshold, c["threshold"].get<double>());
      EXPECT_EQ(p.ToString(), c["str"].get<std::string>());
      EXPECT_EQ(p.drafts(), c["drafts"].get<bool>());
    } else {
      EXPECT_EQ(st.code(), dspark::StatusCode::kInvalidArgument);
      EXPECT_NE(st.message().find("policy"), std::string::npos) << st.message();
    }
    ++checked;
  }
  EXPECT_GE(checked, 20);
}

// A profile from the vectors' JSON form (scripts/make_cpp_vectors.py _profile_json), layout cost included.
::testing::AssertionResult ProfileFromJson(const json& c, dspark::ThroughputProfile* out) {
  dspark::Status st = dspark::ThroughputProfile::Create(
      c["buckets"].get<std::vector<int64_t>>(), c["sps"].get<std::vector<double>>(), out,
      c["draft_requests"].get<std::vector<int64_t>>(), c["draft_ms"].get<std::vector<double>>());
  if (!st.ok()) return ::testing::AssertionFailure() << st.ToString();
  if (c.contains("layout") && !c["layout"].empty()) {
    std::vector<std::array<int64_t, 3>> layout;
    for (const auto& row : c["layout"]) layout.push_back({row[0].get<int64_t>(), row[1].get<int64_t>(), row[2].get<int64_t>()});
    st = out->SetLayoutCost(c["attention_ms"].get<double>(), c["kv_read_ms"].get<double>(), std::move(layout));
    if (!st.ok()) return ::testing::AssertionFailure() << st.ToString();
  }
  if (c.contains("num_slots") && !c["num_slots"].is_null()) {
    *out = out->At(c["num_slots"].get<int64_t>(), c["kv_capacity"].get<int64_t>());
  }
  return ::testing::AssertionSuccess();
}

TEST(Policy, VerifyLengthsMatchPython) {
  json data = ReadJson("policies.json");
  std::map<std::string, int> per_policy;
  int with_draft_cost = 0, with_layout_cost = 0;
  for (const auto& c : data["cases"]) {
    dspark::Policy policy;
    ASSERT_TRUE(dspark::Policy::Parse(c["policy"], &policy).ok());
    int64_t rows = 0, cols = 0;
    std::vector<float> conf = Flat(c["confidence"], &rows, &cols);
    const int64_t gamma = c["gamma"];
    if (rows == 0) cols = gamma;
    dspark::ConfidenceView view{conf.data(), rows, cols};
    dspark::ThroughputProfile profile;
    if (!c["profile"].is_null()) {
      ASSERT_TRUE(ProfileFromJson(c["profile"], &profile));
      with_draft_cost += profile.has_draft_cost();
      with_layout_cost += profile.has_layout_cost();
    }
    std::vector<float> lagged_data;
    dspark::ConfidenceView lagged;
    if (!c["lagged"].is_null()) {
      int64_t lr = 0, lc = 0;
      lagged_data = Flat(c["lagged"], &lr, &lc);
      lagged = dspark::ConfidenceView{lagged_data.data(), lr, lc};
    }
    std::vector<int64_t> caps;
    if (!c["max_lengths"].is_null()) caps = c["max_lengths"].get<std::vector<int64_t>>();
    std::vector<int64_t> lengths;
    dspark::Status st = dspark::VerifyLengths(policy, view, gamma, c["profile"].is_null() ? nullptr : &profile,
                                              c["lagged"].is_null() ? nullptr : &lagged,
                                              caps.empty() ? nullptr : caps.data(), &lengths);
    ASSERT_TRUE(st.ok()) << c["tag"] << " " << c["policy"] << ": " << st.ToString();
    ASSERT_EQ(lengths, c["expected"].get<std::vector<int64_t>>())
        << c["tag"] << " " << c["policy"] << " confidence " << c["confidence"].dump();
    per_policy[policy.Name()] += 1;
  }
  for (const char* name : {"ar", "fixed", "threshold", "dspark", "dspark-async"}) {
    EXPECT_GE(per_policy[name], 1000) << name;
  }
  EXPECT_GE(with_draft_cost, 500);  // about half of the dspark cases price the drafter
  EXPECT_GE(with_layout_cost, 500);  // about half price the layout
}

TEST(Policy, WorkedExampleFromTheDocstring) {
  // runtime/scheduler.py dspark_lengths: ℓ = [2, 0], B = 4; dspark-async with lagged = current: ℓ = [3, 3].
  dspark::ThroughputProfile profile;
  ASSERT_TRUE(dspark::ThroughputProfile::Create({2, 4, 8}, {100.0, 90.0, 75.0}, &profile).ok());
  std::vector<float> c = {0.9f, 0.8f, 0.5f, 0.6f, 0.5f, 0.9f};
  dspark::ConfidenceView view{c.data(), 2, 3};
  dspark::Policy p;
  std::vector<int64_t> lengths;
  ASSERT_TRUE(dspark::Policy::Parse("dspark", &p).ok());
  ASSERT_TRUE(dspark::VerifyLengths(p, view, 3, &profile, nullptr, nullptr, &lengths).ok());
  EXPECT_EQ(lengths, (std::vector<int64_t>{2, 0}));
  ASSERT_TRUE(dspark::Policy::Parse("dspark-async", &p).ok());
  ASSERT_TRUE(dspark::VerifyLengths(p, view, 3, &profile, &view, nullptr, &lengths).ok());
  EXPECT_EQ(lengths, (std::vector<int64_t>{3, 3}));
}

TEST(Policy, BadInputIsAnError) {
  dspark::Policy p;
  ASSERT_TRUE(dspark::Policy::Parse("dspark", &p).ok());
  std::vector<float> c = {0.5f, 1.5f};
  std::vector<int64_t> lengths;
  dspark::ThroughputProfile profile;
  ASSERT_TRUE(dspark::ThroughputProfile::Create({4}, {10.0}, &profile).ok());
  dspark::Status st = dspark::VerifyLengths(p, {c.data(), 1, 2}, 2, &profile, nullptr, nullptr, &lengths);
  EXPECT_EQ(st.code(), dspark::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("[0, 1]"), std::string::npos) << st.message();
  c = {0.5f, NAN};
  EXPECT_FALSE(dspark::VerifyLengths(p, {c.data(), 1, 2}, 2, &profile, nullptr, nullptr, &lengths).ok());
  c = {0.5f, 0.5f};
  st = dspark::VerifyLengths(p, {c.data(), 1, 2}, 3, &profile, nullptr, nullptr, &lengths);  // γ mismatch
  EXPECT_EQ(st.code(), dspark::StatusCode::kInvalidArgument);
  st = dspark::VerifyLengths(p, {c.data(), 1, 2}, 2, nullptr, nullptr, nullptr, &lengths);  // no profile
  EXPECT_EQ(st.code(), dspark::StatusCode::kProfile);
}

TEST(Profile, LookupsMatchPython) {
  json data = ReadJson("profile.json");
  for (const auto& c : data["lookups"]) {
    dspark::ThroughputProfile p;
    ASSERT_TRUE(ProfileFromJson(c, &p));
    EXPECT_EQ(p.max_tokens(), c["max_tokens"].get<int64_t>());
    EXPECT_EQ(p.has_layout_cost(), c["has_layout_cost"].get<bool>());
    const auto queries = c["queries"].get<std::vector<int64_t>>();
    const auto widths = c["widths"].get<std::vector<int64_t>>();
    const auto expected = c["expected"].get<std::vector<double>>();
    const auto expected_draft = c["expected_draft_s"].get<std::vector<double>>();
    for (size_t i = 0; i < queries.size(); ++i) {
      EXPECT_EQ(p.Sps(queries[i]), expected[i]) << "B=" << queries[i];
      EXPECT_EQ(p.DraftSeconds(queries[i]), expected_draft[i]) << "R=" << queries[i];
      const auto& step = c["expected_step_s"][i];
      EXPECT_EQ(p.StepSeconds(queries[i], widths[i]), step.is_string() ? INFINITY : step.get<double>())
          << "B=" << queries[i] << " w=" << widths[i];
    }
  }
  for (const auto& c : data["invalid"]) {
    std::vector<double> sps;
    for (const auto& v : c["sps"]) sps.push_back(v.is_string() ? INFINITY : v.get<double>());
    dspark::ThroughputProfile p;
    dspark::Status st = dspark::ThroughputProfile::Create(c["buckets"].get<std::vector<int64_t>>(), sps, &p);
    EXPECT_EQ(st.ok(), c["ok"].get<bool>()) << c.dump();
    if (!st.ok()) EXPECT_EQ(st.code(), dspark::StatusCode::kProfile);
  }
  dspark::ThroughputProfile p;
  ASSERT_TRUE(dspark::ThroughputProfile::FromSpsJson(data["sps_json"]["data"].dump(), &p).ok());
  EXPECT_EQ(p.buckets(), data["sps_json"]["buckets"].get<std::vector<int64_t>>());
  EXPECT_EQ(p.steps_per_s(), data["sps_json"]["sps"].get<std::vector<double>>());
  EXPECT_TRUE(p.has_draft_cost());
  EXPECT_EQ(p.DraftSeconds(1), data["sps_json"]["draft_ms"][0].get<double>() / 1000.0);
  ASSERT_TRUE(dspark::ThroughputProfile::FromSpsJson(data["sps_json"]["data"].dump(), &p, false).ok());
  EXPECT_FALSE(p.has_draft_cost());
  EXPECT_FALSE(p.has_layout_cost());
  // the layout fit (sps.json "attention", target rows' S, Q, P)
  const json& fit = data["sps_json_fit"];
  ASSERT_TRUE(dspark::ThroughputProfile::FromSpsJson(fit["data"].dump(), &p).ok());
  EXPECT_FALSE(p.has_layout_cost());  // not bound to a layout yet
  dspark::ThroughputProfile bound = p.At(fit["num_slots"].get<int64_t>(), fit["kv_capacity"].get<int64_t>());
  EXPECT_TRUE(bound.has_layout_cost());
  for (size_t i = 0; i < fit["queries"].size(); ++i) {
    const auto& step = fit["expected_step_s"][i];
    EXPECT_EQ(bound.StepSeconds(fit["queries"][i].get<int64_t>(), fit["widths"][i].get<int64_t>()),
              step.is_string() ? INFINITY : step.get<double>()) << i;
  }
  json broken = fit["data"];
  broken["target"][1].erase("Q");
  dspark::Status st = dspark::ThroughputProfile::FromSpsJson(broken.dump(), &p);
  EXPECT_EQ(st.code(), dspark::StatusCode::kProfile);
  EXPECT_NE(st.message().find("'Q'"), std::string::npos) << st.message();
  broken = fit["data"];
  broken["attention"]["ms_per_row_entry"] = -1.0;
  EXPECT_FALSE(dspark::ThroughputProfile::FromSpsJson(broken.dump(), &p).ok());
  EXPECT_FALSE(dspark::ThroughputProfile::FromSpsJson("{\"target\": []}", &p).ok());
  EXPECT_FALSE(dspark::ThroughputProfile::FromSpsJson("not json", &p).ok());
  EXPECT_FALSE(dspark::ThroughputProfile::FromSpsJson("{\"target\": [{\"B\": \"4\", \"sps\": 1}]}", &p).ok());
}

TEST(Verify, AcceptanceRuleMatchesPython) {
  json data = ReadJson("verify.json");
  int checked = 0;
  std::map<std::string, int> tags;
  for (const auto& c : data["cases"]) {
    int64_t rows = 0, cols = 0, drows = 0, dcols = 0;
    std::vector<float> target = Flat(c["target_logits"], &rows, &cols);
    std::vector<float> draft = Flat(c["draft_logits"], &drows, &dcols);
    std::vector<int64_t> ids = c["draft_ids"].get<std::vector<int64_t>>();
    std::vector<float> u;
    for (const auto& v : c["uniforms"]) u.push_back(static_cast<float>(v.get<double>()));
    dspark::VerifyRequest q;
    q.vocab = c["V"];
    q.gamma = c["gamma"];
    q.verify_len = c["verify_len"];
    q.target_logits = target.data();
    q.draft_logits = draft.data();
    q.draft_ids = ids.data();
    q.temperature = static_cast<float>(c["temperature"].get<double>());
    q.top_k = c["top_k"];
    q.top_p = static_cast<float>(c["top_p"].get<double>());
    q.uniforms = u.data();
    const std::vector<float> target_before = target, draft_before = draft;
    dspark::VerifyResult r;
    dspark::Status st = dspark::SpeculativeVerify(q, &r);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(r.num_accepted, c["expected"]["num_accepted"].get<int64_t>()) << "case " << checked << " " << c["tag"];
    EXPECT_EQ(r.next_id, c["expected"]["next_id"].get<int64_t>()) << "case " << checked << " " << c["tag"];
    EXPECT_EQ(target, target_before);  // inputs never modified (failure case SD-07)
    EXPECT_EQ(draft, draft_before);
    tags[c["tag"]] += 1;
    ++checked;
  }
  EXPECT_GE(checked, 1000);
  for (const char* tag : {"random", "close", "one-hot", "all-accepted", "first-rejected"}) EXPECT_GT(tags[tag], 0) << tag;
}

TEST(Verify, BadInputIsAnError) {
  std::vector<float> logits(2 * 4, 0.0f), u(3, 0.5f);
  std::vector<int64_t> ids = {1, 7};
  dspark::VerifyRequest q{4, 2, 1, logits.data(), logits.data(), ids.data(), 0.0f, 0, 1.0f, u.data()};
  dspark::VerifyResult r;
  ASSERT_TRUE(dspark::SpeculativeVerify(q, &r).ok());
  auto expect_invalid = [&](dspark::VerifyRequest bad, const char* field) {
    dspark::Status st = dspark::SpeculativeVerify(bad, &r);
    EXPECT_EQ(st.code(), dspark::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(st.message().find(field), std::string::npos) << st.message();
  };
  auto bad = q;
  bad.verify_len = 2;  // draft id 7 outside V = 4
  expect_invalid(bad, "draft_ids");
  bad = q;
  bad.verify_len = 3;
  expect_invalid(bad, "verify_lens");
  bad = q;
  bad.temperature = -1.0f;
  expect_invalid(bad, "temperature");
  bad = q;
  bad.temperature = NAN;
  expect_invalid(bad, "temperature");
  bad = q;
  bad.top_p = 1.5f;
  expect_invalid(bad, "top_p");
  bad = q;
  bad.top_k = -1;
  expect_invalid(bad, "top_k");
  std::vector<float> u_bad = {0.5f, 1.0f, 0.2f};
  bad = q;
  bad.uniforms = u_bad.data();
  expect_invalid(bad, "uniforms");
  bad = q;
  bad.gamma = 0;
  bad.verify_len = 0;
  expect_invalid(bad, "gamma");
}

TEST(Manifest, MatchesPythonOnEveryCase) {
  json cases = ReadJson("manifests/cases.json");
  int rejected = 0;
  for (const auto& c : cases) {
    const std::string dir = VectorsDir() + "/manifests/" + c["name"].get<std::string>();
    dspark::Manifest m;
    dspark::Status st = dspark::Manifest::Load(dir, dspark::ManifestOptions{true}, &m);
    EXPECT_EQ(st.ok(), c["ok"].get<bool>()) << c["name"] << ": C++ says " << st.ToString() << "; Python says "
                                            << (c["python_error"].is_null() ? "ok" : c["python_error"].get<std::string>());
    if (!st.ok()) {
      EXPECT_EQ(st.code(), dspark::StatusCode::kEngineDir) << c["name"];
      EXPECT_FALSE(st.message().empty());
      ++rejected;
    }
  }
  EXPECT_GE(rejected, 25);
}

TEST(Manifest, ValidDirectoryAccessors) {
  dspark::Manifest m;
  ASSERT_TRUE(dspark::Manifest::Load(VectorsDir() + "/manifests/valid", {true}, &m).ok());
  EXPECT_EQ(m.block_size(), 4);
  EXPECT_EQ(m.max_context(), 96);
  EXPECT_EQ(m.vocab_size(), 256);
  EXPECT_EQ(m.eos_token_ids(), (std::vector<int64_t>{2}));
  EXPECT_EQ(m.confidence_temperature(), (std::vector<double>{1.0, 1.0, 1.5, 2.0}));
  EXPECT_EQ(m.Buckets("target"), (std::vector<int64_t>{4}));
  std::string path;
  ASSERT_TRUE(m.GraphPath("verify", &path).ok());
  EXPECT_NE(path.find("graphs/verify.onnx"), std::string::npos);
  EXPECT_FALSE(m.GraphPath("nope", &path).ok());
  dspark::ThroughputProfile profile;
  ASSERT_TRUE(m.LoadProfile(&profile).ok());
  EXPECT_EQ(profile.Sps(3), 20.0);
  EXPECT_EQ(profile.Sps(5), 0.0);
  std::string full;
  EXPECT_EQ(m.ResolveInside("../x", "t", &full).code(), dspark::StatusCode::kEngineDir);
  EXPECT_EQ(m.ResolveInside("/etc/passwd", "t", &full).code(), dspark::StatusCode::kEngineDir);
}
