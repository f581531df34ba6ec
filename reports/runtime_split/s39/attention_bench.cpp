// One RaggedAttention layer (9 heads, 3 kv heads, D 64, 300 cached keys) for B query rows of one request, one thread.
//   g++ -O3 -std=c++17 -ffp-contract=off -DRAGGED_ATTENTION_CPP=\"$PWD/src/dspark_export/plugins/cpu_ops/ragged_attention.cpp\" \
//       reports/runtime_split/s39/attention_bench.cpp -o /tmp/attention_bench && /tmp/attention_bench
#include RAGGED_ATTENTION_CPP
#include <chrono>
#include <cstdio>
#include <random>
int main() {
  const int64_t H = 9, KVH = 3, D = 64, P = 512, ctx = 300;
  std::mt19937 rng(0); std::normal_distribution<float> nd;
  std::vector<float> pk(KVH * P * D), pv(KVH * P * D);
  for (auto& v : pk) v = nd(rng); for (auto& v : pv) v = nd(rng);
  for (int B : {1, 2, 4, 6, 1, 2, 4, 6}) {
    std::vector<float> q(B * H * D), k(B * KVH * D), v(B * KVH * D), out(B * H * D);
    for (auto& x : q) x = nd(rng); for (auto& x : k) x = nd(rng); for (auto& x : v) x = nd(rng);
    int64_t qs[2] = {0, B}, lens[1] = {ctx};
    double best = 1e9;
    for (int rep = 0; rep < 200; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      dspark_ragged_attention(q.data(), k.data(), v.data(), pk.data(), pv.data(), qs, lens, 1, H, KVH, D, P, 0.125f, 1, out.data(), 0);
      best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    printf("B=%d %.1f us per layer (1 thread, ctx %ld) -> x30 layers %.2f ms\n", B, best, ctx, best * 30 / 1e3);
  }
}
