#pragma once
// What this CPU and OS can run, read once with cpuid / xgetbv at run time: the extension is built for
// the build machine's baseline, and wider kernels (AVX-512) are compiled beside it for CPUs that have them.
#include <string>

namespace deepinfer {

struct CpuFeatures {
  bool avx2 = false, fma = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512_bf16 = false;
  bool amx_tile = false, amx_bf16 = false;
  std::string model;  // the brand string, "AMD EPYC ..." / "Intel(R) Xeon(R) ..."
};

const CpuFeatures& cpu_features();

// The GEMM kernels compiled into the extension, by the instructions they use. AVX512_BF16 and AMX round
// the activations to bf16 (their dot products take bf16 pairs); the others read them in fp32.
enum class Isa : int { AVX2 = 0, AVX512 = 1, AVX512_BF16 = 2, AMX = 3 };

bool isa_supported(Isa isa);

}  // namespace deepinfer
