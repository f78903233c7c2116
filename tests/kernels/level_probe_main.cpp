// level_probe.cpp as a command-line program (with torch_stubs.cpp: no libtorch), for the levels
// of another architecture, run under qemu-user by tests/kernels/test_cpu_levels.py. Tensors
// travel as raw files of their bytes:
//   features
//   linear CODE M N K x w y        (y written)
//   panels M N K x w y             (y written: the bf16 panel product, w packed)
//   quantize N x q                 (q written: the fp32 scale, then N int8)
//   silu N y                       (in place)
//   window p x h                   (p in place, h written)
//   delta DK s k q kn v a o        (s, a in place, o written; decay 0.9, beta 0.5)
//   deltac DK s k q kn v d dn a o  (the per-channel pass: decays d, dn [DK]; beta 0.5)

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "level_probe.cpp"

namespace {

std::vector<char> slurp(const char* path) {
  std::FILE* f = std::fopen(path, "rb");
  if (f == nullptr) std::exit(2);
  std::vector<char> data;
  char buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) data.insert(data.end(), buf, buf + n);
  std::fclose(f);
  return data;
}

void spill(const char* path, const void* p, size_t n) {
  std::FILE* f = std::fopen(path, "wb");
  if (f == nullptr || std::fwrite(p, 1, n, f) != n) std::exit(3);
  std::fclose(f);
}

template <typename T>
T* as(std::vector<char>& v) {
  return reinterpret_cast<T*>(v.data());
}

}  // namespace

int main(int argc, char** argv) {
  const std::string op = argc > 1 ? argv[1] : "";
  if (op == "features") {
    std::printf("%s\n", probe_features());
  } else if (op == "linear" && argc == 9) {
    const int64_t M = std::atoll(argv[3]), N = std::atoll(argv[4]), K = std::atoll(argv[5]);
    auto x = slurp(argv[6]), w = slurp(argv[7]);
    std::vector<float> y(M * N);
    probe_linear(std::atoi(argv[2]), as<float>(x), w.data(), y.data(), M, N, K);
    spill(argv[8], y.data(), y.size() * sizeof(float));
  } else if (op == "panels" && argc == 8) {
    const int64_t M = std::atoll(argv[2]), N = std::atoll(argv[3]), K = std::atoll(argv[4]);
    auto x = slurp(argv[5]), w = slurp(argv[6]);
    std::vector<float> y(M * N);
    probe_bf16_panels(as<float>(x), as<c10::BFloat16>(w), y.data(), M, N, K);
    spill(argv[7], y.data(), y.size() * sizeof(float));
  } else if (op == "quantize" && argc == 5) {
    const int64_t n = std::atoll(argv[2]);
    auto x = slurp(argv[3]);
    std::vector<char> out(4 + n);
    const float scale = probe_quantize(as<float>(x), n, reinterpret_cast<int8_t*>(&out[4]));
    std::memcpy(out.data(), &scale, 4);
    spill(argv[4], out.data(), out.size());
  } else if (op == "silu" && argc == 4) {
    auto y = slurp(argv[3]);
    probe_silu(as<float>(y), std::atoll(argv[2]));
    spill(argv[3], y.data(), y.size());
  } else if (op == "window" && argc == 5) {
    auto p = slurp(argv[2]), x = slurp(argv[3]);
    float h[24];
    probe_window(as<float>(p), as<float>(x), h);
    spill(argv[2], p.data(), p.size());
    spill(argv[4], h, sizeof h);
  } else if (op == "delta" && argc == 10) {
    const int64_t dk = std::atoll(argv[2]);
    auto s = slurp(argv[3]), k = slurp(argv[4]), q = slurp(argv[5]), kn = slurp(argv[6]);
    auto v = slurp(argv[7]), a = slurp(argv[8]);
    double o[16];
    probe_delta_pass(as<double>(s), as<double>(k), as<double>(q), as<double>(kn), as<double>(v),
                     0.9, 0.5, dk, as<double>(a), o);
    spill(argv[3], s.data(), s.size());
    spill(argv[8], a.data(), a.size());
    spill(argv[9], o, sizeof o);
  } else if (op == "deltac" && argc == 12) {
    const int64_t dk = std::atoll(argv[2]);
    auto s = slurp(argv[3]), k = slurp(argv[4]), q = slurp(argv[5]), kn = slurp(argv[6]);
    auto v = slurp(argv[7]), d = slurp(argv[8]), dn = slurp(argv[9]), a = slurp(argv[10]);
    double o[16];
    probe_delta_pass_channels(as<double>(s), as<double>(k), as<double>(q), as<double>(kn),
                              as<double>(v), as<double>(d), as<double>(dn), 0.5, dk,
                              as<double>(a), o);
    spill(argv[3], s.data(), s.size());
    spill(argv[10], a.data(), a.size());
    spill(argv[11], o, sizeof o);
  } else {
    std::fprintf(stderr, "usage: see level_probe_main.cpp\n");
    return 1;
  }
  return 0;
}
