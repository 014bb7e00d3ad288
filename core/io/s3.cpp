#include "core/io/s3.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>

#include "core/io/s3_build.h"
#if WEFT_WITH_S3
#include <curl/curl.h>
#include <openssl/evp.h>
#endif

namespace weft {

namespace {

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

std::string trim(const std::string& s) {
  const auto first = s.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(" \t\r\n") - first + 1);
}

// AWS's URI encoding: unreserved characters kept, everything else %XX (and '/' too unless a path).
std::string uri_encode(const std::string& s, bool path) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (path && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += fmt::format("%{:02X}", c);
    }
  }
  return out;
}

// The text of every <tag>...</tag> in `xml`, XML entities decoded (S3's responses are flat enough
// for this; no element we read nests another of its name).
std::vector<std::string> xml_values(const std::string& xml, const std::string& tag) {
  std::vector<std::string> values;
  const std::string open = "<" + tag + ">", close = "</" + tag + ">";
  for (size_t at = xml.find(open); at != std::string::npos; at = xml.find(open, at)) {
    const size_t begin = at + open.size(), end = xml.find(close, begin);
    if (end == std::string::npos) break;
    std::string raw = xml.substr(begin, end - begin), value;
    for (size_t i = 0; i < raw.size(); ++i) {
      static const std::pair<const char*, char> entities[] = {
          {"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}};
      bool decoded = false;
      for (const auto& [name, c] : entities) {
        if (raw.compare(i, std::strlen(name), name) == 0) {
          value += c;
          i += std::strlen(name) - 1;
          decoded = true;
          break;
        }
      }
      if (!decoded) value += raw[i];
    }
    values.push_back(value);
    at = end + close.size();
  }
  return values;
}

std::string xml_value(const std::string& xml, const std::string& tag) {
  auto values = xml_values(xml, tag);
  return values.empty() ? "" : values.front();
}

#if WEFT_WITH_S3
void global_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}
#endif

}  // namespace

S3Url S3Url::parse(const std::string& url, const std::string& key) {
  WEFT_CHECK(url.rfind("s3://", 0) == 0, "{} = '{}' is not an s3://bucket/prefix URL", key, url);
  const std::string rest = url.substr(5);
  const auto slash = rest.find('/');
  S3Url parsed;
  parsed.bucket = rest.substr(0, slash);
  WEFT_CHECK(!parsed.bucket.empty() && parsed.bucket.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789.-") ==
                                           std::string::npos,
             "{} = '{}': '{}' is not an S3 bucket name (lowercase letters, digits, '.' and '-')", key, url,
             parsed.bucket);
  if (slash != std::string::npos) {
    parsed.prefix = rest.substr(slash + 1);
    while (!parsed.prefix.empty() && parsed.prefix.back() == '/') parsed.prefix.pop_back();
    if (!parsed.prefix.empty()) parsed.prefix += '/';
  }
  return parsed;
}

std::optional<S3Credentials> S3Credentials::from_environment() {
  S3Credentials c;
  c.access_key = env("AWS_ACCESS_KEY_ID");
  c.secret_key = env("AWS_SECRET_ACCESS_KEY");
  if (!c.access_key.empty() && !c.secret_key.empty()) {
    c.session_token = env("AWS_SESSION_TOKEN");
    c.source = "the environment (AWS_ACCESS_KEY_ID)";
    return c;
  }
  std::string file = env("AWS_SHARED_CREDENTIALS_FILE");
  if (file.empty() && !env("HOME").empty()) file = env("HOME") + "/.aws/credentials";
  const std::string profile = env("AWS_PROFILE").empty() ? "default" : env("AWS_PROFILE");
  std::ifstream in(file);
  if (file.empty() || !in) return std::nullopt;
  std::map<std::string, std::string> values;
  std::string line, section;
  while (std::getline(in, line)) {
    line = trim(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[' && line.back() == ']') {
      section = trim(line.substr(1, line.size() - 2));
      continue;
    }
    const auto eq = line.find('=');
    if (section == profile && eq != std::string::npos) values[trim(line.substr(0, eq))] = trim(line.substr(eq + 1));
  }
  c.access_key = values["aws_access_key_id"];
  c.secret_key = values["aws_secret_access_key"];
  c.session_token = values["aws_session_token"];
  if (c.access_key.empty() || c.secret_key.empty()) return std::nullopt;
  c.source = fmt::format("{} [{}]", file, profile);
  return c;
}

bool S3Error::transient() const {
  if (code == "cancelled" || code == "io") return false;
  return http_status == 0 || http_status >= 500 || http_status == 408 || http_status == 429 ||
         code == "RequestTimeout" || code == "SlowDown" || code == "InternalError" || code == "ServiceUnavailable";
}

#if WEFT_WITH_S3

struct S3Client::Request {
  const char* method = "GET";
  std::string key, query;
  const std::string* body = nullptr;  // PUT/POST from memory
  std::string path;                   // PUT from this file's [offset, offset + length)
  int64_t offset = 0, length = 0;
  std::string payload_sha256;
  FILE* sink = nullptr;  // GET into a file
  // state of the transfer
  int fd = -1;
  int64_t sent = 0;
};

S3Client::S3Client(S3Options options, std::string bucket) : options_(std::move(options)), bucket_(std::move(bucket)) {
  global_init();
  region_ = options_.region;
  if (region_.empty()) region_ = env("AWS_REGION");
  if (region_.empty()) region_ = env("AWS_DEFAULT_REGION");
  if (region_.empty()) region_ = "us-east-1";
  while (!options_.endpoint.empty() && options_.endpoint.back() == '/') options_.endpoint.pop_back();
  curl_ = curl_easy_init();
  if (!curl_) throw S3Error("libcurl could not create a handle", 0, "curl");
}

S3Client::~S3Client() { curl_easy_cleanup(static_cast<CURL*>(curl_)); }

std::string S3Client::url(const std::string& key, const std::string& query) const {
  // AWS: virtual-hosted style, but path style for a bucket name with dots (TLS's *.s3 wildcard
  // certificate does not cover a.b.s3...); any other endpoint: path style.
  std::string base = !options_.endpoint.empty()             ? fmt::format("{}/{}/", options_.endpoint, bucket_)
                     : bucket_.find('.') != std::string::npos ? fmt::format("https://s3.{}.amazonaws.com/{}/", region_, bucket_)
                                                              : fmt::format("https://{}.s3.{}.amazonaws.com/", bucket_, region_);
  base += uri_encode(key, /*path=*/true);
  if (!query.empty()) base += "?" + query;
  return base;
}

S3Client::Response S3Client::perform(Request& request) {
  if (cancelled_) throw S3Error("cancelled", 0, "cancelled");
  CURL* curl = static_cast<CURL*>(curl_);
  curl_easy_reset(curl);
  Response response;
  const std::string target = url(request.key, request.query);
  const std::string sigv4 = fmt::format("aws:amz:{}:s3", region_);
  curl_easy_setopt(curl, CURLOPT_URL, target.c_str());
  curl_easy_setopt(curl, CURLOPT_AWS_SIGV4, sigv4.c_str());
  curl_easy_setopt(curl, CURLOPT_USERNAME, options_.credentials.access_key.c_str());
  curl_easy_setopt(curl, CURLOPT_PASSWORD, options_.credentials.secret_key.c_str());
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT, options_.connect_timeout_seconds);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME, options_.stall_timeout_seconds);
  if (options_.max_send_bytes_per_second > 0) {
    curl_easy_setopt(curl, CURLOPT_MAX_SEND_SPEED_LARGE, static_cast<curl_off_t>(options_.max_send_bytes_per_second));
  }
  // Progress: lets cancel() stop a transfer in flight.
  curl_easy_setopt(curl, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(curl, CURLOPT_XFERINFODATA, this);
  curl_easy_setopt(curl, CURLOPT_XFERINFOFUNCTION,
                   +[](void* self, curl_off_t, curl_off_t, curl_off_t, curl_off_t) -> int {
                     return static_cast<S3Client*>(self)->cancelled_ ? 1 : 0;
                   });
  // Response headers: the ETag of an uploaded part.
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &response);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, +[](char* data, size_t size, size_t count, void* out) -> size_t {
    const std::string line(data, size * count);
    if (line.size() > 5 && strncasecmp(line.c_str(), "etag:", 5) == 0) {
      static_cast<Response*>(out)->etag = trim(line.substr(5));
    }
    return size * count;
  });
  // Response body: into the sink file when the status is a success, else into response.body.
  struct Sink {
    CURL* curl;
    Response* response;
    FILE* file;
  } sink{curl, &response, request.sink};
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &sink);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, +[](char* data, size_t size, size_t count, void* out) -> size_t {
    auto* s = static_cast<Sink*>(out);
    long status = 0;
    curl_easy_getinfo(s->curl, CURLINFO_RESPONSE_CODE, &status);
    if (s->file && status >= 200 && status < 300) return std::fwrite(data, size, count, s->file) * size;
    s->response->body.append(data, size * count);
    return size * count;
  });

  struct curl_slist* headers = nullptr;
  const std::string empty_sha = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
  headers = curl_slist_append(headers, fmt::format("x-amz-content-sha256: {}",
                                                   request.payload_sha256.empty() ? empty_sha : request.payload_sha256)
                                           .c_str());
  if (!options_.credentials.session_token.empty()) {
    headers = curl_slist_append(headers,
                                fmt::format("x-amz-security-token: {}", options_.credentials.session_token).c_str());
  }
  // No "Expect:" header to switch off 100-continue: curl 7.88's SigV4 signs that empty header and
  // S3 then rejects the signature (found against moto's signature check, tools/s3_backup_test.py).
  // A server that does not answer 100-continue costs at most this wait per upload instead.
  curl_easy_setopt(curl, CURLOPT_EXPECT_100_TIMEOUT_MS, 300L);
  const std::string method = request.method;
  if (method == "HEAD") {
    curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
  } else if (method == "DELETE") {
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, "DELETE");
  } else if (method == "POST") {
    curl_easy_setopt(curl, CURLOPT_POST, 1L);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, request.body ? request.body->data() : "");
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(request.body ? request.body->size() : 0));
    headers = curl_slist_append(headers, "Content-Type: application/xml");
  } else if (method == "PUT") {
    curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE,
                     static_cast<curl_off_t>(request.body ? request.body->size() : request.length));
    curl_easy_setopt(curl, CURLOPT_READDATA, &request);
    curl_easy_setopt(curl, CURLOPT_READFUNCTION, +[](char* buffer, size_t size, size_t count, void* in) -> size_t {
      auto* r = static_cast<Request*>(in);
      const int64_t total = r->body ? static_cast<int64_t>(r->body->size()) : r->length;
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(size * count), total - r->sent);
      if (n <= 0) return 0;
      if (r->body) {
        std::memcpy(buffer, r->body->data() + r->sent, n);
      } else {
        const ssize_t got = ::pread(r->fd, buffer, n, r->offset + r->sent);
        if (got <= 0) return CURL_READFUNC_ABORT;
        r->sent += got;
        return static_cast<size_t>(got);
      }
      r->sent += n;
      return static_cast<size_t>(n);
    });
  }
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);

  request.sent = 0;
  if (!request.body && !request.path.empty()) {
    request.fd = ::open(request.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (request.fd < 0) {
      curl_slist_free_all(headers);
      throw S3Error(fmt::format("cannot read {}: {}", request.path, std::strerror(errno)), 0, "io");
    }
  }
  const CURLcode code = curl_easy_perform(curl);
  if (request.fd >= 0) ::close(request.fd);
  request.fd = -1;
  curl_slist_free_all(headers);
  const std::string what = fmt::format("{} s3://{}/{}", method, bucket_, request.key);
  if (code != CURLE_OK) {
    if (cancelled_) throw S3Error(what + ": cancelled", 0, "cancelled");
    throw S3Error(fmt::format("{}: {}", what, curl_easy_strerror(code)), 0, "curl");
  }
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &response.status);
  // CompleteMultipartUpload can answer 200 with an error in its body.
  const bool error_body = response.body.find("<Error>") != std::string::npos;
  if (response.status < 200 || response.status >= 300 || error_body) {
    std::string s3_code = xml_value(response.body, "Code"), message = xml_value(response.body, "Message");
    if (s3_code.empty() && response.status == 404) s3_code = "NotFound";
    throw S3Error(fmt::format("{}: HTTP {}{}{}", what, response.status, s3_code.empty() ? "" : " " + s3_code,
                              message.empty() ? "" : " (" + message + ")"),
                  response.status, s3_code);
  }
  return response;
}

bool S3Client::bucket_exists() {
  Request request;
  request.method = "HEAD";
  try {
    perform(request);
  } catch (const S3Error& e) {
    if (e.http_status == 404) return false;
    throw;
  }
  return true;
}

void S3Client::put_object(const std::string& key, const std::string& body) {
  Request request;
  request.method = "PUT";
  request.key = key;
  request.body = &body;
  request.payload_sha256 = sha256_hex(body);
  perform(request);
}

void S3Client::put_file(const std::string& key, const std::string& path, int64_t offset, int64_t length) {
  Request request;
  request.method = "PUT";
  request.key = key;
  request.path = path;
  request.offset = offset;
  request.length = length;
  request.payload_sha256 = sha256_file_hex(path, offset, length);
  perform(request);
}

std::string S3Client::create_multipart_upload(const std::string& key) {
  Request request;
  request.method = "POST";
  request.key = key;
  request.query = "uploads=";
  const std::string id = xml_value(perform(request).body, "UploadId");
  if (id.empty()) throw S3Error(fmt::format("POST s3://{}/{}?uploads: no UploadId in the answer", bucket_, key), 500, "");
  return id;
}

std::string S3Client::upload_part(const std::string& key, const std::string& upload_id, int part_number,
                                  const std::string& path, int64_t offset, int64_t length) {
  Request request;
  request.method = "PUT";
  request.key = key;
  request.query = fmt::format("partNumber={}&uploadId={}", part_number, uri_encode(upload_id, false));
  request.path = path;
  request.offset = offset;
  request.length = length;
  request.payload_sha256 = sha256_file_hex(path, offset, length);
  const Response response = perform(request);
  if (response.etag.empty()) {
    throw S3Error(fmt::format("PUT s3://{}/{} part {}: no ETag in the answer", bucket_, key, part_number), 500, "");
  }
  return response.etag;
}

void S3Client::complete_multipart_upload(const std::string& key, const std::string& upload_id,
                                         const std::vector<std::string>& etags) {
  std::string body = "<CompleteMultipartUpload>";
  for (size_t i = 0; i < etags.size(); ++i) {
    body += fmt::format("<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>", i + 1, etags[i]);
  }
  body += "</CompleteMultipartUpload>";
  Request request;
  request.method = "POST";
  request.key = key;
  request.query = "uploadId=" + uri_encode(upload_id, false);
  request.body = &body;
  request.payload_sha256 = sha256_hex(body);
  perform(request);
}

void S3Client::abort_multipart_upload(const std::string& key, const std::string& upload_id) {
  Request request;
  request.method = "DELETE";
  request.key = key;
  request.query = "uploadId=" + uri_encode(upload_id, false);
  perform(request);
}

bool S3Client::multipart_upload_exists(const std::string& key, const std::string& upload_id) {
  Request request;
  request.method = "GET";
  request.key = key;
  request.query = "max-parts=1&uploadId=" + uri_encode(upload_id, false);
  try {
    perform(request);
  } catch (const S3Error& e) {
    if (e.code == "NoSuchUpload") return false;
    throw;
  }
  return true;
}

std::vector<std::pair<std::string, std::string>> S3Client::list_multipart_uploads(const std::string& prefix) {
  Request request;
  request.method = "GET";
  request.query = "prefix=" + uri_encode(prefix, false) + "&uploads=";
  std::vector<std::pair<std::string, std::string>> uploads;
  for (const std::string& upload : xml_values(perform(request).body, "Upload")) {
    uploads.emplace_back(xml_value(upload, "Key"), xml_value(upload, "UploadId"));
  }
  return uploads;
}

void S3Client::set_credentials(const S3Credentials& credentials) { options_.credentials = credentials; }

std::vector<S3Object> S3Client::list(const std::string& prefix) {
  std::vector<S3Object> objects;
  std::string token;
  for (;;) {
    Request request;
    request.method = "GET";
    // Parameters sorted by name, values encoded: SigV4's canonical query string as sent.
    request.query = (token.empty() ? "" : "continuation-token=" + uri_encode(token, false) + "&") +
                    "list-type=2&prefix=" + uri_encode(prefix, false);
    const std::string body = perform(request).body;
    for (const std::string& contents : xml_values(body, "Contents")) {
      S3Object object;
      object.key = xml_value(contents, "Key");
      object.size = std::atoll(xml_value(contents, "Size").c_str());
      objects.push_back(std::move(object));
    }
    token = xml_value(body, "NextContinuationToken");
    if (xml_value(body, "IsTruncated") != "true" || token.empty()) break;
  }
  return objects;
}

void S3Client::get_to_file(const std::string& key, const std::string& path) {
  FILE* file = std::fopen(path.c_str(), "wb");
  if (!file) throw S3Error(fmt::format("cannot write {}: {}", path, std::strerror(errno)), 0, "io");
  Request request;
  request.method = "GET";
  request.key = key;
  request.sink = file;
  try {
    perform(request);
  } catch (...) {
    std::fclose(file);
    throw;
  }
  if (std::fclose(file) != 0) throw S3Error(fmt::format("cannot write {}: {}", path, std::strerror(errno)), 0, "io");
}

std::string S3Client::get_object(const std::string& key) {
  Request request;
  request.method = "GET";
  request.key = key;
  return perform(request).body;
}

void S3Client::delete_object(const std::string& key) {
  Request request;
  request.method = "DELETE";
  request.key = key;
  perform(request);
}

namespace {

struct Digest {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  Digest() { EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr); }
  ~Digest() { EVP_MD_CTX_free(ctx); }
  void update(const void* data, size_t n) { EVP_DigestUpdate(ctx, data, n); }
  std::string hex() {
    unsigned char out[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    EVP_DigestFinal_ex(ctx, out, &n);
    std::string text;
    for (unsigned int i = 0; i < n; ++i) text += fmt::format("{:02x}", out[i]);
    return text;
  }
};

}  // namespace

std::string sha256_hex(const std::string& data) {
  Digest digest;
  digest.update(data.data(), data.size());
  return digest.hex();
}

std::string sha256_file_hex(const std::string& path, int64_t offset, int64_t length) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  WEFT_CHECK(fd >= 0, "cannot read {}: {}", path, std::strerror(errno));
  Digest digest;
  std::vector<char> buffer(1 << 20);
  int64_t done = 0;
  for (;;) {
    const size_t want = length < 0 ? buffer.size() : static_cast<size_t>(std::min<int64_t>(buffer.size(), length - done));
    if (want == 0) break;
    const ssize_t got = ::pread(fd, buffer.data(), want, offset + done);
    if (got < 0) {
      const int error = errno;
      ::close(fd);
      fail("cannot read {}: {}", path, std::strerror(error));
    }
    if (got == 0) break;
    digest.update(buffer.data(), static_cast<size_t>(got));
    done += got;
  }
  ::close(fd);
  WEFT_CHECK(length < 0 || done == length, "{}: expected {} bytes from offset {}, read {}", path, length, offset, done);
  return digest.hex();
}

#else  // !WEFT_WITH_S3: the client's functions exist, and refuse by name

namespace {
[[noreturn]] void no_s3() {
  fail("this build of weft has no S3 client (it needs libcurl >= 7.87 and OpenSSL at build time: install "
       "libcurl4-openssl-dev and libssl-dev, then build again)");
}
}  // namespace

struct S3Client::Request {};
S3Client::S3Client(S3Options options, std::string bucket) : options_(std::move(options)), bucket_(std::move(bucket)) { no_s3(); }
S3Client::~S3Client() = default;
S3Client::Response S3Client::perform(Request&) { no_s3(); }
std::string S3Client::url(const std::string&, const std::string&) const { no_s3(); }
bool S3Client::bucket_exists() { no_s3(); }
void S3Client::put_object(const std::string&, const std::string&) { no_s3(); }
void S3Client::put_file(const std::string&, const std::string&, int64_t, int64_t) { no_s3(); }
std::string S3Client::create_multipart_upload(const std::string&) { no_s3(); }
std::string S3Client::upload_part(const std::string&, const std::string&, int, const std::string&, int64_t, int64_t) { no_s3(); }
void S3Client::complete_multipart_upload(const std::string&, const std::string&, const std::vector<std::string>&) { no_s3(); }
void S3Client::abort_multipart_upload(const std::string&, const std::string&) { no_s3(); }
bool S3Client::multipart_upload_exists(const std::string&, const std::string&) { no_s3(); }
std::vector<std::pair<std::string, std::string>> S3Client::list_multipart_uploads(const std::string&) { no_s3(); }
void S3Client::set_credentials(const S3Credentials&) { no_s3(); }
std::vector<S3Object> S3Client::list(const std::string&) { no_s3(); }
void S3Client::get_to_file(const std::string&, const std::string&) { no_s3(); }
std::string S3Client::get_object(const std::string&) { no_s3(); }
void S3Client::delete_object(const std::string&) { no_s3(); }
std::string sha256_hex(const std::string&) { no_s3(); }
std::string sha256_file_hex(const std::string&, int64_t, int64_t) { no_s3(); }

#endif

bool s3_supported() { return WEFT_WITH_S3 != 0; }

}  // namespace weft
