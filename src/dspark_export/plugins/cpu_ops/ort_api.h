// What the dspark.cpu kernels need of ONNX Runtime's C API, without its headers.
//
// Functions are reached through the slot indices of the OrtApi table (onnxruntime_c_api.h: the table only ever
// appends, so an index holds for every later version), and ops are described by the OrtCustomOp layout up to
// API version 18. `RegisterCustomOps` (register.cpp) sets `g_api` once; every kernel reads it.

#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

struct OrtStatus;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtSessionOptions;
struct OrtCustomOpDomain;

namespace dspark_cpu {

using Status = OrtStatus*;

struct OrtApiBase {
  const void* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

enum Slot : int {  // indices into OrtApi (function pointers)
  kCreateStatus = 0,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetTensorElementType = 60,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttributeFloat = 85,
  kKernelInfoGetAttributeInt64 = 86,
  kKernelContextGetInputCount = 88,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelInfoGetConstantInputTensor = 249,
  kKernelContextParallelFor = 274,
};
constexpr uint32_t kApiVersion = 18;  // KernelContext_ParallelFor and OrtCustomOp's fields up to GetMayInplace
constexpr int kFloat = 1, kUint8 = 2, kInt64 = 7;  // ONNXTensorElementDataType

inline const void* const* g_api = nullptr;

template <typename F>
F api(Slot s) {
  return reinterpret_cast<F>(const_cast<void*>(g_api[s]));
}

inline Status make_error(const std::string& msg) {
  return api<Status (*)(int, const char*)>(kCreateStatus)(2 /* ORT_INVALID_ARGUMENT */, msg.c_str());
}

#define DSPARK_TRY(expr)                 \
  do {                                   \
    if (Status st_ = (expr)) return st_; \
  } while (0)

inline Status shape_of(const OrtValue* v, std::vector<int64_t>& dims, int& elem_type) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  DSPARK_TRY(api<Status (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(kGetTensorTypeAndShape)(v, &info));
  size_t count = 0;
  Status st = api<Status (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(kGetDimensionsCount)(info, &count);
  if (!st) {
    dims.assign(count, 0);
    st = api<Status (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(kGetDimensions)(info, dims.data(),
                                                                                           count);
  }
  if (!st) st = api<Status (*)(const OrtTensorTypeAndShapeInfo*, int*)>(kGetTensorElementType)(info, &elem_type);
  api<void (*)(OrtTensorTypeAndShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(info);
  return st;
}

inline Status input_count(OrtKernelContext* ctx, size_t& count) {
  return api<Status (*)(const OrtKernelContext*, size_t*)>(kKernelContextGetInputCount)(ctx, &count);
}

// Input `index`, or nullptr for an optional input the node leaves out.
inline Status input(OrtKernelContext* ctx, size_t index, const OrtValue*& value) {
  return api<Status (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContextGetInput)(ctx, index,
                                                                                                    &value);
}

inline Status output(OrtKernelContext* ctx, size_t index, const std::vector<int64_t>& dims, OrtValue*& value) {
  return api<Status (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(kKernelContextGetOutput)(
      ctx, index, dims.data(), dims.size(), &value);
}

template <typename T>
Status data_of(const OrtValue* v, T*& out) {
  void* p = nullptr;
  DSPARK_TRY(api<Status (*)(OrtValue*, void**)>(kGetTensorMutableData)(const_cast<OrtValue*>(v), &p));
  out = static_cast<T*>(p);
  return nullptr;
}

inline Status attribute_float(const OrtKernelInfo* info, const char* name, float& value) {
  return api<Status (*)(const OrtKernelInfo*, const char*, float*)>(kKernelInfoGetAttributeFloat)(info, name, &value);
}

inline Status attribute_int(const OrtKernelInfo* info, const char* name, int64_t& value) {
  return api<Status (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttributeInt64)(info, name, &value);
}

// Whether input `index` is a constant initializer of the graph (so its contents never change between calls).
inline bool constant_input(const OrtKernelInfo* info, size_t index) {
  int is_constant = 0;
  const OrtValue* value = nullptr;
  using Fn = Status (*)(const OrtKernelInfo*, size_t, int*, const OrtValue**);
  if (Status st = api<Fn>(kKernelInfoGetConstantInputTensor)(info, index, &is_constant, &value)) {
    api<void (*)(Status)>(kReleaseStatus)(st);
    return false;
  }
  return is_constant != 0;
}

// ---- what the kernels share ------------------------------------------------------------------------------------

// DSPARK_W4A8_PORTABLE=1 makes every kernel take its portable path (same bits, for tests).
inline bool portable_forced() {
  const char* force = std::getenv("DSPARK_W4A8_PORTABLE");
  return force && force[0] == '1';
}

inline std::string dims_text(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// A kernel's packed copy of its weight inputs. Initializers (`constant`) are packed once and the copy is shared by
// every kernel that sees the same bytes (the engines' per-bucket sessions share one set of initializers), freed
// with the last kernel holding it; inputs fed at run time may change between calls, so they are packed per call.
template <class T>
class PackedWeights {
 public:
  using Key = std::tuple<const void*, const void*, int64_t, int64_t>;  // two weight pointers, two dims
  explicit PackedWeights(bool constant) : constant_(constant) {}

  template <class Make>
  std::shared_ptr<T> get(const Key& key, Make make) {
    if (!constant_) return make();
    std::lock_guard<std::mutex> lock(mutex_);
    if (!packed_ || key_ != key) key_ = key, packed_ = shared(key, make);
    return packed_;
  }

 private:
  template <class Make>
  static std::shared_ptr<T> shared(const Key& key, Make make) {
    static std::mutex mutex;
    static std::map<Key, std::weak_ptr<T>> cache;
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end())
      if (auto p = it->second.lock()) return p;
    for (auto e = cache.begin(); e != cache.end();)  // forget weights whose kernels are all gone
      e = e->second.expired() ? cache.erase(e) : std::next(e);
    auto p = make();
    cache[key] = p;
    return p;
  }

  const bool constant_;
  std::mutex mutex_;
  Key key_{};
  std::shared_ptr<T> packed_;
};

using ParallelFor = Status (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*);

inline Status parallel_for(OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t tasks, void* data) {
  return api<ParallelFor>(kKernelContextParallelFor)(ctx, fn, tasks, 0, data);
}

// ---- OrtCustomOp -----------------------------------------------------------------------------------------------

struct CustomOp {
  uint32_t version;
  void* (*CreateKernel)(const CustomOp*, const void*, const OrtKernelInfo*);
  const char* (*GetName)(const CustomOp*);
  const char* (*GetExecutionProviderType)(const CustomOp*);
  int (*GetInputType)(const CustomOp*, size_t);
  size_t (*GetInputTypeCount)(const CustomOp*);
  int (*GetOutputType)(const CustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const CustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const CustomOp*, size_t);
  int (*GetOutputCharacteristic)(const CustomOp*, size_t);
  int (*GetInputMemoryType)(const CustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const CustomOp*);
  int (*GetVariadicInputHomogeneity)(const CustomOp*);
  int (*GetVariadicOutputMinArity)(const CustomOp*);
  int (*GetVariadicOutputHomogeneity)(const CustomOp*);
  Status (*CreateKernelV2)(const CustomOp*, const void*, const OrtKernelInfo*, void**);
  Status (*KernelComputeV2)(void*, OrtKernelContext*);
  Status (*InferOutputShapeFn)(const CustomOp*, void*);
  int (*GetStartVersion)(const CustomOp*);
  int (*GetEndVersion)(const CustomOp*);
  size_t (*GetMayInplace)(int**, int**);
  void (*ReleaseMayInplace)(int*, int*);
  size_t (*GetAliasMap)(int**, int**);
  void (*ReleaseAliasMap)(int*, int*);
};

// An op of the CPU provider, version 1 onward. `Spec` names it and types its inputs and outputs (kName,
// kInputs[], kOutputs[] element types; inputs from kRequired on are optional); `Kernel` holds the op's per-node
// state (made from the node's OrtKernelInfo); `compute` runs it.
template <typename Spec, typename Kernel, Status (*compute)(void*, OrtKernelContext*)>
CustomOp make_op() {
  CustomOp op{};
  op.version = kApiVersion;
  op.GetName = [](const CustomOp*) { return Spec::kName; };
  op.GetInputType = [](const CustomOp*, size_t i) { return Spec::kInputs[i]; };
  op.GetInputTypeCount = [](const CustomOp*) -> size_t { return std::size(Spec::kInputs); };
  op.GetOutputType = [](const CustomOp*, size_t i) { return Spec::kOutputs[i]; };
  op.GetOutputTypeCount = [](const CustomOp*) -> size_t { return std::size(Spec::kOutputs); };
  op.CreateKernel = [](const CustomOp*, const void*, const OrtKernelInfo* info) -> void* { return new Kernel(info); };
  op.GetExecutionProviderType = [](const CustomOp*) -> const char* { return "CPUExecutionProvider"; };
  // ONNX Runtime calls KernelComputeV2 (it reports errors) when version >= 16; this V1 entry only fills the slot
  op.KernelCompute = [](void* k, OrtKernelContext* ctx) {
    if (Status st = compute(k, ctx)) api<void (*)(Status)>(kReleaseStatus)(st);
  };
  op.KernelDestroy = [](void* k) { delete static_cast<Kernel*>(k); };
  op.GetInputCharacteristic = [](const CustomOp*, size_t i) { return i < Spec::kRequired ? 0 : 1 /* optional */; };
  op.GetOutputCharacteristic = [](const CustomOp*, size_t) { return 0; };
  op.GetInputMemoryType = [](const CustomOp*, size_t) { return 0; };
  op.GetVariadicInputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const CustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const CustomOp*) { return 1; };
  op.CreateKernelV2 = [](const CustomOp*, const void*, const OrtKernelInfo* info, void** out) -> Status {
    *out = new Kernel(info);
    return nullptr;
  };
  op.KernelComputeV2 = compute;
  op.InferOutputShapeFn = nullptr;
  op.GetStartVersion = [](const CustomOp*) { return 1; };
  op.GetEndVersion = [](const CustomOp*) { return INT_MAX; };
  op.GetMayInplace = [](int**, int**) -> size_t { return 0; };
  op.ReleaseMayInplace = [](int*, int*) {};
  op.GetAliasMap = [](int**, int**) -> size_t { return 0; };
  op.ReleaseAliasMap = [](int*, int*) {};
  return op;
}

// The one OrtCustomOp of an op (made on first use), for the accessors below.
template <typename Spec, typename Kernel, Status (*compute)(void*, OrtKernelContext*)>
const CustomOp* op_of() {
  static const CustomOp op = make_op<Spec, Kernel, compute>();
  return &op;
}

// The ops register.cpp adds to the dspark.cpu domain.
const CustomOp* matmul_w4a8_op();
const CustomOp* markov_draft_greedy_op();
const CustomOp* ragged_attention_op();

}  // namespace dspark_cpu
