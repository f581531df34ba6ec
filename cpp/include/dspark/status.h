// dspark/status.h: the error type every dspark C++ call returns. No exceptions cross the API.
#pragma once

#include <string>
#include <utility>

namespace dspark {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // a parameter, prompt, policy string or input array is invalid
  kNotFound,            // an unknown request id, a missing file
  kEngineDir,           // an engine directory is missing, incomplete, altered or its manifest invalid
  kProfile,             // the throughput profile SPS(B) is unusable
  kFailedPrecondition,  // the call is not possible in this state (runtime closed, built without a feature)
  kUnavailable,         // the Python runtime could not be started or imported
  kInternal,            // anything else (the message says what)
};

// "OK", "INVALID_ARGUMENT", ...
const char* StatusCodeName(StatusCode code);

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: RequestError: temperature: expected a finite value >= 0, found -1.0" (errors from the
  // hosted Python runtime carry its exception type; native ones do not)
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace dspark
