// Sparse prefill's shared parts: method names and defaults, the f32 key matrices and visible
// counts the estimators read, the work count, and Select's dispatch (sparse_prefill.h).
#include "kvsparse/sparse_prefill.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "kvsparse/kv_cache.h"
#include "kvsparse/ops.h"
#include "kvsparse/status.h"
#include "policy/sparse_prefill_internal.h"

namespace kvsparse {

std::string_view PrefillMethodName(PrefillMethod method) {
  switch (method) {
    case PrefillMethod::kDense:
      return "dense";
    case PrefillMethod::kVerticalSlash:
      return "vertical_slash";
    case PrefillMethod::kBlockSparse:
      return "block_sparse";
    case PrefillMethod::kXAttention:
      return "xattention";
  }
  return "?";
}

std::optional<PrefillMethod> PrefillMethodFromName(std::string_view name) {
  for (PrefillMethod m : {PrefillMethod::kDense, PrefillMethod::kVerticalSlash, PrefillMethod::kBlockSparse,
                          PrefillMethod::kXAttention}) {
    if (name == PrefillMethodName(m)) return m;
  }
  return std::nullopt;
}

PrefillSparsity DefaultPrefillSparsity(PrefillMethod method) {
  PrefillSparsity p;
  p.method = method;
  if (method == PrefillMethod::kXAttention) p.block = 128;
  if (method == PrefillMethod::kBlockSparse) p.estimate_bits = 32;
  return p;
}

std::vector<std::string_view> PrefillParamKeys(PrefillMethod method) {
  std::vector<std::string_view> keys = {"block", "min_queries", "min_context", "estimate_bits", "group_shared"};
  switch (method) {
    case PrefillMethod::kDense:
      return {};
    case PrefillMethod::kVerticalSlash:
      keys.insert(keys.end(), {"last_q", "vertical", "slash", "sink_columns", "local_diagonals", "two_pass"});
      break;
    case PrefillMethod::kBlockSparse:
      keys.push_back("top_blocks");
      break;
    case PrefillMethod::kXAttention:
      keys.insert(keys.end(), {"stride", "threshold"});
      break;
  }
  return keys;
}

namespace {

std::string JoinKeys(const std::vector<std::string_view>& keys) {
  std::string out;
  for (std::string_view k : keys) out += (out.empty() ? "" : ", ") + std::string(k);
  return out.empty() ? "(none)" : out;
}

}  // namespace

Status SetPrefillParam(std::string_view key, double value, PrefillSparsity* p) {
  const std::vector<std::string_view> keys = PrefillParamKeys(p->method);
  if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
    return InvalidArgumentError(fmt::format("sparse prefill: '{}' is not a parameter of '{}'; valid keys: {}", key,
                                            PrefillMethodName(p->method), JoinKeys(keys)));
  }
  if (key == "threshold") {
    p->threshold = value;
    return Status::Ok();
  }
  if (!std::isfinite(value) || value != std::floor(value) || std::fabs(value) > 1e9) {
    return InvalidArgumentError(fmt::format("sparse prefill: '{}' takes an integer; found {}", key, value));
  }
  const int v = static_cast<int>(value);
  if (key == "block") p->block = v;
  if (key == "min_queries") p->min_queries = v;
  if (key == "min_context") p->min_context = v;
  if (key == "last_q") p->last_q = v;
  if (key == "vertical") p->vertical = v;
  if (key == "slash") p->slash = v;
  if (key == "sink_columns") p->sink_columns = v;
  if (key == "local_diagonals") p->local_diagonals = v;
  if (key == "top_blocks") p->top_blocks = v;
  if (key == "stride") p->stride = v;
  if (key == "estimate_bits") p->estimate_bits = v;
  if (key == "group_shared") p->group_shared = v;
  if (key == "two_pass") p->two_pass = v;
  return Status::Ok();
}

Status ValidatePrefillSparsity(const PrefillSparsity& p) {
  auto bad = [&](std::string_view key, const std::string& what) {
    return InvalidArgumentError(fmt::format("sparse prefill '{}': '{}' {}", PrefillMethodName(p.method), key, what));
  };
  if (p.block < 1 || p.block > 8192) return bad("block", fmt::format("must be in [1, 8192]; found {}", p.block));
  if (p.min_queries < 1) return bad("min_queries", fmt::format("must be >= 1; found {}", p.min_queries));
  if (p.min_context < 0) return bad("min_context", fmt::format("must be >= 0; found {}", p.min_context));
  if (p.last_q < 1) return bad("last_q", fmt::format("must be >= 1; found {}", p.last_q));
  for (auto [key, value] : {std::pair<std::string_view, int>{"vertical", p.vertical},
                            {"slash", p.slash},
                            {"sink_columns", p.sink_columns},
                            {"local_diagonals", p.local_diagonals},
                            {"top_blocks", p.top_blocks}}) {
    if (value < 0) return bad(key, fmt::format("must be >= 0; found {}", value));
  }
  if (p.stride < 1 || p.stride > p.block || p.block % p.stride != 0) {
    return bad("stride", fmt::format("must divide the block ({}); found {}", p.block, p.stride));
  }
  if (p.estimate_bits != 8 && p.estimate_bits != 32) {
    return bad("estimate_bits", fmt::format("must be 8 or 32; found {}", p.estimate_bits));
  }
  if (p.group_shared != 0 && p.group_shared != 1) {
    return bad("group_shared", fmt::format("must be 0 (a selection per query head) or 1 (per kv head); found {}",
                                           p.group_shared));
  }
  if (p.two_pass != 0 && p.two_pass != 1) {
    return bad("two_pass", fmt::format("must be 0 (an estimate per chunk) or 1 (one per prompt, from its tail, "
                                       "in two passes); found {}",
                                       p.two_pass));
  }
  if (!(p.threshold > 0 && p.threshold <= 1))
    return bad("threshold", fmt::format("must be in (0, 1]; found {}", p.threshold));
  return Status::Ok();
}

StatusOr<PrefillSparsity> ParsePrefillSparsity(std::string_view text, std::string_view flag) {
  const size_t colon = text.find(':');
  const std::string_view name = text.substr(0, colon);
  const std::optional<PrefillMethod> method = PrefillMethodFromName(name);
  if (!method) {
    return InvalidArgumentError(
        fmt::format("{}: unknown sparse prefill method '{}'; valid: dense, vertical_slash, "
                    "block_sparse, xattention",
                    flag, name));
  }
  PrefillSparsity p = DefaultPrefillSparsity(*method);
  std::string_view rest = colon == std::string_view::npos ? std::string_view() : text.substr(colon + 1);
  while (!rest.empty()) {
    const size_t next = rest.find(':');
    const std::string_view item = rest.substr(0, next);
    rest = next == std::string_view::npos ? std::string_view() : rest.substr(next + 1);
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      return InvalidArgumentError(fmt::format("{}: expected KEY=VALUE after the method, found '{}'", flag, item));
    }
    const std::string value_text(item.substr(eq + 1));
    char* end = nullptr;
    const double value = std::strtod(value_text.c_str(), &end);
    if (value_text.empty() || end != value_text.c_str() + value_text.size()) {
      return InvalidArgumentError(
          fmt::format("{}: '{}' needs a number; found '{}'", flag, item.substr(0, eq), value_text));
    }
    if (Status s = SetPrefillParam(item.substr(0, eq), value, &p); !s.ok()) {
      return InvalidArgumentError(fmt::format("{}: {}", flag, s.message()));
    }
  }
  if (Status s = ValidatePrefillSparsity(p); !s.ok())
    return InvalidArgumentError(fmt::format("{}: {}", flag, s.message()));
  return p;
}

std::string PrefillSparsitySummary(const PrefillSparsity& p) {
  std::string s(PrefillMethodName(p.method));
  switch (p.method) {
    case PrefillMethod::kDense:
      break;
    case PrefillMethod::kVerticalSlash:
      s += fmt::format(" block={} last_q={} vertical={} slash={}", p.block, p.last_q, p.vertical, p.slash);
      if (p.two_pass) s += " two_pass";
      break;
    case PrefillMethod::kBlockSparse:
      s += fmt::format(" block={} top_blocks={}", p.block, p.top_blocks);
      break;
    case PrefillMethod::kXAttention:
      s += fmt::format(" block={} stride={} threshold={:g}", p.block, p.stride, p.threshold);
      break;
  }
  if (p.method != PrefillMethod::kDense) s += fmt::format(" estimate_bits={}", p.estimate_bits);
  if (p.method != PrefillMethod::kDense && p.group_shared) s += " group_shared";
  return s;
}

PrefillWork CountPrefillWork(const PrefillSelection& selection, const int64_t* visible, int32_t n_q) {
  PrefillWork work;
  for (int32_t i = 0; i < n_q; ++i) {
    work.causal_pairs += visible[i];
    const int block = i / selection.query_block;
    for (int64_t r = selection.range_offsets[block]; r < selection.range_offsets[block + 1]; ++r) {
      const int64_t begin = selection.ranges[2 * r], end = std::min(selection.ranges[2 * r + 1], visible[i]);
      if (end > begin) work.selected_pairs += end - begin;
    }
  }
  return work;
}

void LoadKeyMatrices(KvStorage storage, const KvSpan* spans, int32_t n_spans, int row_heads, int head_dim, int round_to,
                     int n_threads, std::vector<float>* out, int64_t* n_rows) {
  std::vector<int64_t> first_token(static_cast<size_t>(n_spans) + 1, 0);  // [n_spans + 1]
  for (int32_t s = 0; s < n_spans; ++s) first_token[s + 1] = first_token[s] + spans[s].n;
  const int64_t n_tokens = first_token[n_spans];
  const int64_t rows = (n_tokens + round_to - 1) / round_to * round_to;
  *n_rows = rows;
  out->resize(static_cast<size_t>(row_heads) * rows * head_dim);
  for (int h = 0; h < row_heads; ++h) {  // the rounding rows
    std::fill(out->begin() + (static_cast<size_t>(h) * rows + n_tokens) * head_dim,
              out->begin() + static_cast<size_t>(h + 1) * rows * head_dim, 0.f);
  }
  float* const dst = out->data();
  // Spans (pages) are independent: one per iteration.
#pragma omp parallel num_threads(std::max(1, n_threads)) if (n_threads > 1 && n_tokens > 4096)
  {
    std::vector<float> token_row(static_cast<size_t>(row_heads) * head_dim);  // [row_heads, head_dim]
#pragma omp for schedule(static)
    for (int32_t s = 0; s < n_spans; ++s) {
      const KvSpan& span = spans[s];
      const KvStorage type = SpanStorage(storage, span);
      for (int32_t j = 0; j < span.n; ++j) {
        const int64_t t = first_token[s] + j;
        LoadSpanKeyRow(type, span, j, row_heads, head_dim, token_row.data());
        for (int h = 0; h < row_heads; ++h) {
          std::copy_n(token_row.data() + static_cast<size_t>(h) * head_dim, head_dim,
                      dst + (static_cast<size_t>(h) * rows + t) * head_dim);
        }
      }
    }
  }
}

void SpanPositions(const KvSpan* spans, int32_t n_spans, std::vector<int32_t>* out) {
  out->clear();
  for (int32_t s = 0; s < n_spans; ++s) out->insert(out->end(), spans[s].positions, spans[s].positions + spans[s].n);
}

void VisibleCounts(const KvSpan* spans, int32_t n_spans, const int32_t* q_pos, int32_t n_q,
                   std::vector<int64_t>* visible) {
  std::vector<int32_t> positions;  // [n_tokens] ascending
  SpanPositions(spans, n_spans, &positions);
  visible->resize(static_cast<size_t>(n_q));
  for (int32_t i = 0; i < n_q; ++i) {
    (*visible)[i] = std::upper_bound(positions.begin(), positions.end(), q_pos[i]) - positions.begin();
  }
}

void PrefillSelector::Select(const PrefillSparsity& config, const AttentionShape& head_shape, const float* q,
                             const int64_t* visible, int32_t n_q, const float* keys, int64_t n_tokens, int n_threads,
                             PrefillSelection* out) {
  KVS_CHECK(head_shape.n_kv_heads == 1 && n_q > 0 && config.block > 0);
  switch (config.method) {
    case PrefillMethod::kDense: {  // every token: what dense attention computes
      for (int o = 0; o < PrefillSelectionsPerKvHead(config, head_shape.n_heads); ++o) {
        prefill_detail::RangeAssembler ranges(config.block, &out[o]);
        for (int32_t first = 0; first < n_q; first += config.block) {
          ranges.Add(0, n_tokens);
          ranges.EndBlock(visible[std::min(n_q, first + config.block) - 1]);
        }
      }
      return;
    }
    case PrefillMethod::kVerticalSlash:
      return VerticalSlash(config, head_shape, q, visible, n_q, keys, n_tokens, n_threads, out);
    case PrefillMethod::kBlockSparse:
      return BlockSparse(config, head_shape, q, visible, n_q, keys, n_tokens, n_threads, out);
    case PrefillMethod::kXAttention:
      return XAttention(config, head_shape, q, visible, n_q, keys, n_tokens, n_threads, out);
  }
}

namespace prefill_detail {

const ops::Int8Keys* PrepareEstimateKeys(const PrefillSparsity& config, const float* keys, int64_t n_keys, int dim,
                                         int n_threads, ops::Int8Keys* int8_keys) {
  if (config.estimate_bits != 8 || !ops::Int8ScoresAvailable()) return nullptr;
  ops::QuantizeKeysInt8(keys, n_keys, dim, int8_keys, n_threads);
  return int8_keys;
}

void ScoreProducts(const float* rows, int64_t n_rows, const float* keys, int64_t n_keys, int dim, int n_threads,
                   std::vector<float>* scores, const ops::Int8Keys* int8_keys) {
  scores->resize(static_cast<size_t>(n_rows) * n_keys);
  if (int8_keys != nullptr) {
    KVS_CHECK(int8_keys->n_keys == n_keys && int8_keys->dim == dim);
    ops::ScoreMatrixInt8(rows, n_rows, *int8_keys, scores->data(), n_threads);
  } else {
    ops::ScoreMatrix(rows, n_rows, keys, n_keys, dim, scores->data(), n_threads);
  }
}

RangeAssembler::RangeAssembler(int query_block, PrefillSelection* out) : out_(out) {
  out_->query_block = query_block;
  out_->range_offsets.assign(1, 0);
  out_->ranges.clear();
}

void RangeAssembler::EndBlock(int64_t limit) {
  if (!ascending_) std::sort(pending_.begin(), pending_.end());
  ascending_ = true;
  int64_t open_begin = -1, open_end = -1;
  auto flush = [&] {
    if (open_end > open_begin) {
      out_->ranges.push_back(open_begin);
      out_->ranges.push_back(open_end);
    }
  };
  for (auto [begin, end] : pending_) {
    begin = std::max<int64_t>(begin, 0);
    end = std::min(end, limit);
    if (end <= begin) continue;
    if (open_end >= begin && open_end > open_begin) {
      open_end = std::max(open_end, end);
    } else {
      flush();
      open_begin = begin;
      open_end = end;
    }
  }
  flush();
  pending_.clear();
  out_->range_offsets.push_back(static_cast<int64_t>(out_->ranges.size() / 2));
}

}  // namespace prefill_detail
}  // namespace kvsparse
