// Streams generated text to a client piece by piece without ever sending bytes that must later be
// taken back: a UTF-8 character split across token pieces is held until it is complete, and text
// that might be the start of a stop string is held until it is known not to be one. Single-threaded
// (one per request).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kvsparse::server {

class TextStream {
 public:
  // Empty stop strings are ignored (they would match before any text).
  explicit TextStream(std::vector<std::string> stop);

  // Adds a token's text; returns what can be sent now (possibly empty). Once a stop string appears,
  // returns the text up to just before it, stopped() becomes true, and later calls return "".
  std::string Push(std::string_view piece);

  // The text still held back, at the end of generation (an incomplete UTF-8 tail included: it
  // will not be completed now). Empty after a stop.
  std::string Finish();

  bool stopped() const { return stopped_; }

 private:
  // Bytes at the end of pending_ that cannot be sent yet.
  size_t HeldBackBytes() const;

  std::vector<std::string> stop_;
  std::string pending_;  // received but not yet returned
  bool stopped_ = false;
};

}  // namespace kvsparse::server
