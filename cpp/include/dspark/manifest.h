// dspark/manifest.h: the engine directory's manifest.json, read natively (schema versions 1 and 2).
//
// A C++ port of `dspark_export.engines.manifest.Manifest.load`: the schema version is checked, every
// path is confined to the directory (no absolute paths, no `..` or symlink escapes), the sections the
// runtime reads are type-checked, and every listed file must exist with its recorded size (and sha256,
// when hashes are verified). A directory without a valid manifest is not an engine directory.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dspark/scheduler.h"
#include "dspark/status.h"

namespace dspark {

// The manifest schema the Python side writes (engines/manifest.py SCHEMA_VERSION) and the oldest one read.
// 2: with a draft_vocab, the drafter block's draft logits may be [R, gamma, N] over the manifest's
// draft_vocab.d2t ids rather than [R, gamma, V]. This loader does not parse draft_vocab: a native driver
// must scatter such logits to V at d2t (-inf elsewhere) before SpeculativeVerify, which reads [gamma, V].
constexpr int kManifestSchemaVersion = 2;
constexpr int kMinManifestSchemaVersion = 1;

struct EngineEntry {
  std::string graph;    // "target", "drafter_context", "drafter_block", "verify"
  std::string backend;  // "onnxruntime" (or "tensorrt")
  std::string dim;      // the bucketed dimension: "N" packed tokens, "R" requests
  int64_t bucket = 0;
  std::string path;     // engines/<backend>/<graph>.<dim><bucket>.json, relative to the directory
};

struct ManifestOptions {
  // Check every file's sha256 (about 1 s per GB). Sizes are always checked. Needs OpenSSL at build time;
  // without it a hash check fails with kFailedPrecondition.
  bool verify_hashes = true;
};

class Manifest {
 public:
  // Reads and validates <engine_dir>/manifest.json. Errors: kEngineDir naming the file and field.
  static Status Load(const std::string& engine_dir, const ManifestOptions& options, Manifest* out);

  const std::string& root() const { return root_; }
  int64_t block_size() const { return block_size_; }        // γ, drafts per block
  int64_t max_context() const { return max_context_; }      // tokens per request (prompt + generated)
  int64_t vocab_size() const { return vocab_size_; }
  const std::vector<int64_t>& eos_token_ids() const { return eos_token_ids_; }
  // STS temperatures per draft position [γ] (ones when uncalibrated), paper §3.2.1.
  const std::vector<double>& confidence_temperature() const { return confidence_temperature_; }
  const std::vector<EngineEntry>& engines() const { return engines_; }
  // Buckets of one graph's engines, ascending.
  std::vector<int64_t> Buckets(const std::string& graph) const;
  // Absolute path of a graph file. Errors: kEngineDir if the graph is unknown.
  Status GraphPath(const std::string& graph, std::string* path) const;
  // The throughput profile named by the manifest (profile.path). Errors: kEngineDir / kProfile.
  Status LoadProfile(ThroughputProfile* profile) const;
  // Resolve a manifest-relative path inside the directory. Errors: kEngineDir (absolute, escapes).
  Status ResolveInside(const std::string& rel, const std::string& what, std::string* full) const;

 private:
  std::string root_;
  int64_t block_size_ = 0, max_context_ = 0, vocab_size_ = 0;
  std::vector<int64_t> eos_token_ids_;
  std::vector<double> confidence_temperature_;
  std::vector<EngineEntry> engines_;
  std::map<std::string, std::string> graph_paths_;
  std::string profile_path_;
};

// Hex sha256 of a file (OpenSSL). Errors: kNotFound (unreadable), kFailedPrecondition (built without OpenSSL).
Status Sha256File(const std::string& path, std::string* hex);

}  // namespace dspark
