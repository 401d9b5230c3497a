// Vector math shared by the CPU kernels (GCC/Clang vector extensions, no intrinsics).
#pragma once

#include <cstdint>

namespace specplan {

typedef float F8 __attribute__((vector_size(32)));  // one AVX register, or two SSE/NEON registers
typedef int32_t I8 __attribute__((vector_size(32)));

// The float vector of one full register: 16 lanes with AVX-512, 8 otherwise. A kernel that keeps
// vectors live across a loop (accumulators, running maxima) uses these, never a fixed 64-byte
// type: GCC 12 spills a generic vector wider than the registers through the stack on every
// operation, which ran the AVX2 build's kernels 12-44x slower than torch
// (scripts/bench_linear_vs_torch.py, 2026-11-25).
#if defined(__AVX512F__)
#define SPECPLAN_REG_LANES 16
#else
#define SPECPLAN_REG_LANES 8
#endif
constexpr int kRegLanes = SPECPLAN_REG_LANES;
typedef float RegF __attribute__((vector_size(kRegLanes * sizeof(float)), aligned(4)));
typedef int32_t RegI __attribute__((vector_size(kRegLanes * sizeof(int32_t)), aligned(4)));

// {0, 1, ..., kRegLanes - 1}
inline RegI lane_index() {
  RegI lanes;
  for (int i = 0; i < kRegLanes; ++i) lanes[i] = i;
  return lanes;
}

// e^x for x <= 0 (softmax scores minus their maximum; sigmoid's e^-|x|), for a float vector V of
// any width with the int32 vector VI of the same width. Cody-Waite reduction x = k ln2 + r,
// |r| <= ln2/2, Cephes' degree-5 polynomial for e^r (max relative error 8.4e-8 on [-87, 0]), 2^k
// built in the exponent bits; inputs below -87 (and -inf) give 0.
template <typename V, typename VI>
inline V exp_nonpositive_v(V x) {
  const V lo = V{} + (-87.0f);
  const VI under = x < lo;  // all ones where x < -87 (false for NaN, which propagates)
  const V xc = (V)(((VI)lo & under) | ((VI)x & ~under));
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const V k = (xc * 1.44269504088896341f + magic) - magic;
  V r = xc - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V y = p * (r * r) + r + 1.0f;
  const VI two_k = (__builtin_convertvector(k, VI) + 127) << 23;
  const V res = y * (V)two_k;
  return (V)((VI)res & ~under);
}

inline F8 exp_nonpositive(F8 x) { return exp_nonpositive_v<F8, I8>(x); }

}  // namespace specplan
