// Transparent huge pages for the weights decoding streams.
//
// Why: a decode step reads every weight once (3.1 GB a token for the 1.5B target), and with 4 KB
// pages that is a TLB miss every 4 KB, which the hardware prefetchers do not cross either. On the
// 2-core Xeon VM a plain streaming read of 1 GB ran at 22 GB/s in 4 KB pages and 30 GB/s in 2 MB
// ones, and the 1.5B target decoded 8.0 tok/s against 9.6-9.9 with its weights in 2 MB pages.
// Linux gives anonymous memory huge pages only where asked (``madvise`` mode, the common default)
// or everywhere (``always``); this asks.
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "linear.h"

namespace specd {

// Advise the 2 MB-aligned interior of [p, p + n) for transparent huge pages: pages faulted from now
// on come 2 MB at a time; and fold the pages already there (MADV_COLLAPSE, Linux 6.1+: a copy,
// synchronous), for weights written before the advice or placed in reused heap memory.
// Not the KV cache: at 16 demo streams it made no measurable difference, and on a VM that hands
// free memory back to its host each huge page costs milliseconds to fault in, which a block pool
// would pay mid-serving as its blocks are first used.
// Best effort: false where nothing could be advised (a range under 2 MB, THP "never", not Linux).
// SPECD_HUGE_PAGES=0 leaves every page at 4 KB (for A/B runs).
inline bool advise_huge_pages(void* p, size_t n) {
#ifdef __linux__
  static const bool off = env_is("SPECD_HUGE_PAGES", "0");
  if (off) return false;
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = (start + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (start + n) & ~(kHuge - 1);
  if (hi <= lo || madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE) != 0) return false;
  constexpr int kMadvCollapse = 25;  // older headers lack the name; older kernels refuse it (EINVAL)
  madvise(reinterpret_cast<void*>(lo), hi - lo, kMadvCollapse);
  return true;
#else
  (void)p;
  (void)n;
  return false;
#endif
}

}  // namespace specd
