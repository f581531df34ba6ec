#include "dspark/manifest.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#ifdef DSPARK_HAVE_OPENSSL
#include <openssl/evp.h>
#endif

namespace fs = std::filesystem;
using nlohmann::json;

namespace dspark {
namespace {

const char* kRequiredFields[] = {"schema_version", "tool", "graphs", "engines", "runtime", "files"};
const char* kRequiredGraphs[] = {"target", "drafter_context", "drafter_block", "verify"};

std::string TypeName(const json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "bool";
  if (v.is_number_integer()) return "int";
  if (v.is_number()) return "float";
  if (v.is_string()) return "str";
  if (v.is_array()) return "list";
  return "dict";
}

bool IsInside(const fs::path& root, const fs::path& full) {
  auto r = root.begin(), f = full.begin();
  for (; r != root.end(); ++r, ++f) {
    if (f == full.end() || *r != *f) return false;
  }
  return true;
}

}  // namespace

Status Sha256File(const std::string& path, std::string* hex) {
#ifdef DSPARK_HAVE_OPENSSL
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status(StatusCode::kNotFound, path + ": cannot read");
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  std::vector<char> buf(1 << 22);
  while (f) {
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    if (f.gcount() > 0) EVP_DigestUpdate(ctx, buf.data(), static_cast<size_t>(f.gcount()));
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, md, &len);
  EVP_MD_CTX_free(ctx);
  hex->clear();
  char two[3];
  for (unsigned int i = 0; i < len; ++i) {
    std::snprintf(two, sizeof two, "%02x", md[i]);
    *hex += two;
  }
  return Status::Ok();
#else
  (void)path;
  (void)hex;
  return Status(StatusCode::kFailedPrecondition,
                "sha256: this build has no OpenSSL; load with verify_hashes = false (sizes are still checked)");
#endif
}

Status Manifest::ResolveInside(const std::string& rel, const std::string& what, std::string* full) const {
  const std::string where = (fs::path(root_) / "manifest.json").string();
  if (rel.empty() || fs::path(rel).is_absolute()) {
    return Status(StatusCode::kEngineDir, where + ": " + what +
                                              ": expected a relative path inside the engine directory, found '" +
                                              rel + "'");
  }
  std::error_code ec;
  fs::path root = fs::weakly_canonical(fs::path(root_), ec);
  fs::path resolved = fs::weakly_canonical(root / rel, ec);
  if (ec || !IsInside(root, resolved)) {
    return Status(StatusCode::kEngineDir, where + ": " + what + ": path '" + rel +
                                              "' points outside the engine directory " + root.string());
  }
  *full = resolved.string();
  return Status::Ok();
}

Status Manifest::Load(const std::string& engine_dir, const ManifestOptions& options, Manifest* out) {
  Manifest m;
  m.root_ = engine_dir;
  const fs::path path = fs::path(engine_dir) / "manifest.json";
  const std::string where = path.string();
  auto fail = [&](const std::string& msg) { return Status(StatusCode::kEngineDir, where + ": " + msg); };
  if (!fs::is_directory(engine_dir)) {
    return Status(StatusCode::kEngineDir, engine_dir + ": expected an engine directory (built by `dspark-export "
                                                       "build`), found " +
                                              (fs::exists(engine_dir) ? "a file" : "no such directory"));
  }
  if (!fs::is_regular_file(path)) {
    return fail("missing; " + engine_dir + " is not a complete engine directory (an interrupted build leaves no manifest)");
  }
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  json data = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (data.is_discarded()) return fail("not valid JSON");
  if (!data.is_object()) return fail("expected a JSON object, found " + TypeName(data));
  const json& version = data.contains("schema_version") ? data["schema_version"] : json();
  if (!(version.is_number_integer() && version.get<int64_t>() >= kMinManifestSchemaVersion &&
        version.get<int64_t>() <= kManifestSchemaVersion)) {
    return fail("schema_version: expected " + std::to_string(kMinManifestSchemaVersion) + " to " +
                std::to_string(kManifestSchemaVersion) + ", found " + version.dump() +
                " (rebuild the engine directory with this version of dspark-export)");
  }
  std::vector<std::string> missing;
  for (const char* k : kRequiredFields)
    if (!data.contains(k)) missing.push_back(k);
  if (!missing.empty()) return fail("missing fields " + json(missing).dump());
  // section types
  for (auto [name, want_object] : {std::pair{"graphs", true}, {"runtime", true}, {"files", true}, {"engines", false}}) {
    const json& v = data[name];
    if (want_object ? !v.is_object() : !v.is_array()) {
      return fail(std::string(name) + ": expected a JSON " + (want_object ? "object" : "list") + ", found " + TypeName(v));
    }
  }
  missing.clear();
  for (const char* g : kRequiredGraphs)
    if (!data["graphs"].contains(g) || !data["graphs"][g].is_object()) missing.push_back(g);
  if (!missing.empty()) return fail("graphs: missing " + json(missing).dump());
  const json& rt = data["runtime"];
  for (const char* k : {"block_size", "max_context", "vocab_size"}) {
    if (!rt.contains(k) || !rt[k].is_number_integer()) {
      return fail(std::string("runtime.") + k + ": expected a JSON int, found " + (rt.contains(k) ? rt[k].dump() : "None"));
    }
  }
  for (const char* k : {"eos_token_ids", "confidence_temperature"}) {
    if (!rt.contains(k) || !rt[k].is_array()) {
      return fail(std::string("runtime.") + k + ": expected a JSON list, found " + (rt.contains(k) ? rt[k].dump() : "None"));
    }
  }
  for (const char* k : {"block_size", "max_context", "vocab_size"}) {
    if (rt[k].get<int64_t>() < 1) {
      return fail(std::string("runtime.") + k + ": expected an integer >= 1, found " + rt[k].dump());
    }
  }
  if (data["engines"].empty()) return fail("engines: expected at least one engine, found an empty list");
  {
    const json& target = data["graphs"]["target"];
    if (target.contains("spec") && target["spec"].is_object() && target["spec"].contains("vocab_size") &&
        target["spec"]["vocab_size"] != rt["vocab_size"]) {
      return fail("runtime.vocab_size " + rt["vocab_size"].dump() + " does not match the target graph's vocab_size " +
                  target["spec"]["vocab_size"].dump() + " (graphs.target.spec)");
    }
  }
  m.block_size_ = rt["block_size"].get<int64_t>();
  m.max_context_ = rt["max_context"].get<int64_t>();
  m.vocab_size_ = rt["vocab_size"].get<int64_t>();
  for (const auto& v : rt["eos_token_ids"]) {
    if (!v.is_number_integer()) return fail("runtime.eos_token_ids: expected integers, found " + v.dump());
    m.eos_token_ids_.push_back(v.get<int64_t>());
  }
  for (const auto& v : rt["confidence_temperature"]) {
    if (!v.is_number()) return fail("runtime.confidence_temperature: expected numbers, found " + v.dump());
    m.confidence_temperature_.push_back(v.get<double>());
  }
  const json& block_graph = data["graphs"]["drafter_block"];
  const json block = block_graph.contains("spec") && block_graph["spec"].is_object() &&
                             block_graph["spec"].contains("block_size")
                         ? block_graph["spec"]["block_size"]
                         : json();
  if (!block.is_number_integer() || block.get<int64_t>() != m.block_size_ ||
      static_cast<int64_t>(m.confidence_temperature_.size()) != m.block_size_) {
    return fail("runtime.block_size " + std::to_string(m.block_size_) +
                " and confidence_temperature must match the drafter graph's block_size " + block.dump());
  }
  for (const auto& entry : data["engines"]) {
    const json key = entry.is_object() && entry.contains("key") ? entry["key"] : json();
    bool ok = key.is_object();
    for (const char* k : {"graph", "backend", "dim"}) ok = ok && key.contains(k) && key[k].is_string();
    ok = ok && key.contains("bucket") && key["bucket"].is_number_integer();
    if (!ok) return fail("engines: malformed entry " + entry.dump());
    EngineEntry e{key["graph"], key["backend"], key["dim"], key["bucket"].get<int64_t>(), ""};
    const std::string expected = "engines/" + e.backend + "/" + e.graph + "." + e.dim + std::to_string(e.bucket) + ".json";
    const json p = entry.contains("path") ? entry["path"] : json();
    if (!p.is_string() || p.get<std::string>() != expected) {
      return fail("engines: path " + p.dump() + " does not match its key (expected '" + expected + "')");
    }
    e.path = expected;
    m.engines_.push_back(e);
  }
  // files: inside the directory, present, sizes (and hashes) as recorded
  for (const auto& [rel, info] : data["files"].items()) {
    std::string full;
    Status st = m.ResolveInside(rel, "files", &full);
    if (!st.ok()) return st;
    if (!fs::is_regular_file(full)) {
      return Status(StatusCode::kEngineDir, engine_dir + ": file '" + rel + "' listed in the manifest is missing");
    }
    const json bytes = info.is_object() && info.contains("bytes") ? info["bytes"] : json();
    const auto size = static_cast<int64_t>(fs::file_size(full));
    if (!bytes.is_number_integer() || bytes.get<int64_t>() != size) {
      return Status(StatusCode::kEngineDir, engine_dir + ": file '" + rel + "' was altered: expected " + bytes.dump() +
                                                " bytes, found " + std::to_string(size));
    }
    if (options.verify_hashes) {
      std::string hex;
      Status hs = Sha256File(full, &hex);
      if (!hs.ok()) return hs;
      if (!info.contains("sha256") || !info["sha256"].is_string() || info["sha256"].get<std::string>() != hex) {
        return Status(StatusCode::kEngineDir,
                      engine_dir + ": file '" + rel + "' was altered: sha256 does not match the manifest");
      }
    }
  }
  for (const auto& [name, entry] : data["graphs"].items()) {
    for (const char* k : {"path", "data"}) {
      if (!entry.is_object() || !entry.contains(k) || entry[k].is_null() ||
          (entry[k].is_string() && entry[k].get<std::string>().empty())) {
        continue;
      }
      if (!entry[k].is_string()) return fail("graphs." + name + "." + k + ": expected a string path");
      const std::string rel = entry[k];
      std::string full;
      Status st = m.ResolveInside(rel, "graphs." + name + "." + k, &full);
      if (!st.ok()) return st;
      if (!data["files"].contains(rel)) {
        return Status(StatusCode::kEngineDir, engine_dir + ": graphs." + name + "." + k + " '" + rel +
                                                  "' is not listed in files (cannot be verified)");
      }
      if (std::string(k) == "path") m.graph_paths_[name] = full;
    }
  }
  if (data.contains("profile") && data["profile"].is_object() && data["profile"].contains("path") &&
      data["profile"]["path"].is_string()) {
    m.profile_path_ = data["profile"]["path"];
  }
  *out = std::move(m);
  return Status::Ok();
}

std::vector<int64_t> Manifest::Buckets(const std::string& graph) const {
  std::vector<int64_t> out;
  for (const auto& e : engines_)
    if (e.graph == graph) out.push_back(e.bucket);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

Status Manifest::GraphPath(const std::string& graph, std::string* path) const {
  auto it = graph_paths_.find(graph);
  if (it == graph_paths_.end()) {
    return Status(StatusCode::kEngineDir, root_ + "/manifest.json: graphs." + graph + ".path is missing");
  }
  *path = it->second;
  return Status::Ok();
}

Status Manifest::LoadProfile(ThroughputProfile* profile) const {
  if (profile_path_.empty()) {
    return Status(StatusCode::kEngineDir, root_ + ": manifest has no profile; run `dspark-export profile`");
  }
  std::string full;
  Status st = ResolveInside(profile_path_, "profile.path", &full);
  if (!st.ok()) return st;
  return ThroughputProfile::FromFile(full, profile);
}

}  // namespace dspark
