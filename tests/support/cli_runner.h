// Runs the `kvsparse` binary for end-to-end tests and checks that bad input fails cleanly.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "support/shared_data.h"

namespace kvsparse::testing {

struct CliResult {
  int exit_code = -1;
  bool crashed = false;  // killed by a signal (segfault, abort, sanitizer)
  std::string out;       // stdout only
  std::string all;       // stdout + stderr
};

// KVS_CLI (set by CMake for ctest) names the binary; else the build folder's kvsparse.
inline std::string CliPath() {
  const char* env = std::getenv("KVS_CLI");
  return env ? env : std::string(KVS_BINARY_DIR) + "/kvsparse";
}

// `env`: assignments put before the command, e.g. "KVSPARSE_ISA=avx2".
inline CliResult RunCli(const std::string& args, const std::string& env = "") {
  CliResult r;
  const std::string err_path = TempPath("cli_stderr.txt");
  const std::string cmd = (env.empty() ? "" : env + " ") + CliPath() + " " + args + " 2>" + err_path;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(pipe);
  if (WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
    r.crashed = r.exit_code >= 128;  // the shell reports death by signal as 128 + signal
  } else {
    r.crashed = true;
  }
  std::ifstream err(err_path);
  r.all = r.out + std::string(std::istreambuf_iterator<char>(err), {});
  return r;
}

// Non-zero exit, no crash, an "error:" line that mentions `must_mention`.
inline void ExpectCleanFailure(const CliResult& r, const std::string& must_mention) {
  EXPECT_FALSE(r.crashed) << r.all;
  EXPECT_NE(r.exit_code, 0) << r.all;
  EXPECT_NE(r.all.find("error:"), std::string::npos) << r.all;
  EXPECT_NE(r.all.find(must_mention), std::string::npos) << "expected '" << must_mention << "' in: " << r.all;
}

}  // namespace kvsparse::testing
