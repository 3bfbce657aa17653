// Shared by the paged-cache tests: a cache that must build (the tests' geometry is valid).
#pragma once

#include <memory>
#include <vector>

#include "kvsparse/paged_kv_cache.h"

namespace kvsparse::testing {

inline std::unique_ptr<PagedKvCache> MakePagedCache(const KvGeometry& geo, std::vector<KvStorage> storage, int n_seqs,
                                                    int32_t page_size, size_t budget,
                                                    std::vector<uint8_t> per_head = {}, int32_t kivi_residual = 0,
                                                    int32_t kivi_v_group = 0) {
  PagedKvCacheOptions options;
  options.n_seqs = n_seqs;
  options.page_size = page_size;
  options.budget_bytes = budget;
  options.layer_storage = std::move(storage);
  options.layer_per_head = std::move(per_head);
  options.kivi_residual = kivi_residual;
  options.kivi_v_group = kivi_v_group;
  auto cache = PagedKvCache::Create(geo, options);
  KVS_CHECK_MSG(cache.ok(), cache.status().ToString());
  return std::move(cache).value();
}

}  // namespace kvsparse::testing
