// dspark_generate: generate with DSpark speculative decoding from a C++ program.
//
//   dspark_generate --engine-dir engines/smollm2 --prompt "What is 2+3?" --chat
//   dspark_generate --engine-dir DIR --ids 5,6,7 --max-new-tokens 16 --policy fixed:4 --json
//
// Streams the text to stdout as it is committed (or, with --json, prints one JSON object at the end:
// token_ids, text, finish_reason, stats). Exit codes: 0 generated, 1 the request failed, 2 bad arguments
// or engine directory.
#include <cstdlib>
#include <cstring>
#include <future>
#include <iostream>
#include <sstream>
#include <string>

#include "dspark/runtime.h"

namespace {

void Usage() {
  std::cerr << "usage: dspark_generate --engine-dir DIR (--prompt TEXT [--chat] | --ids 1,2,3)\n"
               "                       [--max-new-tokens N] [--policy P] [--temperature T] [--top-k K]\n"
               "                       [--top-p P] [--seed S] [--json] [--no-verify]\n";
}

std::string JsonString(const std::string& s) {
  std::ostringstream o;
  o << '"';
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') o << '\\' << c;
    else if (c == '\n') o << "\\n";
    else if (c < 0x20) { char buf[8]; std::snprintf(buf, sizeof buf, "\\u%04x", c); o << buf; }
    else o << c;
  }
  o << '"';
  return o.str();
}

}  // namespace

int main(int argc, char** argv) {
  dspark::RuntimeOptions options;
  dspark::GenerateRequest request;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) { std::cerr << "dspark_generate: " << a << " needs a value\n"; std::exit(2); }
      return argv[++i];
    };
    try {
      if (a == "--engine-dir") options.engine_dir = value();
      else if (a == "--prompt") request.text = value();
      else if (a == "--chat") request.chat = true;
      else if (a == "--ids") {
        std::stringstream ss(value());
        for (std::string tok; std::getline(ss, tok, ',');) request.token_ids.push_back(std::stoll(tok));
      } else if (a == "--max-new-tokens") request.params.max_new_tokens = std::stoll(value());
      else if (a == "--policy") request.policy = value();
      else if (a == "--temperature") request.params.temperature = std::stof(value());
      else if (a == "--top-k") request.params.top_k = std::stoll(value());
      else if (a == "--top-p") request.params.top_p = std::stof(value());
      else if (a == "--seed") request.params.seed = std::stoll(value());
      else if (a == "--json") json = true;
      else if (a == "--no-verify") options.verify_hashes = false;
      else if (a == "--help" || a == "-h") { Usage(); return 0; }
      else { std::cerr << "dspark_generate: unknown argument " << a << "\n"; Usage(); return 2; }
    } catch (const std::exception&) {
      std::cerr << "dspark_generate: " << a << ": not a number\n";
      return 2;
    }
  }
  if (options.engine_dir.empty()) { Usage(); return 2; }
  if (!request.policy.empty()) options.policy = request.policy;

  std::unique_ptr<dspark::Runtime> runtime;
  dspark::Status st = dspark::Runtime::Open(options, &runtime);
  if (!st.ok()) { std::cerr << "dspark_generate: " << st.ToString() << "\n"; return 2; }

  dspark::GenerationResult result;
  if (json) {
    st = runtime->Generate(request, &result);
  } else {
    // streaming through the callback; Generate-like wait on the final event
    std::promise<void> done;
    dspark::RequestId id;
    st = runtime->Submit(request, [&](const dspark::Event& ev) {
      std::cout << ev.text_delta << std::flush;
      result.token_ids.insert(result.token_ids.end(), ev.token_ids.begin(), ev.token_ids.end());
      if (ev.finished) {
        result.finish_reason = ev.finish_reason;
        result.error = ev.error;
        result.stats = ev.stats;
        done.set_value();
      }
    }, &id);
    if (st.ok()) done.get_future().wait();
    std::cout << "\n";
  }
  if (!st.ok()) { std::cerr << "dspark_generate: " << st.ToString() << "\n"; return 2; }
  if (json) {
    std::cout << "{\"token_ids\": [";
    for (size_t i = 0; i < result.token_ids.size(); ++i) std::cout << (i ? ", " : "") << result.token_ids[i];
    std::cout << "], \"text\": " << JsonString(result.text) << ", \"finish_reason\": " << JsonString(result.finish_reason)
              << ", \"error\": " << JsonString(result.error) << ", \"stats\": {\"prompt_tokens\": "
              << result.stats.prompt_tokens << ", \"completion_tokens\": " << result.stats.completion_tokens
              << ", \"rounds\": " << result.stats.rounds << ", \"acceptance_length\": " << result.stats.acceptance_length
              << ", \"wall_s\": " << result.stats.wall_s << ", \"tokens_per_s\": " << result.stats.tokens_per_s
              << "}}\n";
  } else {
    std::cerr << result.stats.completion_tokens << " tokens, " << result.stats.tokens_per_s << " tokens/s, tau "
              << result.stats.acceptance_length << ", finish_reason " << result.finish_reason << "\n";
  }
  if (result.finish_reason == "error") { std::cerr << "dspark_generate: " << result.error << "\n"; return 1; }
  return 0;
}
