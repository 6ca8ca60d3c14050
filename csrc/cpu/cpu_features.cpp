#include "cpu/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace deepinfer {
namespace {

bool bit(uint32_t reg, int i) { return (reg >> i) & 1u; }

// XCR0: which register states the OS saves on a context switch. A CPU flag without its state
// enabled here (a VM or kernel that turns AVX-512 off) would fault on the first instruction.
uint64_t xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

// Linux hands out AMX tile state only to processes that ask for it (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); without the grant the first tile instruction raises SIGILL.
bool request_tile_state() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

std::string brand() {
  uint32_t r[12] = {};
  if (__get_cpuid_max(0x80000000u, nullptr) < 0x80000004u) return "unknown";
  for (uint32_t i = 0; i < 3; ++i) __get_cpuid(0x80000002u + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
  char s[49] = {};
  std::memcpy(s, r, 48);
  std::string out(s);
  out.erase(0, out.find_first_not_of(' '));
  return out;
}

CpuFeatures detect() {
  CpuFeatures f;
  f.model = brand();
  uint32_t a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !bit(c, 27)) return f;  // no OSXSAVE: xgetbv unavailable
  const uint64_t xcr = xcr0();
  const bool ymm = (xcr & 0x6) == 0x6, zmm = ymm && (xcr & 0xe0) == 0xe0, tiles = (xcr & 0x60000) == 0x60000;
  f.fma = ymm && bit(c, 12);
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = ymm && bit(b, 5);
  f.avx512f = zmm && bit(b, 16);
  f.avx512bw = zmm && bit(b, 30);
  f.avx512vl = zmm && bit(b, 31);
  const bool granted = tiles && bit(d, 24) && request_tile_state();
  f.amx_tile = granted;
  f.amx_bf16 = granted && bit(d, 22);
  __cpuid_count(7, 1, a, b, c, d);
  f.avx512_bf16 = zmm && bit(a, 5);
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

bool isa_supported(Isa isa) {
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    case Isa::AVX2: return f.avx2 && f.fma;
    case Isa::AVX512: return f.avx512f && f.avx512bw && f.avx512vl;
    case Isa::AVX512_BF16: return f.avx512f && f.avx512bw && f.avx512vl && f.avx512_bf16;
    case Isa::AMX: return isa_supported(Isa::AVX512_BF16) && f.amx_tile && f.amx_bf16;
  }
  return false;
}

}  // namespace deepinfer
