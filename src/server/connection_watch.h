// Notices that the client of a request in progress has hung up, without writing to it.
//
// A non-streaming response is written only at its end, so a write cannot reveal a client gone
// meanwhile. cpp-httplib 0.11 (Debian 12) gives a handler no access to its socket, so the
// watch finds it once: the connected socket of this process whose local and peer ports are the
// request's (Linux, /proc/self/fd). The socket stays open until the handler returns. A peek
// that reads end-of-file means the peer closed its side.
#pragma once

#include <string>

namespace kvsparse::server {

class ConnectionWatch {
 public:
  // local_port / remote_port: the request's (httplib::Request::local_port, remote_port).
  ConnectionWatch(int local_port, int remote_port);
  // True once the peer has closed the connection (or reset it). False while it is open, and
  // always when the socket was not found (the watch then never cancels anything).
  bool PeerClosed() const;
  bool found() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

}  // namespace kvsparse::server
