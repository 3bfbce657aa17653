#include "server/text_stream.h"

#include <algorithm>
#include <utility>

namespace kvsparse::server {
namespace {

// Length of the UTF-8 sequence a lead byte starts; 0 for a continuation or invalid byte.
size_t Utf8SequenceLength(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 0;
}

// Bytes at the end of `text` that begin a multi-byte character still missing bytes. Invalid
// bytes are not held: no later piece can make them valid.
size_t IncompleteUtf8Tail(std::string_view text) {
  size_t continuation_bytes = 0;
  while (continuation_bytes < 3 && continuation_bytes < text.size() &&
         (static_cast<unsigned char>(text[text.size() - 1 - continuation_bytes]) & 0xC0) == 0x80) {
    ++continuation_bytes;
  }
  if (continuation_bytes == text.size()) return 0;
  const size_t lead_index = text.size() - 1 - continuation_bytes;
  const size_t needed = Utf8SequenceLength(static_cast<unsigned char>(text[lead_index]));
  const size_t have = continuation_bytes + 1;
  return needed > have ? have : 0;
}

// Longest proper prefix of `stop` that `text` ends with.
size_t StopPrefixAtEnd(std::string_view text, std::string_view stop) {
  for (size_t length = std::min(text.size(), stop.size() - 1); length > 0; --length) {
    if (text.substr(text.size() - length) == stop.substr(0, length)) return length;
  }
  return 0;
}

}  // namespace

TextStream::TextStream(std::vector<std::string> stop) {
  for (std::string& s : stop) {
    if (!s.empty()) stop_.push_back(std::move(s));
  }
}

size_t TextStream::HeldBackBytes() const {
  size_t held = IncompleteUtf8Tail(pending_);
  for (const std::string& s : stop_) held = std::max(held, StopPrefixAtEnd(pending_, s));
  return held;
}

std::string TextStream::Push(std::string_view piece) {
  if (stopped_) return {};
  pending_ += piece;
  // Text already returned never holds the start of a stop string (it would have been held back),
  // so searching what is pending finds every match; the earliest one wins.
  size_t stop_at = std::string::npos;
  for (const std::string& s : stop_) stop_at = std::min(stop_at, pending_.find(s));
  if (stop_at != std::string::npos) {
    stopped_ = true;
    std::string ready = pending_.substr(0, stop_at);
    pending_.clear();
    return ready;
  }
  const size_t ready_bytes = pending_.size() - HeldBackBytes();
  std::string ready = pending_.substr(0, ready_bytes);
  pending_.erase(0, ready_bytes);
  return ready;
}

std::string TextStream::Finish() {
  if (stopped_) return {};
  return std::exchange(pending_, std::string());
}

}  // namespace kvsparse::server
