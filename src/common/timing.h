#pragma once
// Wall-clock intervals for stats and benchmarks: one steady clock, seconds as double.
#include <chrono>

namespace kvsparse {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace kvsparse
