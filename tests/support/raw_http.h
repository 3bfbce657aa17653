// Raw loopback HTTP clients for the server tests: requests that httplib's client would never
// send (unfinished heads, truncated bodies, connections left open).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kvsparse::testing {

// Connects to 127.0.0.1:port and sends `bytes`: the open descriptor (the caller closes it), or -1
// when the connection or the send failed.
int SendRawLoopback(int port, std::string_view bytes);

// The request line and headers of a POST /v1/completions whose JSON body has `body_bytes` bytes.
std::string CompletionRequestHead(size_t body_bytes);

}  // namespace kvsparse::testing
