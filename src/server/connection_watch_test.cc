#include "server/connection_watch.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

namespace kvsparse::server {
namespace {

int PortOf(int fd, bool peer) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  const int rc = peer ? getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len)
                      : getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return rc == 0 ? ntohs(a.sin_port) : -1;
}

// A loopback connection: the watch finds the server side by its ports, reads nothing while the
// client is there (even with data waiting), and sees the hang-up.
TEST(ConnectionWatch, FindsTheSocketAndSeesTheHangUp) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  addr.sin_port = htons(static_cast<uint16_t>(PortOf(listener, false)));
  const int client = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const int server = accept(listener, nullptr, nullptr);
  ASSERT_GE(server, 0);

  const ConnectionWatch watch(PortOf(server, false), PortOf(server, true));
  EXPECT_TRUE(watch.found());
  EXPECT_FALSE(watch.PeerClosed());
  ASSERT_EQ(send(client, "x", 1, MSG_NOSIGNAL), 1);  // a pipelined byte: still connected, and kept
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(watch.PeerClosed());
  close(client);
  bool closed = false;
  for (int i = 0; i < 200 && !closed; ++i) {
    closed = watch.PeerClosed();
    if (!closed) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_FALSE(closed) << "the unread byte comes first";
  char byte = 0;
  EXPECT_EQ(recv(server, &byte, 1, 0), 1);
  EXPECT_TRUE(watch.PeerClosed());

  // No such connection: the watch never reports a hang-up.
  const ConnectionWatch none(1, 1);
  EXPECT_FALSE(none.found());
  EXPECT_FALSE(none.PeerClosed());
  close(server);
  close(listener);
}

}  // namespace
}  // namespace kvsparse::server
