// Status / StatusOr: recoverable errors carry a message a user can act on
// (which file, key, tensor or layer; what was expected; what was found).
// KVS_CHECK aborts with file:line for broken invariants (programmer errors).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace kvsparse {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,
  kNotFound,
  kOutOfRange,
  kDataLoss,       // malformed / truncated / corrupt input file
  kUnimplemented,  // unsupported architecture, tensor type, feature
  kResourceExhausted,
  kInternal,
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "DataLoss: tensor 'blk.0.attn_q.weight': data [12..40) lies past end of file (size 20)"
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgumentError(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFoundError(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status OutOfRangeError(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status DataLossError(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status UnimplementedError(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status ResourceExhaustedError(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status InternalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

[[noreturn]] void CheckFailed(const char* file, int line, const char* expr, const std::string& detail);

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) CheckFailed(__FILE__, __LINE__, "!status.ok()", "StatusOr built from an OK status");
  }
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }

  T& value() & { EnsureOk(); return *value_; }
  const T& value() const& { EnsureOk(); return *value_; }
  T&& value() && { EnsureOk(); return std::move(*value_); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void EnsureOk() const {
    if (!status_.ok()) CheckFailed(__FILE__, __LINE__, "ok()", "value() on error: " + status_.ToString());
  }
  Status status_;
  std::optional<T> value_;
};

}  // namespace kvsparse

#define KVS_CHECK(cond)                                                                  \
  do {                                                                                   \
    if (!(cond)) ::kvsparse::CheckFailed(__FILE__, __LINE__, #cond, std::string());     \
  } while (0)

#define KVS_CHECK_MSG(cond, msg)                                                         \
  do {                                                                                   \
    if (!(cond)) ::kvsparse::CheckFailed(__FILE__, __LINE__, #cond, (msg));             \
  } while (0)

#define KVS_CONCAT_INNER(a, b) a##b
#define KVS_CONCAT(a, b) KVS_CONCAT_INNER(a, b)

#define KVS_RETURN_IF_ERROR(expr)                  \
  do {                                             \
    ::kvsparse::Status kvs_status_ = (expr);       \
    if (!kvs_status_.ok()) return kvs_status_;     \
  } while (0)

#define KVS_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()

// KVS_ASSIGN_OR_RETURN(auto file, GgufFile::Open(path));
#define KVS_ASSIGN_OR_RETURN(lhs, expr) \
  KVS_ASSIGN_OR_RETURN_IMPL(KVS_CONCAT(kvs_statusor_, __LINE__), lhs, expr)
