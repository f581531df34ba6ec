// The embedded runtime on a tiny random engine directory (ctest fixture "tiny_engine", $DSPARK_FIXTURE):
// greedy ids equal the Python runtime's, several C++ threads submit at once, streaming, pull API, cancel,
// and bad input returns an error status (never a crash) without disturbing other requests.
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <map>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "dspark/runtime.h"

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string FixtureDir() {
  const char* dir = std::getenv("DSPARK_FIXTURE");
  return dir ? dir : "fixture";
}

json Expected() {
  std::ifstream f(FixtureDir() + "/expected.json");
  if (!f) throw std::runtime_error("missing " + FixtureDir() + "/expected.json (run cpp/tests/make_fixture.py)");
  std::stringstream ss;
  ss << f.rdbuf();
  return json::parse(ss.str());
}

// One runtime for the whole test program (opening one takes a few seconds).
dspark::Runtime* Shared() {
  static std::unique_ptr<dspark::Runtime> rt = [] {
    dspark::RuntimeOptions opt;
    opt.engine_dir = FixtureDir() + "/engines";
    opt.policy = "dspark";
    std::unique_ptr<dspark::Runtime> out;
    dspark::Status st = dspark::Runtime::Open(opt, &out);
    if (!st.ok()) throw std::runtime_error(st.ToString());
    return out;
  }();
  return rt.get();
}

dspark::GenerateRequest IdsRequest(const std::vector<int64_t>& ids, const std::string& policy, int64_t max_new) {
  dspark::GenerateRequest req;
  req.token_ids = ids;
  req.policy = policy;
  req.params.max_new_tokens = max_new;
  return req;
}

}  // namespace

TEST(Runtime, GreedyIdsEqualPythonUnderEveryPolicy) {
  json expected = Expected();
  for (const char* policy : {"ar", "fixed:1", "fixed:4", "threshold:0.5", "dspark", "dspark-async"}) {
    for (const auto& p : expected["prompts"]) {
      dspark::GenerationResult r;
      dspark::Status st = Shared()->Generate(
          IdsRequest(p["prompt"].get<std::vector<int64_t>>(), policy, expected["max_new_tokens"]), &r);
      ASSERT_TRUE(st.ok()) << st.ToString();
      EXPECT_EQ(r.token_ids, p["token_ids"].get<std::vector<int64_t>>()) << policy;
      EXPECT_EQ(r.finish_reason, p["finish_reason"].get<std::string>());
      EXPECT_EQ(r.stats.completion_tokens, static_cast<int64_t>(r.token_ids.size()));
    }
  }
}

TEST(Runtime, ChatTextPrompt) {
  json expected = Expected();
  dspark::GenerateRequest req;
  req.text = expected["chat"]["text"];
  req.chat = true;
  req.params.max_new_tokens = expected["max_new_tokens"];
  dspark::GenerationResult r;
  ASSERT_TRUE(Shared()->Generate(req, &r).ok());
  EXPECT_EQ(r.token_ids, expected["chat"]["token_ids"].get<std::vector<int64_t>>());
  EXPECT_EQ(r.text, expected["chat"]["output_text"].get<std::string>());
}

TEST(Runtime, ManyThreadsSubmitAtOnce) {
  json expected = Expected();
  const auto& prompts = expected["prompts"];
  const char* policies[] = {"dspark", "ar", "fixed:2", "dspark-async"};
  constexpr int kThreads = 8, kPerThread = 4;
  std::mutex mu;
  std::map<dspark::RequestId, std::pair<size_t, std::vector<int64_t>>> streamed;  // id → (prompt, tokens)
  std::map<dspark::RequestId, std::string> finished;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const size_t which = static_cast<size_t>(t * kPerThread + i) % prompts.size();
        auto req = IdsRequest(prompts[which]["prompt"].get<std::vector<int64_t>>(), policies[(t + i) % 4],
                              expected["max_new_tokens"]);
        dspark::RequestId id = 0;
        std::lock_guard<std::mutex> hold(mu);  // the callback may fire before Submit returns: map first
        dspark::Status st = Shared()->Submit(
            req,
            [&](const dspark::Event& ev) {
              std::lock_guard<std::mutex> lock(mu);
              auto& s = streamed[ev.request_id];
              s.second.insert(s.second.end(), ev.token_ids.begin(), ev.token_ids.end());
              if (ev.finished) finished[ev.request_id] = ev.finish_reason;
            },
            &id);
        if (!st.ok()) {
          failures++;
          continue;
        }
        streamed[id].first = which;
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(failures.load(), 0);
  for (int waited = 0; waited < 6000; ++waited) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (finished.size() == kThreads * kPerThread) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(finished.size(), static_cast<size_t>(kThreads * kPerThread));
  for (const auto& [id, s] : streamed) {
    EXPECT_EQ(s.second, prompts[s.first]["token_ids"].get<std::vector<int64_t>>()) << "request " << id;
    EXPECT_EQ(finished[id], prompts[s.first]["finish_reason"].get<std::string>());
  }
}

TEST(Runtime, PullApiAndCancel) {
  dspark::Runtime* rt = Shared();
  dspark::RequestId long_id = 0, short_id = 0;
  ASSERT_TRUE(rt->Submit(IdsRequest({5, 6, 7}, "dspark", 60), nullptr, &long_id).ok());
  ASSERT_TRUE(rt->Submit(IdsRequest({40, 41}, "dspark", 8), nullptr, &short_id).ok());
  std::map<dspark::RequestId, std::string> reasons;
  std::map<dspark::RequestId, size_t> counts;
  bool cancelled = false;
  dspark::Event ev;
  while (reasons.size() < 2 && rt->NextEvent(&ev, std::chrono::seconds(60))) {
    counts[ev.request_id] += ev.token_ids.size();
    if (ev.finished) reasons[ev.request_id] = ev.finish_reason;
    if (!cancelled && ev.request_id == long_id && counts[long_id] >= 2) {
      ASSERT_TRUE(rt->Cancel(long_id).ok());
      cancelled = true;
    }
  }
  ASSERT_EQ(reasons.size(), 2u);
  EXPECT_EQ(reasons[long_id], "cancelled");
  EXPECT_LT(counts[long_id], 60u);
  EXPECT_EQ(reasons[short_id], "length");
  EXPECT_EQ(counts[short_id], 8u);
  EXPECT_EQ(rt->Cancel(long_id).code(), dspark::StatusCode::kNotFound);  // already finished
  EXPECT_EQ(rt->Cancel(987654).code(), dspark::StatusCode::kNotFound);
  // the cancelled request's slot is free: the runtime keeps serving
  dspark::GenerationResult r;
  ASSERT_TRUE(rt->Generate(IdsRequest({40, 41}, "ar", 4), &r).ok());
  EXPECT_EQ(r.token_ids.size(), 4u);
}

TEST(Runtime, InvalidRequestsReturnErrorsAndDisturbNothing) {
  dspark::Runtime* rt = Shared();
  json expected = Expected();
  // a long request runs while the bad ones are refused
  dspark::GenerationResult good;
  std::thread runner([&] {
    auto p = expected["prompts"][0];
    ASSERT_TRUE(rt->Generate(IdsRequest(p["prompt"].get<std::vector<int64_t>>(), "dspark", 16), &good).ok());
  });
  struct Case {
    const char* name;
    dspark::GenerateRequest req;
    const char* expect_in_message;
  };
  std::vector<Case> cases;
  auto base = IdsRequest({5, 6, 7}, "", 8);
  auto c = base; c.params.temperature = -1.0f; cases.push_back({"negative temperature", c, "temperature"});
  c = base; c.params.temperature = NAN; cases.push_back({"NaN temperature", c, "temperature"});
  c = base; c.params.top_p = 0.0f; cases.push_back({"top_p 0", c, "top_p"});
  c = base; c.params.top_p = 1.5f; cases.push_back({"top_p 1.5", c, "top_p"});
  c = base; c.params.top_k = -3; cases.push_back({"top_k -3", c, "top_k"});
  c = base; c.params.max_new_tokens = 0; cases.push_back({"max_new_tokens 0", c, "max_new_tokens"});
  c = base; c.params.max_new_tokens = int64_t(1) << 40; cases.push_back({"max_new_tokens huge", c, "max_new_tokens"});
  c = base; c.policy = "fastest"; cases.push_back({"unknown policy", c, "policy"});
  c = base; c.policy = "fixed:99"; cases.push_back({"fixed above gamma", c, "block size"});
  c = base; c.token_ids = {}; c.text = ""; cases.push_back({"empty prompt", c, "prompt"});
  c = base; c.token_ids = {5, 100000}; cases.push_back({"id outside vocab", c, "token ids"});
  c = base; c.token_ids = {5, -1}; cases.push_back({"negative id", c, "prompt"});
  c = base; c.token_ids = std::vector<int64_t>(expected["max_context"].get<size_t>() + 5, 7);
  cases.push_back({"prompt beyond capacity", c, "capacity"});
  c = base; c.token_ids = {5}; c.chat = true; cases.push_back({"chat on ids", c, "chat"});
  for (const auto& k : cases) {
    dspark::RequestId id = -1;
    dspark::Status st = rt->Submit(k.req, nullptr, &id);
    EXPECT_EQ(st.code(), dspark::StatusCode::kInvalidArgument) << k.name << ": " << st.ToString();
    EXPECT_NE(st.message().find(k.expect_in_message), std::string::npos) << k.name << ": " << st.message();
    EXPECT_EQ(id, -1) << k.name;
  }
  runner.join();
  EXPECT_EQ(good.token_ids, expected["prompts"][0]["token_ids"].get<std::vector<int64_t>>());
  EXPECT_GE(rt->Stats().finished, 1);
}

TEST(Runtime, BadEngineDirectoriesReturnErrors) {
  std::unique_ptr<dspark::Runtime> rt;
  dspark::RuntimeOptions opt;
  dspark::Status st = dspark::Runtime::Open(opt, &rt);
  EXPECT_EQ(st.code(), dspark::StatusCode::kInvalidArgument);
  opt.engine_dir = FixtureDir() + "/no-such-dir";
  st = dspark::Runtime::Open(opt, &rt);
  EXPECT_EQ(st.code(), dspark::StatusCode::kEngineDir) << st.ToString();
  EXPECT_NE(st.message().find("no-such-dir"), std::string::npos);
  // an altered manifest: copy the directory, change the schema version / a hash
  const fs::path copy = fs::path(FixtureDir()) / "altered";
  fs::remove_all(copy);
  fs::copy(fs::path(FixtureDir()) / "engines", copy, fs::copy_options::recursive);
  std::ifstream in(copy / "manifest.json");
  json m = json::parse(in);
  in.close();
  m["schema_version"] = 99;
  std::ofstream(copy / "manifest.json") << m.dump();
  opt.engine_dir = copy.string();
  st = dspark::Runtime::Open(opt, &rt);
  EXPECT_EQ(st.code(), dspark::StatusCode::kEngineDir) << st.ToString();
  EXPECT_NE(st.message().find("schema_version"), std::string::npos) << st.message();
  m["schema_version"] = 1;
  m["files"]["profile/sps.json"]["sha256"] = std::string(64, '0');
  std::ofstream(copy / "manifest.json") << m.dump();
  st = dspark::Runtime::Open(opt, &rt);
  EXPECT_EQ(st.code(), dspark::StatusCode::kEngineDir) << st.ToString();
  EXPECT_NE(st.message().find("sha256"), std::string::npos) << st.message();
  opt.engine_dir = FixtureDir() + "/engines";
  opt.policy = "nope";
  st = dspark::Runtime::Open(opt, &rt);
  EXPECT_EQ(st.code(), dspark::StatusCode::kInvalidArgument) << st.ToString();
  fs::remove_all(copy);
}

TEST(Runtime, CloseEndsOpenRequests) {
  dspark::RuntimeOptions opt;
  opt.engine_dir = FixtureDir() + "/engines";
  opt.verify_hashes = false;
  std::unique_ptr<dspark::Runtime> rt;
  ASSERT_TRUE(dspark::Runtime::Open(opt, &rt).ok());
  std::atomic<int> ended{0};
  std::string reason;
  dspark::RequestId id;
  ASSERT_TRUE(rt->Submit(IdsRequest({5, 6}, "ar", 80), [&](const dspark::Event& ev) {
                if (ev.finished) { reason = ev.finish_reason; ended++; }
              }, &id).ok());
  rt->Close();
  EXPECT_EQ(ended.load(), 1);
  EXPECT_TRUE(reason == "cancelled" || reason == "length") << reason;
  EXPECT_EQ(rt->Submit(IdsRequest({5}, "ar", 2), nullptr, &id).code(), dspark::StatusCode::kFailedPrecondition);
  dspark::Event ev;
  EXPECT_FALSE(rt->NextEvent(&ev, std::chrono::milliseconds(10)));
  rt->Close();  // idempotent
}

// ---------------------------------------------------------------- lifecycle and misuse (never a crash)

namespace {
std::unique_ptr<dspark::Runtime> OpenTiny() {
  dspark::RuntimeOptions opt;
  opt.engine_dir = FixtureDir() + "/engines";
  opt.verify_hashes = false;
  std::unique_ptr<dspark::Runtime> rt;
  dspark::Status st = dspark::Runtime::Open(opt, &rt);
  if (!st.ok()) throw std::runtime_error(st.ToString());
  return rt;
}
}  // namespace

TEST(Lifecycle, CallsAfterCloseAreErrorsNotCrashes) {
  auto rt = OpenTiny();
  dspark::GenerationResult r;
  ASSERT_TRUE(rt->Generate(IdsRequest({5, 6}, "ar", 3), &r).ok());
  rt->Close();
  EXPECT_EQ(rt->Cancel(1).code(), dspark::StatusCode::kFailedPrecondition);
  dspark::RuntimeStats s = rt->Stats();
  EXPECT_EQ(s.finished, 1);
  EXPECT_EQ(s.generated_tokens, 3);
  dspark::RequestId id;
  EXPECT_EQ(rt->Submit(IdsRequest({5}, "ar", 2), nullptr, &id).code(), dspark::StatusCode::kFailedPrecondition);
  EXPECT_EQ(rt->Generate(IdsRequest({5}, "ar", 2), &r).code(), dspark::StatusCode::kFailedPrecondition);
  dspark::Event ev;
  EXPECT_FALSE(rt->NextEvent(&ev, std::chrono::milliseconds::max()));  // closed: returns at once
}

TEST(Lifecycle, ConcurrentCloseAndStatsFromManyThreads) {
  for (int round = 0; round < 3; ++round) {
    auto rt = OpenTiny();
    dspark::RequestId id;
    ASSERT_TRUE(rt->Submit(IdsRequest({5, 6, 7}, "fixed:2", 40), nullptr, &id).ok());
    std::atomic<bool> stop{false};
    std::thread stats([&] { while (!stop) { rt->Stats(); rt->Cancel(12345); } });
    std::thread a([&] { rt->Close(); }), b([&] { rt->Close(); });
    a.join();
    b.join();
    stop = true;
    stats.join();
    dspark::Event ev;
    ASSERT_TRUE(rt->NextEvent(&ev, std::chrono::seconds(5)));  // the open request got its final event
    while (!ev.finished) ASSERT_TRUE(rt->NextEvent(&ev, std::chrono::seconds(5)));
    EXPECT_TRUE(ev.finish_reason == "cancelled" || ev.finish_reason == "length") << ev.finish_reason;
  }
}

TEST(Lifecycle, EverySubmitRacingCloseGetsOneFinalEvent) {
  for (int round = 0; round < 3; ++round) {
    auto rt = OpenTiny();
    std::mutex mu;
    std::map<dspark::RequestId, int> finals;
    std::atomic<int> accepted{0};
    std::vector<std::thread> clients;
    for (int t = 0; t < 3; ++t) {
      clients.emplace_back([&] {
        for (int i = 0; i < 40; ++i) {
          dspark::RequestId id;
          dspark::Status st = rt->Submit(IdsRequest({5, 6}, "ar", 2), [&](const dspark::Event& ev) {
            if (ev.finished) { std::lock_guard<std::mutex> lock(mu); finals[ev.request_id] += 1; }
          }, &id);
          if (st.ok()) accepted++;
          else ASSERT_EQ(st.code(), dspark::StatusCode::kFailedPrecondition) << st.ToString();
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(30 * (round + 1)));
    rt->Close();
    for (auto& c : clients) c.join();
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(static_cast<int>(finals.size()), accepted.load());
    for (auto& [id, n] : finals) EXPECT_EQ(n, 1) << id;
  }
}

TEST(Lifecycle, CallbacksMayCloseOrDestroyTheRuntimeAndMayThrow) {
  // Close from inside a callback: no deadlock, the other request still gets its final event.
  auto rt = OpenTiny();
  dspark::Runtime* raw = rt.get();
  std::atomic<int> finals{0};
  dspark::RequestId id;
  ASSERT_TRUE(rt->Submit(IdsRequest({5, 6}, "ar", 30), [&](const dspark::Event& ev) {
    if (ev.finished) finals++;
  }, &id).ok());
  ASSERT_TRUE(rt->Submit(IdsRequest({7, 8}, "ar", 30), [&](const dspark::Event& ev) {
    if (!ev.token_ids.empty() && !ev.finished) raw->Close();
    if (ev.finished) finals++;
  }, &id).ok());
  rt.reset();  // joins the driver after it finished the close
  EXPECT_EQ(finals.load(), 2);

  // Generate inside a callback is refused (it would wait for its own thread); a throwing callback is logged.
  auto rt2 = OpenTiny();
  raw = rt2.get();
  dspark::Status inner;
  std::promise<void> done;
  ASSERT_TRUE(rt2->Submit(IdsRequest({5, 6}, "ar", 4), [&](const dspark::Event& ev) {
    if (ev.finished) {
      dspark::GenerationResult r;
      inner = raw->Generate(IdsRequest({5}, "ar", 2), &r);
      done.set_value();
      throw std::runtime_error("a callback that throws");
    }
  }, &id).ok());
  done.get_future().wait();
  EXPECT_EQ(inner.code(), dspark::StatusCode::kFailedPrecondition);
  dspark::GenerationResult after;
  ASSERT_TRUE(rt2->Generate(IdsRequest({5, 6}, "ar", 3), &after).ok());  // still serving
  EXPECT_EQ(after.token_ids.size(), 3u);

  // Destroying the Runtime from its own callback.
  auto* holder = new std::unique_ptr<dspark::Runtime>(OpenTiny());
  std::promise<void> gone;
  ASSERT_TRUE((*holder)->Submit(IdsRequest({5, 6}, "ar", 20), [&](const dspark::Event& ev) {
    if (!ev.finished && holder != nullptr) {
      delete holder;
      holder = nullptr;
      gone.set_value();
    }
  }, &id).ok());
  EXPECT_EQ(gone.get_future().wait_for(std::chrono::seconds(60)), std::future_status::ready);
}

TEST(Lifecycle, NullOutputsAndBadOptions) {
  EXPECT_EQ(dspark::Runtime::Open(dspark::RuntimeOptions{}, nullptr).code(), dspark::StatusCode::kInvalidArgument);
  dspark::Runtime* rt = Shared();
  EXPECT_EQ(rt->Submit(IdsRequest({5}, "ar", 2), nullptr, nullptr).code(), dspark::StatusCode::kInvalidArgument);
  EXPECT_EQ(rt->Generate(IdsRequest({5}, "ar", 2), nullptr).code(), dspark::StatusCode::kInvalidArgument);
  EXPECT_FALSE(rt->NextEvent(nullptr, std::chrono::milliseconds(1)));
  dspark::RuntimeOptions opt;
  opt.engine_dir = FixtureDir() + "/engines";
  std::unique_ptr<dspark::Runtime> out;
  opt.threads = 100000;
  dspark::Status st = dspark::Runtime::Open(opt, &out);
  EXPECT_EQ(st.code(), dspark::StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("threads"), std::string::npos);
  opt.threads = -1;
  EXPECT_EQ(dspark::Runtime::Open(opt, &out).code(), dspark::StatusCode::kInvalidArgument);
  opt.threads = 0;
  opt.engine_dir = FixtureDir() + "/engines/manifest.json";
  st = dspark::Runtime::Open(opt, &out);
  EXPECT_EQ(st.code(), dspark::StatusCode::kEngineDir);
  EXPECT_NE(st.message().find("found a file"), std::string::npos) << st.message();
  opt.engine_dir = std::string("bad\xff\xfe");
  EXPECT_EQ(dspark::Runtime::Open(opt, &out).code(), dspark::StatusCode::kInvalidArgument);
}

TEST(Lifecycle, InvalidUtf8SeedsAndTinyTemperatures) {
  dspark::Runtime* rt = Shared();
  dspark::RequestId id;
  dspark::GenerateRequest req;
  req.text = std::string("caf\xc3");  // truncated 2-byte sequence
  dspark::Status st = rt->Submit(req, nullptr, &id);
  EXPECT_EQ(st.code(), dspark::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("text"), std::string::npos) << st.message();
  auto seeded = IdsRequest({5, 6, 7}, "fixed:2", 12);
  seeded.params.temperature = 1.0f;
  seeded.params.seed = 7;
  dspark::GenerationResult a, b;
  ASSERT_TRUE(rt->Generate(seeded, &a).ok());
  ASSERT_TRUE(rt->Generate(seeded, &b).ok());
  EXPECT_EQ(a.token_ids, b.token_ids);  // the same seed reproduces
  seeded.params.seed = -5;
  EXPECT_EQ(rt->Submit(seeded, nullptr, &id).code(), dspark::StatusCode::kInvalidArgument);
  json expected = Expected();
  auto tiny = IdsRequest(expected["prompts"][0]["prompt"].get<std::vector<int64_t>>(), "fixed:2",
                         expected["max_new_tokens"]);
  tiny.params.temperature = 1e-39f;  // below 1e-5: greedy (logits / T would overflow)
  dspark::GenerationResult r;
  ASSERT_TRUE(rt->Generate(tiny, &r).ok());
  EXPECT_EQ(r.token_ids, expected["prompts"][0]["token_ids"].get<std::vector<int64_t>>());
  auto stops = IdsRequest({5, 6}, "ar", 4);
  stops.params.stop_token_ids = {100000};
  EXPECT_EQ(rt->Submit(stops, nullptr, &id).code(), dspark::StatusCode::kInvalidArgument);
}
