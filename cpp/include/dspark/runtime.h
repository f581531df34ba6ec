// dspark/runtime.h: DSpark speculative decoding over an engine directory, from C++.
//
//   dspark::RuntimeOptions opt;
//   opt.engine_dir = "engines/smollm2";
//   std::unique_ptr<dspark::Runtime> rt;
//   dspark::Status st = dspark::Runtime::Open(opt, &rt);
//   if (!st.ok()) { std::cerr << st.ToString() << "\n"; return 1; }
//   dspark::GenerateRequest req;
//   req.text = "What is 2+3?";
//   req.chat = true;
//   dspark::RequestId id;
//   st = rt->Submit(req, [](const dspark::Event& ev) { std::cout << ev.text_delta << std::flush; }, &id);
//
// This implementation hosts the project's Python runtime (dspark_export.runtime.service.Service) in
// an embedded CPython interpreter, so the C++ and Python APIs run the same loop and give the same
// tokens. Nothing Python appears in this header.
//
// Threading (docs/cpp.md): every method may be called from any thread, concurrently, Close included. One
// driver thread per Runtime advances all of its requests (continuous batching: one packed target pass per
// step) and delivers events. Callbacks run on that driver thread, in commit order, without the Python GIL
// held and without any Runtime lock held: a callback may call Submit, Cancel, Stats or Close, and may even
// destroy the Runtime; Generate from a callback is refused (kFailedPrecondition: it would wait for its own
// thread); an exception thrown by a callback is caught and logged to stderr. A slow callback delays every
// request of this Runtime. Submit and Cancel take the GIL briefly. The interpreter is started by the first
// Runtime::Open of the process (or reused when the host process already runs Python; call in with the GIL
// released, e.g. ctypes.CDLL, or Generate is refused) and lives until the process exits.
//
// Errors: no exception crosses this API; every call returns a Status (status.h). A request that fails
// while running (an engine error) ends with an Event whose finish_reason is "error" and whose error
// says why; the Runtime keeps serving the other requests.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dspark/status.h"

namespace dspark {

using RequestId = int64_t;

struct SamplingParams {
  int64_t max_new_tokens = 128;  // generated tokens at most, in [1, 2^20]
  float temperature = 0.0f;      // 0 (or below 1e-5) = greedy; otherwise softmax(logits / temperature), finite
  int64_t top_k = 0;             // keep the k most likely tokens; 0 = off
  float top_p = 1.0f;            // nucleus mass in (0, 1]; 1 = off
  int64_t seed = -1;             // seeds the request's uniforms: same seed, prompt, params → same output; -1 = random
  std::vector<int64_t> stop_token_ids;  // extra stop ids on top of the engine's EOS ids, each in [0, vocab)
};

struct GenerateRequest {
  std::vector<int64_t> token_ids;  // the prompt as token ids, or
  std::string text;                // the prompt as text (used when token_ids is empty)
  bool chat = false;               // apply the engine directory's chat template to `text` (one user turn)
  SamplingParams params;
  std::string policy;              // "ar", "fixed:K", "threshold:C", "dspark", "dspark-async"; "" = the default
  bool decode_text = true;         // fill Event::text_delta (off for id-only clients: saves detokenising)
};

struct RequestStats {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t rounds = 0;            // verification rounds
  int64_t draft_tokens = 0;      // drafts sent to verification
  int64_t accepted_tokens = 0;   // drafts accepted
  double acceptance_length = 0;  // τ: tokens committed per round, bonus included
  double wall_s = 0;             // seconds from admission to the end
  double tokens_per_s = 0;
};

// Tokens committed for one request by one step, or its end.
struct Event {
  RequestId request_id = 0;
  std::vector<int64_t> token_ids;  // generated ids committed by this step (may be empty on the final event)
  std::string text_delta;          // newly decodable UTF-8 text (a split multi-byte character is held back)
  bool finished = false;
  std::string finish_reason;       // "" while running; "stop", "length", "capacity", "error", "cancelled"
  std::string error;               // why the request failed (finish_reason "error")
  RequestStats stats;              // filled on the final event
};

using EventCallback = std::function<void(const Event&)>;

struct GenerationResult {
  std::vector<int64_t> token_ids;
  std::string text;
  std::string finish_reason;
  std::string error;
  RequestStats stats;
};

struct RuntimeStats {
  int64_t submitted = 0, finished = 0, failed = 0, cancelled = 0, running = 0, steps = 0, generated_tokens = 0;
};

struct RuntimeOptions {
  std::string engine_dir;          // built by `dspark-export build`
  std::string policy = "dspark-async";   // the default verification policy (runtime.DEFAULT_POLICY)
  bool verify_hashes = true;       // check every file's sha256 at open (about 1 s per GB)
  int threads = 0;                 // ONNX Runtime intra-op threads for the target (0 = its default)
  // Run every engine on one process-wide ONNX Runtime pool of `threads` (what the dspark-export command does:
  // the drafter block then wakes no sleeping worker). It covers the ORT sessions the embedded Python makes
  // (ours), not ORT used through its C/C++ API; from then on that Python refuses ORT sessions with threads of
  // their own. false keeps a pool per session (the Python API's default).
  bool shared_thread_pool = true;
  // The Python whose environment provides dspark_export (a venv's bin/python works); "" = the Python the
  // library was built against. Only used when this call starts the interpreter.
  std::string python_executable;
  std::vector<std::string> python_path;  // extra sys.path entries, prepended
};

class Runtime {
 public:
  // Open and check an engine directory and start the driver thread.
  // Errors: kInvalidArgument (options), kEngineDir (missing/altered directory, bad manifest),
  // kProfile (a dspark policy without a usable profile), kUnavailable (Python or dspark_export missing).
  static Status Open(const RuntimeOptions& options, std::unique_ptr<Runtime>* out);
  ~Runtime();  // Close()
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Queue a request. Events go to `on_event` (called on the driver thread) or, if it is empty, to the
  // pull queue (NextEvent). Errors, with nothing queued: kInvalidArgument (parameters, policy, empty
  // prompt, ids outside the vocabulary, prompt longer than the capacity), kFailedPrecondition (closed).
  Status Submit(const GenerateRequest& request, EventCallback on_event, RequestId* id);
  // Stop a request: it ends with finish_reason "cancelled" at the next step and its KV slot is freed.
  // Errors: kNotFound (unknown or already finished).
  Status Cancel(RequestId id);
  // Pull API: waits up to `timeout` for the next event of any request submitted without a callback (one
  // queue per Runtime, shared by all such requests; Event::request_id says whose). Returns false on
  // timeout, or when the runtime is closed and the queue is empty. milliseconds::max() waits without limit.
  bool NextEvent(Event* event, std::chrono::milliseconds timeout);
  // Blocking convenience: submit and wait for the end. Errors as Submit, plus kFailedPrecondition from a
  // callback or with the Python GIL held by the caller.
  Status Generate(const GenerateRequest& request, GenerationResult* result);
  RuntimeStats Stats() const;
  // Stop the driver; requests still running end with finish_reason "cancelled" (error "runtime closed").
  // Idempotent and thread-safe (a second caller waits for the first); from a callback it returns at once
  // and the close completes when the callback returns. Called by the destructor. After Close, Submit,
  // Generate and Cancel return kFailedPrecondition and Stats returns the final counters.
  void Close();

 private:
  struct Impl;
  explicit Runtime(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace dspark
