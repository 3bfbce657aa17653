#include "kvsparse/contiguous_kv_cache.h"

#include <cstring>
#include <string>

#include "kvsparse/dtype.h"
#include "kvsparse/ops.h"

namespace kvsparse {

namespace {

size_t StorageElementBytes(KvStorage storage) { return storage == KvStorage::kF32 ? sizeof(float) : sizeof(f16_bits); }

}  // namespace

size_t ContiguousKvCache::BytesFor(const KvGeometry& geometry, KvStorage storage, int n_seqs, int32_t max_tokens) {
  if (!DenseCacheHolds(storage)) return 0;
  const size_t row_bytes = static_cast<size_t>(geometry.n_kv_heads) * geometry.head_dim * StorageElementBytes(storage);
  return static_cast<size_t>(n_seqs) * geometry.n_layers * static_cast<size_t>(max_tokens) *
         (geometry.StoredRows() * row_bytes + sizeof(int32_t));
}

ContiguousKvCache::ContiguousKvCache(const KvGeometry& geometry, KvStorage storage, int n_seqs, int32_t max_tokens)
    : geometry_(geometry), storage_(storage), n_seqs_(n_seqs), max_tokens_(max_tokens) {
  KVS_CHECK(geometry.n_layers > 0 && geometry.n_kv_heads > 0 && geometry.head_dim > 0);
  KVS_CHECK(n_seqs > 0 && max_tokens > 0);
  // int8, fp8 and KIVI need scales this layout has no room for: such a cache stores nothing and its
  // Append reports Unimplemented (PagedKvCache stores them).
  row_bytes_ = !DenseCacheHolds(storage)
                   ? 0
                   : static_cast<size_t>(geometry.n_kv_heads) * geometry.head_dim * StorageElementBytes(storage);
  slots_.resize(static_cast<size_t>(n_seqs) * geometry.n_layers);
  for (Slot& s : slots_) {
    s.k.resize(row_bytes_ * max_tokens);
    if (!geometry.values_in_keys) s.v.resize(row_bytes_ * max_tokens);  // (a latent row is its own value)
    s.positions.resize(row_bytes_ > 0 ? max_tokens : 0);
  }
}

ContiguousKvCache::Slot& ContiguousKvCache::slot(int seq, int layer) {
  KVS_CHECK_MSG(seq >= 0 && seq < n_seqs_ && layer >= 0 && layer < geometry_.n_layers,
                "seq " + std::to_string(seq) + " layer " + std::to_string(layer) + " out of range");
  return slots_[static_cast<size_t>(seq) * geometry_.n_layers + layer];
}

const ContiguousKvCache::Slot& ContiguousKvCache::slot(int seq, int layer) const {
  return const_cast<ContiguousKvCache*>(this)->slot(seq, layer);
}

Status ContiguousKvCache::Append(int seq, int layer, int32_t n, const float* k, const float* v,
                                 const int32_t* positions) {
  if (seq < 0 || seq >= n_seqs_) {
    return InvalidArgumentError("KV cache append: seq " + std::to_string(seq) + " out of range [0, " +
                                std::to_string(n_seqs_) + ")");
  }
  if (layer < 0 || layer >= geometry_.n_layers) {
    return InvalidArgumentError("KV cache append: layer " + std::to_string(layer) + " out of range [0, " +
                                std::to_string(geometry_.n_layers) + ")");
  }
  if (n < 0) return InvalidArgumentError("KV cache append: negative token count " + std::to_string(n));
  if (!DenseCacheHolds(storage_)) {
    return UnimplementedError(std::string("ContiguousKvCache stores f32, f16 or bf16 K/V only; ") +
                              KvStorageName(storage_) + " KV storage needs the paged KV cache");
  }
  if (n == 0) return Status::Ok();
  if (k == nullptr || v == nullptr || positions == nullptr) {
    return InvalidArgumentError("KV cache append: null k, v or positions for " + std::to_string(n) + " tokens");
  }
  Slot& s = slot(seq, layer);
  if (n > max_tokens_ - s.n) {
    return ResourceExhaustedError("KV cache full: seq " + std::to_string(seq) + " layer " + std::to_string(layer) +
                                  " holds " + std::to_string(s.n) + " of " + std::to_string(max_tokens_) +
                                  " tokens; cannot append " + std::to_string(n) +
                                  " more (raise the context size / max_tokens)");
  }
  // Validate every position before writing anything, so a failed append leaves the cache unchanged.
  for (int32_t i = 0; i < n; ++i) {
    const bool has_prev = i > 0 || s.n > 0;
    const int32_t prev = i > 0 ? positions[i - 1] : (s.n > 0 ? s.positions[s.n - 1] : 0);
    if (positions[i] < 0 || (has_prev && positions[i] <= prev)) {
      return InvalidArgumentError("KV cache append: seq " + std::to_string(seq) + " layer " + std::to_string(layer) +
                                  ": position " + std::to_string(positions[i]) + " (token " + std::to_string(i) +
                                  " of the batch) must be >= 0 and greater than the previous position " +
                                  (has_prev ? std::to_string(prev) : std::string("(none)")));
    }
  }

  const size_t n_elems = static_cast<size_t>(n) * geometry_.n_kv_heads * geometry_.head_dim;
  uint8_t* k_dst = s.k.data() + row_bytes_ * s.n;
  const bool store_v = !geometry_.values_in_keys;
  uint8_t* v_dst = store_v ? s.v.data() + row_bytes_ * s.n : nullptr;
  if (storage_ == KvStorage::kF32) {
    std::memcpy(k_dst, k, n_elems * sizeof(float));
    if (store_v) std::memcpy(v_dst, v, n_elems * sizeof(float));
  } else {
    const DType type = storage_ == KvStorage::kBf16 ? DType::kBF16 : DType::kF16;
    ops::QuantizeRow(type, k, k_dst, static_cast<int64_t>(n_elems));
    if (store_v) ops::QuantizeRow(type, v, v_dst, static_cast<int64_t>(n_elems));
  }
  std::memcpy(s.positions.data() + s.n, positions, n * sizeof(int32_t));
  s.n += n;
  return Status::Ok();
}

Status ContiguousKvCache::CheckAppend(std::span<const KvAppendPlan> plans, const uint8_t* relative_positions) const {
  for (const KvAppendPlan& plan : plans) {
    if (plan.seq < 0 || plan.seq >= n_seqs_) {
      return InvalidArgumentError("KV cache append: seq " + std::to_string(plan.seq) + " out of range [0, " +
                                  std::to_string(n_seqs_) + ")");
    }
    for (int layer = 0; layer < geometry_.n_layers; ++layer) {
      const Slot& s = slot(plan.seq, layer);
      if (plan.n > max_tokens_ - s.n) {
        return ResourceExhaustedError("KV cache full: seq " + std::to_string(plan.seq) + " layer " +
                                      std::to_string(layer) + " holds " + std::to_string(s.n) + " of " +
                                      std::to_string(max_tokens_) + " tokens; cannot append " +
                                      std::to_string(plan.n) + " more (raise the context size / max_tokens)");
      }
      const bool check = relative_positions == nullptr || relative_positions[layer] == 0;
      if (check && plan.n > 0 && (plan.pos0 < 0 || (s.n > 0 && plan.pos0 <= s.positions[s.n - 1]))) {
        return InvalidArgumentError("KV cache append: seq " + std::to_string(plan.seq) + " layer " +
                                    std::to_string(layer) + ": position " + std::to_string(plan.pos0) +
                                    " must be >= 0 and greater than the previous position " +
                                    (s.n > 0 ? std::to_string(s.positions[s.n - 1]) : std::string("(none)")));
      }
    }
  }
  return Status::Ok();
}

void ContiguousKvCache::Spans(int seq, int layer, std::vector<KvSpan>* out) const {
  const Slot& s = slot(seq, layer);
  out->clear();
  if (s.n == 0) return;
  const uint8_t* v = geometry_.values_in_keys ? s.k.data() : s.v.data();
  out->push_back(KvSpan{.k = s.k.data(), .v = v, .positions = s.positions.data(), .n = s.n});
}

int32_t ContiguousKvCache::NumTokens(int seq, int layer) const { return slot(seq, layer).n; }

void ContiguousKvCache::Clear(int seq) {
  KVS_CHECK_MSG(seq >= 0 && seq < n_seqs_, "Clear: seq " + std::to_string(seq) + " out of range");
  for (int layer = 0; layer < geometry_.n_layers; ++layer) slot(seq, layer).n = 0;
}

size_t ContiguousKvCache::AllocatedBytes() const {
  return slots_.size() * row_bytes_ * max_tokens_ * geometry_.StoredRows();
}

size_t ContiguousKvCache::LiveBytes() const {
  size_t tokens = 0;
  for (const Slot& s : slots_) tokens += static_cast<size_t>(s.n);
  return tokens * row_bytes_ * geometry_.StoredRows();
}

}  // namespace kvsparse
