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
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

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

// The parts of [lo, hi) that lie in private file mappings (/proc/self/maps: a "p" mapping with an
// inode), in address order: where weights are read in place from a checkpoint's memory map
// (checkpoint.py), which Linux does not fold into huge pages (MADV_COLLAPSE refuses it here).
inline std::vector<std::pair<uintptr_t, uintptr_t>> private_file_spans(uintptr_t lo, uintptr_t hi) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
#ifdef __linux__
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return spans;
  char line[4096];
  while (std::fgets(line, sizeof line, maps) != nullptr) {
    unsigned long start = 0, end = 0, offset = 0, inode = 0;
    char perms[8] = {0}, dev[32] = {0};
    if (std::sscanf(line, "%lx-%lx %7s %lx %31s %lu", &start, &end, perms, &offset, dev, &inode) != 6) continue;
    if (start >= hi) break;
    if (end > lo && perms[3] == 'p' && inode != 0)
      spans.emplace_back(std::max<uintptr_t>(start, lo), std::min<uintptr_t>(end, hi));
  }
  std::fclose(maps);
#else
  (void)lo;
  (void)hi;
#endif
  return spans;
}

// Replace [lo, hi) (2 MB-aligned) with a copy in fresh huge pages at the same addresses: copied into
// memory advised for them, then moved over the old pages (mremap). The bytes moved (0: failed).
inline size_t move_span_to_huge_pages(uintptr_t lo, uintptr_t hi) {
#ifdef __linux__
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const size_t len = hi - lo;
  // Over-allocate by one huge page to find a 2 MB-aligned start, then trim both ends.
  void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return 0;
  const uintptr_t r = reinterpret_cast<uintptr_t>(raw), a = (r + kHuge - 1) & ~(kHuge - 1);
  if (a > r) munmap(raw, a - r);
  if (r + len + kHuge > a + len) munmap(reinterpret_cast<void*>(a + len), r + len + kHuge - (a + len));
  void* fresh = reinterpret_cast<void*>(a);
  if (madvise(fresh, len, MADV_HUGEPAGE) != 0) {  // THP "never": 4 KB pages gain nothing
    munmap(fresh, len);
    return 0;
  }
  std::memcpy(fresh, reinterpret_cast<void*>(lo), len);
  if (mremap(fresh, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(lo)) == MAP_FAILED) {
    munmap(fresh, len);
    return 0;
  }
  return len;
#else
  (void)lo;
  (void)hi;
  return 0;
#endif
}

// Put the 2 MB pages that [p, p + n) touches in huge pages where a private file mapping holds them:
// each is copied into a fresh huge page that then takes its place at the same address, so every
// pointer into it stays valid. The bytes are the same, and a thread reading them meanwhile sees the
// old pages or the new ones (the move holds the mapping's lock; a read that faults waits for it).
// The rest of a page the range only touches is the same map's (a checkpoint's other tensors or its
// header), which nothing writes. Pages moved before are anonymous by then and left alone, so
// neighbouring tensors can be moved one after the other. Why: weights read in place from a
// checkpoint's map sit in 4 KB pages, and the 1.5B target decoded 1.108x faster once they were moved
// (median of 24 alternated rounds in one process, AMD Zen 4 VM: faster in its fast minutes, level in
// its slow ones). Not at load: on a VM that hands free memory back to its host each 2 MB page costs
// milliseconds to fault in, so weight_pages.py moves a model's weights on a background thread.
// Returns the bytes moved: 0 where nothing could be (no private file mapping, already moved, THP
// off, SPECD_HUGE_PAGES=0, not Linux).
inline size_t move_to_huge_pages(void* p, size_t n) {
  static const bool off = env_is("SPECD_HUGE_PAGES", "0");
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  if (off || n == 0) return 0;
  size_t moved = 0;
  for (const auto& [a, b] : private_file_spans(start & ~(kHuge - 1), (start + n + kHuge - 1) & ~(kHuge - 1))) {
    const uintptr_t lo = (a + kHuge - 1) & ~(kHuge - 1), hi = b & ~(kHuge - 1);
    if (hi > lo) moved += move_span_to_huge_pages(lo, hi);
  }
  return moved;
}

}  // namespace specd
