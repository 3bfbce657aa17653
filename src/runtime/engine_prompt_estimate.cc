// Two-pass Vertical-Slash (sparse_prefill.h, `two_pass`): MInference estimates each layer's
// columns and diagonals once per prompt from its last 64 queries; a chunked prefill cannot see
// those queries before its last chunk, so the prompt runs twice. Pass 1 (on a fork of the
// sequence, with per-chunk estimates) yields the tail's queries at every layer and the estimate
// from them; pass 2 prefills the sequence itself with those patterns.
#include <fmt/format.h>

#include <algorithm>

#include "common/timing.h"
#include "kvsparse/engine.h"
#include "kvsparse/sparse_kv_controller.h"
#include "kvsparse/sparse_prefill.h"
#include "runtime/engine_internal.h"

namespace kvsparse {

using namespace engine_detail;  // NOLINT

namespace {

bool IsTwoPass(const PrefillSparsity& p) { return p.method == PrefillMethod::kVerticalSlash && p.two_pass != 0; }

}  // namespace

bool Engine::WantsPromptEstimate(int seq, int32_t n, int32_t max_chunk) const {
  if (controller_ == nullptr || n <= max_chunk) return false;  // one chunk: its estimate is the tail's
  for (int layer = 0; layer < model_.config().n_layers; ++layer) {
    const PrefillSparsity& p = controller_->prefill_sparsity(seq, layer);
    if (IsTwoPass(p) && cache_->NumTokens(seq, layer) + n >= p.min_context) return true;
  }
  return false;
}

Status Engine::EstimatePrompt(int seq, const int32_t* tokens, int32_t n, int32_t pos0, int32_t max_chunk) {
  const ModelConfig& c = model_.config();
  if (prompt_estimate_ == nullptr) prompt_estimate_ = std::make_unique<PromptEstimate>();
  PromptEstimate& pe = *prompt_estimate_;
  int32_t tail = 1;
  for (int layer = 0; layer < c.n_layers; ++layer) {
    const PrefillSparsity& p = controller_->prefill_sparsity(seq, layer);
    if (IsTwoPass(p)) tail = std::max(tail, p.last_q);
  }
  pe.pattern_seq = -1;
  pe.prompt_end = pos0 + n;
  pe.tail_begin = pe.prompt_end - std::min(tail, n);
  pe.layers.assign(static_cast<size_t>(c.n_layers), PromptEstimate::Layer{});
  // Pass 1 runs on a copy-on-write fork, so seq itself (its tokens and its policies) is as it was.
  KVS_ASSIGN_OR_RETURN(const int fork, controller_->AcquireSequence());
  Status pass = controller_->Fork(seq, fork);
  if (pass.ok()) {
    pe.capture_seq = fork;
    pass = ForwardChunks(fork, tokens, n, pos0, max_chunk, /*logits=*/nullptr, /*all_logits=*/false);
    pe.capture_seq = -1;
  }
  const Status released = controller_->ReleaseSequence(fork);
  if (!pass.ok()) {
    return Status(pass.code(), fmt::format("two-pass sparse prefill, pass 1 (estimating the prompt's pattern): {}",
                                           pass.message()));
  }
  KVS_RETURN_IF_ERROR(released);
  for (PromptEstimate::Layer& layer : pe.layers) {  // the queries have served
    std::vector<float>().swap(layer.q);
    std::vector<int32_t>().swap(layer.q_pos);
  }
  pe.mapped.resize(static_cast<size_t>(c.n_kv_heads));  // before pass 2's parallel assembly
  pe.pattern_seq = seq;
  return Status::Ok();
}

void Engine::CapturePromptTail(const Entry& e, int layer, const AttentionShape& shape, const PrefillSparsity& prefill) {
  if (!IsTwoPass(prefill)) return;
  Scratch& s = *scratch_;
  PromptEstimate& pe = *prompt_estimate_;
  PromptEstimate::Layer& kept = pe.layers[static_cast<size_t>(layer)];
  const size_t row_values = static_cast<size_t>(shape.n_heads) * shape.head_dim;
  for (int32_t i = std::max(0, pe.tail_begin - e.pos0); i < e.n && e.pos0 + i < pe.prompt_end; ++i) {
    const float* row = s.q.data() + static_cast<size_t>(e.row0 + i) * row_values;
    kept.q.insert(kept.q.end(), row, row + row_values);
    kept.q_pos.push_back(s.positions[static_cast<size_t>(e.row0 + i)]);
  }
  if (e.pos0 + e.n != pe.prompt_end) return;

  // The layer's last chunk: its estimate from the tail's last last_q queries against every key the
  // layer holds now (this chunk's included), as MInference's from the whole prompt's.
  const Clock::time_point start = Clock::now();
  const int32_t n_q = std::min<int32_t>(prefill.last_q, static_cast<int32_t>(kept.q_pos.size()));
  const size_t first = kept.q_pos.size() - static_cast<size_t>(n_q);
  const int n_kv = shape.n_kv_heads, group = shape.n_heads / n_kv, d = shape.head_dim;
  const int per_kv = PrefillSelectionsPerKvHead(prefill, group);
  const bool per_head = cache_->per_head(layer);
  const size_t group_values = static_cast<size_t>(group) * d;
  GroupRowsByKvHead(kept.q.data() + first * row_values, n_q, n_kv, group_values, &s.q_head);  // [n_kv, n_q, group, d]
  LoadPrefillKeys(e.seq, layer, kept.q_pos.data() + first, n_q, /*round_to=*/1);
  kept.patterns.assign(static_cast<size_t>(n_kv) * per_kv, VerticalSlashPattern{});
  s.selectors.resize(static_cast<size_t>(n_kv));
  const AttentionShape head_shape = WithHeads(shape, group, 1);
  const int estimate_threads = std::min(n_threads_, n_kv);
#pragma omp parallel for schedule(dynamic, 1) num_threads(estimate_threads) if (estimate_threads > 1)
  for (int h = 0; h < n_kv; ++h) {
    const int table = per_head ? h : 0;
    const std::vector<KvSpan>& spans = per_head ? s.head_spans[static_cast<size_t>(h)] : s.spans;
    int64_t n_tokens = 0;
    for (const KvSpan& span : spans) n_tokens += span.n;
    const float* keys =
        s.prefill_keys[table].data() + (per_head ? 0 : static_cast<size_t>(h) * s.prefill_key_rows[0] * d);
    VerticalSlashPattern* patterns = kept.patterns.data() + static_cast<size_t>(h) * per_kv;
    s.selectors[h].EstimateVerticalSlash(prefill, head_shape, s.q_head.data() + static_cast<size_t>(h) * n_q * group_values,
                                         s.visible[table].data(), n_q, keys, n_tokens, /*n_threads=*/1, patterns);
    // Columns as positions: pass 2's chunks see other key sets (fewer tokens, other evictions).
    std::vector<int32_t> positions;
    SpanPositions(spans.data(), static_cast<int32_t>(spans.size()), &positions);
    for (int o = 0; o < per_kv; ++o) {
      for (int64_t& column : patterns[o].columns) column = positions[static_cast<size_t>(column)];
    }
  }
  controller_->RecordPromptEstimate(layer, Seconds(start, Clock::now()));
}

const std::vector<VerticalSlashPattern>& Engine::PromptPatterns(int layer) const {
  static const std::vector<VerticalSlashPattern> kNone;
  if (prompt_estimate_ == nullptr || layer < 0 || static_cast<size_t>(layer) >= prompt_estimate_->layers.size()) {
    return kNone;
  }
  return prompt_estimate_->layers[static_cast<size_t>(layer)].patterns;
}

bool Engine::HasPromptPattern(int seq, int layer) const {
  return prompt_estimate_ != nullptr && prompt_estimate_->pattern_seq == seq &&
         !prompt_estimate_->layers[static_cast<size_t>(layer)].patterns.empty();
}

void Engine::TakeChunkKeyPositions(int layer) {
  Scratch& s = *scratch_;
  const bool per_head = cache_->per_head(layer);
  const int n_tables = per_head ? cache_->geometry().n_kv_heads : 1;
  std::vector<std::vector<int32_t>>& positions = prompt_estimate_->table_positions;
  positions.resize(static_cast<size_t>(n_tables));
  for (int table = 0; table < n_tables; ++table) {
    const std::vector<KvSpan>& spans = per_head ? s.head_spans[static_cast<size_t>(table)] : s.spans;
    SpanPositions(spans.data(), static_cast<int32_t>(spans.size()), &positions[static_cast<size_t>(table)]);
  }
}

void Engine::AssembleFromPromptPattern(int layer, const PrefillSparsity& prefill, int table, int selection,
                                       const int64_t* visible, int32_t n_q, PrefillSelection* out) {
  PromptEstimate& pe = *prompt_estimate_;
  const VerticalSlashPattern& pattern = pe.layers[static_cast<size_t>(layer)].patterns[static_cast<size_t>(selection)];
  const int n_kv = cache_->geometry().n_kv_heads;
  const int per_kv = static_cast<int>(pe.layers[static_cast<size_t>(layer)].patterns.size()) / n_kv;
  VerticalSlashPattern& mapped = pe.mapped[static_cast<size_t>(selection / per_kv)];  // this kv head's scratch
  const std::vector<int32_t>& positions = pe.table_positions[static_cast<size_t>(table)];
  // Each column's index among this chunk's keys; columns the keys lack (evicted, or not yet
  // seen) drop out.
  mapped.columns.clear();
  for (const int64_t position : pattern.columns) {
    const auto it = std::lower_bound(positions.begin(), positions.end(), position);
    if (it != positions.end() && *it == position) mapped.columns.push_back(it - positions.begin());
  }
  mapped.diagonals = pattern.diagonals;
  PrefillSelector::AssembleVerticalSlash(prefill, visible, n_q, mapped, out);
}

}  // namespace kvsparse
