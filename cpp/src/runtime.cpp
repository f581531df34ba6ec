// dspark::Runtime: hosts dspark_export.runtime.service.Service in an embedded CPython interpreter.
//
// Locking rules (no lock-order inversion is possible):
//   - the GIL is taken by Submit/Cancel (briefly) and by the driver thread (one step at a time);
//   - mu_ (the C++ state: callbacks, pull queue, open requests) may be taken while holding the GIL,
//     but the GIL is never requested while holding mu_;
//   - user callbacks run on the driver thread with neither held.
#include "dspark/runtime.h"

#include <pybind11/embed.h>
#include <pybind11/stl.h>

#include <condition_variable>
#include <deque>
#include <cstdio>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

namespace py = pybind11;

#ifndef DSPARK_DEFAULT_PYTHON
#define DSPARK_DEFAULT_PYTHON ""
#endif

namespace dspark {
namespace {

std::mutex g_interpreter_mu;
std::mutex g_open_mu;  // serialises Runtime::Open: concurrent first imports of transformers race in Python
bool g_started_by_us = false;

// Whether `s` is well-formed UTF-8 (Python would raise UnicodeDecodeError converting it).
bool IsUtf8(const std::string& s) {
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (len == 0 || i + len > n) return false;
    for (size_t k = 1; k < len; ++k)
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 0x2) return false;
    if (len == 2 && c < 0xc2) return false;  // overlong
    i += len;
  }
  return true;
}

Status CheckUtf8(const std::string& value, const char* field) {
  if (IsUtf8(value)) return Status::Ok();
  return Status(StatusCode::kInvalidArgument, std::string(field) + ": expected UTF-8 text, found invalid bytes");
}

// Map a Python exception to a Status (message: "<ExceptionType>: <text>").
Status FromPython(const py::error_already_set& e) {
  std::string type;
  {
    py::gil_scoped_acquire gil;
    type = py::str(e.type().attr("__name__")).cast<std::string>();
  }
  std::string text = e.what();
  // e.what() is "<Type>: <message>\n\nAt:\n<trace>"; keep the first paragraph
  size_t cut = text.find("\n\nAt:");
  if (cut != std::string::npos) text = text.substr(0, cut);
  StatusCode code = StatusCode::kInternal;
  if (type == "EngineDirError") code = StatusCode::kEngineDir;
  else if (type == "ProfileError") code = StatusCode::kProfile;
  else if (type == "RequestError" || type == "ConfigError" || type == "PluginError" || type == "ValueError" ||
           type == "TypeError" || type == "UnicodeDecodeError" || type == "UnicodeEncodeError")
    code = StatusCode::kInvalidArgument;
  else if (type == "ModuleNotFoundError" || type == "ImportError")
    code = StatusCode::kUnavailable;
  return Status(code, text);
}

Status EnsureInterpreter(const RuntimeOptions& options) {
  std::lock_guard<std::mutex> lock(g_interpreter_mu);
  if (!Py_IsInitialized()) {
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.parse_argv = 0;
    config.install_signal_handlers = 0;  // the host process owns its signals
    const std::string exe = options.python_executable.empty() ? DSPARK_DEFAULT_PYTHON : options.python_executable;
    if (!exe.empty()) {
      PyConfig_SetBytesString(&config, &config.executable, exe.c_str());
      PyConfig_SetBytesString(&config, &config.program_name, exe.c_str());
    }
    try {
      py::initialize_interpreter(&config, 0, nullptr, /*add_program_dir_to_path=*/false);
    } catch (const std::exception& e) {
      return Status(StatusCode::kUnavailable, std::string("could not start the Python interpreter: ") + e.what());
    }
    g_started_by_us = true;
    PyEval_SaveThread();  // release the GIL: every later call takes it with gil_scoped_acquire
  }
  py::gil_scoped_acquire gil;
  try {
    py::list path = py::module_::import("sys").attr("path");
    for (auto it = options.python_path.rbegin(); it != options.python_path.rend(); ++it) {
      bool present = false;
      for (auto p : path) present = present || py::str(p).cast<std::string>() == *it;
      if (!present) path.insert(0, *it);
    }
  } catch (const py::error_already_set& e) {
    return FromPython(e);
  }
  return Status::Ok();
}

RequestStats StatsFrom(const py::dict& d) {
  RequestStats s;
  auto get_i = [&](const char* k) { return d.contains(k) ? d[k].cast<int64_t>() : 0; };
  auto get_f = [&](const char* k) { return d.contains(k) ? d[k].cast<double>() : 0.0; };
  s.prompt_tokens = get_i("prompt_tokens");
  s.completion_tokens = get_i("completion_tokens");
  s.rounds = get_i("rounds");
  s.draft_tokens = get_i("draft_tokens");
  s.accepted_tokens = get_i("accepted_tokens");
  s.acceptance_length = get_f("acceptance_length");
  s.wall_s = get_f("wall_s");
  s.tokens_per_s = get_f("tokens_per_s");
  return s;
}

Event EventFrom(const py::handle& ev) {
  Event out;
  out.request_id = ev.attr("request_id").cast<int64_t>();
  out.token_ids = ev.attr("token_ids").cast<std::vector<int64_t>>();
  out.text_delta = ev.attr("text_delta").cast<std::string>();
  out.finished = ev.attr("finished").cast<bool>();
  py::object reason = ev.attr("finish_reason"), error = ev.attr("error");
  out.finish_reason = reason.is_none() ? "" : reason.cast<std::string>();
  out.error = error.is_none() ? "" : error.cast<std::string>();
  if (out.finished) out.stats = StatsFrom(ev.attr("stats").cast<py::dict>());
  return out;
}

}  // namespace

struct __attribute__((visibility("hidden"))) Runtime::Impl {
  RuntimeOptions options;
  py::object service;  // touched only with the GIL held; None once closed

  mutable std::mutex mu;
  std::condition_variable work_cv;   // the driver waits for work
  std::condition_variable event_cv;  // NextEvent waits for events
  bool closing = false;  // set once by Close: no new requests; the driver stops
  bool finishing = false;  // Finish has started collecting the open requests: no more registrations
  bool closed = false;   // Finish has run: every open request has its final event
  bool work = false;     // a submit or cancel happened since the driver last found no work
  std::map<RequestId, EventCallback> callbacks;  // open requests (empty callback = pull queue)
  std::deque<Event> pull_queue;
  std::thread driver;
  std::thread::id driver_id;
  RuntimeStats final_stats;  // the counters at Close
  std::mutex close_mu;  // serialises Close callers (a second caller waits until the first is done)

  bool OnDriver() const { return std::this_thread::get_id() == driver_id; }
  void Drive();
  void Dispatch(std::vector<Event>& events);
  void Finish();
};

Runtime::Runtime(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

Runtime::~Runtime() {
  Close();
  // Destroyed from its own callback: the driver thread still runs (it finishes the close and owns Impl
  // until it returns), so it cannot be joined from itself.
  if (impl_ && impl_->OnDriver() && impl_->driver.joinable()) impl_->driver.detach();
}

Status Runtime::Open(const RuntimeOptions& options, std::unique_ptr<Runtime>* out) {
  if (out == nullptr) return Status(StatusCode::kInvalidArgument, "Open: out must not be null");
  if (options.engine_dir.empty()) {
    return Status(StatusCode::kInvalidArgument, "engine_dir: expected the path of an engine directory, found \"\"");
  }
  for (auto [value, field] : {std::pair{&options.engine_dir, "engine_dir"}, {&options.policy, "policy"},
                              {&options.python_executable, "python_executable"}}) {
    Status u = CheckUtf8(*value, field);
    if (!u.ok()) return u;
  }
  for (const auto& p : options.python_path) {
    Status u = CheckUtf8(p, "python_path");
    if (!u.ok()) return u;
  }
  if (!options.python_executable.empty() && !Py_IsInitialized()) {
    std::ifstream probe(options.python_executable);
    if (!probe.good()) {
      return Status(StatusCode::kInvalidArgument,
                    "python_executable: expected an existing Python executable, found no file at '" +
                        options.python_executable + "'");
    }
  }
  std::lock_guard<std::mutex> open_lock(g_open_mu);
  Status st = EnsureInterpreter(options);
  if (!st.ok()) return st;
  auto impl = std::make_shared<Impl>();
  impl->options = options;
  {
    py::gil_scoped_acquire gil;
    try {
      if (options.shared_thread_pool)
        py::module_::import("dspark_export.engines.ort.runner").attr("use_shared_thread_pool")(options.threads);
      py::module_ mod = py::module_::import("dspark_export.runtime.service");
      impl->service = mod.attr("Service").attr("open")(options.engine_dir, options.policy,
                                                         py::arg("verify") = options.verify_hashes,
                                                         py::arg("threads") = options.threads);
    } catch (const py::error_already_set& e) {
      return FromPython(e);
    }
  }
  // The driver thread co-owns Impl, so a Runtime destroyed from its own callback stays valid until the
  // driver has returned from that callback.
  impl->driver = std::thread([impl] { impl->Drive(); });
  impl->driver_id = impl->driver.get_id();
  out->reset(new Runtime(std::move(impl)));
  return Status::Ok();
}

void Runtime::Impl::Drive() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu);
      work_cv.wait(lock, [&] { return closing || work; });
      if (closing) break;
      work = false;
    }
    std::vector<Event> events;
    bool more = false;
    {
      py::gil_scoped_acquire gil;
      try {
        more = service.attr("step")().cast<bool>();
        for (auto ev : service.attr("take_events")()) events.push_back(EventFrom(ev));
      } catch (const py::error_already_set& e) {
        // Service.step fails the affected requests itself; anything reaching here is a bug in the loop.
        // Report it on every open request rather than dying silently.
        std::string why = e.what();
        std::lock_guard<std::mutex> lock(mu);
        for (auto& [id, cb] : callbacks) {
          Event ev;
          ev.request_id = id;
          ev.finished = true;
          ev.finish_reason = "error";
          ev.error = "runtime step failed: " + why.substr(0, why.find("\n\nAt:"));
          events.push_back(ev);
        }
        more = false;
      }
    }
    Dispatch(events);
    if (more) {
      std::lock_guard<std::mutex> lock(mu);
      work = true;
    }
  }
  // Close was called from a callback on this thread (or the Runtime was destroyed there): finish here.
  bool finished;
  {
    std::lock_guard<std::mutex> lock(mu);
    finished = closed;
  }
  if (!finished) Finish();
}

void Runtime::Impl::Dispatch(std::vector<Event>& events) {
  for (auto& ev : events) {
    EventCallback cb;
    bool known = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = callbacks.find(ev.request_id);
      if (it != callbacks.end()) {
        known = true;
        cb = it->second;
        if (ev.finished) callbacks.erase(it);
      }
      if (known && !cb) {
        pull_queue.push_back(ev);
        event_cv.notify_all();
      }
    }
    if (known && cb) {
      try {
        cb(ev);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "dspark: an event callback threw (%s); the runtime goes on\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "dspark: an event callback threw; the runtime goes on\n");
      }
    }
  }
}

Status Runtime::Submit(const GenerateRequest& request, EventCallback on_event, RequestId* id) {
  Impl& m = *impl_;
  if (id == nullptr) return Status(StatusCode::kInvalidArgument, "submit: id must not be null");
  for (auto [value, field] : {std::pair{&request.text, "text"}, {&request.policy, "policy"}}) {
    Status u = CheckUtf8(*value, field);
    if (!u.ok()) return u;
  }
  if (request.params.seed < -1) {
    return Status(StatusCode::kInvalidArgument,
                  "seed: expected an integer >= 0, or -1 for a random seed, found " + std::to_string(request.params.seed));
  }
  py::gil_scoped_acquire gil;
  {
    // Checked with the GIL held: Close sets `closing` before it takes the GIL to end the open requests
    // and drop the service, so a submit that passes here is seen (and ended) by that Close.
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.closing) return Status(StatusCode::kFailedPrecondition, "submit: the runtime is closed");
  }
  try {
    py::dict params;
    params["max_new_tokens"] = request.params.max_new_tokens;
    params["temperature"] = static_cast<double>(request.params.temperature);
    params["top_k"] = request.params.top_k;
    params["top_p"] = static_cast<double>(request.params.top_p);
    params["seed"] = request.params.seed < 0 ? py::object(py::none()) : py::object(py::int_(request.params.seed));
    params["stop_token_ids"] = py::tuple(py::cast(request.params.stop_token_ids));
    py::object prompt = request.token_ids.empty() ? py::object(py::str(request.text))
                                                  : py::object(py::cast(request.token_ids));
    py::object policy = request.policy.empty() ? py::object(py::none()) : py::object(py::str(request.policy));
    RequestId rid = m.service.attr("submit")(prompt, params, policy, request.chat, request.decode_text).cast<RequestId>();
    // Registered before this thread gives up the GIL for good, so the driver cannot have produced an
    // event for rid yet. Python may switch threads inside submit(), though: if Close began ending the
    // open requests meanwhile, this one would be missed, so it is refused instead (the queue it joined
    // is never stepped again).
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.finishing) return Status(StatusCode::kFailedPrecondition, "submit: the runtime closed during the call");
    m.callbacks[rid] = std::move(on_event);
    m.work = true;
    m.work_cv.notify_one();
    *id = rid;
  } catch (const py::error_already_set& e) {
    return FromPython(e);
  }
  return Status::Ok();
}

Status Runtime::Cancel(RequestId id) {
  Impl& m = *impl_;
  bool ok = false;
  {
    py::gil_scoped_acquire gil;
    if (!m.service) {
      return Status(StatusCode::kFailedPrecondition, "cancel: the runtime is closed");
    }
    try {
      ok = m.service.attr("cancel")(id).cast<bool>();
    } catch (const py::error_already_set& e) {
      return FromPython(e);
    }
  }
  if (!ok) return Status(StatusCode::kNotFound, "cancel: request " + std::to_string(id) + " is unknown or finished");
  std::lock_guard<std::mutex> lock(m.mu);
  m.work = true;
  m.work_cv.notify_one();
  return Status::Ok();
}

bool Runtime::NextEvent(Event* event, std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  if (event == nullptr) return false;
  std::unique_lock<std::mutex> lock(m.mu);
  auto ready = [&] { return !m.pull_queue.empty() || m.closed; };
  if (timeout > std::chrono::hours(24 * 365)) {  // "forever": wait_for would overflow its deadline
    m.event_cv.wait(lock, ready);
  } else if (!m.event_cv.wait_for(lock, timeout, ready)) {
    return false;
  }
  if (m.pull_queue.empty()) return false;
  *event = std::move(m.pull_queue.front());
  m.pull_queue.pop_front();
  return true;
}

Status Runtime::Generate(const GenerateRequest& request, GenerationResult* result) {
  if (result == nullptr) return Status(StatusCode::kInvalidArgument, "generate: result must not be null");
  if (impl_->OnDriver()) {
    return Status(StatusCode::kFailedPrecondition,
                  "generate: called from an event callback, which runs on the thread that would produce the "
                  "result; use Submit there");
  }
  if (Py_IsInitialized() && PyGILState_Check()) {
    return Status(StatusCode::kFailedPrecondition,
                  "generate: called with the Python GIL held (from Python, load the library with ctypes.CDLL, "
                  "not PyDLL, so the GIL is released); the runtime's driver thread needs the GIL");
  }
  auto done = std::make_shared<std::promise<void>>();
  auto acc = std::make_shared<GenerationResult>();
  RequestId id = 0;
  Status st = Submit(
      request,
      [done, acc](const Event& ev) {
        acc->token_ids.insert(acc->token_ids.end(), ev.token_ids.begin(), ev.token_ids.end());
        acc->text += ev.text_delta;
        if (ev.finished) {
          acc->finish_reason = ev.finish_reason;
          acc->error = ev.error;
          acc->stats = ev.stats;
          done->set_value();
        }
      },
      &id);
  if (!st.ok()) return st;
  done->get_future().wait();
  *result = *acc;
  return Status::Ok();
}

RuntimeStats Runtime::Stats() const {
  RuntimeStats s;
  py::gil_scoped_acquire gil;
  if (!impl_->service) return impl_->final_stats;
  try {
    py::dict d = impl_->service.attr("stats")();
    s.submitted = d["submitted"].cast<int64_t>();
    s.finished = d["finished"].cast<int64_t>();
    s.failed = d["failed"].cast<int64_t>();
    s.cancelled = d["cancelled"].cast<int64_t>();
    s.running = d["running"].cast<int64_t>();
    s.steps = d["steps"].cast<int64_t>();
    s.generated_tokens = d["generated_tokens"].cast<int64_t>();
  } catch (const py::error_already_set&) {
  }
  return s;
}

void Runtime::Close() {
  if (!impl_) return;
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.closing = true;
    m.work_cv.notify_all();
  }
  if (m.OnDriver()) return;  // from a callback: the driver finishes the close when the callback returns
  std::lock_guard<std::mutex> serial(m.close_mu);
  if (m.driver.joinable()) m.driver.join();
  bool finished;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    finished = m.closed;
  }
  if (!finished) m.Finish();
}

void Runtime::Impl::Finish() {
  // End every open request, then release the Python objects (with the GIL).
  std::vector<Event> ends;
  {
    py::gil_scoped_acquire gil;
    {
      std::lock_guard<std::mutex> lock(mu);
      finishing = true;
      for (auto& [id, cb] : callbacks) {
        Event ev;
        ev.request_id = id;
        ev.finished = true;
        ev.finish_reason = "cancelled";
        ev.error = "runtime closed";
        ends.push_back(ev);
      }
    }
    try {
      if (service) {
        for (auto& ev : ends) service.attr("cancel")(ev.request_id);
        py::dict d = service.attr("stats")();
        final_stats.submitted = d["submitted"].cast<int64_t>();
        final_stats.finished = d["finished"].cast<int64_t>() + static_cast<int64_t>(ends.size());
        final_stats.failed = d["failed"].cast<int64_t>();
        final_stats.cancelled = d["cancelled"].cast<int64_t>() + static_cast<int64_t>(ends.size());
        final_stats.steps = d["steps"].cast<int64_t>();
        final_stats.generated_tokens = d["generated_tokens"].cast<int64_t>();
      }
    } catch (const py::error_already_set&) {
    }
    service = py::object();  // released with the GIL held
  }
  Dispatch(ends);
  std::lock_guard<std::mutex> lock(mu);
  closed = true;
  event_cv.notify_all();
}

}  // namespace dspark
