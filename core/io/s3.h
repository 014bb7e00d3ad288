// A small client for S3-compatible object storage (AWS S3, MinIO, Ceph RGW): the requests that
// checkpoint backup needs, over libcurl. Requests are signed by libcurl's own AWS Signature V4
// (CURLOPT_AWS_SIGV4); the payload's SHA-256 goes in x-amz-content-sha256, which S3 wants and curl
// leaves to the caller. Credentials come only from the standard AWS environment variables or the
// shared credentials file, never from a config. One client per thread (a libcurl easy handle is
// not shared); every call is one request, without retries (the caller decides: see transient()).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/util/error.h"

namespace weft {

// Whether this build has the client (libcurl >= 7.87 and OpenSSL at build time). Without it every
// S3Client constructor throws weft::Error saying what the build lacks.
bool s3_supported();

// "s3://bucket/prefix/..." split into the bucket and the key prefix ("" or ending in '/').
// Throws weft::Error naming `key` when `url` is not of that form.
struct S3Url {
  std::string bucket, prefix;
  static S3Url parse(const std::string& url, const std::string& key);
};

struct S3Credentials {
  std::string access_key, secret_key, session_token;
  std::string source;  // where they came from, for messages (never the keys themselves)
  // AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (/ AWS_SESSION_TOKEN), else the profile AWS_PROFILE
  // (default "default") of AWS_SHARED_CREDENTIALS_FILE (default ~/.aws/credentials); nullopt when
  // neither has them.
  static std::optional<S3Credentials> from_environment();
};

struct S3Options {
  std::string endpoint;  // "http(s)://host[:port]", path-style requests; "" = AWS (virtual-hosted)
  std::string region;    // "" = AWS_REGION, AWS_DEFAULT_REGION, else us-east-1
  S3Credentials credentials;
  int64_t max_send_bytes_per_second = 0;  // 0 = unlimited (CURLOPT_MAX_SEND_SPEED_LARGE)
  long connect_timeout_seconds = 10;
  long stall_timeout_seconds = 60;  // a transfer moving no byte this long fails
};

// A request that failed: the HTTP status (0 when none came: connection refused, reset, timeout),
// S3's error code ("NoSuchBucket", "NoSuchUpload", ...) or curl's message.
class S3Error : public Error {
 public:
  S3Error(const std::string& message, long http_status, std::string code)
      : Error(message), http_status(http_status), code(std::move(code)) {}
  // Worth retrying: no response, 5xx, 408, 429, RequestTimeout, SlowDown, InternalError,
  // ServiceUnavailable (also in a 200 answer's body, as CompleteMultipartUpload gives them).
  bool transient() const;
  long http_status;
  std::string code;
};

struct S3Object {
  std::string key;
  int64_t size = 0;
};

class S3Client {
 public:
  S3Client(S3Options options, std::string bucket);
  ~S3Client();
  S3Client(const S3Client&) = delete;
  S3Client& operator=(const S3Client&) = delete;


  // Whether the bucket exists and these credentials reach it (HEAD bucket: false on 404; throws
  // S3Error on anything else that is not a 2xx).
  bool bucket_exists();
  // PUT of a small object from memory.
  void put_object(const std::string& key, const std::string& body);
  // PUT of `length` bytes of the file `path` from `offset` (one request: at most 5 GiB).
  void put_file(const std::string& key, const std::string& path, int64_t offset, int64_t length);
  // Multipart upload: create returns the upload id; upload_part (part_number from 1) returns the
  // part's ETag; complete takes the ETags in order; abort discards the parts.
  std::string create_multipart_upload(const std::string& key);
  std::string upload_part(const std::string& key, const std::string& upload_id, int part_number,
                          const std::string& path, int64_t offset, int64_t length);
  void complete_multipart_upload(const std::string& key, const std::string& upload_id,
                                 const std::vector<std::string>& etags);
  void abort_multipart_upload(const std::string& key, const std::string& upload_id);
  // Whether the server still knows the multipart upload (ListParts; false on NoSuchUpload). Some
  // servers answer a part sent to a forgotten upload with a bare 500 rather than NoSuchUpload.
  bool multipart_upload_exists(const std::string& key, const std::string& upload_id);
  // The multipart uploads in progress under `prefix` (key, upload id; the first 1000).
  std::vector<std::pair<std::string, std::string>> list_multipart_uploads(const std::string& prefix);
  // Every object whose key starts with `prefix` (ListObjectsV2, all pages), in key order.
  std::vector<S3Object> list(const std::string& prefix);
  // GET into `path` (replaced), or into a string.
  void get_to_file(const std::string& key, const std::string& path);
  std::string get_object(const std::string& key);
  void delete_object(const std::string& key);

  // Replaces the keys (temporary credentials renewed in the environment or the credentials file).
  void set_credentials(const S3Credentials& credentials);
  // Set from another thread to abort the request in flight (it then throws S3Error "cancelled").
  void cancel() { cancelled_ = true; }

 private:
  struct Request;
  struct Response {
    long status = 0;
    std::string body, etag;
  };
  Response perform(Request& request);
  std::string url(const std::string& key, const std::string& query) const;

  S3Options options_;
  std::string bucket_, region_;
  void* curl_ = nullptr;  // CURL*
  std::atomic<bool> cancelled_{false};
};

// Lowercase hex SHA-256 of a string, and of `length` bytes of a file from `offset` (-1: to its end).
std::string sha256_hex(const std::string& data);
std::string sha256_file_hex(const std::string& path, int64_t offset = 0, int64_t length = -1);

}  // namespace weft
