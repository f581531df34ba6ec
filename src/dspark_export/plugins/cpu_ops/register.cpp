// The dspark.cpu custom-op library's entry point: `SessionOptions.register_custom_ops_library` calls
// `RegisterCustomOps`, which adds the domain with every op of the library (MatMulW4A8, MarkovDraftGreedy, RaggedAttention).

#include <mutex>

#include "ort_api.h"

using namespace dspark_cpu;

extern "C" {

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                    const OrtApiBase* base) {
  const void* table = base->GetApi(kApiVersion);
  if (!table) return nullptr;  // older than API 18: ONNX Runtime then fails on the unknown op, naming it
  g_api = static_cast<const void* const*>(table);
  static OrtCustomOpDomain* domain = nullptr;  // one per process; ONNX Runtime keeps a reference per session
  static std::mutex m;
  std::lock_guard<std::mutex> lock(m);
  if (!domain) {
    DSPARK_TRY(api<Status (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)("dspark.cpu", &domain));
    for (const CustomOp* op : {matmul_w4a8_op(), markov_draft_greedy_op(), ragged_attention_op()})
      DSPARK_TRY(api<Status (*)(OrtCustomOpDomain*, const CustomOp*)>(kCustomOpDomainAdd)(domain, op));
  }
  return api<Status (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, domain);
}

}  // extern "C"
